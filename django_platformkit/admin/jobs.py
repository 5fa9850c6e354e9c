"""The job states list: each periodic job's slot ledger row
(``platformkit_jobs``) beside its declaration - schedule, time zone, last
and next slot, whether it is on time (``states.missed_slot``) or failing
(its last run raised), and how its last run ended. Read-only: the next slot is the retry.
"""

from __future__ import annotations

from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_platformkit.admin import states
from django_platformkit.admin.display import ReadOnlyAdmin, _first_line, _pre, schedule_text
from django_platformkit.jobs.specs import JobSpec, jobs
from django_platformkit.models import JobState
from django_platformkit.templatetags.platformkit_admin import when_html


@admin.register(JobState)
class JobStateAdmin(ReadOnlyAdmin[JobState]):
    list_display = (
        "name",
        "schedule",
        "time_zone",
        "on_time",
        "last_slot_at",
        "started",
        "finished",
        "last_error_first_line",
        "next_slot",
    )
    search_fields = ("name",)
    fields = (
        "name",
        "schedule",
        "time_zone",
        "on_time",
        "last_slot_at",
        "started",
        "finished",
        "next_slot",
        "last_error_text",
    )
    readonly_fields = fields

    def _spec(self, obj: JobState) -> JobSpec | None:
        return {spec.name: spec for spec in jobs()}.get(obj.name)

    @admin.display(description=gettext_lazy("schedule"))
    def schedule(self, obj: JobState) -> str:
        return schedule_text(self._spec(obj))

    @admin.display(description=gettext_lazy("time zone"))
    def time_zone(self, obj: JobState) -> str:
        spec = self._spec(obj)
        return str(spec.timezone) if spec is not None else "—"

    @admin.display(description=gettext_lazy("state"))
    def on_time(self, obj: JobState) -> str:
        spec = self._spec(obj)
        if spec is None:
            return "—"
        missed = states.missed_slot(spec, obj.last_slot, timezone.now())
        if missed is not None:
            return format_html(
                '<strong class="platformkit-terminal pk-overdue">{}</strong> {}',
                _("overdue"),
                format_html(_("since the slot of {slot}"), slot=when_html(missed, relative=False)),
            )
        if obj.last_error:
            return format_html('<strong class="platformkit-terminal pk-job-failing">{}</strong>', _("failing"))
        return _("on time") if obj.last_slot is not None else _("not run yet")

    @admin.display(description=gettext_lazy("started at"), ordering="started_at")
    def started(self, obj: JobState) -> str:
        return when_html(obj.started_at)

    @admin.display(description=gettext_lazy("finished at"), ordering="finished_at")
    def finished(self, obj: JobState) -> str:
        return when_html(obj.finished_at)

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
    def last_error_first_line(self, obj: JobState) -> str:
        return _first_line(obj.last_error)

    @admin.display(description=gettext_lazy("last error"))
    def last_error_text(self, obj: JobState) -> str:
        return _pre(obj.last_error)
