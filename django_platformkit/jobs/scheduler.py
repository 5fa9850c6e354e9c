"""The scheduler: runs each declared job once per slot across any number of
workers and clocks.

Every worker decides slots (``jobs.specs.JobSpec``) from the same clock, the
database's (``DatabaseClock``), and a slot ahead of that clock is never
claimed, so a worker whose own clock runs ahead can't take the others' future
slots. At a due slot a worker takes the job's session-level advisory lock on
a dedicated connection, then - under the lock - claims the slot in the ledger
(``platformkit_jobs``) before running: a lock alone is not enough, since a
second worker can take it right after the first released it. Each run has its
own thread, so a hung job holds only its own lock (its next slots are
skipped, not doubled) and delays no other job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from django.db import connections

from django_platformkit import conf
from django_platformkit._retry import Backoff
from django_platformkit._tables import JOBS_TABLE
from django_platformkit.jobs.clocks import Clock, DatabaseClock
from django_platformkit.jobs.controls import JobSwitches
from django_platformkit.jobs.locks import advisory_key
from django_platformkit.jobs.manual import run_by_hand
from django_platformkit.jobs.slots import JobRunner, SlotRun
from django_platformkit.jobs.specs import JobSpec, job_named, require_aware
from django_platformkit.jobs.specs import jobs as registered_jobs
from django_platformkit.outage import Outage, is_database_error

logger = logging.getLogger(__name__)

#: How long a stopping scheduler waits for running jobs before it leaves them
#: to die with the process (their locks go with their connections).
STOP_GRACE_SECONDS = 25.0
#: The scheduler's wait after a database error: doubling from the first to the cap, in seconds.
OUTAGE_FIRST_SECONDS = 0.5
OUTAGE_MAX_SECONDS = 5.0

#: How far ahead of the database's clock a slot may be when a worker claims
#: it. A worker whose clock (or a bad injected one) runs ahead by more is
#: refused: it would claim a future slot, and the correct workers would then
#: find that slot - and every one before it - already "run".
SLOT_AHEAD_TOLERANCE_SECONDS = 5.0
#: A moment before a slot: ``count_slots_between`` excludes its ends, and the slot due is counted.
_BEFORE = timedelta(microseconds=1)


class Scheduler:
    """Runs the registered jobs (or those named in ``jobs``) on their slots.

    ``using``: the database alias of the ledger and locks (default
    ``DATABASE_ALIAS``). ``clock``: a ``Clock`` (default ``DatabaseClock``:
    the database's time, shared by every worker); tests pass a fixed one and
    call ``tick()``. Whatever the clock, a slot more than
    ``SLOT_AHEAD_TOLERANCE_SECONDS`` ahead of the database's clock is never
    claimed (logged at WARNING); ``max_ahead_seconds=None`` turns that off
    (tests of calendar arithmetic years ahead only). ``switches``: the
    operators' job switches as the worker's control watch last read them
    (``jobs.controls``): a disabled job's slots are skipped, a run asked
    for by hand starts at the next tick; None: no switches. ``run(stop)``
    loops until ``stop`` is set. Raises ``ConfigurationError`` for an
    unknown job name.
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        clock: Clock | None = None,
        jobs: Iterable[str | JobSpec] | None = None,
        stop_grace_seconds: float = STOP_GRACE_SECONDS,
        max_ahead_seconds: float | None = SLOT_AHEAD_TOLERANCE_SECONDS,
        switches: JobSwitches | None = None,
    ) -> None:
        self.using = using or conf.settings.DATABASE_ALIAS
        self.clock = clock or DatabaseClock(self.using)
        # None only for tests of calendar arithmetic on a clock years ahead.
        self.max_ahead_seconds = max_ahead_seconds
        self.stop_grace_seconds = stop_grace_seconds
        chosen = registered_jobs() if jobs is None else jobs
        specs = [item if isinstance(item, JobSpec) else job_named(item) for item in chosen]
        self._runners = [JobRunner(spec, advisory_key(spec.name)) for spec in specs]
        self.slots = SlotRun(using=self.using, max_ahead_seconds=max_ahead_seconds)
        self.switches = switches
        self._told_disabled: dict[str, datetime] = {}  # job -> the disable its skipped slots were logged for

    @property
    def jobs(self) -> list[JobSpec]:
        return [runner.spec for runner in self._runners]

    def run(self, stop: threading.Event) -> None:
        """Tick at each due slot (re-reading the clock at least every second)
        until ``stop`` is set, then wait up to ``stop_grace_seconds`` for
        running jobs. Database errors are logged and retried."""
        logger.info("scheduler started jobs=%s", ",".join(r.spec.name for r in self._runners) or "-")
        backoff = Backoff(OUTAGE_FIRST_SECONDS, OUTAGE_MAX_SECONDS)
        outage = Outage("scheduler", logger)
        try:
            while not stop.is_set():
                try:
                    self.tick()
                    outage.recovered()
                    backoff.reset()
                    pause = self._seconds_to_next_due()
                except Exception as exc:
                    # Raw psycopg errors too (the database clock is read on a
                    # connection of our own): an outage is waited out, never fatal.
                    if not is_database_error(exc):
                        raise
                    outage.failed(exc, backoff.current)
                    connections[self.using].close()
                    pause = backoff.next()
                self.clock.wait(stop, pause)
        finally:
            if not self.join(self.stop_grace_seconds):
                logger.warning(
                    "scheduler stopping with jobs still running jobs=%s: their slots are lost, their locks go with the process",
                    ",".join(r.spec.name for r in self._runners if r.busy()),
                )
            self.close()
            logger.info("scheduler stopped")

    def tick(self) -> list[threading.Thread]:
        """Act on every slot due at ``clock.now()``: start a thread for each
        job whose newest due slot is not yet handled here; return those
        threads. A job still running from an earlier slot is skipped."""
        now = self.clock.now()
        require_aware(now)
        fresh = [r for r in self._runners if r.next_due is None]
        if fresh:
            self._start(fresh, now)
        started = []
        for runner in self._runners:
            assert runner.next_due is not None
            if runner.next_due > now:
                continue
            slot = runner.spec.prev_slot(now)
            # The slots between the one due and the newest were never run: say how many, once.
            passed = runner.spec.count_slots_between(runner.next_due - _BEFORE, slot)
            runner.next_due = runner.spec.next_slot(slot)
            if self._disabled(runner, slot):
                continue
            too_late = now - slot > runner.spec.grace_after(slot)
            if too_late or passed:
                logger.warning(
                    "slot skipped, too late name=%s skipped=%s slot=%s now=%s grace=%s: the scheduler was not "
                    "ticking (a busy or paused process, a database outage) until after the slots' grace; %s",
                    runner.spec.name,
                    passed + too_late,
                    slot.isoformat(),
                    now.isoformat(),
                    runner.spec.grace_after(slot),
                    "the next runs at its slot" if too_late else "the newest runs now",
                )
                if too_late:
                    continue
            if runner.busy():
                logger.warning(
                    "job still running, slot skipped name=%s slot=%s running_slot=%s running_for=%.0fs",
                    runner.spec.name,
                    slot.isoformat(),
                    runner.running_slot.isoformat() if runner.running_slot else "by-hand",
                    time.monotonic() - runner.running_since,
                )
                continue
            runner.running_slot, runner.running_since = slot, time.monotonic()
            thread = threading.Thread(
                target=self.slots.run, args=(runner, slot), name=f"platformkit-job-{runner.spec.name}", daemon=True
            )
            runner.thread = thread
            thread.start()
            started.append(thread)
        return started + self._start_manual_runs()

    def _disabled(self, runner: JobRunner, slot: datetime) -> bool:
        """Whether an operator disabled ``runner``'s job: its slot is skipped
        (logged at INFO for the first slot of a disable, then at DEBUG)."""
        switch = self.switches.disabled(runner.spec.name) if self.switches is not None else None
        if switch is None:
            return False
        assert switch.disabled_at is not None  # disabled() returns disabled ones
        first = self._told_disabled.get(runner.spec.name) != switch.disabled_at
        self._told_disabled[runner.spec.name] = switch.disabled_at
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "slot skipped, job disabled name=%s slot=%s disabled_by=%s disabled_at=%s reason=%s",
            runner.spec.name,
            slot.isoformat(),
            switch.disabled_by,
            switch.disabled_at.isoformat(),
            switch.disabled_reason,
        )
        return True

    def _start_manual_runs(self) -> list[threading.Thread]:
        """A thread per job with a run asked for by hand and none of its runs
        going here (``jobs/manual.py``: the lock and the request decide which
        worker runs it)."""
        started = []
        for runner in self._runners:
            if self.switches is None or not self.switches.run_requested(runner.spec.name) or runner.busy():
                continue
            runner.running_slot, runner.running_since = None, time.monotonic()
            thread = threading.Thread(
                target=run_by_hand,
                args=(self.slots, runner),
                name=f"platformkit-job-{runner.spec.name}-by-hand",
                daemon=True,
            )
            runner.thread = thread
            thread.start()
            started.append(thread)
        return started

    def join(self, timeout: float | None = None) -> bool:
        """Wait for running jobs; return whether none is left running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for runner in self._runners:
            if runner.thread is not None:
                runner.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(r.busy() for r in self._runners)

    def close(self) -> None:
        """Close the lock connections of jobs not running."""
        for runner in self._runners:
            if not runner.busy():
                runner.close_connection()

    def _seconds_to_next_due(self) -> float:
        now = self.clock.now()
        due = [r.next_due for r in self._runners if r.next_due is not None]
        if not due:
            return 1.0
        return min(1.0, max(0.0, (min(due) - now).total_seconds()))

    # -- start-up: catch up the newest slot missed while no worker ran --
    def _start(self, runners: Sequence[JobRunner], now: datetime) -> None:
        connection = connections[self.using]
        names = [r.spec.name for r in runners]
        try:
            with connection.cursor() as cursor:
                # Every job this scheduler runs has its ledger row from its first start, so the
                # jobs list offers it to operators (run now, disable) before its first slot.
                cursor.execute(
                    f"INSERT INTO {JOBS_TABLE} (name, last_error) SELECT n, '' FROM unnest(%s::text[]) AS n "
                    "ON CONFLICT (name) DO NOTHING",
                    [names],
                )
                cursor.execute(f"SELECT name, last_slot FROM {JOBS_TABLE} WHERE name = ANY(%s)", [names])
                ledger = dict(cursor.fetchall())
        finally:
            # The scheduler thread needs no connection between start-ups.
            if not connection.in_atomic_block:
                connection.close()
        for runner in runners:
            spec = runner.spec
            last, newest = ledger.get(spec.name), spec.prev_slot(now)
            runner.next_due = spec.next_slot(now)
            if last is None or newest <= last:
                # Never run: nothing was missed; or the newest slot is done.
                continue
            if self.switches is not None and self.switches.skipped_on_purpose(spec.name, newest):
                continue  # missed while disabled: skipped on purpose, never caught up
            catch_up = now - newest <= spec.grace_after(newest)
            # Every slot between the last run and the newest was missed (no worker ran); the newest runs
            # once if it is within its grace.
            skipped = spec.count_slots_between(last, newest) + (0 if catch_up else 1)
            if catch_up:
                runner.next_due = newest
            if skipped:
                logger.warning(
                    "missed slots skipped name=%s skipped=%s last_slot=%s newest_missed=%s grace=%s: no worker ran "
                    "them; %s",
                    spec.name,
                    skipped,
                    last.isoformat(),
                    newest.isoformat(),
                    spec.grace_after(newest),
                    "the newest runs now (catch-up)"
                    if catch_up
                    else "the newest is past its grace too; the next runs at its slot",
                )
            else:
                logger.info("catching up name=%s slot=%s last_slot=%s", spec.name, newest.isoformat(), last.isoformat())
