"""A worker's look at the operators' controls every ``CONTROL_POLL_SECONDS``:
the paused subscriptions (``operate/pause.py``) for its consumer pool (a
newly paused lane hands back what it fetched and has not started; a resumed
one fetches again: ``apply_pauses``), the job switches (``jobs/controls.py``)
for its scheduler. The first look is
made before either starts, so a worker started while a subscription is
paused never starts its handler, nor a disabled job's slot. A database
outage keeps the last controls read (logged once, as every loop's outage
is): a paused subscription stays paused, and its messages wait.
"""

from __future__ import annotations

import logging
import threading

from django.db import connections

from django_platformkit.consume.pausing import Pauses, pause_key
from django_platformkit.consume.pool import ConsumerPool
from django_platformkit.exceptions import DatabaseUnavailable
from django_platformkit.jobs.controls import JobSwitches, read_switches
from django_platformkit.operate.pause import paused
from django_platformkit.outage import Outage, database_unavailable, is_database_error

logger = logging.getLogger(__name__)

#: How often every worker reads the controls: a pause, a disable or a run
#: asked for by hand takes effect on every worker within this (DESIGN.md:
#: "within 5 s"), for one read of two small tables per worker.
CONTROL_POLL_SECONDS = 2.0


def apply_pauses(pool: ConsumerPool, paused: frozenset[str], resumed: frozenset[str]) -> None:
    """New pauses read: hand back at once what a newly paused lane of
    ``pool`` fetched and has not started (uncounted: it waits in the
    stream), and wake a resumed lane's puller to fetch again."""
    for lane in pool.lanes:
        key = pause_key(lane.subscription)
        if key in paused:
            pool.hand_back_queued([lane])
            logger.info(
                "subscription paused subscription=%s: no handler of it starts here until it is resumed "
                "(running ones finish; what it fetched and has not started is handed back)",
                lane.subscription.name,
            )
        elif key in resumed:
            logger.info("subscription resumed subscription=%s: fetching and starting again", lane.subscription.name)
            if lane.puller is not None:
                lane.puller.wake()


class ControlWatch:
    """Reads the controls into ``pauses`` and ``switches``.

    Args:
        using: The database alias of the control tables.
        stop: Set when the worker stops.
        pool: The worker's consumer pool: its ``pauses`` (the paused
            subscriptions its consumers ask) are read, and it is told of the
            pauses a look changed (``apply_pauses``); or None (the worker
            consumes nothing).
        switches: The job switches the scheduler asks, or None (no scheduler).
        every_seconds: The time between two looks.
    """

    def __init__(
        self,
        *,
        using: str,
        stop: threading.Event,
        pool: ConsumerPool | None,
        switches: JobSwitches | None,
        every_seconds: float = CONTROL_POLL_SECONDS,
    ) -> None:
        self.using = using
        self.stop = stop
        self.pool = pool
        self.pauses: Pauses | None = pool.pauses if pool is not None else None
        self.switches = switches
        self.every_seconds = every_seconds
        self._outage = Outage("controls", logger)

    @property
    def wanted(self) -> bool:
        """Whether there is anything to watch (a pool or a scheduler)."""
        return self.pauses is not None or self.switches is not None

    def look(self, *, apply: bool = True) -> None:
        """Read the controls once and apply them (``apply``: tell the pool
        of the pauses that changed; the first look has nothing to tell it).

        Raises:
            DatabaseUnavailable: The database can't answer now (the last
                controls read stay in force).
            DatabaseError: Any other database error.
        """
        try:
            keys = frozenset(p.name for p in paused(using=self.using)) if self.pauses is not None else None
            switches = read_switches(using=self.using) if self.switches is not None else None
        except Exception as exc:
            if is_database_error(exc):
                connections[self.using].close()
                if database_unavailable(exc):
                    raise DatabaseUnavailable(f"the controls can't be read: {exc}") from exc
            raise
        if switches is not None and self.switches is not None:
            self.switches.replace(switches)
        if keys is not None and self.pauses is not None:
            now_paused, resumed = self.pauses.replace(keys)
            if (now_paused or resumed) and apply and self.pool is not None:
                apply_pauses(self.pool, now_paused, resumed)

    def first_look(self) -> None:
        """The look before the pool and the scheduler start (on the worker's
        main thread, whose connection it then closes): the pauses it reads
        hold from the pool's first unit; nothing was fetched to hand back."""
        try:
            self.look(apply=False)
        finally:
            connection = connections[self.using]
            if not connection.in_atomic_block:
                connection.close()

    def run(self) -> None:
        """Look every ``every_seconds`` until ``stop`` is set."""
        while not self.stop.wait(self.every_seconds):
            try:
                self.look()
                self._outage.recovered()
            except Exception as exc:
                if not is_database_error(exc) and not isinstance(exc, DatabaseUnavailable):
                    raise
                self._outage.failed(exc.__cause__ or exc, self.every_seconds)
