"""The outbox and the claims, read-only, with filters, search and dates
to the second: what was published, whether the relay sent it, and which
subscription handled it or gave up on it (a *terminal* claim, a dead
letter beside it).

Query-string lookups are limited to the filters each list offers
(``display.ReadOnlyAdmin.lookup_allowed``): ``?error__regex=(`` or
``?payload__key=`` get a 400, never a 500 or an unindexed scan of payloads.
The other pages have modules of their own: ``overview.py``,
``attempts.py``, ``jobs.py``, ``deadletters.py`` (with the two actions that
change state, Replay and Discard), ``tasks.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin
from django.db.models import BooleanField, Count, Exists, Min, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_platformkit.admin.cancelling import OPERATOR_PERMISSION, cancel_selected
from django_platformkit.admin.display import ReadOnlyAdmin, pretty_json, uuid_or_none
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent, OutboxQuerySet
from django_platformkit.templatetags.platformkit_admin import age_text, when_html

if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    class _Terminal(TypedDict):
        terminal: bool

    # A claim annotated by with_terminal().
    _ClaimWithTerminal = WithAnnotations[HandledEvent, _Terminal]


class StatusFilter(admin.SimpleListFilter):
    title = gettext_lazy("status")
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", _("pending")), ("published", _("published"))]

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

    title = gettext_lazy("event name")
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
    search_help_text = gettext_lazy("Search by event id (exact) or event name.")
    ordering = ("-created_at", "-id")
    # Counting a large outbox on every page view is the slow part: skip the total.
    show_full_result_count = False
    actions = [cancel_selected]

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """Whether ``request.user`` may run the operator actions (Cancel): ``OPERATOR_PERMISSION``."""
        return request.user.has_perm(OPERATOR_PERMISSION)

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

    @admin.display(description=gettext_lazy("status"), ordering="published_at")
    def status(self, obj: OutboxEvent) -> str:
        return _("pending") if obj.is_pending else _("published")

    @admin.display(description=gettext_lazy("created at"), ordering="created_at")
    def created(self, obj: OutboxEvent) -> str:
        return when_html(obj.created_at)

    @admin.display(description=gettext_lazy("published at"), ordering="published_at")
    def published(self, obj: OutboxEvent) -> str:
        return when_html(obj.published_at) if obj.published_at else _("— (pending: the relay has not sent it yet)")

    @admin.display(description=gettext_lazy("relay lag"))
    def relay_lag(self, obj: OutboxEvent) -> str:
        end = obj.published_at or timezone.now()
        text = age_text((end - obj.created_at).total_seconds())
        return text if obj.published_at else _("%(age)s so far") % {"age": text}

    @admin.display(description=gettext_lazy("age"), ordering="created_at")
    def age(self, obj: OutboxEvent) -> str:
        return age_text((timezone.now() - obj.created_at).total_seconds())

    @admin.display(description=gettext_lazy("payload"))
    def payload_json(self, obj: OutboxEvent) -> str:
        return pretty_json(obj.payload)

    @admin.display(description=gettext_lazy("headers"))
    def headers_json(self, obj: OutboxEvent) -> str:
        return pretty_json(obj.headers)

    @admin.display(description=gettext_lazy("dead letters and claims"))
    def related(self, obj: OutboxEvent) -> str:
        dead = DeadLetter.objects.filter(event_id=obj.pk).count()
        claims = HandledEvent.objects.filter(event_id=obj.pk).count()
        return format_html(
            '<a href="{}?q={}">{}</a> · <a href="{}?q={}">{}</a>',
            self._url(DeadLetter, "changelist"),
            obj.pk,
            _("%(n)d dead letter(s)") % {"n": dead},
            self._url(HandledEvent, "changelist"),
            obj.pk,
            _("%(n)d claim(s)") % {"n": claims},
        )

    @admin.display(description=gettext_lazy("claims"))
    def claims(self, obj: OutboxEvent) -> str:
        """Each subscription's claim on this event, terminal ones marked."""
        rows = list(
            with_terminal(HandledEvent.objects.filter(event_id=obj.pk)).order_by("subscription")[:CLAIMS_ON_PAGE]
        )
        if not rows:
            return _("— (no subscription has handled or given up on it yet)")
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
        event_id = uuid_or_none(search_term)
        if event_id is not None:  # the primary key: one index lookup, not a scan
            return queryset.filter(pk=event_id), False
        return super().get_search_results(request, queryset, search_term)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # The relay's lag at a glance; both walk the partial index of pending rows.
        lag = OutboxEvent.objects.pending().aggregate(count=Count("id"), oldest=Min("created_at"))
        context = {
            "pending_count": lag["count"],
            "oldest_pending_age": age_text((timezone.now() - lag["oldest"]).total_seconds()) if lag["oldest"] else None,
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
        return format_html('<strong class="platformkit-terminal">{}</strong>', _("terminal: dead-lettered"))
    return _("handled")


class ClaimKindFilter(admin.SimpleListFilter):
    title = gettext_lazy("kind")
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("handled", _("handled")), ("terminal", _("terminal: dead-lettered"))]

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
    search_help_text = gettext_lazy("Search by event id (or part of it).")
    ordering = ("-handled_at", "-id")
    show_full_result_count = False
    fields = ("subscription", "event_id", "handled", "kind")
    readonly_fields = fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[HandledEvent]:
        # One EXISTS per listed row on the dead letters' unique index, not one query per row.
        return with_terminal(super().get_queryset(request))

    @admin.display(description=gettext_lazy("handled at"), ordering="handled_at")
    def handled(self, obj: HandledEvent) -> str:
        return when_html(obj.handled_at)

    @admin.display(description=gettext_lazy("kind"))
    def kind(self, obj: HandledEvent) -> str:
        return claim_kind(obj)
