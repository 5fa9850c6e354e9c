"""The overview's **Pause** and **Resume** of a subscription or a task queue
(``operate.pause``): a confirmation page that says what a pause does and
asks why, then the pause, an admin ``LogEntry`` and the message bar. Both
need the ``django_platformkit.replay_deadletter`` permission, as the other
operator actions do. The overview links them on each subscription's row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import messages
from django.contrib.admin.models import ADDITION, DELETION
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _

from django_platformkit.exceptions import ControlRefused
from django_platformkit.models.controls import Pause
from django_platformkit.operate.audit import REPLAY_PERMISSION, log_control
from django_platformkit.operate.pause import PauseChange, pause, paused, queue_name, resume

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin
    from django.urls import URLPattern


def pause_urls(model_admin: ModelAdmin[Any]) -> list[URLPattern]:
    """The two views, under the overview's URL (``.../overview/pause/?subscription=NAME``)."""
    site = model_admin.admin_site
    return [
        path("pause/", site.admin_view(PauseView(model_admin, "pause")), name="django_platformkit_overview_pause"),
        path("resume/", site.admin_view(PauseView(model_admin, "resume")), name="django_platformkit_overview_resume"),
    ]


def may_pause(request: HttpRequest) -> bool:
    """Whether the user may pause and resume (the operator actions' permission)."""
    return bool(request.user.has_perm(REPLAY_PERMISSION))


class PauseView:
    """One of the two verbs (``pause``, ``resume``) as a view: GET shows the
    confirmation, POST with ``confirm=yes`` (and, to pause, a reason) acts."""

    def __init__(self, model_admin: ModelAdmin[Any], verb: str) -> None:
        self.model_admin = model_admin
        self.verb = verb

    def __call__(self, request: HttpRequest) -> HttpResponse:
        admin = self.model_admin
        if not (admin.has_view_permission(request) and may_pause(request)):
            raise PermissionDenied
        overview = reverse(f"{admin.admin_site.name}:django_platformkit_overview")
        name = str(request.GET.get("subscription") or request.POST.get("subscription") or "")
        reason = str(request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        if confirmed and (reason or self.verb == "resume"):
            try:
                changes = self.act(request, name, reason)
            except ControlRefused as exc:
                admin.message_user(request, str(exc), messages.ERROR)
                return HttpResponseRedirect(overview)
            for change in changes:
                admin.message_user(request, self.said(change), messages.SUCCESS if change.changed else messages.INFO)
            return HttpResponseRedirect(overview)
        standing = next((p for p in paused() if p.name == name), None)
        context = {
            **admin.admin_site.each_context(request),
            "title": _("Pause %(name)s") % {"name": name}
            if self.verb == "pause"
            else _("Resume %(name)s") % {"name": name},
            "opts": admin.model._meta,
            "verb": self.verb,
            "name": name,
            "queue": queue_name(name),
            "standing": standing,
            "reason": reason,
            "reason_missing": confirmed and not reason,
            "overview_url": overview,
        }
        return TemplateResponse(request, "admin/django_platformkit/pause_confirm.html", context)

    def act(self, request: HttpRequest, name: str, reason: str) -> list[PauseChange]:
        """Pause or resume ``name`` as the signed-in user, with a ``LogEntry`` for each change."""
        actor = request.user.get_username()
        if self.verb == "pause":
            changes = pause([name], actor=actor, reason=reason)
        else:
            changes = resume([name], actor=actor, reason=reason)
        for change in changes:
            if change.changed:
                past = _("Paused") if self.verb == "pause" else _("Resumed")
                text = f"{past} {change.name}." + (f" Reason: {reason}" if reason else "")
                log_control(
                    request.user.pk, Pause, change.name, text, flag=ADDITION if self.verb == "pause" else DELETION
                )
        return changes

    def said(self, change: PauseChange) -> str:
        """The message bar's line for ``change``."""
        values = {"name": change.name, "by": change.paused_by, "reason": change.reason}
        if self.verb == "pause":
            if change.changed:
                return (
                    _(
                        "Paused %(name)s: within seconds no worker starts its handlers; its events wait in the stream "
                        "until you resume it."
                    )
                    % values
                )
            return _("%(name)s was already paused by %(by)s: %(reason)s") % values
        if change.changed:
            return _("Resumed %(name)s: its waiting events run again.") % values
        return _("%(name)s was not paused.") % values
