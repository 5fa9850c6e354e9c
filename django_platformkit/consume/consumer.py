"""Subscriptions and the consumer: handling is exactly once per
(subscription, event), and ``attempt`` counts handler runs.

A unit of deliveries (consecutive first deliveries of one subscription, or
one redelivery alone) is one ``transaction.atomic()``: one statement claims
every event in ``platformkit_handled`` (``ON CONFLICT DO NOTHING``) and, for
a trusted subscription, reads each event's row from the outbox - the
handler runs with the outbox's payload, and a message the outbox doesn't
know never runs. The commit makes the claims and the handlers' writes
durable together; only then are the messages acked. A handler's failure
rolls the unit back and the rest is redone with a savepoint per message.
Failures and redelivered runs leave ``platformkit_attempts`` rows, so a run
that killed its worker counts and a hand-back or an outage doesn't; after
the last attempt one transaction writes the dead letter and a terminal
claim, and the message is terminated.

The stages of a unit live beside this module, and ``Consumer`` carries their
methods: ``claim`` (the claim statement and the unit's transaction),
``handler`` (calling the handler with its timeout and tenant context) and
``settling`` (retry, dead letter, malformed, hand-back); ``units`` holds the
unit's values. This module decides: it cuts deliveries into units, runs each
unit until the database answers, and acks after the commit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import traceback as traceback_module
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, connections

from django_platformkit import conf
from django_platformkit._retry import Backoff
from django_platformkit.consume.attempts import record_failed_run, run_history, start_run
from django_platformkit.consume.claim import NOT_IN_OUTBOX, _Claiming
from django_platformkit.consume.handler import _Running
from django_platformkit.consume.settle import _Settling
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.tenancy import set_config_tenant, tenant_context_factory
from django_platformkit.consume.units import _Redo, _Stopping, _Work
from django_platformkit.outage import close_broken_connections, close_old_connections_for, not_the_handlers_fault
from django_platformkit.wire import Delivery, MalformedMessage, ReceivedEvent, parse_delivery

if TYPE_CHECKING:
    # The worker hands the consumer its transport: handling events imports no nats.
    from django_platformkit.broker.transport import Transport


logger = logging.getLogger(__name__)
T = TypeVar("T")


class Consumer(_Claiming, _Running, _Settling):
    """Runs one subscription's handler over deliveries from its durable.

    ``handle()`` may be called from several threads at once (each with its
    own database connection): per-run state is kept per thread."""

    def __init__(
        self,
        subscription: Subscription,
        transport: Transport,
        *,
        using: str | None = None,
        stop: threading.Event | None = None,
        instance: int = 0,
    ) -> None:
        self.subscription = subscription
        self.instance = instance  # which of the subscription's concurrent consumers: each pulls on its own
        self.transport = transport
        self.using = using or conf.settings.DATABASE_ALIAS
        self.stop = stop or threading.Event()
        self.handlers_started: dict[int, float] = {}  # thread ident -> monotonic start; read by the watchdog
        self.runs_now: dict[int, _Work] = {}  # thread ident -> the run its handler is in (record_stuck_runs)
        self.counts = {"handled": 0, "skipped": 0, "retried": 0, "dead_lettered": 0, "malformed": 0}
        self._local = threading.local()  # .keep: (KeepAlive | None, {event id: Delivery}) of this thread's unit
        self._durations: dict[uuid.UUID, float] = {}  # event id -> the handler's run, for the signals
        self._tenant_factory = tenant_context_factory()
        self._default_tenant_context = self._tenant_factory is set_config_tenant

    @property
    def handler_started(self) -> float | None:
        """Monotonic start of the oldest handler running now, or None."""
        return min(self.handlers_started.values(), default=None)

    @handler_started.setter
    def handler_started(self, value: float | None) -> None:
        if value is None:
            self.handlers_started.pop(threading.get_ident(), None)
        else:
            self.handlers_started[threading.get_ident()] = value

    def record_stuck_runs(self, started_before: float, error: str) -> int:
        """Record each run whose handler started before ``started_before``
        (monotonic seconds) and is still in it as ``failed`` with ``error``
        and, as its traceback, the stack its thread is in now: called by the
        watchdog just before it exits the process for a stuck handler, so the
        event's retries and dead letter say why the run ended and where it
        hung, not "never reported". Returns how many it recorded; a database
        error is logged, never raised (the process exits either way)."""
        frames = sys._current_frames()
        recorded = 0
        for ident, started in list(self.handlers_started.items()):
            work = self.runs_now.get(ident)
            if started >= started_before or work is None:
                continue
            frame = frames.get(ident)
            stack = "".join(traceback_module.format_stack(frame)) if frame is not None else ""
            if not work.lock.acquire(timeout=2.0):  # the slow-run recorder writing its row: wait for it
                continue
            try:
                record_failed_run(
                    subscription=self.subscription.name,
                    event_id=work.event.id,
                    attempt_row=work.attempt_row,
                    started_at=work.started_at,
                    error=error,
                    traceback=f"The stuck handler's thread, when the worker exited:\n{stack}",
                    using=self.using,
                )
                recorded += 1
            except Exception as exc:
                logger.error(
                    "stuck run not recorded subscription=%s event_id=%s error=%s",
                    self.subscription.name,
                    work.event.id,
                    exc,
                )
            finally:
                work.lock.release()
        return recorded

    # -- the loop --
    def ensure(self) -> None:
        """Create or update this subscription's durable (``Transport.ensure_consumer``); raises ``ConsumerDrift`` for a change the broker can't make."""
        self.transport.ensure_consumer(self.subscription.consumer_config())

    def poll(self, *, batch: int | None = None, timeout: float = 1.0) -> int:
        """Fetch once and ``handle()`` what came; return how many were fetched."""
        deliveries = self.transport.fetch(
            self.subscription.durable, batch or conf.settings.CONSUMER_BATCH_SIZE, timeout=timeout, puller=self.instance
        )
        if deliveries:
            self.handle(deliveries)
        return len(deliveries)

    def handle(self, deliveries: Sequence[Delivery], keep: Any = None) -> list[str]:
        """Handle deliveries of this subscription; return one outcome per
        delivery, in order: ``handled``, ``skipped`` (a claim existed),
        ``retried`` (naked with its backoff), ``dead_lettered``,
        ``malformed`` (termed, recorded as a ``(malformed)`` dead letter),
        ``unacked`` (the database is gone: left for redelivery) or
        ``handed_back`` (the worker is stopping: naked, not counted).

        Every delivery is settled (ack / nak / term) before this returns,
        except ``unacked`` ones. First deliveries (broker count 1) are
        handled in units: one claim statement, one transaction (``batch=True``)
        or one each (``batch=False``); a redelivery is always a unit of its
        own, its run recorded before the handler starts (DESIGN.md
        "Attempts"). ``keep``: a ``transport.KeepAlive`` covering the
        deliveries, or None to make one here.
        """
        own_keep = keep is None
        if own_keep:
            keep = self.transport.keep_alive(
                deliveries, every_seconds=max(0.2, float(conf.settings.ACK_WAIT_SECONDS) / 3)
            )
        results: dict[int, str] = {}
        try:
            units: list[list[_Work]] = []
            chunk: list[_Work] = []
            for delivery in deliveries:
                event, reason = self._decode(delivery)
                if event is None:
                    results[id(delivery)] = self._malformed(delivery, reason)
                    self._settled(keep, delivery)
                    continue
                work = _Work(delivery, event)
                if delivery.attempt > 1:
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
            for unit in units:
                if self.stop.is_set():
                    for work in unit:
                        results[id(work.delivery)] = self._hand_back(work)
                        self._settled(keep, work.delivery)
                    continue
                for work in self._handle_unit(unit, keep):
                    results[id(work.delivery)] = work.outcome
                    self._settled(keep, work.delivery)
        finally:
            if own_keep:
                keep.stop()
        return [results.get(id(d), "unacked") for d in deliveries]

    def run_event(self, event: ReceivedEvent, *, timeout: float | None = None) -> str:
        """No broker: claim ``event`` and run the handler in one transaction,
        in this thread, as the worker does (``testing.run_pending``). Returns
        ``handled`` or ``skipped`` (a claim existed); the handler's exception
        propagates after its transaction rolled back. No attempt is recorded."""
        budget = float(conf.settings.HANDLER_TIMEOUT_SECONDS) if timeout is None else timeout
        work = _Work(delivery=None, event=event)  # type: ignore[arg-type]
        try:
            self._execute([work], safe=False, skip=set(), trust_outbox=False, timeout=budget)
        except _Redo:
            raise work.error from None  # type: ignore[misc]
        return work.outcome

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
    def _handle_unit(self, unit: list[_Work], keep: Any) -> list[_Work]:
        sub = self.subscription
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        self._local.keep = (keep, {w.event.id: w.delivery for w in unit})
        try:
            if unit[0].delivery.attempt > 1:
                try:
                    ready = self._until_db_answers(unit, lambda: self._start_redelivery(unit[0]), timeout, keep)
                except _Stopping:
                    return [self._done(unit[0], self._hand_back(unit[0]))]
                except DatabaseError as exc:
                    logger.error(
                        "redelivery not started, left for the broker subscription=%s event_id=%s error=%s",
                        sub.name,
                        unit[0].event.id,
                        exc,
                    )
                    with contextlib.suppress(Exception):
                        connections[self.using].close()
                    return [self._done(unit[0], "unacked")]
                if not ready:
                    if unit[0].outcome == "skipped":  # handled meanwhile: its ack was lost
                        self._settle(lambda: self.transport.ack(unit[0].delivery), unit[0].event, "ack")
                        self.counts["skipped"] += 1
                        self._send_handled(unit[0].event, "skipped")
                    return unit
            skip: set[int] = set()
            safe = False
            while True:
                try:
                    self._until_db_answers(
                        unit,
                        functools.partial(
                            self._execute,
                            unit,
                            safe=safe,
                            skip=skip,
                            trust_outbox=not sub.external,
                            timeout=timeout,
                        ),
                        timeout * len(unit),
                        keep,
                    )
                    break
                except _Redo:
                    # A handler failed: everything rolled back. Redo the rest of
                    # the unit with a savepoint per message, without the failed one.
                    skip.update(id(w) for w in unit if w.outcome == "failed")
                    safe = True
                except _Stopping:
                    # The database is away and we are stopping: nothing of the
                    # unit committed, and a failure can't be recorded either.
                    for work in unit:
                        work.outcome = self._hand_back(work)
                    return unit
                except Exception as exc:
                    tb = "".join(traceback_module.format_exception(exc))
                    for work in unit:
                        if work.outcome != "failed":
                            work.outcome, work.error, work.tb = "failed", exc, tb
                    break
            acks = []
            for work in unit:
                if work.outcome in ("handled", "skipped"):
                    acks.append(work.delivery)
                    self.counts[work.outcome] += 1
                    self._send_handled(work.event, work.outcome)
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
                self._settle(lambda: self.transport.ack_many(acks), unit[0].event, "ack")
            for work in unit:
                if work.outcome == "skipped" and work.attempt_row is not None:
                    self._mark_interrupted(work)  # handled elsewhere meanwhile: this run never started
                if work.outcome == "not_in_outbox":
                    self._mark_interrupted(work)
                    work.outcome = self._malformed(work.delivery, NOT_IN_OUTBOX)
                elif work.outcome == "failed":
                    work.outcome = self._failed(work)
            return unit
        finally:
            self._local.keep = None

    def _done(self, work: _Work, outcome: str) -> _Work:
        work.outcome = outcome
        return work

    def _until_db_answers(self, unit: list[_Work], run: Callable[[], T], timeout: float, keep: Any) -> T:
        """Run ``run``; while the database is away or refuses for reasons
        that are not the handler's (``not_the_handlers_fault``), wait with
        backoff, keep the unit's acks alive and try again - never an attempt.
        Raises ``_Stopping`` when the worker stops meanwhile."""
        delay = Backoff(0.2, 5.0)
        since: float | None = None  # the outage's first refusal (monotonic): one WARNING, then DEBUG
        retries = 0
        while True:
            started = time.monotonic()
            try:
                result = run()
                if since is not None:
                    logger.warning(
                        "database back, handled after waiting (not an attempt) subscription=%s event_id=%s "
                        "waited=%.1fs retries=%s",
                        self.subscription.name,
                        unit[0].event.id,
                        time.monotonic() - since,
                        retries,
                    )
                return result
            except (_Redo, _Stopping):
                raise
            except BaseException as exc:
                # A session killed because the handler overran its timeout
                # (idle_in_transaction_session_timeout) is the handler's fault.
                if not (not_the_handlers_fault(exc, self.using) and time.monotonic() - started < timeout):
                    raise
                if self.stop.is_set():
                    raise _Stopping() from exc
                wait = delay.next()
                # README: an outage is two log lines, not one per retry.
                logger.log(
                    logging.WARNING if since is None else logging.DEBUG,
                    "database unavailable, retrying (not an attempt) subscription=%s event_id=%s retry_in=%.1fs error=%s",
                    self.subscription.name,
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
                        # The ack stays alive through the outage (+ one handler run).
                        with contextlib.suppress(Exception):
                            keep.started(work.delivery, wait + 5 + timeout)
                self.stop.wait(wait)
            finally:
                self.handler_started = None

    def _start_redelivery(self, work: _Work) -> bool:
        """Before a redelivery runs: read its history. Already claimed (a
        lost ack): ack, skip. Counted runs at ``max_attempts``: dead-letter
        without running. Else commit a ``running`` row for this run, so a run
        that kills or hangs its worker still counts. Returns whether to run."""
        sub = self.subscription
        event = work.event
        close_old_connections_for(self.using)
        for _ in range(3):
            handled, rows = run_history(sub.name, event.id, using=self.using)
            if handled:
                work.outcome = "skipped"
                return False
            counted = [r for r in rows if r[1] in ("failed", "running")]
            if len(counted) >= sub.max_attempts:
                work.outcome = self._dead_letter_without_running(work, rows, counted)
                return False
            number = max((r[0] for r in rows), default=0) + 1
            attempt_row = start_run(sub.name, event.id, number, using=self.using)
            if attempt_row is not None:
                work.attempt_row = attempt_row
                work.event = replace(event, attempt=len(counted) + 1)
                return True
        # Another worker is starting this very run (a redelivery raced ours): let it.
        self._settle(lambda: self.transport.nak(work.delivery, 1.0), event, "nak")
        work.outcome = "handed_back"
        return False
