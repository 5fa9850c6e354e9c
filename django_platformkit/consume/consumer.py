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

``Consumer`` decides: it cuts deliveries into units, runs each unit until
the database answers, and acks after the commit. Its collaborators do the
rest: ``UnitTransaction`` (``claim``: the claim and the handlers in one
transaction), ``HandlerRunner`` (``handler``: one handler call),
``DatabaseWait`` (``waiting``: an outage waited out, never an attempt) and
``Settlement`` (``settle``: retry, dead letter, malformed, hand-back).
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
from django_platformkit.consume.attempts import run_history, start_run
from django_platformkit.consume.claim import NOT_IN_OUTBOX, UnitTransaction
from django_platformkit.consume.handler import HandlerRunner
from django_platformkit.consume.pausing import Pauses
from django_platformkit.consume.ratelimit import RateLimiter
from django_platformkit.consume.settle import Settlement
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import Redo, Stopping, Work
from django_platformkit.consume.waiting import DatabaseWait
from django_platformkit.outage import close_old_connections_for
from django_platformkit.wire import (
    TARGET_HEADER,
    Delivery,
    HandlingOutcome,
    MalformedMessage,
    ReceivedEvent,
    meant_for,
    parse_delivery,
)

logger = logging.getLogger(__name__)

#: What a unit's outcome leaves to ack after its commit.
_ACKED = (HandlingOutcome.HANDLED, HandlingOutcome.SKIPPED)
#: The outcomes a consumer counts (its ``counts``, the worker's totals and health file).
COUNTED = (
    HandlingOutcome.HANDLED,
    HandlingOutcome.SKIPPED,
    HandlingOutcome.RETRIED,
    HandlingOutcome.DEAD_LETTERED,
    HandlingOutcome.MALFORMED,
)


def may_have_run(delivery: Delivery) -> bool:
    """Whether the handler may have run for this delivery's event before, so
    its run history decides (a unit of its own, ``attempt`` from the recorded
    runs): a redelivery, or a reconciliation's re-send - the broker's first
    delivery of a new message for an event whose earlier runs may have failed."""
    return delivery.attempt > 1 or TARGET_HEADER in delivery.headers


class Consumer:
    """Runs one subscription's handler over deliveries from its durable.

    ``handle()`` may be called from several threads at once (each with its
    own database connection): per-run state is kept per thread.

    Args:
        subscription: Whose handler it runs.
        broker: Where the deliveries come from and are settled.
        using: The database alias of the claims (default ``DATABASE_ALIAS``).
        stop: Set when the worker stops: units not started are handed back.
        instance: Which of the subscription's concurrent consumers this is
            (each pulls on its own, ``poll()``).
        contested: Set while this database's identity is contested: a
            message the outbox doesn't know is handed back, not terminated
            (``Settlement.not_in_outbox``).
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
        #: Totals by outcome (``handled``, ``skipped``, ``retried``, ``dead_lettered``, ``malformed``).
        self.counts: Counter[HandlingOutcome] = Counter(dict.fromkeys(COUNTED, 0))
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
        self.settlement = Settlement(
            subscription, broker, self.using, self.counts, self.runner, self.wait, contested=contested
        )

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

        Every delivery is settled (ack / nak / term) before this returns,
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
        settlement = self.settlement
        results: dict[int, HandlingOutcome] = {}
        try:
            for unit in self._units(deliveries, results, keep):
                # The one place a unit is decided to start: not while stopping,
                # nor while its subscription is paused (fetched before the pause
                # was read): handed back, no run recorded, it waits in the stream.
                if self.stop.is_set() or (self.pauses is not None and self.pauses.holds(self.subscription)):
                    for work in unit:
                        results[id(work.delivery)] = settlement.hand_back(work)
                        settlement.settled(keep, work.message)
                    continue
                for work in self._handle_unit(unit, keep):
                    results[id(work.delivery)] = work.outcome or HandlingOutcome.UNACKED
                    settlement.settled(keep, work.message)
        finally:
            if own_keep:
                keep.stop()
        return [results.get(id(d), HandlingOutcome.UNACKED) for d in deliveries]

    def _units(
        self, deliveries: Sequence[Delivery], results: dict[int, HandlingOutcome], keep: KeepAlive
    ) -> list[list[Work]]:
        """Cut ``deliveries`` into units; a message that can't be decoded is
        settled as malformed here (its outcome in ``results``)."""
        units: list[list[Work]] = []
        chunk: list[Work] = []
        for delivery in deliveries:
            if not meant_for(delivery.headers, self.subscription.name):
                results[id(delivery)] = self.settlement.elsewhere(delivery)
                self.settlement.settled(keep, delivery)
                continue
            event, reason = self._decode(delivery)
            if event is None:
                results[id(delivery)] = self.settlement.malformed(delivery, reason)
                self.settlement.settled(keep, delivery)
                continue
            work = Work(delivery, event)
            if may_have_run(delivery):
                # Never inside a batch: a poison message that killed the worker
                # must not count against the neighbours it was fetched with.
                if chunk:
                    units.append(chunk)
                    chunk = []
                units.append([work])
                continue
            chunk.append(work)
            if not self.subscription.batch:
                units.append(chunk)
                chunk = []
        if chunk:
            units.append(chunk)
        return units

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
            self.transaction.execute([work], safe=False, skip=set(), trust_outbox=False, timeout=budget)
        except Redo:
            if work.error is None:
                raise
            raise work.error from None
        return work.outcome or HandlingOutcome.SKIPPED

    # -- decoding and trust --
    def _decode(self, delivery: Delivery) -> tuple[ReceivedEvent | None, str]:
        try:
            event = parse_delivery(delivery)
            if self.subscription.external:
                self._check_schema(event)
            return event, ""
        except MalformedMessage as exc:
            return None, str(exc)
        except Exception as exc:
            return None, f"cannot decode ({type(exc).__name__}: {str(exc)[:200]})"

    def _check_schema(self, event: ReceivedEvent) -> None:
        from django_platformkit.outbox.events import catalogue

        event_type = catalogue().get(self.subscription.event)
        validator = getattr(event_type, "validator", None)
        if validator is None:
            return
        error = next(iter(validator.iter_errors(event.payload)), None)
        if error is not None:
            raise MalformedMessage(f"external event fails the schema of {self.subscription.event!r}: {error.message}")

    # -- one unit --
    def _handle_unit(self, unit: list[Work], keep: KeepAlive) -> list[Work]:
        sub = self.subscription
        settlement = self.settlement
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        self.runner.attach(keep, {w.event.id: w.message for w in unit})
        try:
            if may_have_run(unit[0].message):
                first = unit[0]
                try:
                    ready = self.wait.until_answers(unit, lambda: self._start_redelivery(first), timeout, keep)
                except Stopping:
                    first.outcome = settlement.hand_back(first)
                    return unit
                except DatabaseError as exc:
                    logger.error(
                        "redelivery not started, left for the broker subscription=%s event_id=%s error=%s",
                        sub.name,
                        first.event.id,
                        exc,
                    )
                    with contextlib.suppress(Exception):
                        connections[self.using].close()
                    first.outcome = HandlingOutcome.UNACKED
                    return unit
                if not ready:
                    if first.outcome == HandlingOutcome.SKIPPED:  # handled meanwhile: its ack was lost
                        settlement.settle(lambda: self.broker.ack(first.message), first.event, "ack")
                        self.counts[HandlingOutcome.SKIPPED] += 1
                        settlement.send_handled(first.event, HandlingOutcome.SKIPPED)
                    return unit
            self._run_until_committed(unit, timeout, keep)
            acks = []
            for work in unit:
                if work.outcome in _ACKED:
                    acks.append(work.message)
                    self.counts[work.outcome] += 1
                    settlement.send_handled(work.event, work.outcome)
                    logger.debug(
                        "%s subscription=%s event_id=%s attempt=%s",
                        work.outcome,
                        sub.name,
                        work.event.id,
                        work.event.attempt,
                    )
            # Acked only now, after the commit: a crash before this line means
            # redeliveries that find the claims and skip.
            if acks:
                settlement.settle(lambda: self.broker.ack_many(acks), unit[0].event, "ack")
            for work in unit:
                if work.outcome == HandlingOutcome.SKIPPED and work.attempt_row is not None:
                    settlement.mark_interrupted(work)  # handled elsewhere meanwhile: this run never started
                if work.outcome == HandlingOutcome.NOT_IN_OUTBOX:
                    work.outcome = settlement.not_in_outbox(work, NOT_IN_OUTBOX)
                elif work.outcome == HandlingOutcome.FAILED:
                    work.outcome = settlement.failed(work)
            return unit
        finally:
            self.runner.detach()

    def _run_until_committed(self, unit: list[Work], timeout: float, keep: KeepAlive) -> None:
        """The unit's transaction, waited out through database outages and
        redone with a savepoint per message after a handler failed; every
        work leaves with an outcome (``FAILED`` ones are settled after)."""
        skip: set[int] = set()
        safe = False
        while True:
            try:
                self.wait.until_answers(
                    unit,
                    functools.partial(
                        self.transaction.execute,
                        unit,
                        safe=safe,
                        skip=skip,
                        trust_outbox=not self.subscription.external,
                        timeout=timeout,
                    ),
                    timeout * len(unit),
                    keep,
                )
                return
            except Redo:
                # A handler failed: everything rolled back. Redo the rest of
                # the unit with a savepoint per message, without the failed one.
                skip.update(id(w) for w in unit if w.outcome == HandlingOutcome.FAILED)
                safe = True
            except Stopping:
                # The database is away and we are stopping: nothing of the
                # unit committed, and a failure can't be recorded either.
                for work in unit:
                    work.outcome = self.settlement.hand_back(work)
                return
            except Exception as exc:
                tb = "".join(traceback.format_exception(exc))
                for work in unit:
                    if work.outcome != HandlingOutcome.FAILED:
                        work.outcome, work.error, work.tb = HandlingOutcome.FAILED, exc, tb
                return

    def _start_redelivery(self, work: Work) -> bool:
        """Before a redelivery runs: read its history. Already claimed (a
        lost ack): skip. Counted runs at ``max_attempts``: dead-letter
        without running. Else commit a ``running`` row for this run, so a run
        that kills or hangs its worker still counts.

        Returns:
            Whether to run the handler.
        """
        sub = self.subscription
        event = work.event
        close_old_connections_for(self.using)
        for _ in range(3):
            handled, runs = run_history(sub.name, event.id, using=self.using)
            if handled:
                work.outcome = HandlingOutcome.SKIPPED
                return False
            counted = [r for r in runs if r.counts]
            if len(counted) >= sub.max_attempts:
                work.outcome = self.settlement.dead_letter_without_running(work, runs, counted)
                return False
            number = max((r.attempt for r in runs), default=0) + 1
            attempt_row = start_run(sub.name, event.id, number, using=self.using)
            if attempt_row is not None:
                work.attempt_row = attempt_row
                work.event = replace(event, attempt=len(counted) + 1)
                return True
        # Another worker is starting this very run (a redelivery raced ours): let it.
        self.settlement.settle(lambda: self.broker.nak(work.message, 1.0), event, "nak")
        work.outcome = HandlingOutcome.HANDED_BACK
        return False
