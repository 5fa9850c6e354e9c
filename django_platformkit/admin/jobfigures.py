"""The overview's jobs: each declared job (and each the ledger still holds)
with its slot ledger row, whether a run holds its lock now, and what
operators set on it (``controls.JobControl``: disabled, a run asked for by
hand, the last such run). A disabled job is shown as disabled, never as
overdue, and the slots it skipped while disabled never make it overdue
after it is enabled again (``states.missed_slot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from django_platformkit._tables import JOB_CONTROLS_TABLE, JOBS_TABLE
from django_platformkit.admin import states
from django_platformkit.admin.display import schedule_text
from django_platformkit.admin.queries import Timed
from django_platformkit.models.controls import JobControl

_JOBS_SQL = f"SELECT name, last_slot, started_at, finished_at, last_error FROM {JOBS_TABLE}"
_CONTROLS_SQL = (
    "SELECT name, disabled_at, disabled_by, disabled_reason, enabled_at, run_requested_at, run_requested_by, "
    f"run_reason, manual_started_at, manual_finished_at, manual_by, manual_reason, manual_error FROM {JOB_CONTROLS_TABLE}"
)
# Session-level bigint advisory locks held now (classid: high 32 bits, objid: low 32 bits).
_LOCKS_SQL = (
    "SELECT classid::bigint, objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 "
    "AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_CONTROL_FIELDS = [
    "name",
    "disabled_at",
    "disabled_by",
    "disabled_reason",
    "enabled_at",
    "run_requested_at",
    "run_requested_by",
    "run_reason",
    "manual_started_at",
    "manual_finished_at",
    "manual_by",
    "manual_reason",
    "manual_error",
]


@dataclass
class JobFigures:
    name: str
    schedule: str
    declared: bool
    last_slot: datetime | None
    next_slot: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    last_error: str
    running: bool
    #: The first slot after ``last_slot`` no scheduler claimed in time
    #: (``states.missed_slot``), or None: on time, never run, or disabled.
    missed_slot: datetime | None = None
    #: What operators set on it (disabled, a run asked for, the last manual run), or None.
    control: JobControl | None = None

    @property
    def overdue(self) -> bool:
        return self.missed_slot is not None

    @property
    def disabled(self) -> bool:
        return self.control is not None and self.control.disabled_at is not None

    @property
    def failing(self) -> bool:
        """Its last run that ended raised (``last_error`` is cleared by a run that succeeds)."""
        return bool(self.last_error)


def lock_key(classid: int, objid: int) -> int:
    """The bigint advisory-lock key ``pg_locks`` shows as two 32-bit halves."""
    unsigned = (int(classid) << 32) | int(objid)
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def job_figures(q: Timed) -> list[JobFigures]:
    """Every declared job's figures (and the ledger's jobs no longer declared), by name."""
    from django_platformkit.jobs.locks import advisory_key
    from django_platformkit.jobs.specs import jobs as job_specs

    specs = {spec.name: spec for spec in job_specs()}
    held = {lock_key(c, o) for c, o in q.rows(_LOCKS_SQL, [], "job locks") or []}
    ledger = {row[0]: row for row in q.rows(_JOBS_SQL, [], "jobs") or []}
    controls = {
        row[0]: JobControl(**dict(zip(_CONTROL_FIELDS, row, strict=True)))
        for row in q.rows(_CONTROLS_SQL, [], "job controls") or []
    }
    now = timezone.now()
    rows = []
    for name in sorted(set(specs) | set(ledger)):
        spec = specs.get(name)
        _name, last_slot, started_at, finished_at, last_error = ledger.get(name, (name, None, None, None, ""))
        control = controls.get(name)
        unfinished = started_at is not None and (finished_at is None or finished_at < started_at)
        missed = None
        if spec is not None and (control is None or control.disabled_at is None):
            missed = states.missed_slot(spec, last_slot, now, enabled_at=control.enabled_at if control else None)
        rows.append(
            JobFigures(
                name=name,
                schedule=schedule_text(spec),
                declared=spec is not None,
                last_slot=last_slot,
                next_slot=spec.next_slot(now) if spec else None,
                started_at=started_at,
                finished_at=finished_at,
                last_error=last_error or "",
                # The ledger alone would call a run "running" forever after its worker died mid-run.
                running=unfinished and advisory_key(name) in held,
                missed_slot=missed,
                control=control,
            )
        )
    return rows
