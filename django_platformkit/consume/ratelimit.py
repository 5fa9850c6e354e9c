"""The rate limit of a subscription (``subscribe(..., rate_limit="20/s")``):
handler starts across every worker, process and machine together, never
more than the rate in any window of the period's length.

One row per limited subscription (``platformkit_rate_limits``) holds the
earliest time its next handler may start. A worker about to start one takes
that slot and moves the row on by ``period / count`` in one autocommit
statement (the row lock serialises the takers for microseconds), then sleeps
until its slot - no polling, no lock held while it waits. Slots are the
database's clock, the sleep the worker's: clocks of different machines never
meet. A subscription without a limit has no row, no statement and no lane
change. Borrowed: the evenly spaced schedule of GCRA (a token bucket of
depth one), as pgqueuer's global limits keep their count in PostgreSQL.
"""

from __future__ import annotations

import threading
import time

from django.db import connections

from django_platformkit._tables import RATE_LIMITS_TABLE
from django_platformkit.conf import Rate

#: A start that wakes later than its slot by more than this share of the
#: spacing takes a fresh slot instead (its own is gone): a late start would
#: share a window with the slots after it (a busy machine, a pause).
LATE_SHARE_OF_SPACING = 0.5
#: Fresh slots a late waker takes at most before it starts anyway.
LATE_RETAKES = 3

#: Take the next slot and say how long to wait for it, in seconds (<= 0: now).
#: ``clock_timestamp()`` read once: the slot is never earlier than the read.
_TAKE_SLOT_SQL = (
    f"WITH t AS (SELECT clock_timestamp() AS now) INSERT INTO {RATE_LIMITS_TABLE} AS r (name, next_at) "
    "SELECT %s, t.now + make_interval(secs => %s) FROM t "
    "ON CONFLICT (name) DO UPDATE SET next_at = greatest(r.next_at + make_interval(secs => %s), EXCLUDED.next_at) "
    "RETURNING EXTRACT(EPOCH FROM r.next_at - (SELECT now FROM t))::float8 - %s"
)


class RateLimiter:
    """Hands out the start times of one rate-limited subscription.

    Args:
        name: The subscription (the limiter row's key).
        rate: Its limit.
        using: The database alias of the limiter row.
    """

    def __init__(self, name: str, rate: Rate, using: str) -> None:
        self.name = name
        self.rate = rate
        self.using = using

    def take(self) -> float:
        """Take the next start slot: one statement, committed at once (on the
        calling thread's connection, outside any transaction), so every
        other worker sees it taken.

        Returns:
            Seconds to wait before the handler may start (0 when the slot is now).

        Raises:
            DatabaseError: The database didn't answer; no slot was taken.
        """
        spacing = self.rate.spacing_seconds
        with connections[self.using].cursor() as cursor:
            cursor.execute(_TAKE_SLOT_SQL, [self.name, spacing, spacing, spacing])
            row = cursor.fetchone()
        return max(0.0, float(row[0])) if row else 0.0

    def wait_for_slot(self, stop: threading.Event) -> None:
        """Take a slot and sleep until it (returns early when ``stop`` is
        set). Woken too late - past ``LATE_SHARE_OF_SPACING`` of the spacing
        - it takes a fresh slot rather than start in the next one's window.

        Raises:
            DatabaseError: The database didn't answer.
        """
        late_after = self.rate.spacing_seconds * LATE_SHARE_OF_SPACING
        for _ in range(1 + LATE_RETAKES):
            wait = self.take()
            due = time.monotonic() + wait
            if stop.wait(wait):
                return
            if time.monotonic() - due <= late_after:
                return
