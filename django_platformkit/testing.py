"""Helpers for your own tests: see what a block of code published, and run
the subscribed handlers in this thread, with the worker's claim-in-transaction
and tenant semantics but no broker. Works inside Django's ``TestCase`` (its
wrapping transaction) and ``TransactionTestCase``.

    with capture_events() as events:
        client.post("/orders/", ...)
    assert [e.name for e in events] == ["shop.order_placed"]
    run_pending()        # the handlers ran, once each; an exception propagates

    result = run_worker_burst()   # the worker's path: relay -> durable -> handler,
                                  # retries, dead letters, attempts; an in-memory broker
    assert result.dead_lettered == 0

``run_worker_burst()`` drives the real relay and consumer over an
``InMemoryTransport`` (``broker.memory``), which imports no ``nats``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from django.db import connections, transaction

from django_platformkit import conf, signals
from django_platformkit._tables import OUTBOX_TABLE
from django_platformkit.broker.memory import InMemoryTransport
from django_platformkit.broker.memory_stream import ConsumerSpec, ManualClock
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.outcome import COUNTED
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.subscriptions import subscriptions as registered_subscriptions
from django_platformkit.identity import database_identity
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import HandlingOutcome, ReceivedEvent

if TYPE_CHECKING:
    from django_platformkit.broker.transport import Transport

__all__ = [
    "BurstResult",
    "CapturedEvent",
    "HandlerFailure",
    "InMemoryTransport",
    "ManualClock",
    "capture_events",
    "consumer_spec",
    "run_pending",
    "run_worker_burst",
]


@dataclass(frozen=True)
class CapturedEvent:
    """One ``publish()`` call: ``id``, ``name``, ``tenant``, ``payload`` (as
    encoded, i.e. what the handler will receive)."""

    id: uuid.UUID
    name: str
    tenant: str | None
    payload: dict[str, Any]


@contextlib.contextmanager
def capture_events() -> Iterator[list[CapturedEvent]]:
    """Collect every event ``publish()``/``publish_many()`` wrote inside the
    block, in order. Rolled-back events are collected too (the call
    happened); check the outbox for what committed."""
    captured: list[CapturedEvent] = []

    def listener(
        sender: Any, *, event_id: uuid.UUID, name: str, tenant: str | None, payload_text: str, **kwargs: Any
    ) -> None:
        captured.append(CapturedEvent(event_id, name, tenant, json.loads(payload_text)))

    # A uid of its own: nested or concurrent captures each get every event.
    uid = f"platformkit-capture-{id(captured)}"
    signals.event_published.connect(listener, weak=False, dispatch_uid=uid)
    try:
        yield captured
    finally:
        signals.event_published.disconnect(dispatch_uid=uid)


class _NoTransport:
    """run_pending() never talks to a broker."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("run_pending() handles events without a broker")


def run_pending(
    *, subscriptions: Iterable[Subscription] | None = None, using: str | None = None, max_rounds: int = 10
) -> int:
    """Handle every pending outbox event now, in this thread, with no broker.

    For each event (relay order) and each subscription of its name: claim
    and run the handler in one transaction, as the worker does; then mark
    the rows published. Events the handlers publish are handled too.

    Args:
        subscriptions: Which subscriptions run (default every registered one).
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).
        max_rounds: How many rounds of events published by handlers to follow.

    Returns:
        How many handler runs happened.

    Raises:
        BaseException: A handler's exception, after its transaction rolled
            back, so the test sees it.
    """
    alias = using or conf.settings.DATABASE_ALIAS
    subs = list(registered_subscriptions() if subscriptions is None else subscriptions)
    by_event: dict[str, list[Subscription]] = {}
    for sub in subs:
        by_event.setdefault(sub.event, []).append(sub)
    timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
    runs = 0
    no_broker = cast("Transport", _NoTransport())  # run_event() never reaches it
    with _session_settings_kept(alias):
        for _ in range(max_rounds):
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    f"SELECT id, name, tenant, payload::text, headers::text, created_at FROM {OUTBOX_TABLE} "
                    "WHERE published_at IS NULL ORDER BY created_at, id"
                )
                rows = cursor.fetchall()
            if not rows:
                break
            for event_id, name, tenant, payload, headers, created_at in rows:
                event = ReceivedEvent(
                    id=event_id,
                    name=name,
                    tenant=tenant,
                    payload=json.loads(payload),
                    occurred_at=created_at,
                    attempt=1,
                    headers=json.loads(headers or "{}"),
                )
                for sub in by_event.get(name, []):
                    if (
                        Consumer(sub, no_broker, using=alias).run_event(event, timeout=timeout)
                        == HandlingOutcome.HANDLED
                    ):
                        runs += 1
                with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
                    cursor.execute(f"UPDATE {OUTBOX_TABLE} SET published_at = now() WHERE id = %s", [event_id])
    return runs


#: Settings the relay's and the claim's statements set for their transaction
#: only (``set_config(..., true)``). Inside a ``TestCase`` that transaction is
#: the test's own, so without a reset they would stay in force for the rest of
#: the test: a 25 s idle-in-transaction timeout would end a session paused in
#: a debugger, and RLS policies would still see the last handler's tenant.
_TRANSACTION_SETTINGS = (
    "statement_timeout",
    "idle_in_transaction_session_timeout",
    "enable_sort",
    "enable_seqscan",
    "jit",
    "platformkit.tenant",
)


@contextlib.contextmanager
def _session_settings_kept(alias: str) -> Iterator[None]:
    connection = connections[alias]
    if not connection.in_atomic_block:
        yield  # each statement's transaction ended with it: nothing stays set
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT " + ", ".join("current_setting(%s, true)" for _ in _TRANSACTION_SETTINGS), _TRANSACTION_SETTINGS
        )
        before = cursor.fetchone()
    yield
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT " + ", ".join("set_config(%s, %s, true)" for _ in _TRANSACTION_SETTINGS),
            [part for pair in zip(_TRANSACTION_SETTINGS, before, strict=True) for part in (pair[0], pair[1] or "")],
        )


@dataclass(frozen=True)
class HandlerFailure:
    """One failed handler run during ``run_worker_burst()``: ``subscription``
    (its name), ``event_id``, ``attempt`` (1-based), ``error`` (the exception
    raised) and ``will_retry`` (False: it was the last attempt, a dead letter follows)."""

    subscription: str
    event_id: uuid.UUID
    attempt: int
    error: BaseException
    will_retry: bool


@dataclass
class BurstResult:
    """What ``run_worker_burst()`` did. Per delivery outcome: ``handled``,
    ``skipped`` (a claim existed), ``retried`` (the handler failed, a retry
    follows), ``dead_lettered``, ``malformed`` (recorded as a ``(malformed)``
    dead letter), ``unacked`` (the database failed outside a handler);
    ``relayed``: outbox rows the relay sent; ``failures``: every failed run,
    in order; ``transport``: the ``InMemoryTransport`` used (its clock and
    messages)."""

    transport: InMemoryTransport
    relayed: int = 0
    handled: int = 0
    skipped: int = 0
    retried: int = 0
    dead_lettered: int = 0
    malformed: int = 0
    unacked: int = 0
    failures: list[HandlerFailure] = field(default_factory=list)

    @property
    def runs(self) -> int:
        """Handler runs: each success and each failure."""
        return self.handled + len(self.failures)


def consumer_spec(subscription: Subscription) -> ConsumerSpec:
    """The in-memory durable of ``subscription``: its durable name and filter
    subject, ``ACK_WAIT_SECONDS``, and its ``max_ack_pending`` override or
    ``MAX_ACK_PENDING`` (None: unlimited)."""
    cap = subscription.max_ack_pending_override or conf.settings.MAX_ACK_PENDING
    return ConsumerSpec(
        durable_name=subscription.durable,
        filter_subject=subscription.filter_subject,
        ack_wait=float(conf.settings.ACK_WAIT_SECONDS),
        max_ack_pending=int(cap) if cap else None,
    )


def run_worker_burst(
    transport: InMemoryTransport | None = None,
    *,
    subscriptions: Iterable[Subscription] | None = None,
    using: str | None = None,
    max_rounds: int = 1000,
) -> BurstResult:
    """Do what ``runworker --burst`` does, in this thread, over an in-memory broker.

    Relay every pending outbox row, deliver each subscription's messages to
    the real consumer (claim and handler in one transaction, tenant context,
    ``attempt``, retries after the subscription's backoff up to its
    ``max_attempts``, then a dead letter and a terminal claim; malformed
    messages recorded), and repeat until nothing is pending, in flight or
    awaiting a retry. Handler exceptions don't propagate: they are retries
    and dead letters, listed in the result's ``failures``. Rows deferred by
    the database clock (a task's ``run_after``) stay pending until due.

    Args:
        transport: An ``InMemoryTransport`` to reuse (its stream and
            durables), default a new one. Its clock jumps over backoffs (no
            test waits for one); with ``auto_advance=False`` the burst stops
            at the first retry that isn't due yet, and a later call after
            ``clock.advance()`` goes on.
        subscriptions: Which subscriptions run (default every registered one).
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).
        max_rounds: Relay-and-deliver rounds before giving up.

    Returns:
        What happened: handled and dead-lettered counts, and every failed run.

    Raises:
        RuntimeError: Still not drained after ``max_rounds`` rounds (a handler
            that publishes on every run).
        DatabaseError: What the database raises outside a handler.
    """
    transport = InMemoryTransport() if transport is None else transport
    alias = using or conf.settings.DATABASE_ALIAS
    subs = list(registered_subscriptions() if subscriptions is None else subscriptions)
    result = BurstResult(transport)
    outcomes: collections.Counter[HandlingOutcome] = collections.Counter()

    def failed(
        sender: Any, *, subscription: str, event: ReceivedEvent, error: BaseException, will_retry: bool, **kwargs: Any
    ) -> None:
        result.failures.append(HandlerFailure(subscription, event.id, event.attempt, error, will_retry))

    uid = f"platformkit-burst-{id(result)}"
    signals.event_failed.connect(failed, weak=False, dispatch_uid=uid)
    try:
        with _session_settings_kept(alias):
            transport.ensure_stream(owner=database_identity(alias))
            consumers = []
            for sub in subs:
                transport.ensure_consumer(consumer_spec(sub))
                consumers.append(Consumer(sub, transport, using=alias))
            relay = Relay(transport, using=alias, lanes=1)  # one lane: no threads, so it sees a TestCase's rows
            batch = int(conf.settings.CONSUMER_BATCH_SIZE)
            for _ in range(max_rounds):
                # Reset after each drain, not only after the burst: the relay's
                # planner settings would otherwise reach the handlers below.
                with _session_settings_kept(alias):
                    stats = relay.drain()
                result.relayed += stats.stored
                progressed = stats.selected > 0
                for consumer in consumers:
                    deliveries = transport.fetch(consumer.subscription.durable, batch, timeout=0)
                    if deliveries:
                        progressed = True
                        outcomes.update(consumer.handle(deliveries))
                if progressed:
                    continue
                due = transport.next_due(in_flight=True) if transport.auto_advance else None
                if due is None:
                    break
                transport.clock.advance_to(due)  # the next retry's backoff (or a lost ack's wait) has passed
            else:
                raise RuntimeError(
                    f"run_worker_burst(): still not drained after {max_rounds} rounds: does a handler publish "
                    "an event on every run? Pass max_rounds=... if the work is just long."
                )
    finally:
        signals.event_failed.disconnect(dispatch_uid=uid)
    for outcome in (*COUNTED, HandlingOutcome.UNACKED):
        setattr(result, outcome.value, outcomes[outcome])
    return result
