"""Worker heartbeats: each worker process says "I am alive, and this is what
I consume" in ``platformkit_workers`` every few seconds, so the admin
overview can list the workers seen, their subscriptions and start time.

Owns the one upsert per beat. A heartbeat is news, never a duty: a database
outage makes a beat fail quietly (logged once at WARNING), it never stops
the watchdog that calls it. The idea is Flower's worker list and Oban's
``oban_peers``, kept to one row per ``host:pid``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db import DatabaseError, connections
from django.utils import timezone

from django_platformkit import conf
from django_platformkit._process import worker_id
from django_platformkit._tables import WORKERS_TABLE

logger = logging.getLogger(__name__)

#: How often a worker writes its row; the overview calls a worker "alive"
#: when it beat within ``ALIVE_AFTER_SECONDS``.
BEAT_EVERY_SECONDS = 5.0
ALIVE_AFTER_SECONDS = 3 * BEAT_EVERY_SECONDS
#: Rows of workers not seen for this long are deleted at a worker's start, so
#: the table holds the recent past, not every process that ever ran.
FORGET_AFTER = timedelta(days=7)

_UPSERT_SQL = (
    f"INSERT INTO {WORKERS_TABLE} (worker, started_at, last_seen, stopped_at, subscriptions, version) "
    "VALUES (%s, %s, now(), NULL, %s::jsonb, %s) "
    "ON CONFLICT (worker) DO UPDATE SET last_seen = now(), stopped_at = NULL, "
    "started_at = EXCLUDED.started_at, subscriptions = EXCLUDED.subscriptions, version = EXCLUDED.version"
)
# An upsert too: a burst shorter than one beat still shows in "workers seen".
_STOP_SQL = (
    f"INSERT INTO {WORKERS_TABLE} (worker, started_at, last_seen, stopped_at, subscriptions, version) "
    "VALUES (%s, %s, now(), now(), %s::jsonb, %s) "
    "ON CONFLICT (worker) DO UPDATE SET last_seen = now(), stopped_at = now()"
)
_FORGET_SQL = f"DELETE FROM {WORKERS_TABLE} WHERE last_seen < now() - make_interval(secs => %s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("django_platformkit")
    except PackageNotFoundError:
        return ""


class Heartbeat:
    """One worker's heartbeat row.

    ``subscriptions``: the names the worker consumes; ``every_seconds``: the
    least time between two writes (``beat()`` may be called more often, e.g.
    once a second from the watchdog: it writes only when due). ``using``: the
    database alias (default ``DATABASE_ALIAS``). Nothing here raises on a
    database error: the beat is skipped and logged.
    """

    def __init__(
        self,
        subscriptions: Sequence[str] = (),
        *,
        using: str | None = None,
        every_seconds: float = BEAT_EVERY_SECONDS,
        worker: str | None = None,
    ) -> None:
        self.worker = worker or worker_id()
        self.subscriptions = sorted(subscriptions)
        self.using = using or conf.settings.DATABASE_ALIAS
        self.every_seconds = every_seconds
        self.started_at: datetime = timezone.now()
        self.version = _version()
        self._last_beat: float | None = None
        self._failing = False
        self._forgotten = False

    def beat(self, *, force: bool = False) -> bool:
        """Write the row if a beat is due (or ``force``). Returns whether it wrote."""
        now = time.monotonic()
        if not force and self._last_beat is not None and now - self._last_beat < self.every_seconds:
            return False
        self._last_beat = now
        try:
            with connections[self.using].cursor() as cursor:
                if not self._forgotten:
                    cursor.execute(_FORGET_SQL, [FORGET_AFTER.total_seconds()])
                    self._forgotten = True
                cursor.execute(
                    _UPSERT_SQL, [self.worker, self.started_at, json.dumps(self.subscriptions), self.version]
                )
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
        beating), then close this thread's connection: call it from the
        thread that beat, as it ends, or its connection outlives it."""
        try:
            with connections[self.using].cursor() as cursor:
                cursor.execute(_STOP_SQL, [self.worker, self.started_at, json.dumps(self.subscriptions), self.version])
        except DatabaseError as exc:
            logger.warning("heartbeat stop not written worker=%s error=%s", self.worker, exc)
        finally:
            connections[self.using].close()
