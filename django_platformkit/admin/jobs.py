"""The job states list: each periodic job's slot ledger row
(``platformkit_jobs``) beside its declaration - schedule, time zone, last
and next slot, whether it is on time (``states.missed_slot``) or failing
(its last run raised), how its last run ended - and what operators set on
it (``controls.JobControl``: disabled, a run asked for by hand, the last
such run), with the actions that set it (``jobcontrols``: Run now, Disable,
Enable). Read-only otherwise: the next slot is the retry. Fits 1280 px: one
column per question.
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_platformkit.admin import jobcontrols, states
from django_platformkit.admin.display import ReadOnlyAdmin, duration_text, pre_html, schedule_text, truncated_html
from django_platformkit.jobs.specs import JobSpec, jobs
from django_platformkit.models import JobState
from django_platformkit.models.controls import JobControl
from django_platformkit.operate.audit import REPLAY_PERMISSION
from django_platformkit.templatetags.platformkit_admin import ago_html, when_html


@admin.register(JobState)
class JobStateAdmin(ReadOnlyAdmin[JobState]):
    list_display = ("name", "schedule", "on_time", "last_run", "next_slot", "error_first_line")
    change_list_template = "admin/django_platformkit/jobstate/change_list.html"
    search_fields = ("name",)
    actions = [jobcontrols.run_now, jobcontrols.disable_jobs, jobcontrols.enable_jobs]
    fields = (
        "name",
        "schedule",
        "on_time",
        "last_slot_at",
        "started",
        "finished",
        "next_slot",
        "last_error_text",
        "manual_run",
    )
    readonly_fields = fields

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(REPLAY_PERMISSION))

    def _spec(self, obj: JobState) -> JobSpec | None:
        return {spec.name: spec for spec in jobs()}.get(obj.name)

    def _control(self, obj: JobState) -> JobControl | None:
        """The job's controls, read once per row shown (the list has at most a page of jobs)."""
        if not hasattr(obj, "_platformkit_control"):
            obj._platformkit_control = JobControl.objects.filter(name=obj.name).first()  # type: ignore[attr-defined]
        control: JobControl | None = obj._platformkit_control  # type: ignore[attr-defined]
        return control

    @admin.display(description=gettext_lazy("schedule"))
    def schedule(self, obj: JobState) -> str:
        return schedule_text(self._spec(obj))

    @admin.display(description=gettext_lazy("state"))
    def on_time(self, obj: JobState) -> SafeString | str:
        spec, control = self._spec(obj), self._control(obj)
        lines: list[SafeString | str] = []
        if control is not None and control.disabled_at is not None:
            lines.append(
                format_html(
                    '<strong class="pk-disabled">{}</strong> {}',
                    _("disabled"),
                    format_html(
                        _("by {by} {when}: {why}"),
                        by=control.disabled_by,
                        when=ago_html(control.disabled_at),
                        why=control.disabled_reason,
                    ),
                )
            )
        elif spec is None:
            lines.append("—")
        else:
            missed = states.missed_slot(
                spec, obj.last_slot, timezone.now(), enabled_at=control.enabled_at if control else None
            )
            if missed is not None:
                lines.append(
                    format_html(
                        '<strong class="platformkit-terminal pk-overdue">{}</strong> {}',
                        _("overdue"),
                        format_html(_("since the slot of {slot}"), slot=when_html(missed, relative=False)),
                    )
                )
            elif obj.last_error:
                lines.append(
                    format_html('<strong class="platformkit-terminal pk-job-failing">{}</strong>', _("failing"))
                )
            else:
                lines.append(_("on time") if obj.last_slot is not None else _("not run yet"))
        if control is not None and control.run_requested_at is not None:
            lines.append(
                format_html(
                    '<span class="pk-run-asked">{}</span>',
                    format_html(
                        _("run asked for by {by} {when}"),
                        by=control.run_requested_by,
                        when=ago_html(control.run_requested_at),
                    ),
                )
            )
        return format_html_join(mark_safe("<br>"), "{}", ((line,) for line in lines))

    @admin.display(description=gettext_lazy("started at"), ordering="started_at")
    def started(self, obj: JobState) -> str:
        return when_html(obj.started_at)

    @admin.display(description=gettext_lazy("finished at"), ordering="finished_at")
    def finished(self, obj: JobState) -> str:
        return when_html(obj.finished_at)

    @admin.display(description=gettext_lazy("last slot"), ordering="last_slot")
    def last_run(self, obj: JobState) -> str:
        """The last slot claimed, and how long its run took (or that it runs, or never reported)."""
        if obj.last_slot is None:
            return "—"
        ran = duration_text(obj.started_at, obj.finished_at) if obj.started_at is not None else "—"
        return format_html(
            "{}{}",
            when_html(obj.last_slot),
            format_html('<span class="pk-ran">{}</span>', _("ran %(for)s") % {"for": ran}),
        )

    @admin.display(description=gettext_lazy("last slot"), ordering="last_slot")
    def last_slot_at(self, obj: JobState) -> str:
        return when_html(obj.last_slot)

    @admin.display(description=gettext_lazy("next slot"))
    def next_slot(self, obj: JobState) -> str:
        spec = self._spec(obj)
        if spec is None:
            return "—"
        return when_html(spec.next_slot(timezone.now()))

    @admin.display(description=gettext_lazy("last error"))
    def error_first_line(self, obj: JobState) -> str:
        return truncated_html(obj.last_error)

    @admin.display(description=gettext_lazy("last error"))
    def last_error_text(self, obj: JobState) -> str:
        return pre_html(obj.last_error)

    @admin.display(description=gettext_lazy("last run by hand"))
    def manual_run(self, obj: JobState) -> str:
        control = self._control(obj)
        if control is None or control.manual_started_at is None:
            return "—"
        outcome = (
            _("running")
            if control.manual_finished_at is None
            else (_("failed") if control.manual_error else _("succeeded"))
        )
        return format_html(
            "{} · {} · {}<br>{}{}",
            when_html(control.manual_started_at),
            control.manual_by,
            outcome,
            control.manual_reason,
            pre_html(control.manual_error) if control.manual_error else "",
        )
