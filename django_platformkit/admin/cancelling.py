"""The admin's **Cancel** action on outbox events and tasks: ``cancel()``
for each selected event, after a confirmation page that asks for a reason.
It needs the ``django_platformkit.replay_deadletter`` permission (the
operator actions' one) and leaves an admin ``LogEntry`` (actor, reason) on
each outbox row it cancelled.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_platformkit.models import OutboxEvent

#: The permission the action needs (``DeadLetter.Meta.permissions``), as Replay and Discard.
OPERATOR_PERMISSION = "django_platformkit.replay_deadletter"
#: Rows one confirmation lists by name; the rest are counted.
CONFIRMATION_LIST_LIMIT = 100


# Offered only to a user who may run it (the model admin's ``has_replay_permission``): one who
# can't was shown the action and then got a 403.
@admin.action(permissions=["replay"], description=gettext_lazy("Cancel selected events (before they run)…"))
def cancel_selected(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[Any]
) -> HttpResponse | None:
    """Confirm with a reason, then ``cancel()`` each selected event for every
    subscription, reporting what was cancelled and what came too late."""
    if not request.user.has_perm(OPERATOR_PERMISSION):
        raise PermissionDenied
    reason = (request.POST.get("reason") or "").strip()
    confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
    if confirmed and reason:
        _perform(modeladmin, request, list(queryset), reason)
        return None
    opts = modeladmin.model._meta
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": _("Cancel events"),
        "opts": opts,
        "rows": list(queryset[:CONFIRMATION_LIST_LIMIT]),
        "count": queryset.count(),
        "reason": reason,
        "reason_missing": confirmed and not reason,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "selected_ids": [str(pk) for pk in queryset.values_list("pk", flat=True)],
        "action_name": "cancel_selected",
        "select_across": request.POST.get("select_across", "0"),
    }
    return TemplateResponse(request, "admin/django_platformkit/cancel_confirm.html", context)


def _perform(modeladmin: admin.ModelAdmin[Any], request: HttpRequest, rows: list[Any], reason: str) -> None:
    from django.contrib.admin.models import CHANGE, LogEntry

    from django_platformkit.exceptions import CancelRefused
    from django_platformkit.operate.cancel import cancel

    actor, user_id = request.user.get_username(), request.user.pk
    if user_id is None:  # an anonymous user: the admin's views let none this far
        raise PermissionDenied
    for row in rows:
        try:
            result = cancel(row.pk, actor=actor, reason=reason)
        except CancelRefused as exc:
            modeladmin.message_user(
                request, _("Did not cancel %(event)s: %(why)s") % {"event": row, "why": exc}, messages.ERROR
            )
            continue
        if result.cancelled:
            text = _("Cancelled for %(subscriptions)s. Reason: %(reason)s") % {
                "subscriptions": ", ".join(result.cancelled),
                "reason": reason,
            }
            LogEntry.objects.log_actions(
                user_id=user_id,
                queryset=[OutboxEvent.objects.only("id", "name").get(pk=row.pk)],
                action_flag=CHANGE,
                change_message=text,
                single_object=True,
            )
            modeladmin.message_user(request, _("%(event)s: %(done)s") % {"event": row, "done": text}, messages.SUCCESS)
        if result.already_cancelled:
            modeladmin.message_user(
                request,
                _("%(event)s was already cancelled for %(subscriptions)s.")
                % {"event": row, "subscriptions": ", ".join(result.already_cancelled)},
                messages.INFO,
            )
        if result.too_late:
            modeladmin.message_user(
                request,
                _("Too late for %(event)s: %(subscriptions)s handled it (or dead-lettered it) first.")
                % {"event": row, "subscriptions": ", ".join(result.too_late)},
                messages.WARNING,
            )
