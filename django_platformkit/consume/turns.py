"""Where a rate-limited unit waits for its turn: beside the pool, never on a
handler thread (DESIGN.md, ``subscribe(... rate_limit)``).

A unit a rate-limited lane fetched is handed to the ``TurnKeeper``: one
thread per worker that takes the unit's start slot from the shared limiter
(``consume.ratelimit``, one statement on its own connection) and holds the
unit until then - a timer, not a sleeping handler thread - then gives it
back to the pool, which starts it on the next free thread. So limited lanes
whose ``concurrency`` adds up to ``CONSUMER_THREADS`` leave every thread to
the subscriptions whose turn has come, limited or not (Celery's rate-limited
tasks hold their prefetched slots and stall the rest: celery/celery#8119).
The unit's acks stay alive meanwhile (its keep-alive runs from fetch time),
and no attempt is counted: its handler has not started. While the database
can't answer, the asks wait and are taken once it is back (two log lines).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from django.db import DatabaseError, connections

from django_platformkit._retry import Backoff
from django_platformkit.consume.ratelimit import RateLimiter
from django_platformkit.outage import Outage

logger = logging.getLogger(__name__)

#: The keeper's wait after a database error while taking slots: doubling from the first to the cap, in seconds.
OUTAGE_FIRST_SECONDS = 0.2
OUTAGE_MAX_SECONDS = 5.0


class TurnKeeper[T]:
    """Takes the start slots of waiting units and releases each when its slot comes.

    Args:
        using: The database alias of the limiter rows (the keeper's own connection).
        stop_event: Set when the worker stops: nothing more is taken or released
            (the pool hands back what waits).
        release: Called with a unit and the monotonic time of its slot when
            that time has come (on the keeper's thread, holding no lock of the keeper's).
    """

    def __init__(self, *, using: str, stop_event: threading.Event, release: Callable[[T, float], None]) -> None:
        self.using = using
        self.stop_event = stop_event
        self._release = release
        self._cond = threading.Condition()
        self._asks: collections.deque[tuple[RateLimiter, T]] = collections.deque()
        self._held: list[tuple[float, int, T]] = []  # (slot, order, unit): a heap of slots taken, not come yet
        self._order = itertools.count()

    def ask(self, limiter: RateLimiter, unit: T) -> None:
        """Queue ``unit`` for a start slot of ``limiter``'s (thread-safe, never
        blocks on the database: the broker's loop calls it)."""
        with self._cond:
            self._asks.append((limiter, unit))
            self._cond.notify()

    def waiting(self) -> int:
        """Units asked for and not released yet."""
        with self._cond:
            return len(self._asks) + len(self._held)

    def run(self) -> None:
        """The keeper's thread: take slots for the asks, release what is due, until the stop."""
        outage = Outage("rate limits", logger)
        delay = Backoff(OUTAGE_FIRST_SECONDS, OUTAGE_MAX_SECONDS)
        try:
            while not self.stop_event.is_set():
                try:
                    self._take_asked()
                except DatabaseError as exc:
                    wait = delay.next()
                    outage.failed(exc, wait)
                    with contextlib.suppress(Exception):
                        connections[self.using].close()
                    self._release_due()  # slots taken before the outage still come
                    self.stop_event.wait(wait)
                    continue
                outage.recovered()
                delay.reset()
                self._release_due()
                with self._cond:
                    if not self._asks and not self.stop_event.is_set():
                        until = self._held[0][0] - time.monotonic() if self._held else 1.0
                        self._cond.wait(max(0.0, min(until, 1.0)))
        finally:
            with contextlib.suppress(Exception):
                connections[self.using].close()

    def wake(self) -> None:
        """Wake the keeper (the worker stops)."""
        with self._cond:
            self._cond.notify_all()

    def _take_asked(self) -> None:
        """Take a slot for every ask, in order. Raises ``DatabaseError``: the
        ask that failed and those after it stay asked."""
        while not self.stop_event.is_set():
            with self._cond:
                if not self._asks:
                    return
                limiter, unit = self._asks[0]
            wait = limiter.take()
            with self._cond:
                self._asks.popleft()
                heapq.heappush(self._held, (time.monotonic() + wait, next(self._order), unit))

    def _release_due(self) -> None:
        now = time.monotonic()
        due = []
        with self._cond:
            while self._held and self._held[0][0] <= now:
                slot, _order, unit = heapq.heappop(self._held)
                due.append((unit, slot))
        for unit, slot in due:
            self._release(unit, slot)
