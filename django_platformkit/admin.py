"""The admin operators work in: the four tables, read-only, with filters,
search and dates. The only state changes are two named actions on dead
letters, **Replay** (``replay()``) and **Discard** (``discard()``); both ask
for a reason, run as the signed-in user, and need the
``django_platformkit.replay_deadletter`` permission, not just staff status.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Min, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.timesince import timesince

from .models import DeadLetter, HandledEvent, JobState, OutboxEvent

#: The permission both operator actions need (``DeadLetter.Meta.permissions``).
REPLAY_PERMISSION = "django_platformkit.replay_deadletter"
#: Rows one Replay/Discard confirmation lists by name; the rest are counted.
CONFIRMATION_LIST_LIMIT = 100


def _first_line(text: str, limit: int = 120) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _pretty_json(value: Any) -> str:
    return format_html('<pre class="platformkit-json">{}</pre>', json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def _pre(text: str) -> str:
    return format_html('<pre class="platformkit-pre">{}</pre>', text) if text else "—"


def _uuid_or_none(term: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(term.strip())
    except ValueError:
        return None


class ReadOnlyAdmin(admin.ModelAdmin):
    """Operational tables are evidence: nobody adds, edits or deletes a row
    by hand. State changes are named actions that call the library."""

    list_per_page = 50

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _url(self, model: type, view: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:django_platformkit_{model._meta.model_name}_{view}", args=args)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    list_display = ("failed_at", "name", "subscription", "tenant", "attempts", "error_first_line")
    list_display_links = ("failed_at", "name")
    list_filter = ("subscription", "name", "tenant")
    date_hierarchy = "failed_at"
    search_fields = ("event_id", "error")
    search_help_text = "Search by event id (or part of it) or error text."
    actions = ["replay_selected", "discard_selected"]
    fields = (
        "event_id", "outbox_link", "name", "subscription", "tenant", "attempts", "failed_at",
        "error", "payload", "traceback_text",
    )
    readonly_fields = fields
    change_form_template = "admin/django_platformkit/deadletter/change_form.html"

    @admin.display(description="error", ordering="error")
    def error_first_line(self, obj: DeadLetter) -> str:
        return _first_line(obj.error)

    @admin.display(description="payload")
    def payload(self, obj: DeadLetter) -> str:
        row = OutboxEvent.objects.filter(pk=obj.event_id).only("payload").first()
        if row is None:
            return "— (not in the outbox: purged, or a message that was never an event of ours)"
        return _pretty_json(row.payload)

    @admin.display(description="traceback")
    def traceback_text(self, obj: DeadLetter) -> str:
        return _pre(obj.traceback)

    @admin.display(description="outbox row")
    def outbox_link(self, obj: DeadLetter) -> str:
        if not OutboxEvent.objects.filter(pk=obj.event_id).exists():
            return "—"
        return format_html('<a href="{}">{}</a>', self._url(OutboxEvent, "change", obj.event_id), obj.event_id)

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REPLAY_PERMISSION)

    # -- the two operator actions ------------------------------------------

    @admin.action(permissions=["replay"], description="Replay selected dead letters…")
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        return self._confirm(request, queryset, "replay")

    @admin.action(permissions=["replay"], description="Discard selected dead letters…")
    def discard_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        return self._confirm(request, queryset, "discard")

    def get_urls(self):
        info = self.model._meta.app_label, self.model._meta.model_name
        view = self.admin_site.admin_view(self.verb_view)
        own = [
            path("<path:object_id>/replay/", view, {"verb": "replay"}, name="%s_%s_replay" % info),
            path("<path:object_id>/discard/", view, {"verb": "discard"}, name="%s_%s_discard" % info),
        ]
        return own + super().get_urls()

    def verb_view(self, request: HttpRequest, object_id: str, verb: str) -> HttpResponse:
        """Replay or Discard from a dead letter's own page."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        # The URL takes any text: an id that isn't a number is "not found", not a 500.
        queryset = self.get_queryset(request).filter(pk=object_id) if str(object_id).isdigit() else self.get_queryset(request).none()
        if not queryset.exists():
            return self._get_obj_does_not_exist_redirect(request, self.model._meta, object_id)
        response = self._confirm(request, queryset, verb, from_object=True)
        return response or HttpResponseRedirect(self._url(DeadLetter, "changelist"))

    def _confirm(self, request: HttpRequest, queryset: QuerySet[DeadLetter], verb: str, *, from_object: bool = False) -> HttpResponse | None:
        """The intermediate page: list what will happen and ask for a reason;
        on a confirmed POST with a reason, do it and report in the message bar."""
        reason = (request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        if confirmed and reason:
            self._perform(request, list(queryset), verb, reason)
            return None
        rows = list(queryset[: CONFIRMATION_LIST_LIMIT])
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb.capitalize()} dead letters",
            "opts": self.model._meta,
            "verb": verb,
            "rows": rows,
            "count": queryset.count(),
            "reason": reason,
            "reason_missing": confirmed and not reason,
            "from_object": from_object,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "selected_ids": [str(pk) for pk in queryset.values_list("pk", flat=True)],
            "action_name": f"{verb}_selected",
            "select_across": request.POST.get("select_across", "0"),
            "changelist_url": self._url(DeadLetter, "changelist"),
        }
        return TemplateResponse(request, "admin/django_platformkit/deadletter/confirm.html", context)

    def _perform(self, request: HttpRequest, rows: list[DeadLetter], verb: str, reason: str) -> None:
        from .exceptions import ReplayRefused
        from .relay import discard, replay

        actor = request.user.get_username()
        done, refused = [], []
        for row in rows:
            try:
                if verb == "replay":
                    replay(row.event_id, subscription=row.subscription, actor=actor, reason=reason)
                    done.append(row)
                elif discard(row.event_id, subscription=row.subscription, actor=actor, reason=reason):
                    done.append(row)
                else:
                    refused.append((row, "already gone"))
            except ReplayRefused as exc:
                refused.append((row, str(exc)))
        if done:
            what = ", ".join(f"{row.name} for {row.subscription}" for row in done[:5]) + (" …" if len(done) > 5 else "")
            plural, them = ("", "it") if len(done) == 1 else ("s", "them")
            if verb == "replay":
                text = f"Replayed {len(done)} dead letter{plural} ({what}): pending again, the relay sends {them} next."
            else:
                text = f"Discarded {len(done)} dead letter{plural} ({what}): the failure is accepted, nothing runs {them} again."
            self.message_user(request, text, messages.SUCCESS)
        for row, why in refused:
            self.message_user(request, f"Did not {verb} {row.name} {row.event_id} for {row.subscription}: {why}", messages.ERROR)


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", "pending"), ("published", "published")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> QuerySet[OutboxEvent]:
        if self.value() == "pending":
            return queryset.pending()
        if self.value() == "published":
            return queryset.published()
        return queryset


class EventNameFilter(admin.SimpleListFilter):
    """Event names from the catalogue: a ``SELECT DISTINCT name`` would scan
    the whole outbox on every page view."""

    title = "event name"
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        from .events import catalogue

        return [(name, name) for name in sorted(catalogue())]

    def queryset(self, request: HttpRequest, queryset: QuerySet[OutboxEvent]) -> QuerySet[OutboxEvent]:
        return queryset.filter(name=self.value()) if self.value() else queryset


@admin.register(OutboxEvent)
class OutboxEventAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "tenant", "status", "created_at", "age")
    list_filter = (StatusFilter, EventNameFilter)
    search_fields = ("name",)
    search_help_text = "Search by event id (exact) or event name."
    ordering = ("-created_at", "-id")
    # Counting a large outbox on every page view is the slow part: skip the total.
    show_full_result_count = False
    fields = ("id", "name", "tenant", "status", "created_at", "published_at", "payload_json", "headers_json", "related")
    readonly_fields = fields
    change_list_template = "admin/django_platformkit/outboxevent/change_list.html"

    @admin.display(description="status", ordering="published_at")
    def status(self, obj: OutboxEvent) -> str:
        return "pending" if obj.is_pending else "published"

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
            self._url(DeadLetter, "changelist"), obj.pk, dead, self._url(HandledEvent, "changelist"), obj.pk, claims,
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[OutboxEvent], search_term: str) -> tuple[QuerySet[OutboxEvent], bool]:
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


@admin.register(HandledEvent)
class HandledEventAdmin(ReadOnlyAdmin):
    list_display = ("handled_at", "subscription", "event_id")
    list_filter = ("subscription",)
    date_hierarchy = "handled_at"
    search_fields = ("event_id",)
    search_help_text = "Search by event id (or part of it)."
    ordering = ("-handled_at", "-id")
    show_full_result_count = False


def _job_specs() -> dict[str, Any]:
    from . import jobs

    listing = getattr(jobs, "jobs", None)
    return {spec.name: spec for spec in listing()} if listing is not None else {}


@admin.register(JobState)
class JobStateAdmin(ReadOnlyAdmin):
    list_display = ("name", "schedule", "time_zone", "last_slot", "started_at", "finished_at", "last_error_first_line", "next_slot")
    search_fields = ("name",)
    fields = ("name", "schedule", "time_zone", "last_slot", "started_at", "finished_at", "next_slot", "last_error_text")
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

    @admin.display(description="next slot")
    def next_slot(self, obj: JobState) -> Any:
        spec = self._spec(obj)
        if spec is None:
            return "—"
        return spec.next_slot(timezone.now())

    @admin.display(description="last error")
    def last_error_first_line(self, obj: JobState) -> str:
        return _first_line(obj.last_error)

    @admin.display(description="last error")
    def last_error_text(self, obj: JobState) -> str:
        return _pre(obj.last_error)


from . import admin_tasks  # noqa: E402,F401 - django.tasks tasks (admin_tasks.py registers them)
