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
there: a uniform pick in [delay * (1 - jitter), delay]).
"""

from __future__ import annotations

import random


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
