"""Waiting out the database for a unit: while PostgreSQL is away or refuses
for reasons that are not the handler's (a restart, a failover, too many
connections), the unit is tried again with backoff and its acks kept alive -
never counted as an attempt, so an outage can't dead-letter healthy events.
A rate-limited unit takes a fresh turn before each try after the first
(``fresh_turn``): the slot it started under is long gone, and units that
waited out the outage must not start on top of the fresh ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import connections

from django_platformkit._retry import Backoff
from django_platformkit.broker.port import KeepAlive
from django_platformkit.consume.handler import HandlerRunner
from django_platformkit.consume.units import Redo, Stopping, Work
from django_platformkit.outage import close_broken_connections, not_the_handlers_fault

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DatabaseWait:
    """Runs a unit's database work until the database answers.

    Args:
        subscription: The subscription's name, for the log lines.
        using: The database alias the work runs on.
        stop: Set when the worker stops: the wait ends with ``Stopping``.
        runner: Whose per-thread handler start a failed try clears.
        fresh_turn: A rate-limited subscription's: takes a fresh start slot
            and waits for it (``RateLimiter.wait_for_slot``), before each
            try after an outage; None without a limit.
    """

    def __init__(
        self,
        subscription: str,
        using: str,
        stop: threading.Event,
        runner: HandlerRunner,
        *,
        fresh_turn: Callable[[threading.Event], None] | None = None,
    ) -> None:
        self.subscription = subscription
        self.using = using
        self.stop = stop
        self.runner = runner
        self.fresh_turn = fresh_turn

    def until_answers(self, unit: list[Work], run: Callable[[], T], timeout: float, keep: KeepAlive | None) -> T:
        """Run ``run``; while the database is away or refuses for reasons
        that are not the handler's (``not_the_handlers_fault``), wait with
        backoff, keep the unit's acks alive and try again.

        Args:
            unit: The works ``run`` is about (their acks are kept alive).
            run: The database work.
            timeout: A failure after this many seconds of ``run`` is the
                handler's (a session ended for overrunning its timeout), not an outage.
            keep: The unit's keep-alive, or None.

        Returns:
            What ``run`` returned.

        Raises:
            Stopping: The worker stops while the database is still away.
            Redo: From ``run``, unchanged.
            BaseException: A failure that is the handler's, from ``run``.
        """
        delay = Backoff(0.2, 5.0)
        since: float | None = None  # the outage's first refusal (monotonic): one WARNING, then DEBUG
        retries = 0
        while True:
            started = time.monotonic()
            try:
                if retries and self.fresh_turn is not None:
                    # This thread already waited out the outage; the turn's wait is a
                    # slot's spacing at most (a database error here is the outage going on).
                    self.fresh_turn(self.stop)
                    if self.stop.is_set():
                        raise Stopping()
                    started = time.monotonic()
                result = run()
                if since is not None:
                    logger.warning(
                        "database back, handled after waiting (not an attempt) subscription=%s event_id=%s "
                        "waited=%.1fs retries=%s",
                        self.subscription,
                        unit[0].event.id,
                        time.monotonic() - since,
                        retries,
                    )
                return result
            except (Redo, Stopping):
                raise
            except BaseException as exc:
                # A session killed because the handler overran its timeout
                # (idle_in_transaction_session_timeout) is the handler's fault.
                if not (not_the_handlers_fault(exc, self.using) and time.monotonic() - started < timeout):
                    raise
                if self.stop.is_set():
                    raise Stopping() from exc
                wait = delay.next()
                # An outage is two log lines (README), not one per retry.
                logger.log(
                    logging.WARNING if since is None else logging.DEBUG,
                    "database unavailable, retrying (not an attempt) subscription=%s event_id=%s retry_in=%.1fs error=%s",
                    self.subscription,
                    unit[0].event.id,
                    wait,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                )
                if since is None:
                    since = time.monotonic()
                retries += 1
                with contextlib.suppress(Exception):
                    connections[self.using].close()
                with contextlib.suppress(Exception):
                    close_broken_connections()  # another alias the handler lost: reconnected by the retry
                if keep is not None:
                    for work in unit:
                        if work.delivery is None:
                            continue
                        # The ack stays alive through the outage (+ one handler run).
                        with contextlib.suppress(Exception):
                            keep.started(work.delivery, wait + 5 + timeout)
                self.stop.wait(wait)
            finally:
                self.runner.forget_start()
