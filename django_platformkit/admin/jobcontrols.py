"""The jobs list's operator actions (``jobs.controls``): **Run now**
(one extra run on the next scheduler tick of one worker, recorded as manual
with its actor; the slots as they were), **Disable** (its slots are skipped,
shown as disabled, never as overdue) and **Enable**. Each asks for a reason
on a confirmation page, needs the ``django_platformkit.replay_deadletter``
permission as the other operator actions do, and leaves an admin
``LogEntry`` on the job's row (its History page lists it).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_platformkit.exceptions import ControlRefused
from django_platformkit.jobs.controls import JobChange, disable, enable, request_run
from django_platformkit.models import JobState
from django_platformkit.operate.audit import log_control

#: The verbs, their library function, and the words the pages use.
VERBS = {
    "run": (request_run, gettext_lazy("Run now"), gettext_lazy("Asked for a run by hand")),
    "disable": (disable, gettext_lazy("Disable"), gettext_lazy("Disabled")),
    "enable": (enable, gettext_lazy("Enable"), gettext_lazy("Enabled")),
}


@admin.action(permissions=["replay"], description=gettext_lazy("Run selected jobs now…"))
def run_now(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[JobState]
) -> HttpResponse | None:
    return confirm(modeladmin, request, queryset, "run")


@admin.action(permissions=["replay"], description=gettext_lazy("Disable selected jobs…"))
def disable_jobs(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[JobState]
) -> HttpResponse | None:
    return confirm(modeladmin, request, queryset, "disable")


@admin.action(permissions=["replay"], description=gettext_lazy("Enable selected jobs…"))
def enable_jobs(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[JobState]
) -> HttpResponse | None:
    return confirm(modeladmin, request, queryset, "enable")


#: The action names of each verb (what the confirmation page posts back).
ACTION_NAMES = {"run": "run_now", "disable": "disable_jobs", "enable": "enable_jobs"}


def confirm(
    modeladmin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[JobState], verb: str
) -> HttpResponse | None:
    """The intermediate page: what will happen to which jobs, and a reason;
    on a confirmed POST with a reason, do it and report in the message bar."""
    reason = (request.POST.get("reason") or "").strip()
    confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
    names = list(queryset.order_by("name").values_list("name", flat=True))
    if confirmed and reason:
        perform(modeladmin, request, names, verb, reason)
        return None
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": VERBS[verb][1],
        "opts": modeladmin.model._meta,
        "verb": verb,
        "names": names,
        "reason": reason,
        "reason_missing": confirmed and not reason,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "action_name": ACTION_NAMES[verb],
        "select_across": request.POST.get("select_across", "0"),
    }
    return TemplateResponse(request, "admin/django_platformkit/job_confirm.html", context)


def perform(modeladmin: admin.ModelAdmin[Any], request: HttpRequest, names: list[str], verb: str, reason: str) -> None:
    """Call the library as the signed-in user; one ``LogEntry`` per job changed."""
    function, _label, past = VERBS[verb]
    try:
        changes: list[JobChange] = function(names, actor=request.user.get_username(), reason=reason)
    except ControlRefused as exc:
        modeladmin.message_user(request, str(exc), messages.ERROR)
        return
    done = [c for c in changes if c.changed]
    for change in done:
        log_control(request.user.pk, JobState, change.name, f"{past}. Reason: {reason}")
    if done:
        names_done = ", ".join(c.name for c in done)
        if verb == "run":
            text = ngettext(
                "Run asked for %(names)s: the next scheduler tick of one worker runs it, recorded as yours; its slots stay as they were.",
                "Runs asked for %(names)s: the next scheduler tick of one worker runs each, recorded as yours; their slots stay as they were.",
                len(done),
            )
        elif verb == "disable":
            text = ngettext(
                "Disabled %(names)s: its slots are skipped until it is enabled (a run going on finishes).",
                "Disabled %(names)s: their slots are skipped until they are enabled (runs going on finish).",
                len(done),
            )
        else:
            text = ngettext(
                "Enabled %(names)s: it runs from its next slot (the slots it skipped are not caught up).",
                "Enabled %(names)s: they run from their next slots (the slots they skipped are not caught up).",
                len(done),
            )
        modeladmin.message_user(request, text % {"names": names_done}, messages.SUCCESS)
    for change in changes:
        if change.changed:
            continue
        values = {"name": change.name, "by": change.by}
        if verb == "run":
            text = _("%(name)s: a run asked for by %(by)s has not started yet; nothing more asked.") % values
        elif verb == "disable":
            text = _("%(name)s was already disabled by %(by)s.") % values
        else:
            text = _("%(name)s was not disabled.") % values
        modeladmin.message_user(request, text, messages.INFO)
