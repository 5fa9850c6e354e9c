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
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.core.exceptions import PermissionDenied
from django.db.models import BooleanField, Count, Exists, Min, Model, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from .heartbeat import ALIVE_AFTER_SECONDS
from .models import Attempt, DeadLetter, HandledEvent, JobState, OutboxEvent, OutboxQuerySet, Overview
from .templatetags.platformkit_admin import when_html

#: The permission both operator actions need (``DeadLetter.Meta.permissions``).
REPLAY_PERMISSION = "django_platformkit.replay_deadletter"
#: Rows one Replay/Discard confirmation lists by name; the rest are counted.
CONFIRMATION_LIST_LIMIT = 100


#: The name the consumer gives a message it could not read as an event.
MALFORMED_NAME = "(malformed)"
#: Lookup suffixes a list filter or the date hierarchy puts in the query string.
_FILTER_SUFFIXES = ("", "__exact", "__isnull")
_DATE_SUFFIXES = ("__year", "__month", "__day", "__gte", "__lt")


def _first_line(text: str, limit: int = 120) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _truncated(text: str) -> str:
    """The first line, cut by CSS to the column's width (full line on hover)."""
    line = _first_line(text, limit=500)
    return format_html('<span class="platformkit-trunc" title="{}">{}</span>', line, line) if line else "—"


def _pretty_json(value: Any) -> str:
    return format_html(
        '<pre class="platformkit-json">{}</pre>', json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    )


def _pre(text: str) -> str:
    return format_html('<pre class="platformkit-pre">{}</pre>', text) if text else "—"


def _uuid_or_none(term: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(term.strip())
    except ValueError:
        return None


if TYPE_CHECKING:
    from typing import TypedDict

    from django.urls import URLPattern
    from django_stubs_ext import WithAnnotations

    class _Terminal(TypedDict):
        terminal: bool

    # A claim annotated by with_terminal().
    _ClaimWithTerminal = WithAnnotations[HandledEvent, _Terminal]
    _ModelAdmin = admin.ModelAdmin
else:

    class _ModelAdmin(admin.ModelAdmin):
        # django-stubs makes ModelAdmin generic in its model (ModelAdmin[M]);
        # Django's class can't be subscripted at run time.
        def __class_getitem__(cls, model: Any) -> type:
            return cls


class ReadOnlyAdmin[ModelT: Model](_ModelAdmin[ModelT]):
    """Operational tables are evidence: nobody adds, edits or deletes a row
    by hand. State changes are named actions that call the library."""

    list_per_page = 50
    change_list_template = "admin/django_platformkit/change_list.html"

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """Only what the list's own filters and date hierarchy produce. Django
        lets any lookup on a local field through (``?error__regex=(`` is a
        500 from PostgreSQL, ``?payload__card__number=`` filters on payload
        keys a view-only user never sees): here they are a 400."""
        return lookup in self._allowed_lookups(request)

    def _allowed_lookups(self, request: HttpRequest) -> set[str]:
        allowed: set[str] = set()
        for item in self.get_list_filter(request):
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                if item.parameter_name is not None:
                    allowed.add(item.parameter_name)
            else:
                name = item[0] if isinstance(item, (list, tuple)) else item
                if isinstance(name, str):  # our lists name fields, never Field objects
                    allowed.update(name + suffix for suffix in _FILTER_SUFFIXES)
        if self.date_hierarchy:
            allowed.update(self.date_hierarchy + suffix for suffix in _DATE_SUFFIXES)
        return allowed

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        try:
            return super().changelist_view(request, extra_context=extra_context)
        except DisallowedModelAdminLookup as exc:
            # A 400 that says what to do, instead of Django's bare "Bad Request".
            offered = ", ".join(sorted(self._allowed_lookups(request))) or "nothing"
            return HttpResponseBadRequest(
                f"{exc}: this list filters only by what it offers ({offered}). Use the filters beside the list or the search box.",
                content_type="text/plain; charset=utf-8",
            )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _url(self, model: type[Model], view: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:django_platformkit_{model._meta.model_name}_{view}", args=args)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin[DeadLetter]):
    list_display = ("failed", "name", "subscription", "tenant", "attempts", "event_id", "error_first_line")
    list_display_links = ("failed", "name")
    list_filter = ("subscription", "name", "tenant")
    date_hierarchy = "failed_at"
    search_fields = ("event_id", "error")
    search_help_text = "Search by event id (or part of it) or error text."
    actions = ["replay_selected", "discard_selected"]
    fields = (
        "event_id",
        "outbox_link",
        "name",
        "subscription",
        "tenant",
        "attempts",
        "failed",
        "error_text",
        "payload",
        "traceback_text",
        "attempt_history",
    )
    readonly_fields = fields
    change_form_template = "admin/django_platformkit/deadletter/change_form.html"
    change_list_template = "admin/django_platformkit/deadletter/change_list.html"

    @admin.display(description="failed at", ordering="failed_at")
    def failed(self, obj: DeadLetter) -> str:
        return when_html(obj.failed_at)

    @admin.display(description="error", ordering="error")
    def error_first_line(self, obj: DeadLetter) -> str:
        return _truncated(obj.error)

    @admin.display(description="error")
    def error_text(self, obj: DeadLetter) -> str:
        return _pre(obj.error)

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

    @admin.display(description="attempts, one by one")
    def attempt_history(self, obj: DeadLetter) -> str:
        """Each run of the handler for this (subscription, event), from ``Attempt`` rows."""
        rows = list(
            Attempt.objects.for_event(obj.event_id, obj.subscription).order_by("attempt")[:ATTEMPT_HISTORY_LIMIT]
        )
        if not rows:
            return "— (no per-attempt record: the worker that ran it did not keep one; the last error is above)"
        body = format_html_join(
            "",
            '<tr class="platformkit-attempt-{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>',
            (
                (
                    a.outcome,
                    a.attempt,
                    a.get_outcome_display(),
                    when_html(a.started_at, relative=False),
                    _duration(a.started_at, a.finished_at),
                    a.worker or "—",
                    _attempt_error(a),
                )
                for a in rows
            ),
        )
        return format_html(
            '<table class="platformkit-attempts"><thead><tr><th>#</th><th>outcome</th><th>started</th><th>ran for</th>'
            "<th>worker</th><th>error</th></tr></thead><tbody>{}</tbody></table>",
            body,
        )

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REPLAY_PERMISSION)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        obj = self.get_object(request, object_id)
        context = {"replay_blocked": replay_blocker(obj) if obj is not None else None, **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra_context=context)

    # -- the two operator actions ------------------------------------------

    @admin.action(permissions=["replay"], description="Replay selected dead letters…")
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        return self._confirm(request, queryset, "replay")

    @admin.action(permissions=["replay"], description="Discard selected dead letters…")
    def discard_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        return self._confirm(request, queryset, "discard")

    def get_urls(self) -> list[URLPattern]:
        info = self.model._meta.app_label, self.model._meta.model_name
        view = self.admin_site.admin_view(self.verb_view)
        own = [
            path("<path:object_id>/replay/", view, {"verb": "replay"}, name="{}_{}_replay".format(*info)),
            path("<path:object_id>/discard/", view, {"verb": "discard"}, name="{}_{}_discard".format(*info)),
        ]
        return own + super().get_urls()

    def verb_view(self, request: HttpRequest, object_id: str, verb: str) -> HttpResponse:
        """Replay or Discard from a dead letter's own page."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        # The URL takes any text: an id that isn't a number is "not found", not a 500.
        queryset = (
            self.get_queryset(request).filter(pk=object_id)
            if str(object_id).isdigit()
            else self.get_queryset(request).none()
        )
        row = queryset.first()
        if row is None:
            # Django's own "doesn't exist" redirect: a private ModelAdmin helper django-stubs leaves out.
            redirect: HttpResponse = self._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined]
                request, self.model._meta, object_id
            )
            return redirect
        blocked = replay_blocker(row) if verb == "replay" else None
        if blocked:
            # The page offers no Replay for it; a hand-typed URL is told why, not sent to a confirmation that can only fail.
            self.message_user(request, f"No replay for {row.name} {row.event_id}: {blocked}", messages.ERROR)
            return HttpResponseRedirect(self._url(DeadLetter, "change", row.pk))
        response = self._confirm(request, queryset, verb, from_object=True)
        return response or HttpResponseRedirect(self._url(DeadLetter, "changelist"))

    def _confirm(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], verb: str, *, from_object: bool = False
    ) -> HttpResponse | None:
        """The intermediate page: list what will happen and ask for a reason;
        on a confirmed POST with a reason, do it and report in the message bar."""
        reason = (request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        if confirmed and reason:
            self._perform(request, list(queryset), verb, reason)
            return None
        rows = list(queryset[:CONFIRMATION_LIST_LIMIT])
        # Said before the operator confirms, not only in the result: which of
        # the selection a Replay will leave alone (no outbox row to send).
        blocked_rows = queryset.none()
        if verb == "replay":
            blocked_rows = queryset.exclude(event_id__in=OutboxEvent.objects.values("id"))
        not_replayed = [(row, replay_blocker(row)) for row in blocked_rows[:CONFIRMATION_LIST_LIMIT]]
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb.capitalize()} dead letters",
            "opts": self.model._meta,
            "verb": verb,
            "rows": rows,
            "count": queryset.count(),
            "not_replayed": not_replayed,
            "not_replayed_count": blocked_rows.count() if not_replayed else 0,
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
        from .deadletters import discard, replay
        from .exceptions import ReplayRefused

        actor = request.user.get_username()
        done, refused = [], []
        for row in rows:
            blocked = replay_blocker(row) if verb == "replay" else None
            if blocked:
                refused.append((row, blocked))
                continue
            try:
                if verb == "replay":
                    replay(row.event_id, subscription=row.subscription, actor=actor, reason=reason)
                    done.append(row)
                elif discard(row.event_id, subscription=row.subscription, actor=actor, reason=reason):
                    done.append(row)
                else:
                    refused.append((row, "already gone"))
                    continue
            except ReplayRefused as exc:
                refused.append((row, str(exc)))
                continue
            self._log(request, row, verb, reason)
        if done:
            what = ", ".join(f"{row.name} for {row.subscription}" for row in done[:5]) + (" …" if len(done) > 5 else "")
            plural, them = ("", "it") if len(done) == 1 else ("s", "them")
            if verb == "replay":
                text = f"Replayed {len(done)} dead letter{plural} ({what}): pending again, the relay sends {them} next."
            else:
                text = f"Discarded {len(done)} dead letter{plural} ({what}): the failure is accepted, nothing runs {them} again."
            self.message_user(request, text, messages.SUCCESS)
        for row, why in refused:
            self.message_user(
                request, f"Did not {verb} {row.name} {row.event_id} for {row.subscription}: {why}", messages.ERROR
            )

    def _log(self, request: HttpRequest, row: DeadLetter, verb: str, reason: str) -> None:
        """The admin's own history of what an operator did: one ``LogEntry``
        on the dead letter (gone afterwards, its History still lists it) and,
        where the event is ours, one on the outbox row (whose History page
        survives). The text carries the reason; the entry the actor."""
        past = "Replayed" if verb == "replay" else "Discarded"
        message = f"{past} for subscription {row.subscription} (event {row.event_id}). Reason: {reason}"
        actor = request.user.pk
        if actor is None:  # an anonymous user: the admin's views let none this far
            raise PermissionDenied
        LogEntry.objects.log_actions(
            user_id=actor,
            queryset=[row],
            action_flag=CHANGE if verb == "replay" else DELETION,
            change_message=message,
            single_object=True,
        )
        outbox_row = OutboxEvent.objects.filter(pk=row.event_id).only("id", "name").first()
        if outbox_row is not None:
            LogEntry.objects.log_actions(
                user_id=actor,
                queryset=[outbox_row],
                action_flag=CHANGE,
                change_message=message,
                single_object=True,
            )


#: Attempt rows one dead letter's page lists.
ATTEMPT_HISTORY_LIMIT = 50


def replay_blocker(row: DeadLetter) -> str | None:
    """Why ``row`` can't be replayed (a Replay could only fail), or None."""
    if OutboxEvent.objects.filter(pk=row.event_id).exists():
        return None
    if row.name == MALFORMED_NAME:
        return (
            "it is a malformed message (bytes on our subjects that were never an event of this project's outbox), "
            "so there is nothing to send again; Discard it to accept the failure."
        )
    return "its outbox row is gone (purged), so there is nothing to send again; Discard it to accept the failure."


def _duration(started: Any, finished: Any) -> str:
    if started is None or finished is None:
        return "— (never reported)"
    from .templatetags.platformkit_admin import age_text

    seconds = (finished - started).total_seconds()
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else age_text(seconds)


def _attempt_error(attempt: Attempt) -> str:
    if not attempt.error:
        return "—"
    if not attempt.traceback:
        return _truncated(attempt.error)
    return format_html(
        '<details><summary><span class="platformkit-trunc">{}</span></summary><pre class="platformkit-pre">{}</pre></details>',
        _first_line(attempt.error, limit=500),
        attempt.traceback,
    )


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
        from .events import catalogue

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
        from .templatetags.platformkit_admin import age_text

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
    from . import jobs

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
class OverviewAdmin(_ModelAdmin[Overview]):
    """The overview page (``admin:django_platformkit_overview``): every
    subscription keeping up or falling behind, the relay's lag, jobs and
    workers, from ``overview.collect()``. Open to staff who may view any of
    the operational tables; it shows counts and names, never payloads."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        return bool(user.is_active and user.is_staff) and any(
            user.has_perm(f"django_platformkit.view_{model._meta.model_name}") for model in _OVERVIEW_MODELS
        )

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.overview_view)
        return [
            path("", view, name="django_platformkit_overview"),
            # The app index links a model's changelist: the same page.
            path("", view, name="django_platformkit_overview_changelist"),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        from . import overview

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


from . import admin_tasks  # noqa: E402,F401 - django.tasks tasks (admin_tasks.py registers them)
