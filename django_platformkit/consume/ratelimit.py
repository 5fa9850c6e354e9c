"""The rate limit of a subscription (``subscribe(..., rate_limit="20/s")``):
handler starts across every worker, process and machine together, never
more than the rate in any window of the period's length.

One row per limited subscription (``platformkit_rate_limits``) holds the
earliest time its next handler may start and the spacing it was reserved
under. A worker about to start one takes that slot and moves the row on by
the spacing (``period / count``, and a margin for starts that lag their
slot: ``START_MARGIN_SHARE_OF_SPACING``) in one autocommit statement (the row lock serialises the
takers for microseconds). A row reserved under another spacing - the limit
changed with a deploy - is judged again: the next slot is the last one
handed out that has come, plus the *new* spacing, so a changed limit takes
effect within one period of the new limit (1/h raised to 20/s no longer
waits out the hour the old workers reserved). Slots are the database's clock, the waits the worker's: clocks of
different machines never meet. Where a unit waits for its slot is the
pool's business (``consume.turns``: beside the pool, on no handler thread).
A subscription without a limit has no row, no statement and no lane change.
Borrowed: the evenly spaced schedule of GCRA (a token bucket of depth one),
as pgqueuer's global limits keep their count in PostgreSQL.
"""

from __future__ import annotations

import threading
import time

from django.db import connections

from django_platformkit._tables import RATE_LIMITS_TABLE
from django_platformkit.conf import Rate

#: A handler starts a little after its slot (the keeper's timer, a pool
#: thread's wake, the claim): evenly spaced slots at exactly ``period /
#: count`` would then let a window of the period hold ``count + 1`` starts
#: whenever one start lags more than the start ``count`` slots later. So the
#: slots keep a margin of this share of the spacing, at most
#: ``START_MARGIN_MAX_SECONDS``, per period: ``(period + margin) / count``
#: apart, and ``count`` starts fit in any window of the period while their
#: lags differ by less than the margin (20/s: 19.5 starts a second at most).
START_MARGIN_SHARE_OF_SPACING = 0.5
START_MARGIN_MAX_SECONDS = 0.1
#: A unit taken by a pool thread later than this share of the margin after
#: its slot takes a fresh slot instead (every thread was busy): the rest of
#: the margin is for the way from there to the handler (the claim).
LATE_SHARE_OF_MARGIN = 0.5
#: Fresh slots a late unit takes at most before it starts anyway (a pool
#: whose threads stay busy must not starve it).
LATE_RETAKES = 3


def start_margin_seconds(rate: Rate) -> float:
    """The margin per period the slots of ``rate`` keep for starts that lag their slot, in seconds."""
    return min(rate.spacing_seconds * START_MARGIN_SHARE_OF_SPACING, START_MARGIN_MAX_SECONDS)


#: Take the next slot and say how long to wait for it, in seconds (<= 0: now).
#: ``clock_timestamp()`` read once: the slot is never earlier than the read.
#: The row's next slot, judged under this taker's spacing: kept when the row
#: was reserved under the same spacing; else the last slot it handed out that
#: has come (``next_at`` less whole old spacings: the later ones are turns
#: workers of the old limit reserved, and they go with those workers) plus
#: the new spacing. A row from before the spacing was stored (NULL) is given
#: at most one new spacing from now.
_TAKE_SLOT_SQL = (
    "WITH t AS (SELECT clock_timestamp() AS now) "
    f"INSERT INTO {RATE_LIMITS_TABLE} AS r (name, next_at, spacing_seconds) "
    "SELECT %(name)s, t.now + make_interval(secs => %(spacing)s), %(spacing)s FROM t "
    "ON CONFLICT (name) DO UPDATE SET next_at = greatest("
    "CASE WHEN r.spacing_seconds = EXCLUDED.spacing_seconds THEN r.next_at "
    "WHEN r.spacing_seconds IS NULL THEN least(r.next_at, (SELECT now FROM t) + make_interval(secs => %(spacing)s)) "
    "ELSE r.next_at - make_interval(secs => r.spacing_seconds * greatest(1, ceil("
    "EXTRACT(EPOCH FROM r.next_at - (SELECT now FROM t))::float8 / r.spacing_seconds))) "
    "+ make_interval(secs => %(spacing)s) END, "
    "(SELECT now FROM t)) + make_interval(secs => %(spacing)s), spacing_seconds = EXCLUDED.spacing_seconds "
    "RETURNING EXTRACT(EPOCH FROM r.next_at - (SELECT now FROM t))::float8 - %(spacing)s"
)


class RateLimiter:
    """Hands out the start times of one rate-limited subscription.

    Args:
        name: The subscription (the limiter row's key; a task queue's bands share their queue's).
        rate: Its limit.
        using: The database alias of the limiter row.
    """

    def __init__(self, name: str, rate: Rate, using: str) -> None:
        self.name = name
        self.rate = rate
        self.using = using
        margin = start_margin_seconds(rate)
        #: Seconds between two slots: ``(period + margin) / count``.
        self.spacing_seconds = (rate.period_seconds + margin) / rate.count
        #: How late a unit may be taken after its slot before it takes a fresh one, in seconds.
        self.late_after_seconds = margin * LATE_SHARE_OF_MARGIN

    def take(self) -> float:
        """Take the next start slot: one statement, committed at once (on the
        calling thread's connection, outside any transaction), so every
        other worker sees it taken.

        Returns:
            Seconds to wait before the handler may start (0 when the slot is now).

        Raises:
            DatabaseError: The database didn't answer; no slot was taken.
        """
        with connections[self.using].cursor() as cursor:
            cursor.execute(_TAKE_SLOT_SQL, {"name": self.name, "spacing": self.spacing_seconds})
            row = cursor.fetchone()
        return max(0.0, float(row[0])) if row else 0.0

    def wait_for_slot(self, stop: threading.Event) -> None:
        """Take a slot and sleep on this thread until it (returns early when
        ``stop`` is set); woken too late (``late_after_seconds``) it takes a
        fresh slot. Only for a unit that already holds its thread: one whose
        wait for the database just ended (``DatabaseWait``) takes a fresh
        turn here - a unit fetched waits beside the pool (``consume.turns``).

        Raises:
            DatabaseError: The database didn't answer.
        """
        for _ in range(1 + LATE_RETAKES):
            wait = self.take()
            due = time.monotonic() + wait
            if stop.wait(wait):
                return
            if time.monotonic() - due <= self.late_after_seconds:
                return
