"""The consumer: handling is exactly once per (subscription, event), and
``attempt`` counts handler runs.

A unit of deliveries (consecutive first deliveries of one subscription, or
one redelivery alone) is one ``transaction.atomic()``: one statement claims
every event in ``platformkit_handled`` (``ON CONFLICT DO NOTHING``) and, for
a trusted subscription, reads each event's row from the outbox - the
handler runs with the outbox's payload, and a message the outbox doesn't
know never runs. The commit makes the claims and the handlers' writes
durable together; only then are the messages acked. A handler's failure
rolls the unit back and the rest is redone with a savepoint per message.

``Consumer`` decides: it cuts deliveries into units (``units.cut``), runs
each unit until the database answers and decides each delivery's outcome;
its ``Outcome`` (``outcome``) then acks, naks or terms it and counts it.
The other collaborators: ``UnitTransaction`` (``claim``: the claim and the
handlers in one transaction), ``HandlerRunner`` (``handler``: one handler
call) and ``DatabaseWait`` (``waiting``: an outage waited out, never an attempt).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import traceback
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from django.db import DatabaseError, connections

from django_platformkit import conf
from django_platformkit.broker.port import Broker, KeepAlive
from django_platformkit.consume.attempts import start_redelivery
from django_platformkit.consume.claim import UnitPass, UnitTransaction
from django_platformkit.consume.handler import HandlerRunner
from django_platformkit.consume.outcome import Outcome
from django_platformkit.consume.pausing import Pauses
from django_platformkit.consume.ratelimit import RateLimiter
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import Redo, Stopping, Work, cut
from django_platformkit.consume.waiting import DatabaseWait
from django_platformkit.wire import Delivery, HandlingOutcome, ReceivedEvent

logger = logging.getLogger(__name__)

#: A redelivery that another worker is starting this very run comes back after this long (seconds).
RACED_REDELIVERY_SECONDS = 1.0


class Consumer:
    """Runs one subscription's handler over deliveries from its durable.

    ``handle()`` may be called from several threads at once (each with its
    own database connection): per-run state is kept per thread.

    Args:
        subscription: Whose handler it runs.
        broker: Where the deliveries come from and are answered (ack / nak / term).
        using: The database alias of the claims (default ``DATABASE_ALIAS``).
        stop: Set when the worker stops: units not started are handed back.
        instance: Which of the subscription's concurrent consumers this is
            (each pulls on its own, ``poll()``).
        contested: Set while this database's identity is contested: a
            message the outbox doesn't know is handed back, not termed
            (``outcome.Outcome``).
        pauses: The paused subscriptions: a unit of a paused one is handed
            back, uncounted, instead of started (``pausing``).
    """

    def __init__(
        self,
        subscription: Subscription,
        broker: Broker,
        *,
        using: str | None = None,
        stop: threading.Event | None = None,
        instance: int = 0,
        contested: threading.Event | None = None,
        pauses: Pauses | None = None,
    ) -> None:
        self.subscription = subscription
        self.pauses = pauses
        self.broker = broker
        self.using = using or conf.settings.DATABASE_ALIAS
        self.stop = stop or threading.Event()
        self.instance = instance
        self.runner = HandlerRunner(subscription, self.using)
        self.transaction = UnitTransaction(subscription, self.using, self.runner)
        limiter = (
            RateLimiter(subscription.rate_limit_name, subscription.rate_limit, self.using)
            if subscription.rate_limit is not None
            else None
        )
        self.wait = DatabaseWait(
            subscription.name,
            self.using,
            self.stop,
            self.runner,
            fresh_turn=limiter.wait_for_slot if limiter is not None else None,
        )
        self.outcome = Outcome(subscription, broker, self.using, self.wait, contested=contested)

    @property
    def counts(self) -> Counter[HandlingOutcome]:
        """Totals by outcome (``handled``, ``skipped``, ``retried``, ``dead_lettered``, ``malformed``), kept by ``outcome``."""
        return self.outcome.counts

    @property
    def handler_started(self) -> float | None:
        """Monotonic start of the oldest handler running now, or None (the watchdog reads it)."""
        return self.runner.oldest_start

    def record_stuck_runs(self, started_before: float, error: str) -> int:
        """See ``HandlerRunner.record_stuck_runs``."""
        return self.runner.record_stuck_runs(started_before, error)

    # -- the loop --
    def ensure(self) -> None:
        """Create or update this subscription's durable.

        Raises:
            ConsumerDrift: The broker can't make the change.
        """
        self.broker.ensure_consumer(self.subscription.consumer_config())

    def poll(self, *, batch: int | None = None, timeout: float = 1.0) -> int:
        """Fetch once and ``handle()`` what came.

        Returns:
            How many deliveries were fetched.
        """
        deliveries = self.broker.fetch(
            self.subscription.durable, batch or conf.settings.CONSUMER_BATCH_SIZE, timeout=timeout, puller=self.instance
        )
        if deliveries:
            self.handle(deliveries)
        return len(deliveries)

    def handle(self, deliveries: Sequence[Delivery], keep: KeepAlive | None = None) -> list[HandlingOutcome]:
        """Handle deliveries of this subscription.

        Every delivery is answered (ack / nak / term) before this returns,
        except ``UNACKED`` ones. First deliveries (broker count 1) are
        handled in units: one claim statement, one transaction (``batch=True``)
        or one each (``batch=False``); a redelivery, or a reconciliation's
        re-send (``may_have_run``), is always a unit of its own, its run
        recorded before the handler starts (DESIGN.md "Attempts").

        Args:
            deliveries: Fetched from this subscription's durable.
            keep: A keep-alive covering the deliveries, or None to make one here.

        Returns:
            One outcome per delivery, in order: ``HANDLED``, ``SKIPPED`` (a
            claim existed), ``RETRIED`` (naked with its backoff),
            ``DEAD_LETTERED``, ``MALFORMED`` (termed, recorded as a
            ``(malformed)`` dead letter), ``UNACKED`` (the database is gone:
            left for redelivery), ``HANDED_BACK`` (the worker is stopping,
            or the subscription is paused: naked, not counted) or
            ``ELSEWHERE`` (a targeted re-send for another subscription:
            acked, not counted).
        """
        own_keep = keep is None
        if keep is None:
            keep = self.broker.keep_alive(deliveries, every_seconds=max(0.2, float(conf.settings.ACK_WAIT_SECONDS) / 3))
        units, refused = cut(deliveries, self.subscription)
        results: dict[int, HandlingOutcome] = {}
        try:
            for refusal in refused:
                results[id(refusal.delivery)] = self.outcome.refuse(refusal, keep)
            for unit in units:
                self._run_unit(unit, keep)
                for work in unit:
                    results[id(work.delivery)] = work.outcome or HandlingOutcome.UNACKED
        finally:
            if own_keep:
                keep.stop()
        return [results.get(id(d), HandlingOutcome.UNACKED) for d in deliveries]

    def run_event(self, event: ReceivedEvent, *, timeout: float | None = None) -> HandlingOutcome:
        """Claim ``event`` and run the handler in one transaction, in this
        thread, as the worker does, with no broker (``testing.run_pending``).
        No attempt is recorded.

        Returns:
            ``HANDLED``, or ``SKIPPED`` (a claim existed).

        Raises:
            BaseException: The handler's exception, after its transaction rolled back.
        """
        budget = float(conf.settings.HANDLER_TIMEOUT_SECONDS) if timeout is None else timeout
        work = Work(delivery=None, event=event)
        try:
            self.transaction.execute(
                [work], how=UnitPass(savepoints=False, trust_outbox=False, timeout_seconds=budget), skip=set()
            )
        except Redo:
            if work.error is None:
                raise
            raise work.error from None
        return work.outcome or HandlingOutcome.SKIPPED

    # -- one unit --
    def _run_unit(self, unit: list[Work], keep: KeepAlive) -> None:
        """Decide each work's outcome (``Work``), then have ``outcome`` carry it out."""
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        self.runner.attach(keep, {w.event.id: w.message for w in unit})
        try:
            # The one place a unit is decided to start: not while stopping,
            # nor while its subscription is paused (fetched before the pause
            # was read): handed back, no run recorded, it waits in the stream.
            if self.stop.is_set() or (self.pauses is not None and self.pauses.holds(self.subscription)):
                for work in unit:
                    work.outcome = HandlingOutcome.HANDED_BACK
            else:
                self._run_until_committed(unit, timeout, keep)
            self.outcome.conclude(unit, keep)
        finally:
            self.runner.detach()

    def _redelivery_starts(self, work: Work, timeout: float, keep: KeepAlive) -> bool:
        """Whether a redelivery's handler is to run (``attempts.start_redelivery``,
        waited out through an outage); if not, its outcome says why."""
        sub = self.subscription
        try:
            start = self.wait.until_answers(
                [work],
                lambda: start_redelivery(sub.name, work.event.id, sub.max_attempts, using=self.using),
                timeout,
                keep,
            )
        except Stopping:
            work.outcome = HandlingOutcome.HANDED_BACK
        except DatabaseError as exc:
            logger.error(
                "redelivery not started, left for the broker subscription=%s event_id=%s error=%s",
                self.subscription.name,
                work.event.id,
                exc,
            )
            with contextlib.suppress(Exception):
                connections[self.using].close()
            work.outcome = HandlingOutcome.UNACKED
            return False
        if start.outcome is None:
            work.attempt_row = start.attempt_row
            work.event = replace(work.event, attempt=start.attempt)
            return True
        # Handled meanwhile (SKIPPED), out of attempts (DEAD_LETTERED: ``exhausted`` says why),
        # or raced by another worker starting this very run (HANDED_BACK: let it).
        work.outcome, work.exhausted = start.outcome, start.exhausted
        if start.outcome == HandlingOutcome.HANDED_BACK:
            work.redeliver_in_seconds = RACED_REDELIVERY_SECONDS
        return False

    def _run_until_committed(self, unit: list[Work], timeout: float, keep: KeepAlive) -> None:
        """The unit's transaction, waited out through database outages and
        redone with a savepoint per message after a handler failed; every
        work leaves with an outcome (``FAILED`` ones are retried or
        dead-lettered by ``outcome``). A redelivery's history decides first
        whether it runs at all."""
        if unit[0].history_decides and not self._redelivery_starts(unit[0], timeout, keep):
            return
        skip: set[int] = set()
        how = UnitPass(savepoints=False, trust_outbox=not self.subscription.external, timeout_seconds=timeout)
        while True:
            try:
                run = functools.partial(self.transaction.execute, unit, how=how, skip=skip)
                self.wait.until_answers(unit, run, timeout * len(unit), keep)
                return
            except Redo:
                # A handler failed: everything rolled back. Redo the rest of
                # the unit with a savepoint per message, without the failed one.
                skip.update(id(w) for w in unit if w.outcome == HandlingOutcome.FAILED)
                how = replace(how, savepoints=True)
            except Stopping:
                # The database is away and we are stopping: nothing of the
                # unit committed, and a failure can't be recorded either.
                for work in unit:
                    work.outcome = HandlingOutcome.HANDED_BACK
                return
            except Exception as exc:
                tb = "".join(traceback.format_exception(exc))
                for work in unit:
                    if work.outcome != HandlingOutcome.FAILED:
                        work.outcome, work.error, work.tb = HandlingOutcome.FAILED, exc, tb
                return
