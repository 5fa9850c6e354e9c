"""The clocks the scheduler reads time from: the ``Clock`` protocol, this
machine's clock, and the database's, which every worker shares.

Keeps "slots are decided by one clock that all workers share (the
database's)": ``DatabaseClock`` reads ``clock_timestamp()`` and ticks on the
monotonic clock between readings, so ticking costs no query.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol

from django.db import connections

from django_platformkit import conf
from django_platformkit.outage import is_database_error

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """What the scheduler reads time from. ``now()``: an aware datetime.
    ``wait(stop, seconds)``: sleep up to ``seconds`` or until ``stop`` is set;
    return whether it is set."""

    def now(self) -> datetime: ...

    def wait(self, stop: threading.Event, seconds: float) -> bool: ...


class SystemClock:
    """This machine's clock (tests and tools; the scheduler's default is ``DatabaseClock``)."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        return stop.wait(seconds)


class DatabaseClock:
    """The database's clock (``clock_timestamp()``), the one clock every
    worker shares: a worker whose own clock runs ahead or behind still
    decides the same slots as the others.

    Reads the database's time every ``resync_seconds`` (default 60) and in
    between adds the monotonic time since, so ticking costs no query. The
    offset is taken at the midpoint of the round trip. While the database
    can't answer, the last offset is kept (the claim then fails anyway and
    the scheduler waits the outage out); before the first reading it is 0.
    """

    def __init__(self, using: str | None = None, *, resync_seconds: float = 60.0) -> None:
        self.using = using or conf.settings.DATABASE_ALIAS
        self.resync_seconds = resync_seconds
        self._base: datetime | None = None  # the database's time at _base_mono
        self._base_mono = 0.0
        self._next_sync = 0.0  # monotonic time of the next reading
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            mono = time.monotonic()
            if self._base is None or mono >= self._next_sync:
                self._sync()
            if self._base is None:
                return datetime.now(UTC)
            return self._base + timedelta(seconds=time.monotonic() - self._base_mono)

    def _sync(self) -> None:
        connection = connections[self.using]
        try:
            before = time.monotonic()
            with connection.cursor() as cursor:
                cursor.execute("SELECT clock_timestamp()")
                database_now = cursor.fetchone()[0]
            after = time.monotonic()
            self._base, self._base_mono = database_now.astimezone(UTC), (before + after) / 2
            self._next_sync = self._base_mono + self.resync_seconds
        except Exception as exc:
            if not is_database_error(exc):
                raise
            logger.debug("database clock not read error=%s", exc)
            # The last offset stays (moving _base_mono would move the time): try again in 5 s.
            self._next_sync = time.monotonic() + 5.0
        finally:
            # The scheduler's thread holds no connection between readings.
            if not connection.in_atomic_block:
                connection.close()

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        return stop.wait(seconds)
