"""Worker heartbeats: each worker process says "I am alive, this is what I
consume, and this is what I am doing" (``models.WorkerState``: waiting for
the broker, running, contested, refused) in ``platformkit_workers`` every
few seconds, so the admin overview can list the workers seen, their
subscriptions, start time and state. The heartbeat starts before the
worker reaches NATS and never waits for it: it needs only PostgreSQL.

Owns the one upsert per beat. A heartbeat is news, never a duty: a database
outage makes a beat fail quietly (logged once at WARNING), it never stops
the watchdog that calls it. The idea is Flower's worker list and Oban's
``oban_peers``, kept to one row per ``host:pid``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections
from django.utils import timezone

from django_platformkit import conf
from django_platformkit._process import worker_id
from django_platformkit._tables import WORKERS_TABLE
from django_platformkit._version import __version__
from django_platformkit.models import WorkerState
from django_platformkit.runtime.runstate import RunState

logger = logging.getLogger(__name__)

#: How often a worker writes its row; the overview calls a worker "alive"
#: when it beat within ``ALIVE_AFTER_SECONDS``.
BEAT_EVERY_SECONDS = 5.0
ALIVE_AFTER_SECONDS = 3 * BEAT_EVERY_SECONDS
#: Rows of workers not seen for this long are deleted at a worker's start, so
#: the table holds the recent past, not every process that ever ran.
FORGET_AFTER = timedelta(days=7)

_COLUMNS = "(worker, started_at, last_seen, stopped_at, subscriptions, version, state, detail, instance)"
_UPSERT_SQL = (
    f"INSERT INTO {WORKERS_TABLE} {_COLUMNS} VALUES (%s, %s, now(), NULL, %s::jsonb, %s, %s, %s, %s) "
    "ON CONFLICT (worker) DO UPDATE SET last_seen = now(), stopped_at = NULL, "
    "started_at = EXCLUDED.started_at, subscriptions = EXCLUDED.subscriptions, version = EXCLUDED.version, "
    "state = EXCLUDED.state, detail = EXCLUDED.detail, instance = EXCLUDED.instance"
)
# An upsert too: a burst shorter than one beat still shows in "workers seen".
# The state stays the last one written, unless the stop says why (a refusal).
_STOP_SQL = (
    f"INSERT INTO {WORKERS_TABLE} {_COLUMNS} VALUES (%s, %s, now(), now(), %s::jsonb, %s, %s, %s, %s) "
    "ON CONFLICT (worker) DO UPDATE SET last_seen = now(), stopped_at = now(), "
    f"state = CASE WHEN EXCLUDED.state = '{WorkerState.REFUSED}' THEN EXCLUDED.state ELSE {WORKERS_TABLE}.state END, "
    f"detail = CASE WHEN EXCLUDED.state = '{WorkerState.REFUSED}' THEN EXCLUDED.detail ELSE {WORKERS_TABLE}.detail END"
)
_FORGET_SQL = f"DELETE FROM {WORKERS_TABLE} WHERE last_seen < now() - make_interval(secs => %s)"


#: What a worker says it does now: its state and, for a wait or a refusal, why (and the fix).
type StateReport = tuple[WorkerState, str]


class Heartbeat:
    """One worker's heartbeat row.

    ``subscriptions``: the names the worker consumes; ``every_seconds``: the
    least time between two writes (``beat()`` may be called more often, e.g.
    once a second from the watchdog: it writes only when due, or at once
    when the state changed). ``using``: the database alias (default
    ``DATABASE_ALIAS``). ``state``: called at each beat for the worker's
    ``(WorkerState, detail)``. ``instance``: the database instance it works
    for (``identity.database_instance()``), once known. Nothing here raises
    on a database error: the beat is skipped and logged.
    """

    def __init__(
        self,
        subscriptions: Sequence[str] = (),
        *,
        using: str | None = None,
        every_seconds: float = BEAT_EVERY_SECONDS,
        worker: str | None = None,
        state: Callable[[], StateReport] | None = None,
    ) -> None:
        self.worker = worker or worker_id()
        self.subscriptions = sorted(subscriptions)
        self.using = using or conf.settings.DATABASE_ALIAS
        self.every_seconds = every_seconds
        self.started_at: datetime = timezone.now()
        self.version = __version__  # _version.py's, not the installed metadata's (stale in an editable install)
        self.state = state or (lambda: (WorkerState.RUNNING, ""))
        self.instance = ""
        #: Why the worker stops refused (its stream), with the fix: the stopped row says so.
        self.refusal = ""
        self._last_beat: float | None = None
        self._last_state: StateReport | None = None
        self._failing = False
        self._forgotten = False

    def beat(self, *, force: bool = False) -> bool:
        """Write the row if a beat is due, the state changed, or ``force``. Returns whether it wrote."""
        now = time.monotonic()
        state = self.state()
        due = self._last_beat is None or now - self._last_beat >= self.every_seconds
        if not (force or due or state != self._last_state):
            return False
        self._last_beat = now
        try:
            with connections[self.using].cursor() as cursor:
                if not self._forgotten:
                    cursor.execute(_FORGET_SQL, [FORGET_AFTER.total_seconds()])
                    self._forgotten = True
                cursor.execute(_UPSERT_SQL, [*self._row(), str(state[0]), state[1], self.instance])
            self._last_state = state
        except DatabaseError as exc:
            # One line per outage: the watchdog beats every second or so.
            if not self._failing:
                logger.warning("heartbeat not written worker=%s error=%s", self.worker, exc)
            self._failing = True
            # A broken connection would fail every later beat too: reconnect next time.
            connections[self.using].close()
            return False
        if self._failing:
            logger.info("heartbeat written again worker=%s", self.worker)
        self._failing = False
        return True

    def stopped(self) -> None:
        """Mark the row as cleanly stopped (a killed worker simply stops
        beating) - state ``refused`` with ``refusal`` when that is why - then
        close this thread's connection: call it from the thread that beat,
        as it ends, or its connection outlives it."""
        state = (WorkerState.REFUSED, self.refusal) if self.refusal else self._last_state or self.state()
        try:
            with connections[self.using].cursor() as cursor:
                cursor.execute(_STOP_SQL, [*self._row(), str(state[0]), state[1], self.instance])
        except DatabaseError as exc:
            logger.warning("heartbeat stop not written worker=%s error=%s", self.worker, exc)
        finally:
            connections[self.using].close()

    def _row(self) -> list[Any]:
        return [self.worker, self.started_at, json.dumps(self.subscriptions), self.version]

    def beat_while(self, run: RunState) -> threading.Thread:
        """Beat once a second from a thread of its own while the worker
        starts (``run.starting``; it may wait for NATS for a long time) and
        ``run.stop`` is not set, then, if the stop ended it, write the
        stopped row; close that thread's connection. Returns the thread (started)."""

        def beat() -> None:
            try:
                while run.starting and not run.stop.is_set():
                    self.beat()
                    run.stop.wait(1.0)
            finally:
                if run.stop.is_set():
                    self.stopped()  # closes the connection
                else:
                    connections[self.using].close()

        thread = threading.Thread(target=beat, name="platformkit-heartbeat-start-up", daemon=True)
        thread.start()
        return thread
