"""One job's slot, run in its own thread: the job's session-level advisory
lock on a connection of its own, then - under the lock - the slot claimed
in the ledger (``platformkit_jobs``) before the job runs, so a crash loses
the slot and never doubles it. A lock alone is not enough: a second worker
can take it right after the first released it. A slot ahead of the
database's clock is never claimed, and a job never starts before its slot
by any clock it can read: the claim's database time and the worker's own
(``timezone.now()`` in the job is at or after the slot: a midnight job sees
its own day).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback as traceback_module
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.utils import timezone

from django_platformkit import signals
from django_platformkit._tables import JOBS_TABLE
from django_platformkit._text import storable_text
from django_platformkit.jobs.specs import JobSpec, in_slot
from django_platformkit.outage import database_unavailable
from django_platformkit.wire import JobOutcome

logger = logging.getLogger(__name__)

#: A wait for the worker's own clock to reach a slot longer than this is
#: logged at WARNING: the worker's clock runs behind the database's (NTP).
CLOCK_BEHIND_WARNING_SECONDS = 1.0

#: A job that runs more often than this logs its successful runs at DEBUG:
#: an every-second job at INFO would drown what a person needs to read.
QUIET_BELOW_INTERVAL = timedelta(minutes=1)


def run_log_level(spec: JobSpec) -> int:
    """INFO for a run worth a line in the log; DEBUG for a frequent job's routine run."""
    return logging.DEBUG if spec.every is not None and spec.every < QUIET_BELOW_INTERVAL else logging.INFO


# One round trip: the claim, refused (no row inserted or updated) when the
# slot is ahead of the database's clock, plus that clock, to say why.
_CLAIM_SQL = (
    "WITH c AS (SELECT clock_timestamp() AS now), claimed AS ("
    f"INSERT INTO {JOBS_TABLE} AS j (name, last_slot, started_at, finished_at, last_error) "
    "SELECT %(name)s, %(slot)s, now(), NULL, '' FROM c WHERE %(slot)s <= c.now + make_interval(secs => %(ahead)s) "
    "ON CONFLICT (name) DO UPDATE SET last_slot = EXCLUDED.last_slot, started_at = EXCLUDED.started_at, finished_at = NULL "
    # A ledger slot ahead of the database's clock can only have been written
    # by a worker whose clock ran ahead (before this guard): it is not a run
    # to respect, or every correct worker would skip each slot until then.
    "WHERE j.last_slot IS NULL OR j.last_slot < EXCLUDED.last_slot "
    "OR j.last_slot > clock_timestamp() + make_interval(secs => %(ahead)s) RETURNING 1"
    f") SELECT (SELECT count(*) FROM claimed), (SELECT now FROM c), (SELECT last_slot FROM {JOBS_TABLE} WHERE name = %(name)s)"
)
_FINISH_SQL = f"UPDATE {JOBS_TABLE} SET finished_at = now(), last_error = %s WHERE name = %s AND last_slot = %s"
_LEDGER_SQL = f"SELECT last_slot, started_at, finished_at FROM {JOBS_TABLE} WHERE name = %s"


def _log_slot_ahead(name: str, slot: datetime, database_now: datetime) -> None:
    """The WARNING for a slot this worker's clock put ahead of the database's (both places that refuse one)."""
    logger.warning(
        "slot skipped, ahead of the database clock name=%s slot=%s database_now=%s ahead=%.1fs: "
        "this worker's clock runs ahead; slots are decided by the database's clock",
        name,
        slot.isoformat(),
        database_now.isoformat(),
        (slot - database_now).total_seconds(),
    )


@dataclass
class JobRunner:
    """One job's state in one scheduler: its next due slot, its running
    thread, and its dedicated lock connection (reused while trusted)."""

    spec: JobSpec
    key: int
    next_due: datetime | None = None
    thread: threading.Thread | None = None
    running_slot: datetime | None = None
    running_since: float = 0.0
    connection: Any = None

    def busy(self) -> bool:
        """Whether a run of this job is in progress here."""
        return self.thread is not None and self.thread.is_alive()

    def close_connection(self) -> None:
        """Close the lock connection (the session's locks go with it)."""
        if self.connection is not None:
            try:
                self.connection.close()
            except Exception:
                pass
        self.connection = None


def run_job(spec: JobSpec, *, slot: datetime | None, manual_by: str | None = None) -> tuple[str, float]:
    """Call ``spec.func()`` once, for ``slot`` (None: a run by hand, asked
    for by ``manual_by``): a failure is logged at ERROR, never raised, and
    ``job_finished`` is sent either way.

    Returns:
        ``(error, duration_seconds)``: the error with its traceback, "" when it succeeded.
    """
    started, error, failure = time.monotonic(), "", None
    try:
        spec.func()
    except Exception as exc:
        failure = exc
        error = f"{type(exc).__name__}: {exc}\n\n" + "".join(traceback_module.format_exception(exc))
        logger.error(
            "job failed name=%s slot=%s error=%s: %s",
            spec.name,
            slot.isoformat() if slot is not None else f"by-hand actor={manual_by}",
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
    duration = time.monotonic() - started
    signals.job_finished.send_robust(
        sender=spec,
        job=spec.name,
        slot=slot,
        outcome=JobOutcome.FAILED if failure is not None else JobOutcome.SUCCEEDED,
        error=failure,
        duration_seconds=duration,
        manual_by=manual_by,
    )
    return error, duration


class SlotRun:
    """Runs one job's slot under its lock (``run``), from the scheduler's run threads.

    Args:
        using: The database alias of the ledger and the locks.
        max_ahead_seconds: How far ahead of the database's clock a slot may
            be claimed (None: no limit; tests of calendar arithmetic only).
    """

    def __init__(self, *, using: str, max_ahead_seconds: float | None) -> None:
        self.using = using
        self.max_ahead_seconds = max_ahead_seconds
        # The job locks' view of an outage (every job's run threads share it):
        # when it began (monotonic) and the slots it has cost, so an outage
        # is two log lines, not an ERROR per slot of every job.
        self._outage_lock = threading.Lock()
        self._outage_since: float | None = None
        self._outage_skipped = 0

    def run(self, runner: JobRunner, slot: datetime) -> None:
        """Lock, claim and run ``runner``'s job for ``slot``; never raises (a failure is logged)."""
        spec = runner.spec
        try:
            with in_slot(slot):
                if not self._lock(runner, slot):
                    return
                try:
                    self._claim_and_run(runner, slot)
                finally:
                    self._unlock(runner)
        except Exception:
            logger.exception("job run failed before the job ran name=%s slot=%s", spec.name, slot.isoformat())
            runner.close_connection()
        finally:
            connections.close_all()

    def _connect(self, runner: JobRunner) -> Any:
        if runner.connection is None or runner.connection.closed:
            import psycopg

            params = connections[self.using].get_connection_params()
            for key in ("cursor_factory", "context", "prepare_threshold"):
                params.pop(key, None)
            params.setdefault("application_name", f"platformkit job {runner.spec.name}"[:63])
            # A database that doesn't answer must not pin the run thread forever.
            params.setdefault("connect_timeout", 10)
            runner.connection = psycopg.connect(**params, autocommit=True)
        return runner.connection

    def _lock(self, runner: JobRunner, slot: datetime) -> bool:
        """Take the job's session-level advisory lock; log why not if not."""
        import psycopg

        spec = runner.spec
        ahead_limit = 1e10 if self.max_ahead_seconds is None else self.max_ahead_seconds
        for attempt in (1, 2):
            try:
                connection = self._connect(runner)
                # A slot ahead of the database clock never takes the lock: a
                # worker whose clock runs ahead would otherwise hold it at the
                # very instant the correct workers contend for the slot due now
                # (every scheduler wakes on the same boundary) and make them skip it.
                locked, database_now = connection.execute(
                    "SELECT CASE WHEN %(slot)s <= clock_timestamp() + make_interval(secs => %(ahead)s) "
                    "THEN pg_try_advisory_lock(%(key)s) END, clock_timestamp()",
                    {"slot": slot, "ahead": ahead_limit, "key": runner.key},
                ).fetchone()
                self._database_back()
                if locked is None:
                    _log_slot_ahead(spec.name, slot, database_now)
                    return False
                if locked:
                    return True
                row = connection.execute(_LEDGER_SQL, [spec.name]).fetchone()
                break
            except psycopg.OperationalError as exc:
                # A reused connection may have died while idle: one fresh try.
                runner.close_connection()
                if attempt == 2:
                    self._database_unavailable(spec.name, slot, exc)
                    return False
        last_slot, started_at, finished_at = row or (None, None, None)
        if last_slot is not None and last_slot < slot and finished_at is None:
            logger.warning(
                "job still running in another worker, slot skipped name=%s slot=%s running_slot=%s started_at=%s",
                spec.name,
                slot.isoformat(),
                last_slot.isoformat(),
                started_at.isoformat() if started_at else "-",
            )
        else:
            logger.debug("job lock held elsewhere name=%s slot=%s", spec.name, slot.isoformat())
        return False

    def _database_unavailable(self, name: str, slot: datetime, exc: BaseException) -> None:
        """A slot lost because its lock could not be asked for: the first of
        an outage at ERROR, the rest at DEBUG (``_database_back`` ends it)."""
        text = " ".join(str(exc).split())
        with self._outage_lock:
            first = self._outage_since is None
            if first:
                self._outage_since = time.monotonic()
            self._outage_skipped += 1
        if first:
            logger.error(
                "job locks: database unavailable error=%s; slots are skipped until it is back (each job runs "
                "again at its first slot after) name=%s slot=%s",
                text,
                name,
                slot.isoformat(),
            )
        else:
            logger.debug(
                "job lock not taken, database unavailable name=%s slot=%s error=%s", name, slot.isoformat(), text
            )

    def _database_back(self) -> None:
        with self._outage_lock:
            since, skipped = self._outage_since, self._outage_skipped
            self._outage_since, self._outage_skipped = None, 0
        if since is not None:
            logger.warning(
                "job locks: database back after %.1fs skipped=%s (slots lost to the outage)",
                time.monotonic() - since,
                skipped,
            )

    def _claim_and_run(self, runner: JobRunner, slot: datetime) -> None:
        import psycopg

        spec, connection = runner.spec, runner.connection
        # Claim before running: a crash mid-run loses this slot, never doubles it.
        claimed, database_now, previous = connection.execute(
            _CLAIM_SQL,
            {
                "name": spec.name,
                "slot": slot,
                "ahead": 1e10 if self.max_ahead_seconds is None else self.max_ahead_seconds,
            },
        ).fetchone()
        if not claimed:
            ahead_seconds = (slot - database_now).total_seconds()
            if self.max_ahead_seconds is not None and ahead_seconds > self.max_ahead_seconds:
                _log_slot_ahead(spec.name, slot, database_now)
            else:
                logger.debug("slot already run name=%s slot=%s", spec.name, slot.isoformat())
            return
        if previous is not None and previous > slot:
            logger.warning(
                "job ledger held a slot ahead of the database clock name=%s recorded_slot=%s slot=%s: written by a "
                "worker whose clock ran ahead; replaced by the slot due now",
                spec.name,
                previous.isoformat(),
                slot.isoformat(),
            )
        self._wait_for_the_slot(spec, slot, database_now)
        logger.debug("job started name=%s slot=%s", spec.name, slot.isoformat())
        error, duration = run_job(spec, slot=slot)
        try:
            # Escaped: PostgreSQL can't store a NUL, and a job's error may
            # hold one; unescaped, the finish and the error would be lost.
            recorded = (
                connection.execute(_FINISH_SQL, [storable_text(error, max_chars=10000), spec.name, slot]).rowcount == 1
            )
        except psycopg.Error as exc:
            if not database_unavailable(exc):
                # The session is fine; the statement was refused. Say what
                # happened rather than claim a lost session.
                logger.error("job outcome not recorded name=%s slot=%s error=%s", spec.name, slot.isoformat(), exc)
                return
            recorded, error = False, error or str(exc)
        if not recorded:
            # The session that held the lock is gone, so another worker may
            # have run meanwhile: this run can't be reported as a success.
            logger.error(
                "job lost its database session during the run name=%s slot=%s duration=%.3fs: its lock was released "
                "early and its outcome is not recorded",
                spec.name,
                slot.isoformat(),
                duration,
            )
            runner.close_connection()
        elif not error:
            logger.log(
                run_log_level(spec),
                "job finished name=%s slot=%s duration=%.3fs",
                spec.name,
                slot.isoformat(),
                duration,
            )

    def _wait_for_the_slot(self, spec: JobSpec, slot: datetime, database_now: datetime) -> None:
        """Sleep until both the database's clock (as the claim read it) and
        this worker's (``timezone.now()``) have reached ``slot``: the scheduler
        ticks on an estimate of the database's time, which can be milliseconds
        ahead of either. Not with ``max_ahead_seconds=None`` (injected clocks
        years ahead: tests of calendar arithmetic only)."""
        if self.max_ahead_seconds is None:
            return
        database_behind = (slot - database_now).total_seconds()
        if database_behind > 0:
            time.sleep(database_behind)
        behind = (slot - timezone.now()).total_seconds()
        if behind > CLOCK_BEHIND_WARNING_SECONDS:
            logger.warning(
                "job waits for this worker's clock name=%s slot=%s behind=%.1fs: this worker's clock runs behind the "
                "database's; the job starts once its own clock reaches the slot (fix the clock: NTP)",
                spec.name,
                slot.isoformat(),
                behind,
            )
        while behind > 0:
            time.sleep(behind)
            behind = (slot - timezone.now()).total_seconds()

    @contextlib.contextmanager
    def locked(self, runner: JobRunner) -> Iterator[Any]:
        """The job's advisory lock for a run outside the slots (a run asked
        for by hand, ``jobs/manual.py``): yields the lock connection once the
        lock is taken - so never beside a slot's run or another manual run,
        on any worker - and releases it after; yields None while a run holds
        it, or when the database can't be reached (logged as for a slot)."""
        import psycopg

        try:
            connection = self._connect(runner)
            taken = bool(connection.execute("SELECT pg_try_advisory_lock(%s)", [runner.key]).fetchone()[0])
        except psycopg.OperationalError as exc:
            runner.close_connection()
            self._database_unavailable(runner.spec.name, datetime.now(UTC), exc)
            taken = False
        if not taken:
            yield None
            return
        try:
            yield connection
        finally:
            self._unlock(runner)

    def _unlock(self, runner: JobRunner) -> None:
        connection = runner.connection
        if connection is None:
            return
        try:
            released = bool(connection.execute("SELECT pg_advisory_unlock(%s)", [runner.key]).fetchone()[0])
        except Exception:
            released = False
        if not released:
            # A connection whose lock state we can't vouch for is never reused:
            # closing it ends the session, and the session's locks with it.
            logger.warning("job unlock not confirmed, closing its connection name=%s", runner.spec.name)
            runner.close_connection()
