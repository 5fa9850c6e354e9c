"""The dead-letter admin: the table, each dead letter's page with its
attempts one by one, and the two operator actions, **Replay** (``replay()``)
and **Discard** (``discard()``), with their confirmation page. Both ask for a
reason, need the ``django_platformkit.replay_deadletter`` permission, and
leave an admin ``LogEntry`` (actor, reason) on the dead letter and the
outbox row. Registered on import (``admin/__init__.py`` imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_platformkit.admin import bulk
from django_platformkit.admin.attempts import outcome_labels
from django_platformkit.admin.display import (
    ReadOnlyAdmin,
    breakable,
    clipped_line,
    duration_text,
    pre_html,
    pretty_json,
    truncated_html,
)
from django_platformkit.admin.tasknames import TaskPathFilter, subscription_and_task, with_task_paths
from django_platformkit.models import Attempt, DeadLetter, OutboxEvent
from django_platformkit.operate.audit import log_dead_letter_action
from django_platformkit.operate.deadletters import replay_blocker as _replay_blocker
from django_platformkit.templatetags.platformkit_admin import when_html

if TYPE_CHECKING:
    from django.urls import URLPattern

#: The permission both operator actions need (``DeadLetter.Meta.permissions``).
REPLAY_PERMISSION = "django_platformkit.replay_deadletter"
#: Rows one Replay/Discard confirmation lists by name; the rest are counted.
CONFIRMATION_LIST_LIMIT = 100
#: Refusals a bulk Replay/Discard reports one by one in the message bar; the rest are counted.
REFUSALS_LISTED = 20


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin[DeadLetter]):
    # At 1280 px beside the filters the error keeps a third of the list: names
    # wrap after their dots, the attempts sit under the time they ended.
    list_display = ("failed", "event_name", "subscription_task", "tenant", "event_id", "error_first_line")
    list_display_links = ("failed", "event_name")
    list_filter = ("subscription", TaskPathFilter, "name", "tenant")
    date_hierarchy = "failed_at"
    search_fields = ("event_id", "error")
    search_help_text = gettext_lazy("Search by event id (or part of it) or error text.")
    actions = ["replay_selected", "discard_selected"]
    fields = (
        "event_id",
        "outbox_link",
        "name",
        "subscription_task",
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

    def get_queryset(self, request: HttpRequest) -> QuerySet[DeadLetter]:
        return with_task_paths(super().get_queryset(request))

    @admin.display(description=gettext_lazy("subscription / task"), ordering="subscription")
    def subscription_task(self, obj: DeadLetter) -> str:
        return subscription_and_task(obj)

    @admin.display(description=gettext_lazy("failed at"), ordering="failed_at")
    def failed(self, obj: DeadLetter) -> str:
        after = ngettext("after %(n)d attempt", "after %(n)d attempts", obj.attempts) % {"n": obj.attempts}
        return format_html('{}<span class="pk-after">{}</span>', when_html(obj.failed_at), after)

    @admin.display(description=gettext_lazy("name"), ordering="name")
    def event_name(self, obj: DeadLetter) -> str:
        return breakable(obj.name)

    @admin.display(description=gettext_lazy("error"), ordering="error")
    def error_first_line(self, obj: DeadLetter) -> str:
        return truncated_html(obj.error)

    @admin.display(description=gettext_lazy("error"))
    def error_text(self, obj: DeadLetter) -> str:
        return pre_html(obj.error)

    @admin.display(description=gettext_lazy("payload"))
    def payload(self, obj: DeadLetter) -> str:
        row = OutboxEvent.objects.filter(pk=obj.event_id).only("payload").first()
        if row is None:
            return _("— (not in the outbox: purged, or a message that was never an event of ours)")
        return pretty_json(row.payload)

    @admin.display(description=gettext_lazy("traceback"))
    def traceback_text(self, obj: DeadLetter) -> str:
        return pre_html(obj.traceback)

    @admin.display(description=gettext_lazy("outbox row"))
    def outbox_link(self, obj: DeadLetter) -> str:
        if not OutboxEvent.objects.filter(pk=obj.event_id).exists():
            return "—"
        return format_html('<a href="{}">{}</a>', self._url(OutboxEvent, "change", obj.event_id), obj.event_id)

    @admin.display(description=gettext_lazy("attempts, one by one"))
    def attempt_history(self, obj: DeadLetter) -> str:
        """Each run of the handler for this (subscription, event), from ``Attempt`` rows."""
        rows = list(
            Attempt.objects.for_event(obj.event_id, obj.subscription).order_by("attempt")[:ATTEMPT_HISTORY_LIMIT]
        )
        if not rows:
            return _("— (no per-attempt record: the worker that ran it did not keep one; the last error is above)")
        labels = outcome_labels()
        body = format_html_join(
            "",
            '<tr class="platformkit-attempt-{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>',
            (
                (
                    a.outcome,
                    a.attempt,
                    labels.get(a.outcome, a.outcome),
                    when_html(a.started_at, relative=False),
                    duration_text(a.started_at, a.finished_at),
                    a.worker or "—",
                    _attempt_error(a),
                )
                for a in rows
            ),
        )
        return format_html(
            '<table class="platformkit-attempts"><thead><tr><th>#</th><th>{}</th><th>{}</th><th>{}</th>'
            "<th>{}</th><th>{}</th></tr></thead><tbody>{}</tbody></table>",
            _("outcome"),
            _("started at"),
            _("ran for"),
            _("worker"),
            _("error"),
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

    @admin.action(permissions=["replay"], description=gettext_lazy("Replay selected dead letters…"))
    def replay_selected(self, request: HttpRequest, queryset: QuerySet[DeadLetter]) -> HttpResponse | None:
        return self._confirm(request, queryset, "replay")

    @admin.action(permissions=["replay"], description=gettext_lazy("Discard selected dead letters…"))
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
            self.message_user(
                request,
                _("No replay for %(name)s %(event_id)s: %(why)s")
                % {"name": row.name, "event_id": row.event_id, "why": blocked},
                messages.ERROR,
            )
            return HttpResponseRedirect(self._url(DeadLetter, "change", row.pk))
        response = self._confirm(request, queryset, verb, from_object=True)
        return response or HttpResponseRedirect(self._url(DeadLetter, "changelist"))

    def _confirm(
        self, request: HttpRequest, queryset: QuerySet[DeadLetter], verb: str, *, from_object: bool = False
    ) -> HttpResponse | None:
        """The intermediate page: list what will happen and ask for a reason;
        on a confirmed POST with a reason, do it and report in the message bar.
        ``queryset`` is the selection, or every row the filter matches
        ("Select all N": ``bulk``)."""
        reason = (request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        chosen = bulk.selection(request, queryset)
        queryset = chosen.rows
        if not queryset.exists():
            if chosen.across:
                bulk.nothing_matches(self, request, chosen, _("replay") if verb == "replay" else _("discard"))
                return None
            # Selected on a page that is out of date: another operator (or
            # this form, sent twice) replayed or discarded them meanwhile.
            # Without this the action did nothing and said nothing.
            text = (
                _(
                    "Nothing to replay: the selected dead letters are gone (replayed or discarded meanwhile?). "
                    "The list below is what is left."
                )
                if verb == "replay"
                else _(
                    "Nothing to discard: the selected dead letters are gone (replayed or discarded meanwhile?). "
                    "The list below is what is left."
                )
            )
            self.message_user(request, text, messages.WARNING)
            return None
        if confirmed and reason:
            self._perform(request, queryset, verb, reason, chosen)
            return None
        rows = list(queryset[:CONFIRMATION_LIST_LIMIT])
        # Said before the operator confirms, not only in the result: which of
        # the selection a Replay will leave alone (no outbox row to send).
        blocked_rows = queryset.none()
        if verb == "replay":
            from django_platformkit.consume.subscriptions import subscriptions
            from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS

            declared = [s.name for s in subscriptions()] + [RELAY_DEAD_LETTERS]
            blocked_rows = queryset.exclude(
                Q(event_id__in=OutboxEvent.objects.values("id")) & Q(subscription__in=declared)
            )
        not_replayed = [(row, replay_blocker(row)) for row in blocked_rows[:CONFIRMATION_LIST_LIMIT]]
        context = {
            **self.admin_site.each_context(request),
            "title": _("Replay dead letters") if verb == "replay" else _("Discard dead letters"),
            "opts": self.model._meta,
            "verb": verb,
            "rows": rows,
            "count": queryset.count(),
            "across": chosen.across,
            "not_replayed": not_replayed,
            "not_replayed_count": blocked_rows.count() if not_replayed else 0,
            "reason": reason,
            "reason_missing": confirmed and not reason,
            "from_object": from_object,
            **chosen.form(),
            "action_name": f"{verb}_selected",
            "changelist_url": self._url(DeadLetter, "changelist"),
        }
        return TemplateResponse(request, "admin/django_platformkit/deadletter/confirm.html", context)

    def _perform(
        self, request: HttpRequest, rows: QuerySet[DeadLetter], verb: str, reason: str, chosen: bulk.Selection
    ) -> None:
        from django_platformkit.exceptions import ReplayRefused
        from django_platformkit.operate.deadletters import BatchLog, discard, replay

        actor = request.user.get_username()
        done, refused = [], []
        log = BatchLog(verb, actor=actor, reason=reason)
        for row in rows.iterator(chunk_size=500):
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
                    refused.append((row, _("already gone")))
                    continue
            except ReplayRefused as exc:
                refused.append((row, str(exc)))
                continue
            log.done()
            self.log_operator_action(request, row, verb, reason)
        log.close()
        if done:
            what = ", ".join(
                _("%(name)s for %(subscription)s") % {"name": row.name, "subscription": row.subscription}
                for row in done[:5]
            ) + (" …" if len(done) > 5 else "")
            if verb == "replay":
                text = ngettext(
                    "Replayed %(n)d dead letter (%(what)s): pending again, the relay sends it next.",
                    "Replayed %(n)d dead letters (%(what)s): pending again, the relay sends them next.",
                    len(done),
                )
            else:
                text = ngettext(
                    "Discarded %(n)d dead letter (%(what)s): the failure is accepted, nothing runs it again.",
                    "Discarded %(n)d dead letters (%(what)s): the failure is accepted, nothing runs them again.",
                    len(done),
                )
            since = bulk.changed_since(chosen, len(done) + len(refused))
            self.message_user(
                request, text % {"n": len(done), "what": what} + (f" {since}" if since else ""), messages.SUCCESS
            )
        for row, why in refused[:REFUSALS_LISTED]:
            text = (
                _("Did not replay %(name)s %(event_id)s for %(subscription)s: %(why)s")
                if verb == "replay"
                else _("Did not discard %(name)s %(event_id)s for %(subscription)s: %(why)s")
            )
            values = {"name": row.name, "event_id": row.event_id, "subscription": row.subscription, "why": why}
            self.message_user(request, text % values, messages.ERROR)
        if len(refused) > REFUSALS_LISTED:
            self.message_user(
                request,
                _("… and %(n)d more not done for the same kinds of reasons.") % {"n": len(refused) - REFUSALS_LISTED},
                messages.ERROR,
            )

    def log_operator_action(self, request: HttpRequest, row: DeadLetter, verb: str, reason: str) -> None:
        """The admin's own history of what an operator did
        (``operate.audit.log_dead_letter_action``): one ``LogEntry`` on the
        dead letter and, where the event is ours, one on the outbox row."""
        actor = request.user.pk
        if actor is None:  # an anonymous user: the admin's views let none this far
            raise PermissionDenied
        log_dead_letter_action(actor, row, verb, reason)


#: Attempt rows one dead letter's page lists.
ATTEMPT_HISTORY_LIMIT = 50


def replay_blocker(row: DeadLetter) -> str | None:
    """Why ``row`` can't be replayed (a Replay could only fail, or leave the
    event unhandled), or None: ``operate.deadletters.replay_blocker``."""
    return _replay_blocker(row.event_id, row.name, row.subscription)


def _attempt_error(attempt: Attempt) -> str:
    if not attempt.error:
        return "—"
    if not attempt.traceback:
        return truncated_html(attempt.error)
    return format_html(
        '<details><summary><span class="platformkit-trunc">{}</span></summary><pre class="platformkit-pre">{}</pre></details>',
        clipped_line(attempt.error, limit=500),
        attempt.traceback,
    )
