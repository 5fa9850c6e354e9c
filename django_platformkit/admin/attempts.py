"""The attempts list: every recorded run of a handler (``platformkit_attempts``),
newest first - what it raised, on which worker, for how long. The overview
links a failing subscription's last error here, so the error gets the
width: the run's number and outcome share a column, and the event id is its
last 12 characters (the whole id on hover, on the attempt's page, and in
the search box, which finds an id by any part of it).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_platformkit.admin.display import ReadOnlyAdmin, duration_text, pre_html, truncated_html
from django_platformkit.admin.tasknames import TaskPathFilter, subscription_and_task, with_task_paths
from django_platformkit.models import Attempt
from django_platformkit.templatetags.platformkit_admin import when_html
from django_platformkit.wire import AttemptOutcome


def outcome_labels() -> dict[str, str]:
    """Each ``AttemptOutcome`` as the operator reads it."""
    return {
        AttemptOutcome.RUNNING: _("running, or never reported"),
        AttemptOutcome.FAILED: _("failed"),
        AttemptOutcome.HANDLED: _("handled"),
        AttemptOutcome.INTERRUPTED: _("interrupted (does not count)"),
    }


class OutcomeFilter(admin.SimpleListFilter):
    """The outcomes, in words (``?outcome=failed``, as the overview links it)."""

    title = gettext_lazy("outcome")
    parameter_name = "outcome"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return list(outcome_labels().items())

    def queryset(self, request: HttpRequest, queryset: QuerySet[Attempt]) -> QuerySet[Attempt]:
        return queryset.filter(outcome=self.value()) if self.value() else queryset


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin[Attempt]):
    list_display = (
        "started",
        "subscription_task",
        "run",
        "error_first_line",
        "ran_for",
        "worker",
        "event",
    )
    list_display_links = ("started",)
    list_filter = (OutcomeFilter, "subscription", TaskPathFilter)
    date_hierarchy = "started_at"
    search_fields = ("event_id", "error")
    search_help_text = gettext_lazy("Search by event id (or part of it) or error text.")
    ordering = ("-started_at", "-id")
    show_full_result_count = False
    fields = (
        "subscription_task",
        "event_id",
        "attempt",
        "outcome_text",
        "started",
        "finished",
        "ran_for",
        "worker",
        "error_text",
        "traceback_text",
    )
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Attempt]:
        return with_task_paths(super().get_queryset(request))

    @admin.display(description=gettext_lazy("subscription / task"), ordering="subscription")
    def subscription_task(self, obj: Attempt) -> str:
        return subscription_and_task(obj)

    @admin.display(description=gettext_lazy("started at"), ordering="started_at")
    def started(self, obj: Attempt) -> str:
        return when_html(obj.started_at)

    @admin.display(description=gettext_lazy("finished at"), ordering="finished_at")
    def finished(self, obj: Attempt) -> str:
        return when_html(obj.finished_at)

    @admin.display(description=gettext_lazy("outcome"), ordering="outcome")
    def outcome_text(self, obj: Attempt) -> str:
        return outcome_labels().get(obj.outcome, obj.outcome)

    @admin.display(description=gettext_lazy("attempt"), ordering="attempt")
    def run(self, obj: Attempt) -> str:
        """``3 · failed``: the run's number and its outcome."""
        return format_html("{} · {}", obj.attempt, self.outcome_text(obj))

    @admin.display(description=gettext_lazy("event"))
    def event(self, obj: Attempt) -> str:
        full = str(obj.event_id)
        return format_html('<span title="{}">…{}</span>', full, full[-12:])

    @admin.display(description=gettext_lazy("ran for"))
    def ran_for(self, obj: Attempt) -> str:
        return duration_text(obj.started_at, obj.finished_at)

    @admin.display(description=gettext_lazy("error"))
    def error_first_line(self, obj: Attempt) -> str:
        return truncated_html(obj.error)

    @admin.display(description=gettext_lazy("error"))
    def error_text(self, obj: Attempt) -> str:
        return pre_html(obj.error)

    @admin.display(description=gettext_lazy("traceback"))
    def traceback_text(self, obj: Attempt) -> str:
        return pre_html(obj.traceback)
