"""A periodic job's switches, set by an operator: **disabled** (its slots
are skipped, shown as disabled, never as overdue, and never caught up once
it is enabled again), and **a run asked for now** (one extra run on the next
tick of one worker's scheduler, under the job's advisory lock, recorded as
manual with its actor; the slot ledger and the schedule untouched). The one
write path of ``platformkit_job_controls``. Every worker's control watch
(``runtime/controlwatch.py``) reads the table into ``JobSwitches``, which
the scheduler asks: its ticks still cost no query.

What broke elsewhere, kept from happening here: django-celery-beat's bulk
disable went unnoticed by a running beat (every worker re-reads the table);
a task enabled again ran at once for the slots it missed (a slot before
``enabled_at`` is never caught up); a "run now" counted as the schedule's
run (the ledger never sees it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import JOB_CONTROLS_TABLE
from django_platformkit._text import storable_text
from django_platformkit.exceptions import ControlRefused
from django_platformkit.jobs.specs import jobs
from django_platformkit.names import unknown_name

logger = logging.getLogger(__name__)

_T = JOB_CONTROLS_TABLE
_DISABLE_SQL = (
    f"INSERT INTO {_T} (name, disabled_at, disabled_by, disabled_reason) VALUES (%s, now(), %s, %s) "
    f"ON CONFLICT (name) DO UPDATE SET disabled_at = now(), disabled_by = EXCLUDED.disabled_by, "
    f"disabled_reason = EXCLUDED.disabled_reason WHERE {_T}.disabled_at IS NULL RETURNING disabled_at"
)
# The values it ends are read under the row's lock, then cleared.
_ENABLE_SQL = (
    f"WITH old AS (SELECT name, disabled_at, disabled_by, disabled_reason FROM {_T} "
    "WHERE name = %s AND disabled_at IS NOT NULL FOR UPDATE) "
    f"UPDATE {_T} j SET disabled_at = NULL, disabled_by = '', disabled_reason = '', enabled_at = now() "
    "FROM old WHERE j.name = old.name RETURNING old.disabled_at, old.disabled_by, old.disabled_reason"
)
_REQUEST_SQL = (
    f"INSERT INTO {_T} (name, run_requested_at, run_requested_by, run_reason) VALUES (%s, now(), %s, %s) "
    f"ON CONFLICT (name) DO UPDATE SET run_requested_at = now(), run_requested_by = EXCLUDED.run_requested_by, "
    f"run_reason = EXCLUDED.run_reason WHERE {_T}.run_requested_at IS NULL RETURNING run_requested_at"
)
# Taken by the one worker whose run thread holds the job's lock: the request
# becomes the manual run's record in one statement (SET reads the old row).
_CLAIM_SQL = (
    f"UPDATE {_T} SET run_requested_at = NULL, run_requested_by = '', run_reason = '', "
    "manual_started_at = now(), manual_finished_at = NULL, manual_error = '', "
    "manual_by = run_requested_by, manual_reason = run_reason "
    "WHERE name = %s AND run_requested_at IS NOT NULL RETURNING manual_started_at, manual_by, manual_reason"
)
_FINISH_SQL = (
    f"UPDATE {_T} SET manual_finished_at = now(), manual_error = %s WHERE name = %s AND manual_started_at = %s"
)
_SWITCHES_SQL = (
    f"SELECT name, disabled_at, disabled_by, disabled_reason, enabled_at, run_requested_at, run_requested_by FROM {_T}"
)


@dataclass(frozen=True)
class JobSwitch:
    """One job's switches as a worker last read them."""

    name: str
    disabled_at: datetime | None = None
    disabled_by: str = ""
    disabled_reason: str = ""
    enabled_at: datetime | None = None
    run_requested_at: datetime | None = None
    run_requested_by: str = ""


class JobSwitches:
    """Every job's switches a worker knows of (``replace()`` by its control
    watch; read by its scheduler's thread). No entry: nothing set."""

    def __init__(self) -> None:
        self._switches: dict[str, JobSwitch] = {}
        self._lock = threading.Lock()

    def replace(self, switches: Iterable[JobSwitch]) -> None:
        """Make ``switches`` the ones known."""
        fresh = {s.name: s for s in switches}
        with self._lock:
            self._switches = fresh

    def get(self, name: str) -> JobSwitch:
        """``name``'s switches (all off when none is set)."""
        return self._switches.get(name) or JobSwitch(name)

    def disabled(self, name: str) -> JobSwitch | None:
        """``name``'s switches if it is disabled now, else None."""
        switch = self._switches.get(name)
        return switch if switch is not None and switch.disabled_at is not None else None

    def run_requested(self, name: str) -> bool:
        """Whether a run of ``name`` was asked for by hand and not started yet."""
        switch = self._switches.get(name)
        return switch is not None and switch.run_requested_at is not None

    def skipped_on_purpose(self, name: str, slot: datetime) -> bool:
        """Whether ``slot`` of ``name`` fell while it was disabled: it is
        disabled now, or ``slot`` came before it was last enabled. Such a
        slot is never caught up."""
        switch = self.get(name)
        return switch.disabled_at is not None or (switch.enabled_at is not None and slot < switch.enabled_at)


def read_switches(*, using: str | None = None) -> list[JobSwitch]:
    """Every job's switches, as stored now (one read of a small table)."""
    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(_SWITCHES_SQL)
        return [JobSwitch(*row) for row in cursor.fetchall()]


@dataclass(frozen=True)
class JobChange:
    """What ``disable()``, ``enable()`` or ``request_run()`` did to one job.

    Attributes:
        name: The job.
        changed: False when there was nothing to do: already disabled, not
            disabled, or a run already asked for and not started yet.
        at: When the switch was set (or, unchanged, the standing one was);
            ``enable()``: when the job had been disabled.
        by: Who set it (``enable()``: who had disabled it).
        reason: Why (``enable()``: why it had been disabled).
    """

    name: str
    changed: bool
    at: datetime | None = None
    by: str = ""
    reason: str = ""


def _checked(names: Sequence[str], actor: str, reason: str, verb: str, *, known: Iterable[str] = ()) -> list[str]:
    if not str(actor or "").strip():
        raise ControlRefused(f"{verb} needs an actor: who acts (e.g. the operator's username). Nothing was written.")
    if not str(reason or "").strip():
        raise ControlRefused(f"{verb} needs a reason: say why (it is kept in the log). Nothing was written.")
    declared = {spec.name for spec in jobs()} | set(known)
    if not names:
        raise ControlRefused(f"{verb}: name the job(s). Nothing was written.")
    for name in names:
        if name not in declared:
            raise ControlRefused(f"{verb}: {unknown_name('job', name, declared)} Nothing was written.")
    return list(dict.fromkeys(names))


def _standing(cursor: Any, name: str, columns: str) -> tuple[Any, ...]:
    cursor.execute(f"SELECT {columns} FROM {_T} WHERE name = %s", [name])
    return tuple(cursor.fetchone() or (None, "", ""))


def disable(names: Sequence[str], *, actor: str, reason: str, using: str | None = None) -> list[JobChange]:
    """Disable jobs: from every worker's next read of the controls (within
    ``CONTROL_POLL_SECONDS``) their slots are skipped, and shown as
    disabled, never as overdue. A run already going finishes.

    Returns:
        One ``JobChange`` per job (unchanged: it was disabled already).

    Raises:
        ControlRefused: (a ``ValueError``) writing nothing: an undeclared
            job (with the closest names), no actor or no reason.
    """
    names = _checked(names, actor, reason, "disable")
    return _switch_on(
        names,
        _DISABLE_SQL,
        "disabled_at, disabled_by, disabled_reason",
        actor=actor.strip(),
        reason=reason.strip(),
        using=using,
        said="job disabled name=%s actor=%s reason=%s: its slots are skipped",
    )


def enable(names: Sequence[str], *, actor: str, reason: str, using: str | None = None) -> list[JobChange]:
    """Enable disabled jobs again: each runs at its first slot after now,
    never for the slots it skipped. A job no longer declared but still
    disabled can be enabled (its row is known).

    Returns:
        One ``JobChange`` per job (``at``/``by``/``reason``: the disable it
        ended; unchanged: it was not disabled).

    Raises:
        ControlRefused: as ``disable()``.
    """
    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT name FROM {_T} WHERE disabled_at IS NOT NULL")
        still_disabled = [row[0] for row in cursor.fetchall()]
    names = _checked(names, actor, reason, "enable", known=still_disabled)
    changes = []
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        for name in names:
            cursor.execute(_ENABLE_SQL, [name])
            row = cursor.fetchone()
            changes.append(JobChange(name, row is not None, *(row or ())))
            if row is not None:
                logger.info("job enabled name=%s actor=%s reason=%s: it runs from its next slot", name, actor, reason)
    return changes


def request_run(names: Sequence[str], *, actor: str, reason: str, using: str | None = None) -> list[JobChange]:
    """Ask for one extra run of each job, now: the next tick of one worker
    whose scheduler runs the job starts it under the job's advisory lock
    (so never beside another run of it), records it as manual with
    ``actor`` and ``reason``, and leaves the slots as they were. A disabled
    job runs too: the operator asked for this run.

    Returns:
        One ``JobChange`` per job (unchanged: a run asked for earlier has
        not started yet; ``at``/``by``/``reason`` are that request's).

    Raises:
        ControlRefused: as ``disable()``.
    """
    names = _checked(names, actor, reason, "run")
    return _switch_on(
        names,
        _REQUEST_SQL,
        "run_requested_at, run_requested_by, run_reason",
        actor=actor.strip(),
        reason=reason.strip(),
        using=using,
        said="job run asked for name=%s actor=%s reason=%s",
    )


def _switch_on(
    names: list[str], sql: str, standing: str, *, actor: str, reason: str, using: str | None, said: str
) -> list[JobChange]:
    """Set a switch (``sql``: the upsert, ``RETURNING`` its time, or nothing
    when it was set already) on each job in one transaction; an unchanged
    job reports the ``standing`` columns (at, by, why) it found."""
    alias = using or conf.settings.DATABASE_ALIAS
    changes = []
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        for name in names:
            cursor.execute(sql, [name, actor, reason])
            row = cursor.fetchone()
            if row is None:
                changes.append(JobChange(name, False, *_standing(cursor, name, standing)))
                continue
            changes.append(JobChange(name, True, row[0], actor, reason))
            logger.info(said, name, actor, reason)
    return changes


def claim_run(connection: Any, name: str) -> tuple[datetime, str, str] | None:
    """On the job's lock connection (psycopg, autocommit), holding its lock:
    take the run asked for, turning it into the manual run's record.

    Returns:
        ``(started_at, actor, reason)``, or None: no run is asked for (another
        worker took it).
    """
    row = connection.execute(_CLAIM_SQL, [name]).fetchone()
    return (row[0], row[1], row[2]) if row is not None else None


def finish_run(connection: Any, name: str, started_at: datetime, error: str) -> bool:
    """Record the end of the manual run that started at ``started_at``
    (``error``: "" when it succeeded). Returns whether it was recorded."""
    cursor = connection.execute(_FINISH_SQL, [storable_text(error, max_chars=10000), name, started_at])
    return bool(cursor.rowcount == 1)
