"""The admin's **Cancel** action on outbox events and tasks: ``cancel()``
for each selected event - or each the list's filter matches ("Select all
N", ``bulk``) - after a confirmation page that says how many and asks for a reason.
It needs the ``django_platformkit.replay_deadletter`` permission (the
operator actions' one) and leaves an admin ``LogEntry`` (actor, reason) on
each outbox row it cancelled.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_platformkit.admin import bulk

#: The permission the action needs (``DeadLetter.Meta.permissions``), as Replay and Discard.
OPERATOR_PERMISSION = "django_platformkit.replay_deadletter"
#: Rows one confirmation lists by name; the rest are counted.
CONFIRMATION_LIST_LIMIT = 100
#: Refusals one Cancel reports one by one.
REFUSALS_LISTED = 20


# Offered only to a user who may run it (the model admin's ``has_replay_permission``): one who
# can't was shown the action and then got a 403.
@admin.action(permissions=["replay"], description=gettext_lazy("Cancel selected events (before they run)…"))
def cancel_selected(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[Any]
) -> HttpResponse | None:
    """Confirm with a reason, then ``cancel()`` each selected event (or each
    the filter matches: "Select all N") for every subscription, reporting
    what was cancelled and what came too late."""
    if not request.user.has_perm(OPERATOR_PERMISSION):
        raise PermissionDenied
    reason = (request.POST.get("reason") or "").strip()
    confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
    chosen = bulk.selection(request, queryset)
    if bulk.nothing_matches(modeladmin, request, chosen, _("cancel")):
        return None
    if confirmed and reason:
        _perform(modeladmin, request, chosen, reason)
        return None
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": _("Cancel events"),
        "opts": opts,
        "rows": list(chosen.rows[:CONFIRMATION_LIST_LIMIT]),
        "count": chosen.rows.count(),
        "across": chosen.across,
        "reason": reason,
        "reason_missing": confirmed and not reason,
        **chosen.form(),
        "action_name": "cancel_selected",
    }
    return TemplateResponse(request, "admin/django_platformkit/cancel_confirm.html", context)


def _perform(modeladmin: admin.ModelAdmin[Any], request: HttpRequest, chosen: bulk.Selection, reason: str) -> None:
    from django.contrib.admin.models import CHANGE, LogEntry

    from django_platformkit.exceptions import CancelRefused
    from django_platformkit.operate.cancel import cancel

    actor, user_id = request.user.get_username(), request.user.pk
    if user_id is None:  # an anonymous user: the admin's views let none this far
        raise PermissionDenied
    cancelled, already, too_late, refused = [], [], [], []
    for row in chosen.rows.only("id", "name").iterator(chunk_size=500):
        try:
            result = cancel(row.pk, actor=actor, reason=reason)
        except CancelRefused as exc:
            refused.append((row, str(exc)))
            continue
        if result.cancelled:
            text = _("Cancelled for %(subscriptions)s. Reason: %(reason)s") % {
                "subscriptions": ", ".join(result.cancelled),
                "reason": reason,
            }
            LogEntry.objects.log_actions(
                user_id=user_id, queryset=[row], action_flag=CHANGE, change_message=text, single_object=True
            )
            cancelled.append(row)
        elif result.already_cancelled:
            already.append(row)
        if result.too_late:
            too_late.append(row)
    since = bulk.changed_since(chosen, len(cancelled) + len(already) + len(too_late) + len(refused))
    if cancelled:
        text = ngettext(
            "Cancelled %(n)d event (%(what)s): no handler starts it from now on. Reason: %(reason)s",
            "Cancelled %(n)d events (%(what)s): no handler starts them from now on. Reason: %(reason)s",
            len(cancelled),
        ) % {"n": len(cancelled), "what": _few(cancelled), "reason": reason}
        modeladmin.message_user(request, text + (f" {since}" if since else ""), messages.SUCCESS)
    if already:
        modeladmin.message_user(
            request,
            ngettext(
                "%(n)d event was already cancelled (%(what)s).",
                "%(n)d events were already cancelled (%(what)s).",
                len(already),
            )
            % {"n": len(already), "what": _few(already)},
            messages.INFO,
        )
    if too_late:
        modeladmin.message_user(
            request,
            ngettext(
                "Too late for %(n)d event (%(what)s): a subscription handled (or dead-lettered) it first.",
                "Too late for %(n)d events (%(what)s): a subscription handled (or dead-lettered) them first.",
                len(too_late),
            )
            % {"n": len(too_late), "what": _few(too_late)},
            messages.WARNING,
        )
    for row, why in refused[:REFUSALS_LISTED]:
        modeladmin.message_user(
            request, _("Did not cancel %(event)s: %(why)s") % {"event": row, "why": why}, messages.ERROR
        )


def _few(rows: list[Any]) -> str:
    """The first few events by name and id, and an ellipsis for the rest."""
    return ", ".join(str(row) for row in rows[:5]) + (" …" if len(rows) > 5 else "")
