"""One doubling backoff for every retry loop (relay, listener, scheduler,
consumers, the transport's reconnects, the supervisor's restarts).

    delay = Backoff(first=0.5, cap=5.0)
    while not stop.is_set():
        try:
            work()
        except Unavailable as exc:
            outage.failed(exc, delay.current)
            stop.wait(delay.next())   # 0.5, 1, 2, 4, 5, 5, ... seconds
            continue
        delay.reset()

The shape is the usual capped exponential backoff (AWS Architecture Blog,
"Exponential Backoff And Jitter", 2015); ``jitter`` spreads the workers of
one deploy that all lost the same server at the same instant ("full jitter"
there: a uniform pick in [delay * (1 - jitter), delay]). ``WaitingLog`` is
what such a loop logs while it waits: one line, then one a minute.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable


class Backoff:
    """A capped doubling delay in seconds: ``first``, ``2 * first``, … up to
    ``cap``, back to ``first`` after :meth:`reset`.

    ``jitter`` (0 ≤ jitter ≤ 1, default 0) is the fraction of each delay that
    may be taken off at random. Raises ``ValueError`` for ``first`` ≤ 0,
    ``cap`` < ``first`` or a ``jitter`` outside [0, 1].
    """

    __slots__ = ("cap", "current", "first", "jitter")

    def __init__(self, first: float = 0.5, cap: float = 5.0, *, jitter: float = 0.0) -> None:
        if first <= 0:
            raise ValueError(f"Backoff: first must be > 0 seconds, got {first!r}")
        if cap < first:
            raise ValueError(f"Backoff: cap ({cap!r}) must be >= first ({first!r})")
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"Backoff: jitter must be within [0, 1], got {jitter!r}")
        self.first = float(first)
        self.cap = float(cap)
        self.jitter = float(jitter)
        #: The delay the next :meth:`next` returns (before jitter), in seconds.
        self.current = self.first

    def next(self) -> float:
        """The delay to wait now, in seconds; doubles the following one (up to ``cap``)."""
        delay = self.current
        self.current = min(self.current * 2, self.cap)
        if self.jitter:
            delay -= delay * self.jitter * random.random()  # spreading retries, not security: any PRNG does
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self.current = self.first


class WaitingLog:
    """What a loop that waits for something (NATS, the stream) logs: its
    first failure, then one line a minute with how long it has waited, and
    the end. A worker started with NATS down logged an ERROR every ~3 s
    (~1,200 lines an hour); the wait itself is unchanged.

    ``what``: what is waited for (``"NATS at nats://host:4222"``).
    ``every_seconds``: the least time between two lines while waiting.
    ``clock``: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        every_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.every_seconds = every_seconds
        self.clock = clock
        #: When the wait began (``clock`` seconds), None while not waiting.
        self.since: float | None = None
        self._last_line = 0.0

    def failed(self, error: str, *, meanwhile: str = "") -> None:
        """One more failed try; logs only when a line is due. ``meanwhile``:
        what goes on during the wait, said once in the first line."""
        now = self.clock()
        if self.since is None:
            self.since = self._last_line = now
            self.log.error("waiting for %s error=%s%s", self.what, error, f"; {meanwhile}" if meanwhile else "")
        elif now - self._last_line >= self.every_seconds:
            self._last_line = now
            self.log.error("still waiting for %s waited=%.0fs error=%s", self.what, now - self.since, error)

    def done(self) -> None:
        """The wait is over (logged when there was one)."""
        if self.since is not None:
            self.log.warning("%s reached after waited=%.0fs", self.what, self.clock() - self.since)
            self.since = None
