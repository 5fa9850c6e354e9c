"""A worker's reconciliation (``operate/reconcile.py``): one pass as soon as
the worker has started (its broker reached, its durables made, so each
subscription's origin is recorded), then one every ``RECONCILE_INTERVAL_SECONDS``.
Every worker runs it; a subscription another worker reconciled within half
an interval is left to that one, and two passes never take the same
subscription at once, so N workers cost about one pass per interval.

A pass is a safety net beside the worker's real work: a database or broker
that can't answer is waited out (the next interval tries again), and a pass
that fails unexpectedly is logged with its traceback, never the end of a
worker that handles events.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from django.db import connections

from django_platformkit import conf
from django_platformkit.broker.port import Broker
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import BrokerUnavailable
from django_platformkit.operate.reconcile import ReconcileReport, reconcile
from django_platformkit.outage import is_database_error
from django_platformkit.runtime.runstate import RunState
from django_platformkit.runtime.startup import StartUp

logger = logging.getLogger(__name__)

#: While the worker starts, the first pass looks this often whether it may begin.
STARTING_POLL_SECONDS = 0.5


class ReconcileLoop:
    """Reconciles until ``stop`` is set.

    Args:
        broker: The worker's broker.
        start_up: The worker's start-up: it reads this database's identity
            and instance (whose stream this is).
        run: Where the worker's run stands: the first pass waits for its
            start; the loop ends when it stops.
        using: The database alias of the outbox.
        declared: The subscriptions to reconcile (default: every declared one:
            a worker reconciles for the project, not only for what it consumes).
        interval_seconds: Between two passes (default ``RECONCILE_INTERVAL_SECONDS``).
    """

    def __init__(
        self,
        broker: Broker,
        *,
        start_up: StartUp,
        run: RunState,
        using: str,
        declared: Sequence[Subscription] | None = None,
        interval_seconds: float | None = None,
    ) -> None:
        self.broker = broker
        self.start_up = start_up
        self.run_state = run
        self.stop = run.stop
        self.using = using
        self.declared = declared
        self.interval_seconds = float(interval_seconds or conf.settings.RECONCILE_INTERVAL_SECONDS)
        #: The last pass's report (None before the first).
        self.last: ReconcileReport | None = None
        self._said = ""  # the last "did nothing" reason logged: said once, not every interval

    def run(self) -> None:
        while self.run_state.starting and not self.stop.wait(STARTING_POLL_SECONDS):
            pass
        while not self.stop.is_set():
            self.pass_once()
            self.stop.wait(self.interval_seconds)

    def pass_once(self) -> ReconcileReport | None:
        """One pass (None when the broker or the database couldn't answer)."""
        owner = self.start_up.owner
        if owner is None:
            return None
        try:
            report = reconcile(
                self.broker,
                owner=owner,
                instance=self.start_up.instance,
                declared=self.declared,
                using=self.using,
                skip_reconciled_within_seconds=self.interval_seconds / 2,
            )
        except BrokerUnavailable as exc:
            logger.debug("reconciliation waits for the broker error=%s", exc)
            return None
        except Exception as exc:
            if is_database_error(exc):
                logger.debug("reconciliation waits for the database error=%s", exc)
                connections[self.using].close()
            else:
                logger.exception("reconciliation pass failed; the next one is in %.0f s", self.interval_seconds)
            return None
        self.last = report
        if report.note != self._said:
            if report.note:
                logger.warning("reconciliation did nothing: %s", report.note)
            self._said = report.note
        return report
