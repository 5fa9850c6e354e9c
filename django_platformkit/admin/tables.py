"""The admin operators work in: the overview page (``overview.py``'s
figures), and the tables, read-only, with filters, search and dates to the
second. The only state changes are two named actions on dead letters,
**Replay** (``replay()``) and **Discard** (``discard()``); both ask for a
reason, run as the signed-in user, need the
``django_platformkit.replay_deadletter`` permission, not just staff status,
and leave an admin ``LogEntry`` (actor, reason) on the dead letter and the
outbox row's History.

Query-string lookups are limited to the filters each list offers
(``lookup_allowed``): ``?error__regex=(`` or ``?payload__key=`` get a 400,
never a 500 or an unindexed scan of payloads.

This module registers the outbox, claims, attempts, jobs and the overview;
``admin_deadletters.py`` the dead letters and their two actions,
``admin_tasks.py`` the tasks; what they share is in ``admin_display.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import BooleanField, Count, Exists, Min, Model, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from django_platformkit.admin.cancelling import cancel_selected
from django_platformkit.admin.display import (
    ModelAdminOf,
    NoWritesAdmin,
    ReadOnlyAdmin,
    _duration,
    _first_line,
    _pre,
    _pretty_json,
    _truncated,
    _uuid_or_none,
)
from django_platformkit.models import Attempt, DeadLetter, HandledEvent, JobState, OutboxEvent, OutboxQuerySet, Overview
from django_platformkit.runtime.heartbeat import ALIVE_AFTER_SECONDS
from django_platformkit.templatetags.platformkit_admin import when_html

if TYPE_CHECKING:
    from typing import TypedDict

    from django.urls import URLPattern
    from django_stubs_ext import WithAnnotations

    class _Terminal(TypedDict):
        terminal: bool

    # A claim annotated by with_terminal().
    _ClaimWithTerminal = WithAnnotations[HandledEvent, _Terminal]


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", "pending"), ("published", "published")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> QuerySet[OutboxEvent]:
        # The list's rows come from OutboxEvent.objects (an OutboxQuerySet);
        # ListFilter's signature only promises a QuerySet.
        rows = cast(OutboxQuerySet, queryset)
        if self.value() == "pending":
            return rows.pending()
        if self.value() == "published":
            return rows.published()
        return queryset


class EventNameFilter(admin.SimpleListFilter):
    """Event names from the catalogue: a ``SELECT DISTINCT name`` would scan
    the whole outbox on every page view."""

    title = "event name"
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from django_platformkit.outbox.events import catalogue

        return [(name, name) for name in sorted(catalogue())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> QuerySet[OutboxEvent]:
        return queryset.filter(name=self.value()) if self.value() else queryset


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyAdmin[OutboxEvent]):
    list_display = ("id", "name", "tenant", "status", "created", "age")
    list_filter = (StatusFilter, EventNameFilter)
    search_fields = ("name",)
    search_help_text = "Search by event id (exact) or event name."
    ordering = ("-created_at", "-id")
    # Counting a large outbox on every page view is the slow part: skip the total.
    show_full_result_count = False
    actions = [cancel_selected]
    fields = (
        "id",
        "name",
        "tenant",
        "status",
        "created",
        "published",
        "relay_lag",
        "payload_json",
        "headers_json",
        "related",
        "claims",
    )
    readonly_fields = fields
    change_list_template = "admin/django_platformkit/outboxevent/change_list.html"

    @admin.display(description="status", ordering="published_at")
    def status(self, obj: OutboxEvent) -> str:
        return "pending" if obj.is_pending else "published"

    @admin.display(description="created at", ordering="created_at")
    def created(self, obj: OutboxEvent) -> str:
        return when_html(obj.created_at)

    @admin.display(description="published at", ordering="published_at")
    def published(self, obj: OutboxEvent) -> str:
        return when_html(obj.published_at) if obj.published_at else "— (pending: the relay has not sent it yet)"

    @admin.display(description="relay lag")
    def relay_lag(self, obj: OutboxEvent) -> str:
        from django_platformkit.templatetags.platformkit_admin import age_text

        end = obj.published_at or timezone.now()
        text = age_text((end - obj.created_at).total_seconds())
        return text if obj.published_at else f"{text} so far"

    @admin.display(description="age", ordering="created_at")
    def age(self, obj: OutboxEvent) -> str:
        return timesince(obj.created_at)

    @admin.display(description="payload")
    def payload_json(self, obj: OutboxEvent) -> str:
        return _pretty_json(obj.payload)

    @admin.display(description="headers")
    def headers_json(self, obj: OutboxEvent) -> str:
        return _pretty_json(obj.headers)

    @admin.display(description="dead letters and claims")
    def related(self, obj: OutboxEvent) -> str:
        dead = DeadLetter.objects.filter(event_id=obj.pk).count()
        claims = HandledEvent.objects.filter(event_id=obj.pk).count()
        return format_html(
            '<a href="{}?q={}">{} dead letter(s)</a> · <a href="{}?q={}">{} claim(s)</a>',
            self._url(DeadLetter, "changelist"),
            obj.pk,
            dead,
            self._url(HandledEvent, "changelist"),
            obj.pk,
            claims,
        )

    @admin.display(description="claims")
    def claims(self, obj: OutboxEvent) -> str:
        """Each subscription's claim on this event, terminal ones marked."""
        rows = list(
            with_terminal(HandledEvent.objects.filter(event_id=obj.pk)).order_by("subscription")[:CLAIMS_ON_PAGE]
        )
        if not rows:
            return "— (no subscription has handled or given up on it yet)"
        return format_html(
            '<table class="platformkit-claims"><tbody>{}</tbody></table>',
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                ((c.subscription, claim_kind(c), when_html(c.handled_at)) for c in rows),
            ),
        )

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[OutboxEvent], search_term: str
    ) -> tuple[QuerySet[OutboxEvent], bool]:
        event_id = _uuid_or_none(search_term)
        if event_id is not None:  # the primary key: one index lookup, not a scan
            return queryset.filter(pk=event_id), False
        return super().get_search_results(request, queryset, search_term)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # The relay's lag at a glance; both walk the partial index of pending rows.
        lag = OutboxEvent.objects.pending().aggregate(count=Count("id"), oldest=Min("created_at"))
        context = {
            "pending_count": lag["count"],
            "oldest_pending_age": timesince(lag["oldest"], timezone.now()) if lag["oldest"] else None,
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)


#: Claims the outbox row's page lists (one per subscription, so few).
CLAIMS_ON_PAGE = 100


def with_terminal(queryset: QuerySet[HandledEvent]) -> QuerySet[_ClaimWithTerminal]:
    """Annotate ``terminal``: the claim has a dead letter beside it (the
    subscription gave up; nothing runs it again until a replay)."""
    dead = DeadLetter.objects.filter(subscription=OuterRef("subscription"), event_id=OuterRef("event_id"))
    return queryset.annotate(terminal=Exists(dead, output_field=BooleanField()))


def claim_kind(claim: HandledEvent) -> str:
    if getattr(claim, "terminal", False):
        return mark_safe('<strong class="platformkit-terminal">terminal: dead-lettered</strong>')
    return "handled"


class ClaimKindFilter(admin.SimpleListFilter):
    title = "kind"
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("handled", "handled"), ("terminal", "terminal: dead-lettered")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[_ClaimWithTerminal]) -> QuerySet[_ClaimWithTerminal]:
        if self.value() == "terminal":
            return queryset.filter(terminal=True)
        if self.value() == "handled":
            return queryset.filter(terminal=False)
        return queryset


@admin.register(HandledEvent)
class HandledEventAdmin(ReadOnlyAdmin[HandledEvent]):
    list_display = ("handled", "subscription", "event_id", "kind")
    list_display_links = ("handled",)
    list_filter = ("subscription", ClaimKindFilter)
    date_hierarchy = "handled_at"
    search_fields = ("event_id",)
    search_help_text = "Search by event id (or part of it)."
    ordering = ("-handled_at", "-id")
    show_full_result_count = False
    fields = ("subscription", "event_id", "handled", "kind")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[HandledEvent]:
        # One EXISTS per listed row on the dead letters' unique index, not one query per row.
        return with_terminal(super().get_queryset(request))

    @admin.display(description="handled at", ordering="handled_at")
    def handled(self, obj: HandledEvent) -> str:
        return when_html(obj.handled_at)

    @admin.display(description="kind")
    def kind(self, obj: HandledEvent) -> str:
        return claim_kind(obj)


@admin.register(Attempt)
class AttemptAdmin(ReadOnlyAdmin[Attempt]):
    list_display = (
        "started",
        "subscription",
        "event_id",
        "attempt",
        "outcome",
        "ran_for",
        "worker",
        "error_first_line",
    )
    list_display_links = ("started",)
    list_filter = ("outcome", "subscription")
    date_hierarchy = "started_at"
    search_fields = ("event_id", "error")
    search_help_text = "Search by event id (or part of it) or error text."
    ordering = ("-started_at", "-id")
    show_full_result_count = False
    fields = (
        "subscription",
        "event_id",
        "attempt",
        "outcome",
        "started",
        "finished",
        "worker",
        "error_text",
        "traceback_text",
    )
    readonly_fields = fields

    @admin.display(description="started at", ordering="started_at")
    def started(self, obj: Attempt) -> str:
        return when_html(obj.started_at)

    @admin.display(description="finished at", ordering="finished_at")
    def finished(self, obj: Attempt) -> str:
        return when_html(obj.finished_at)

    @admin.display(description="ran for")
    def ran_for(self, obj: Attempt) -> str:
        return _duration(obj.started_at, obj.finished_at)

    @admin.display(description="error")
    def error_first_line(self, obj: Attempt) -> str:
        return _truncated(obj.error)

    @admin.display(description="error")
    def error_text(self, obj: Attempt) -> str:
        return _pre(obj.error)

    @admin.display(description="traceback")
    def traceback_text(self, obj: Attempt) -> str:
        return _pre(obj.traceback)


def _job_specs() -> dict[str, Any]:
    from django_platformkit.jobs import specs as jobs

    listing = getattr(jobs, "jobs", None)
    return {spec.name: spec for spec in listing()} if listing is not None else {}


@admin.register(JobState)
class JobStateAdmin(ReadOnlyAdmin[JobState]):
    list_display = (
        "name",
        "schedule",
        "time_zone",
        "last_slot_at",
        "started",
        "finished",
        "last_error_first_line",
        "next_slot",
    )
    search_fields = ("name",)
    fields = ("name", "schedule", "time_zone", "last_slot_at", "started", "finished", "next_slot", "last_error_text")
    readonly_fields = fields

    def _spec(self, obj: JobState) -> Any:
        return _job_specs().get(obj.name)

    @admin.display(description="schedule")
    def schedule(self, obj: JobState) -> str:
        spec = self._spec(obj)
        return spec.schedule_text if spec is not None else "— (no longer declared)"

    @admin.display(description="time zone")
    def time_zone(self, obj: JobState) -> str:
        spec = self._spec(obj)
        return str(spec.timezone) if spec is not None else "—"

    @admin.display(description="started at", ordering="started_at")
    def started(self, obj: JobState) -> str:
        return when_html(obj.started_at)

    @admin.display(description="finished at", ordering="finished_at")
    def finished(self, obj: JobState) -> str:
        return when_html(obj.finished_at)

    @admin.display(description="last slot", ordering="last_slot")
    def last_slot_at(self, obj: JobState) -> str:
        return when_html(obj.last_slot)

    @admin.display(description="next slot")
    def next_slot(self, obj: JobState) -> str:
        spec = self._spec(obj)
        if spec is None:
            return "—"
        return when_html(spec.next_slot(timezone.now()))

    @admin.display(description="last error")
    def last_error_first_line(self, obj: JobState) -> str:
        return _first_line(obj.last_error)

    @admin.display(description="last error")
    def last_error_text(self, obj: JobState) -> str:
        return _pre(obj.last_error)


#: The model admins whose view permission opens the overview.
_OVERVIEW_MODELS = (OutboxEvent, HandledEvent, DeadLetter, JobState, Attempt, Overview)


@admin.register(Overview)
class OverviewAdmin(NoWritesAdmin, ModelAdminOf[Overview]):
    """The overview page (``admin:django_platformkit_overview``): every
    subscription keeping up or falling behind, the relay's lag, jobs and
    workers, from ``overview.collect()``. Open to staff who may view any of
    the operational tables; it shows counts and names, never payloads."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        return bool(user.is_active and user.is_staff) and any(
            user.has_perm(f"django_platformkit.view_{model._meta.model_name}") for model in _OVERVIEW_MODELS
        )

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.overview_view)
        return [
            path("", view, name="django_platformkit_overview"),
            # The app index links a model's changelist: the same page.
            path("", view, name="django_platformkit_overview_changelist"),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        from django_platformkit.admin import figures as overview

        if not self.has_view_permission(request):
            raise PermissionDenied
        figures = overview.collect()
        context = {
            **self.admin_site.each_context(request),
            "title": "Overview",
            "subtitle": None,
            "opts": self.model._meta,
            "overview": figures,
            "alive_after_seconds": int(ALIVE_AFTER_SECONDS),
            "links": {
                "dead_letters": self._url(DeadLetter, "changelist"),
                "claims": self._url(HandledEvent, "changelist"),
                "outbox": self._url(OutboxEvent, "changelist"),
                "jobs": self._url(JobState, "changelist"),
            },
        }
        return TemplateResponse(request, "admin/django_platformkit/overview.html", context)

    def _url(self, model: type[Model], view: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:django_platformkit_{model._meta.model_name}_{view}", args=args)
