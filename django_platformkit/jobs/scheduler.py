"""The scheduler: runs each declared job once per slot across any number of
workers and clocks.

Every worker decides slots (``jobs.JobSpec``) from the same clock, the
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
import traceback as traceback_module
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from django_platformkit import conf, signals
from django_platformkit._retry import Backoff
from django_platformkit._tables import JOBS_TABLE
from django_platformkit._text import storable_text
from django_platformkit.jobs.clocks import Clock, DatabaseClock
from django_platformkit.jobs.locks import advisory_key
from django_platformkit.jobs.specs import JobSpec, in_slot, job_named, require_aware
from django_platformkit.jobs.specs import jobs as registered_jobs
from django_platformkit.outage import Outage, database_unavailable, is_database_error

logger = logging.getLogger(__name__)

#: How long a stopping scheduler waits for running jobs before it leaves them
#: to die with the process (their locks go with their connections).
STOP_GRACE_SECONDS = 25.0
#: The scheduler's wait after a database error: doubling from the first to the cap, in seconds.
OUTAGE_FIRST_SECONDS = 0.5
OUTAGE_MAX_SECONDS = 5.0

# --- the log -----------------------------------------------------------------

#: A job that runs more often than this logs its successful runs at DEBUG:
#: an every-second job at INFO would drown what a person needs to read.
QUIET_BELOW_INTERVAL = timedelta(minutes=1)


def _run_log_level(spec: JobSpec) -> int:
    """INFO for a run worth a line in the log; DEBUG for a frequent job's routine run."""
    return logging.DEBUG if spec.every is not None and spec.every < QUIET_BELOW_INTERVAL else logging.INFO


#: How far ahead of the database's clock a slot may be when a worker claims
#: it. A worker whose clock (or a bad injected one) runs ahead by more is
#: refused: it would claim a future slot, and the correct workers would then
#: find that slot - and every one before it - already "run".
SLOT_AHEAD_TOLERANCE_SECONDS = 5.0


# --- running -----------------------------------------------------------------

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
class _Runner:
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
        return self.thread is not None and self.thread.is_alive()

    def close_connection(self) -> None:
        if self.connection is not None:
            try:
                self.connection.close()
            except Exception:
                pass
        self.connection = None


class Scheduler:
    """Runs the registered jobs (or those named in ``jobs``) on their slots.

    ``using``: the database alias of the ledger and locks (default
    ``DATABASE_ALIAS``). ``clock``: a ``Clock`` (default ``DatabaseClock``:
    the database's time, shared by every worker); tests pass a fixed one and
    call ``tick()``. Whatever the clock, a slot more than
    ``SLOT_AHEAD_TOLERANCE_SECONDS`` ahead of the database's clock is never
    claimed (logged at WARNING); ``max_ahead_seconds=None`` turns that off
    (tests of calendar arithmetic years ahead only). ``run(stop)`` loops until
    ``stop`` is set. Raises ``ConfigurationError`` for an unknown job name.
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        clock: Clock | None = None,
        jobs: Iterable[str | JobSpec] | None = None,
        stop_grace_seconds: float = STOP_GRACE_SECONDS,
        max_ahead_seconds: float | None = SLOT_AHEAD_TOLERANCE_SECONDS,
    ) -> None:
        self.using = using or conf.settings.DATABASE_ALIAS
        self.clock = clock or DatabaseClock(self.using)
        # None only for tests of calendar arithmetic on a clock years ahead.
        self.max_ahead_seconds = max_ahead_seconds
        self.stop_grace_seconds = stop_grace_seconds
        chosen = registered_jobs() if jobs is None else jobs
        specs = [item if isinstance(item, JobSpec) else job_named(item) for item in chosen]
        self._runners = [_Runner(spec, advisory_key(spec.name)) for spec in specs]
        # The job locks' view of an outage (every job's run threads share it):
        # when it began (monotonic) and the slots it has cost, so an outage
        # is two log lines, not an ERROR per slot of every job.
        self._outage_lock = threading.Lock()
        self._outage_since: float | None = None
        self._outage_skipped = 0

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
            runner.next_due = runner.spec.next_slot(slot)
            if now - slot > runner.spec.grace_after(slot):
                logger.warning(
                    "slot skipped, too late name=%s slot=%s now=%s grace=%s: the scheduler was not ticking "
                    "(a busy or paused process, a database outage) until after the slot's grace",
                    runner.spec.name,
                    slot.isoformat(),
                    now.isoformat(),
                    runner.spec.grace_after(slot),
                )
                continue
            if runner.busy():
                logger.warning(
                    "job still running, slot skipped name=%s slot=%s running_slot=%s running_for=%.0fs",
                    runner.spec.name,
                    slot.isoformat(),
                    runner.running_slot.isoformat() if runner.running_slot else "-",
                    time.monotonic() - runner.running_since,
                )
                continue
            runner.running_slot, runner.running_since = slot, time.monotonic()
            thread = threading.Thread(
                target=self._run_slot, args=(runner, slot), name=f"platformkit-job-{runner.spec.name}", daemon=True
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
    def _start(self, runners: Sequence[_Runner], now: datetime) -> None:
        connection = connections[self.using]
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT name, last_slot FROM {JOBS_TABLE} WHERE name = ANY(%s)", [[r.spec.name for r in runners]]
                )
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
            if now - newest <= spec.grace_after(newest):
                logger.info("catching up name=%s slot=%s last_slot=%s", spec.name, newest.isoformat(), last.isoformat())
                runner.next_due = newest
            else:
                logger.info(
                    "missed slots skipped name=%s last_slot=%s newest_missed=%s grace=%s",
                    spec.name,
                    last.isoformat(),
                    newest.isoformat(),
                    spec.grace_after(newest),
                )

    # -- one run, in its own thread --
    def _run_slot(self, runner: _Runner, slot: datetime) -> None:
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

    def _connect(self, runner: _Runner) -> Any:
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

    def _lock(self, runner: _Runner, slot: datetime) -> bool:
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

    def _claim_and_run(self, runner: _Runner, slot: datetime) -> None:
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
        logger.debug("job started name=%s slot=%s", spec.name, slot.isoformat())
        started, error, failure = time.monotonic(), "", None
        try:
            spec.func()
        except Exception as exc:
            failure = exc
            error = f"{type(exc).__name__}: {exc}\n\n" + "".join(traceback_module.format_exception(exc))
            logger.error(
                "job failed name=%s slot=%s error=%s: %s",
                spec.name,
                slot.isoformat(),
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        duration = time.monotonic() - started
        signals.job_finished.send_robust(
            sender=spec,
            job=spec.name,
            slot=slot,
            outcome="failed" if failure is not None else "succeeded",
            error=failure,
            duration_seconds=duration,
        )
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
                _run_log_level(spec),
                "job finished name=%s slot=%s duration=%.3fs",
                spec.name,
                slot.isoformat(),
                duration,
            )

    def _unlock(self, runner: _Runner) -> None:
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
