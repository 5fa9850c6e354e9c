"""The attempt history: ``platformkit_attempts`` rows that make
``ReceivedEvent.attempt`` count handler runs (DESIGN.md "Attempts").

A redelivery's run is recorded before its handler starts, a first
delivery's only when it fails or runs long (``SlowRunRecorder``), so a run
that killed or hung its worker counts while a hand-back or an outage
doesn't. The consumer decides; this module reads and writes the rows.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from django.db import connections
from django.utils import timezone

from django_platformkit._process import worker_id
from django_platformkit._tables import ATTEMPTS_TABLE, HANDLED_TABLE
from django_platformkit.outage import close_old_connections_for
from django_platformkit.wire import AttemptOutcome, HandlingOutcome

logger = logging.getLogger(__name__)

#: A redelivery's history, and whether it was handled meanwhile (a lost ack), in one round trip.
HISTORY_SQL = (
    f"SELECT EXISTS (SELECT 1 FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = %s), "
    f"a.attempt, a.outcome, a.error, a.traceback, a.started_at, a.worker FROM (SELECT 1) one "
    f"LEFT JOIN {ATTEMPTS_TABLE} a ON a.subscription = %s AND a.event_id = %s ORDER BY a.attempt"
)
START_SQL = (
    f"INSERT INTO {ATTEMPTS_TABLE} (subscription, event_id, attempt, outcome, started_at, error, traceback, worker) "
    f"VALUES (%s, %s, %s, '{AttemptOutcome.RUNNING}', clock_timestamp(), '', '', %s) "
    "ON CONFLICT (subscription, event_id, attempt) DO NOTHING RETURNING id"
)
FAILED_ROW_SQL = f"UPDATE {ATTEMPTS_TABLE} SET outcome = '{AttemptOutcome.FAILED}', finished_at = clock_timestamp(), error = %s, traceback = %s WHERE id = %s"
#: A first delivery's failure: its row is the next number after whatever is there.
FAILED_NEW_SQL = (
    f"INSERT INTO {ATTEMPTS_TABLE} (subscription, event_id, attempt, outcome, started_at, finished_at, error, traceback, worker) "
    f"SELECT %s, %s, COALESCE(MAX(attempt), 0) + 1, '{AttemptOutcome.FAILED}', %s, clock_timestamp(), %s, %s, %s FROM {ATTEMPTS_TABLE} "
    "WHERE subscription = %s AND event_id = %s ON CONFLICT (subscription, event_id, attempt) DO NOTHING"
)
INTERRUPTED_SQL = f"UPDATE {ATTEMPTS_TABLE} SET outcome = '{AttemptOutcome.INTERRUPTED}', finished_at = clock_timestamp() WHERE id = %s AND outcome = '{AttemptOutcome.RUNNING}'"


class Run(NamedTuple):
    """One recorded run of a handler (a ``platformkit_attempts`` row)."""

    attempt: int
    outcome: str  # an ``AttemptOutcome`` value
    error: str
    traceback: str
    started_at: datetime | None
    worker: str

    @property
    def counts(self) -> bool:
        """Whether the run counts as an attempt: it failed, or started and never reported."""
        return self.outcome in (AttemptOutcome.FAILED, AttemptOutcome.RUNNING)


def run_history(subscription: str, event_id: uuid.UUID, *, using: str) -> tuple[bool, list[Run]]:
    """The event's history for ``subscription``, in one round trip.

    Returns:
        ``(handled, runs)``: whether the event holds a claim for
        ``subscription`` (a lost ack), and its recorded runs, oldest first.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(HISTORY_SQL, [subscription, event_id, subscription, event_id])
        fetched = cursor.fetchall()
    return bool(fetched[0][0]), [Run._make(r[1:]) for r in fetched if r[1] is not None]


class Exhausted(NamedTuple):
    """What the dead letter of a redelivery out of attempts says: how many
    runs counted, and the last real error with the whole history."""

    attempts: int
    error: str
    traceback: str


class RedeliveryStart(NamedTuple):
    """What a redelivery's history says before its handler runs (``start_redelivery``)."""

    #: None: run it (its ``running`` row is ``attempt_row``); ``SKIPPED``: handled
    #: meanwhile (its ack was lost); ``DEAD_LETTERED``: its counted runs reached
    #: ``max_attempts`` (``exhausted`` says why); ``HANDED_BACK``: another worker is starting this very run.
    outcome: HandlingOutcome | None
    exhausted: Exhausted | None = None
    attempt_row: int | None = None
    attempt: int = 0  # this run's number as an attempt: the counted runs before it + 1


def start_redelivery(subscription: str, event_id: uuid.UUID, max_attempts: int, *, using: str) -> RedeliveryStart:
    """Before a redelivery runs: read its history and, unless it was handled
    meanwhile or is out of attempts, commit a ``running`` row for this run,
    so a run that kills or hangs its worker still counts. Raises Django's
    ``DatabaseError``."""
    close_old_connections_for(using)
    for _ in range(3):
        handled, runs = run_history(subscription, event_id, using=using)
        if handled:
            return RedeliveryStart(HandlingOutcome.SKIPPED)
        counted = [r for r in runs if r.counts]
        if len(counted) >= max_attempts:
            return RedeliveryStart(HandlingOutcome.DEAD_LETTERED, _exhausted(runs, len(counted), max_attempts))
        number = max((r.attempt for r in runs), default=0) + 1
        attempt_row = start_run(subscription, event_id, number, using=using)
        if attempt_row is not None:
            return RedeliveryStart(None, None, attempt_row, len(counted) + 1)
    # Another worker wrote each number first: it is starting this very run (a redelivery raced ours).
    return RedeliveryStart(HandlingOutcome.HANDED_BACK)


def _exhausted(runs: Sequence[Run], counted: int, max_attempts: int) -> Exhausted:
    """The dead letter of a redelivery whose ``counted`` runs reached ``max_attempts``: with the last real error."""
    last_failed = next((r for r in reversed(runs) if r.outcome == AttemptOutcome.FAILED and r.error), None)
    why = (
        f"dead-lettered without running again: the handler already started {counted} times for this event "
        f"(max_attempts={max_attempts}); history: {history_text(runs)}"
    )
    return Exhausted(
        counted,
        f"{last_failed.error}\n{why}" if last_failed else why,
        last_failed.traceback if last_failed else "",
    )


def start_run(subscription: str, event_id: uuid.UUID, attempt: int, *, using: str) -> int | None:
    """Write the ``running`` row of run number ``attempt`` (committed before
    the handler starts, so a run that kills its worker counts); return its
    id, or None when another worker already wrote that number."""
    with connections[using].cursor() as cursor:
        cursor.execute(START_SQL, [subscription, event_id, attempt, worker_id()])
        row = cursor.fetchone()
    return row[0] if row is not None else None


def record_failed_run(
    *,
    subscription: str,
    event_id: uuid.UUID,
    attempt_row: int | None,
    started_at: datetime | None,
    error: str,
    traceback: str,
    using: str,
) -> None:
    """Mark run ``attempt_row`` failed with ``error`` and ``traceback`` (cut
    to 10,000 / 50,000 characters), or - a first delivery, no row yet -
    insert it as the next run number. Raises Django's ``DatabaseError``."""
    with connections[using].cursor() as cursor:
        if attempt_row is not None:
            cursor.execute(FAILED_ROW_SQL, [error[:10000], traceback[:50000], attempt_row])
        else:
            cursor.execute(
                FAILED_NEW_SQL,
                [
                    subscription,
                    event_id,
                    started_at or timezone.now(),
                    error[:10000],
                    traceback[:50000],
                    worker_id(),
                    subscription,
                    event_id,
                ],
            )


class RunEnd(NamedTuple):
    """How one run ended without its handler's success, for ``end_run``:
    failed with ``error`` and ``traceback``, or (``error`` None)
    interrupted - its handler's verdict never came (the worker stopped, a
    claim existed, the outbox doesn't know the event)."""

    subscription: str
    event_id: uuid.UUID
    attempt_row: int | None  # its ``running`` row; None: a first delivery's run, no row yet
    started_at: datetime | None = None
    error: str | None = None
    traceback: str = ""

    @property
    def failed(self) -> bool:
        return self.error is not None

    def interrupted(self) -> RunEnd:
        """The same run, ended without its handler's verdict."""
        return self._replace(error=None, traceback="")


def end_run(end: RunEnd, *, using: str) -> None:
    """Write how a run ended: ``failed`` (``record_failed_run``), or
    ``interrupted``, so it doesn't count (its ``running`` row; a run without
    one wrote nothing). Raises Django's ``DatabaseError``."""
    if end.error is None:
        if end.attempt_row is not None:
            with connections[using].cursor() as cursor:
                cursor.execute(INTERRUPTED_SQL, [end.attempt_row])
        return
    close_old_connections_for(using)
    record_failed_run(
        subscription=end.subscription,
        event_id=end.event_id,
        attempt_row=end.attempt_row,
        started_at=end.started_at,
        error=end.error,
        traceback=end.traceback,
        using=using,
    )


#: A first delivery's run writes nothing - unless it lasts longer than this:
#: then a ``running`` row is written from the side, so a run that hangs or
#: is killed while hanging counts (DESIGN.md "Attempts"). Fast runs pay nothing.
RECORD_SLOW_RUN_AFTER_SECONDS = 0.25

_SLOW_START_SQL = (
    f"INSERT INTO {ATTEMPTS_TABLE} (subscription, event_id, attempt, outcome, started_at, error, traceback, worker) "
    f"SELECT %s, %s, COALESCE(MAX(attempt), 0) + 1, '{AttemptOutcome.RUNNING}', %s, '', '', %s FROM {ATTEMPTS_TABLE} "
    "WHERE subscription = %s AND event_id = %s ON CONFLICT (subscription, event_id, attempt) DO NOTHING RETURNING id"
)


class _Work(Protocol):
    """What the recorder reads and writes of one run (the consumer's unit of work)."""

    event: Any  # the ReceivedEvent: its ``id``
    attempt_row: int | None
    lock: threading.Lock
    running: bool

    @property
    def started_at(self) -> datetime | None: ...


class SlowRunRecorder:
    """One daemon thread per process, with its own database connection:
    writes the ``running`` row of first-delivery runs that pass
    ``RECORD_SLOW_RUN_AFTER_SECONDS``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[float, _Work, str, str]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, work: _Work, subscription: str, using: str) -> None:
        # Once per handler run: a plain dict store (atomic in CPython), no
        # lock; the recorder copies the dict in one step too.
        self._watched[id(work)] = (time.monotonic() + RECORD_SLOW_RUN_AFTER_SECONDS, work, subscription, using)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="platformkit-slow-runs", daemon=True)
                    self._thread.start()

    def unwatch(self, work: _Work) -> None:
        self._watched.pop(id(work), None)

    def _run(self) -> None:
        try:
            self._record_until_exit()
        finally:
            self._thread = None  # the next watch() starts another

    def _record_until_exit(self) -> None:
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            due = [v for v in self._watched.copy().values() if v[0] <= now]
            for _, work, _, _ in due:
                self._watched.pop(id(work), None)
            for _, work, subscription, using in due:
                with work.lock:
                    if not work.running or work.attempt_row is not None:
                        continue
                    try:
                        with connections[using].cursor() as cursor:
                            cursor.execute(
                                _SLOW_START_SQL,
                                [
                                    subscription,
                                    work.event.id,
                                    work.started_at or timezone.now(),
                                    worker_id(),
                                    subscription,
                                    work.event.id,
                                ],
                            )
                            row = cursor.fetchone()
                        work.attempt_row = row[0] if row else None
                    except Exception as exc:
                        logger.debug(
                            "slow run not recorded subscription=%s event_id=%s error=%s",
                            subscription,
                            work.event.id,
                            exc,
                        )
                        with contextlib.suppress(Exception):
                            connections[using].close()
            if due:
                # Slow runs are rare: hold no idle connection in between (it
                # would also keep a test database from being dropped).
                for using in {v[3] for v in due}:
                    with contextlib.suppress(Exception):
                        connections[using].close()


slow_runs = SlowRunRecorder()


def history_text(runs: Sequence[Run]) -> str:
    """One line per recorded run (``run_history()``'s), oldest first: for a dead letter's error."""
    parts = []
    for attempt, outcome, error, _tb, started_at, worker in runs:
        at = started_at.isoformat(timespec="seconds") if started_at else "?"
        if outcome == AttemptOutcome.FAILED:
            parts.append(
                f"run {attempt} failed (started {at} on {worker or '?'}): {(error or '').splitlines()[0] if error else '?'}"
            )
        elif outcome == AttemptOutcome.RUNNING:
            parts.append(
                f"run {attempt} started {at} on {worker or '?'} and never reported (the worker died, hung, or lost its session)"
            )
        else:
            parts.append(f"run {attempt} {outcome} (started {at})")
    return "; ".join(parts) or "no runs recorded"
