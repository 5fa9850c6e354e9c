"""Subscriptions and the consumer: handling is exactly once per
(subscription, event).

For each delivery, one ``transaction.atomic()`` inserts the claim into
``platformkit_handled`` (``ON CONFLICT DO NOTHING``) and, only if the claim is
new, runs the handler inside the tenant context; the commit makes the claim
and the handler's writes durable together, and only then is the message
acked. A lost ack means a redelivery that finds the claim and skips. A
failure rolls the claim back with the handler's writes; the message returns
after its backoff; after the last attempt one transaction writes the dead
letter and a terminal claim, and the message is terminated.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import threading
import time
import traceback as traceback_module
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import psycopg
from django.apps import apps
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.utils.module_loading import import_string

from . import conf, signals, tracing
from .events import check_event_name, check_tenant, current_event
from .exceptions import ConfigurationError, InvalidEventName
from ._tables import DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from .transport import Delivery, Transport, consumer_config, durable_name, filter_subject_for, parse_subject

logger = logging.getLogger(__name__)
T = TypeVar("T")

SUBSCRIPTION_NAME_PART = r"[A-Za-z_][A-Za-z0-9_]*"
_NAMESPACE_MALFORMED = uuid.UUID("8a1d6c61-3f5e-4c2c-9a59-1f0a3d6b7e21")


@dataclass(frozen=True)
class ReceivedEvent:
    """What a handler receives.

    ``id``: the event id (outbox id = CloudEvents ``id`` = claim key);
    ``name``: the event name; ``tenant``: the tenant token or None;
    ``payload``: the JSON object published (as decoded from JSON);
    ``occurred_at``: aware datetime of the outbox insert (database clock);
    ``attempt``: 1-based, the broker's delivery count; ``headers``: message
    headers (``traceparent``/``tracestate`` when the publisher had a trace).
    """

    id: uuid.UUID
    name: str
    tenant: str | None
    payload: dict[str, Any]
    occurred_at: datetime
    attempt: int
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Subscription:
    """A handler subscribed to one event. ``name`` is the claim's namespace
    and, with ``.`` -> ``-``, the durable consumer's name."""

    name: str
    event: str
    handler: Callable[[ReceivedEvent], None]
    max_attempts_override: int | None = None
    backoff_seconds_override: tuple[float, ...] | None = None
    declared_in: str = ""
    batch: bool = False
    concurrency: int = 1

    def __hash__(self) -> int:
        # The signals' sender: Django's dispatcher hashes it once a receiver
        # is connected (an eq dataclass alone is unhashable and crashes the send).
        return hash(self.name)

    @property
    def durable(self) -> str:
        """The durable consumer name: the subscription name with ``.`` -> ``-``."""
        return durable_name(self.name)

    @property
    def filter_subject(self) -> str:
        """``<SUBJECT_PREFIX>.*.<module>.<event>``: this event, every tenant."""
        return filter_subject_for(self.event)

    @property
    def max_attempts(self) -> int:
        """Deliveries before a failing event is dead-lettered: the override, else ``MAX_ATTEMPTS``."""
        return self.max_attempts_override or conf.settings.MAX_ATTEMPTS

    @property
    def backoff_seconds(self) -> tuple[float, ...]:
        """Seconds before each retry (the last repeats): the override, else ``BACKOFF_SECONDS``."""
        return self.backoff_seconds_override or conf.settings.BACKOFF_SECONDS

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1``: the ``attempt``-th
        backoff entry, the last one repeating."""
        delays = self.backoff_seconds
        return float(delays[min(attempt, len(delays)) - 1])

    def consumer_config(self):
        """The ``nats.js.api.ConsumerConfig`` this build wants for the durable (``transport.consumer_config``)."""
        return consumer_config(self.name, self.event)


_subscriptions: dict[str, Subscription] = {}


def _default_name(func: Callable[..., Any]) -> str:
    module = getattr(func, "__module__", "") or ""
    label = None
    if apps.apps_ready:
        config = apps.get_containing_app_config(module)
        if config is not None:
            label = config.label
    if label is None:
        label = module.split(".")[0] or "app"
    return f"{label}.{func.__name__}"


def check_subscription_name(name: Any, where: str = "") -> str:
    """Return ``name`` if it is dot-separated identifiers without ``-`` (at most 200 characters), else raise ``ConfigurationError`` mentioning ``where``."""
    import re

    if not isinstance(name, str) or not re.fullmatch(rf"{SUBSCRIPTION_NAME_PART}(\.{SUBSCRIPTION_NAME_PART})*", name) or len(name) > 200:
        raise ConfigurationError(
            f"subscription name {name!r}{where} is invalid: use dot-separated identifiers "
            "([A-Za-z_][A-Za-z0-9_]*, no '-'), e.g. 'shop.send_confirmation'."
        )
    return name


def subscribe(event: Any, *, name: str | None = None, max_attempts: int | None = None, backoff_seconds: Sequence[float] | None = None, batch: bool = False, concurrency: int = 1) -> Callable[[Callable[[ReceivedEvent], None]], Callable[[ReceivedEvent], None]]:
    """Decorator: run ``handler(event: ReceivedEvent) -> None`` once per
    published ``event`` (a name or ``EventType``).

    ``name`` defaults to ``"<app_label>.<function name>"``. ``max_attempts``
    and ``backoff_seconds`` (one delay in seconds per retry; the last repeats)
    override ``MAX_ATTEMPTS`` / ``BACKOFF_SECONDS``. ``batch=True`` handles a
    fetched batch in one transaction with a savepoint per message (faster;
    the handler must not need to commit alone). ``concurrency``: how many
    of a worker's consumer threads (``CONSUMER_THREADS`` bounds them) fetch
    and handle this subscription at once, each with its own database
    connection; above 1 the subscription gives up stream order (events are
    handled side by side; each still exactly once). Subscribing to an undeclared
    event is a system-check error, not an import error. Raises
    ``ConfigurationError`` for a malformed name or option, or a name already
    used by another handler.
    """
    event_name = getattr(event, "name", event)

    def decorator(func: Callable[[ReceivedEvent], None]) -> Callable[[ReceivedEvent], None]:
        where = f" ({func.__module__}.{func.__qualname__})"
        if inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"@subscribe{where}: handlers run synchronously inside a database transaction; an "
                "'async def' handler would be marked handled without running. Make it a plain 'def' "
                "(call async code with asgiref's async_to_sync if you must)."
            )
        try:
            check_event_name(event_name)
        except InvalidEventName as exc:
            raise ConfigurationError(f"@subscribe{where}: {exc}") from None
        sub_name = check_subscription_name(name if name is not None else _default_name(func), where)
        if max_attempts is not None and (isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1):
            raise ConfigurationError(f"@subscribe{where}: max_attempts must be an integer >= 1, got {max_attempts!r}.")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(f"@subscribe{where}: concurrency must be an integer >= 1, got {concurrency!r}.")
        delays = None
        if backoff_seconds is not None:
            delays = tuple(backoff_seconds)
            if not delays or any(isinstance(d, bool) or not isinstance(d, (int, float)) or d < 0 for d in delays):
                raise ConfigurationError(f"@subscribe{where}: backoff_seconds must be a non-empty list of seconds >= 0.")
        subscription = Subscription(
            name=sub_name, event=event_name, handler=func, max_attempts_override=max_attempts,
            backoff_seconds_override=delays, declared_in=f"{func.__module__}.{func.__qualname__}", batch=batch,
            concurrency=concurrency,
        )
        existing = _subscriptions.get(sub_name)
        # Same function and event again is a re-import; one function stacked
        # under two @subscribe with the default name would silently lose one.
        if existing is not None and (existing.declared_in, existing.event) != (subscription.declared_in, subscription.event):
            raise ConfigurationError(
                f"two subscriptions are named {sub_name!r}: {existing.declared_in} ({existing.event}) and "
                f"{subscription.declared_in} ({subscription.event}). Pass name='...' to one of them."
            )
        _subscriptions[sub_name] = subscription
        return func

    return decorator


def subscriptions() -> list[Subscription]:
    """Every registered subscription, sorted by name."""
    return [_subscriptions[k] for k in sorted(_subscriptions)]


# --- tenant context ----------------------------------------------------------

@contextlib.contextmanager
def set_config_tenant(tenant: str | None) -> Iterator[None]:
    """The default ``TENANT_CONTEXT``: inside the handler's transaction,
    ``current_setting('platformkit.tenant', true)`` returns the event's tenant
    ('' for none), so row-level-security policies can read it."""
    alias = conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT set_config('platformkit.tenant', %s, true)", [tenant or ""])
    yield


def tenant_context_factory() -> Callable[[str | None], contextlib.AbstractContextManager[Any]]:
    """Import ``TENANT_CONTEXT``: a ``(tenant or None) -> context manager`` callable. Raises ``ConfigurationError`` if the path does not import."""
    path = conf.settings.TENANT_CONTEXT
    try:
        return import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"PLATFORMKIT['TENANT_CONTEXT'] = {path!r} can't be imported: {exc}") from exc


# --- parsing a delivery ------------------------------------------------------

class MalformedMessage(Exception):
    """A message on our subjects that isn't a well-formed event of ours."""


def parse_delivery(delivery: Delivery) -> ReceivedEvent:
    """Decode a CloudEvents structured-mode body and cross-check it with the
    subject. Raises ``MalformedMessage`` saying what is wrong."""
    parsed = parse_subject(delivery.subject)
    if parsed is None:
        raise MalformedMessage(f"subject {delivery.subject!r} is not <prefix>.<tenant>.<module>.<event>")
    subject_tenant, subject_name = parsed
    try:
        body = json.loads(delivery.data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedMessage("body is not a JSON object (not a CloudEvents envelope)")
    if body.get("specversion") != "1.0":
        raise MalformedMessage(f"specversion is {body.get('specversion')!r}, not '1.0'")
    try:
        event_id = uuid.UUID(str(body.get("id")))
    except ValueError:
        raise MalformedMessage(f"id {body.get('id')!r} is not a UUID") from None
    name = body.get("type")
    try:
        check_event_name(name)
        tenant = check_tenant(body.get("tenantid"))
    except InvalidEventName as exc:
        raise MalformedMessage(str(exc)) from None
    if name != subject_name:
        raise MalformedMessage(f"type {name!r} differs from the subject's event {subject_name!r}")
    if tenant != subject_tenant:
        raise MalformedMessage(f"tenantid {tenant!r} differs from the subject's tenant {subject_tenant!r}: refusing to run it in either")
    data = body.get("data")
    if not isinstance(data, dict):
        raise MalformedMessage("data is not a JSON object")
    try:
        occurred_at = datetime.fromisoformat(str(body.get("time")).replace("Z", "+00:00"))
    except ValueError:
        raise MalformedMessage(f"time {body.get('time')!r} is not RFC 3339") from None
    if occurred_at.tzinfo is None:
        raise MalformedMessage("time has no UTC offset")
    headers = {k: v for k, v in delivery.headers.items() if not k.startswith("Nats-")}
    for key in ("traceparent", "tracestate"):
        if isinstance(body.get(key), str):
            headers.setdefault(key, body[key])
    return ReceivedEvent(id=event_id, name=name, tenant=tenant, payload=data, occurred_at=occurred_at, attempt=delivery.attempt, headers=headers)


# --- handling ----------------------------------------------------------------

_CLAIM_SQL = (
    f"WITH c AS (INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) VALUES (%s, %s, now()) "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING 1) "
    "SELECT (SELECT count(*) FROM c), set_config('statement_timeout', %s, true), "
    "set_config('idle_in_transaction_session_timeout', %s, true)"
)
_CLAIM_TENANT_SQL = _CLAIM_SQL + ", set_config('platformkit.tenant', %s, true)"
_BATCH_CLAIM_SQL = (
    f"WITH c AS (INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) "
    "SELECT %s, e.id, now() FROM unnest(%s::uuid[]) AS e(id) ORDER BY e.id "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING event_id) "
    "SELECT c.event_id, s.t, s.i FROM (SELECT set_config('statement_timeout', %s, true) AS t, "
    "set_config('idle_in_transaction_session_timeout', %s, true) AS i) s LEFT JOIN c ON true"
)
_TERMINAL_CLAIM_SQL = (
    f"WITH row AS (SELECT 1 FROM {OUTBOX_TABLE} WHERE id = %s FOR KEY SHARE) "
    f"INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) "
    "SELECT %s, %s, now() FROM (SELECT count(*) FROM row) locked "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING 1"
)
_DEAD_LETTER_SQL = (
    f"INSERT INTO {DEAD_LETTER_TABLE} (event_id, subscription, name, tenant, attempts, error, traceback, failed_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, now()) ON CONFLICT (subscription, event_id) DO NOTHING"
)


#: Batch mode commits at most this many messages per transaction: past 64
#: subtransactions with writes, PostgreSQL's per-backend subxid cache
#: overflows and every other session's snapshots get slower.
MAX_SAVEPOINTS_PER_TRANSACTION = 50


class HandlerTimeout(Exception):
    """The handler ran past HANDLER_TIMEOUT_SECONDS: counted as a failed attempt."""


def _connection_lost(exc: BaseException, alias: str) -> bool:
    """True when ``exc`` came from a dead database session rather than from
    the handler's logic: then nothing is counted against the event."""
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    # Leaving the failed atomic block makes Django reconnect, so after
    # pg_terminate_backend the connection looks healthy again: judge by the
    # error too. No SQLSTATE = libpq lost the socket; 08xxx = connection
    # exception; 57P01-57P03 = the server shut the session down. (57014, a
    # statement timeout, stays the handler's failure.)
    cause = exc.__cause__
    if isinstance(cause, psycopg.OperationalError) and (cause.sqlstate is None or cause.sqlstate[:2] == "08" or cause.sqlstate in ("57P01", "57P02", "57P03")):
        return True
    connection = connections[alias]
    return connection.connection is None or not connection.is_usable()


class Consumer:
    """Runs one subscription's handler over deliveries from its durable."""

    def __init__(self, subscription: Subscription, transport: Transport, *, using: str | None = None, stop: threading.Event | None = None, instance: int = 0) -> None:
        self.subscription = subscription
        self.instance = instance  # which of the subscription's concurrent consumers: each pulls on its own
        self.transport = transport
        self.using = using or conf.settings.DATABASE_ALIAS
        self.stop = stop or threading.Event()
        self.handler_started: float | None = None  # monotonic; read by the worker's watchdog
        self.counts = {"handled": 0, "skipped": 0, "retried": 0, "dead_lettered": 0, "malformed": 0}
        self._keep: tuple[Any, dict[uuid.UUID, Delivery]] | None = None  # this batch's keep-alive
        self._durations: dict[uuid.UUID, float] = {}  # event id -> the handler's run, for the signals
        self._tenant_factory = tenant_context_factory()
        self._default_tenant_context = self._tenant_factory is set_config_tenant

    # -- the loop --
    def ensure(self) -> None:
        """Create or update this subscription's durable (``Transport.ensure_consumer``); raises ``ConsumerDrift`` for a change the broker can't make."""
        self.transport.ensure_consumer(self.subscription.consumer_config())

    def poll(self, *, batch: int | None = None, timeout: float = 1.0) -> int:
        """Fetch once and handle what came; return how many were fetched."""
        deliveries = self.transport.fetch(self.subscription.durable, batch or conf.settings.CONSUMER_BATCH_SIZE, timeout=timeout, puller=self.instance)
        if not deliveries:
            return 0
        keep = self.transport.keep_alive(deliveries, every_seconds=max(0.2, float(conf.settings.ACK_WAIT_SECONDS) / 3))
        try:
            if self.subscription.batch:
                self.process_batch(deliveries, keep)
                return len(deliveries)
            for index, delivery in enumerate(deliveries):
                if self.stop.is_set():
                    # Stopping: hand the rest back at once rather than after the ack wait.
                    for rest in deliveries[index:]:
                        with contextlib.suppress(Exception):
                            self.transport.nak(rest)
                    break
                self.process(delivery, keep)
                keep.settled(delivery)
        finally:
            keep.stop()
        return len(deliveries)

    # -- one delivery --
    def process(self, delivery: Delivery, keep: Any = None) -> str:
        """Handle one delivery in a transaction of its own; return what
        happened: ``handled``, ``skipped`` (already claimed), ``retried``,
        ``dead_lettered``, ``malformed``, or ``unacked`` (the database is
        gone; the broker redelivers after the ack wait)."""
        event, settled = self._triage(delivery)
        if event is None:
            return settled
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        self._keep = (keep, {event.id: delivery})
        try:
            outcome, error = self._run_until_db_answers(lambda: self._run(event, timeout), event, timeout)
        finally:
            self._keep = None
        return self._conclude(delivery, event, outcome, error)

    def _call_handler(self, event: ReceivedEvent, timeout: float) -> None:
        """Run the handler inside its transaction (claim already taken): in
        the event's tenant context, with ``publish()`` defaulting to the
        event's tenant. Past ``timeout`` it raises ``HandlerTimeout``, so its
        work rolls back and the attempt counts as failed."""
        self._handler_starts(event, timeout)
        wrapper = connections[self.using]
        on_commit_mark = len(wrapper.run_on_commit)
        token = current_event.set(event)
        try:
            context = contextlib.nullcontext() if self._default_tenant_context else self._tenant_factory(event.tenant)
            try:
                with context, tracing.consumer_span(
                    subscription=self.subscription.name, event_id=event.id, name=event.name, headers=event.headers, attempt=event.attempt,
                ):
                    self.subscription.handler(event)
            finally:
                self._durations[event.id] = time.monotonic() - self.handler_started
            if wrapper.needs_rollback or (
                wrapper.connection is not None and wrapper.connection.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
            ):
                # An ORM error marks the transaction for rollback; a raw cursor's
                # error leaves it aborted in PostgreSQL. Either way the commit
                # would roll back without a word, claim included, and the event
                # would be acked as handled: fail the attempt instead.
                raise TransactionManagementError(
                    "the handler caught a database error and returned, so its transaction can only roll back: "
                    "let the error propagate, or wrap the statement that may fail in transaction.atomic()"
                )
            if time.monotonic() - self.handler_started > timeout:
                raise HandlerTimeout(f"handler ran past HANDLER_TIMEOUT_SECONDS={timeout:g}; its work was rolled back")
        except BaseException:
            # A failed attempt's callbacks must never run. Django drops them
            # itself only for savepoints it made; a batch's are ours.
            del wrapper.run_on_commit[on_commit_mark:]
            raise
        finally:
            current_event.reset(token)
        # The handler's transaction.on_commit() callbacks run after the commit,
        # when the event is handled for good: one that raises is logged
        # (Django's robust=True) instead of failing an attempt that
        # succeeded - or, in a batch, skipping every later message's callbacks.
        wrapper.run_on_commit[on_commit_mark:] = [(sids, func, True) for sids, func, *_ in wrapper.run_on_commit[on_commit_mark:]]

    def _handler_starts(self, event: ReceivedEvent, timeout: float) -> None:
        """The claim is in; the handler starts now. From here its message's
        ack is extended for ``timeout`` seconds only. Not before: while the
        worker waits for a database that went away, the ack keeps being
        extended, so an outage can't push healthy events past MAX_ATTEMPTS."""
        self.handler_started = time.monotonic()
        if self._keep is not None and self._keep[0] is not None:
            delivery = self._keep[1].get(event.id)
            if delivery is not None:
                self._keep[0].started(delivery, timeout)

    def _triage(self, delivery: Delivery) -> tuple[ReceivedEvent | None, str]:
        """Parse a delivery; settle at once what must not reach the handler."""
        sub = self.subscription
        try:
            event = parse_delivery(delivery)
        except MalformedMessage as exc:
            return None, self._malformed(delivery, str(exc))
        if delivery.attempt > sub.max_attempts:
            # The earlier deliveries never reported an outcome: the worker died
            # or hung. Don't run it again, or a handler that kills its worker
            # would loop forever.
            return None, self._dead_letter(
                delivery, event, attempts=delivery.attempt,
                error=f"delivered {delivery.attempt} times, over max_attempts={sub.max_attempts}; the last "
                "attempts never reported an outcome (the worker died, hung, or lost its ack)",
                tb="",
            )
        return event, ""

    def _conclude(self, delivery: Delivery, event: ReceivedEvent, outcome: str, error: BaseException | None) -> str:
        """Ack a success or a skip; retry or dead-letter a failure."""
        sub = self.subscription
        if error is None:
            # Acked only now, after the commit: a crash before this line means a
            # redelivery that finds the claim and skips.
            self._settle(lambda: self.transport.ack(delivery), event, "ack")
            self.counts[outcome] += 1
            self._send_handled(event, outcome)
            logger.debug("%s subscription=%s event_id=%s attempt=%s", outcome, sub.name, event.id, event.attempt)
            return outcome
        tb = "".join(traceback_module.format_exception(error))
        message = f"{type(error).__name__}: {error}"
        signals.event_failed.send_robust(
            sender=sub, subscription=sub.name, event=event, error=error, attempt=event.attempt,
            will_retry=delivery.attempt < sub.max_attempts, duration_seconds=self._durations.pop(event.id, 0.0),
        )
        if delivery.attempt >= sub.max_attempts:
            return self._dead_letter(delivery, event, attempts=delivery.attempt, error=message, tb=tb, exception=error)
        delay = sub.delay_after(delivery.attempt)
        logger.warning(
            "handler failed, retrying subscription=%s event_id=%s attempt=%s/%s retry_in=%ss error=%s",
            sub.name, event.id, delivery.attempt, sub.max_attempts, delay, message,
        )
        self._settle(lambda: self.transport.nak(delivery, delay), event, "nak")
        self.counts["retried"] += 1
        return "retried"

    # -- a batch in one transaction --
    def process_batch(self, deliveries: Sequence[Delivery], keep: Any = None) -> list[str]:
        """Handle a fetched batch in ONE transaction: one statement claims
        every event, each handler runs in a savepoint of its own (a failure
        undoes that message's writes and claim alone), one commit; then the
        successes are acked and the failures retried or dead-lettered."""
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        ready: list[tuple[Delivery, ReceivedEvent]] = []
        results: dict[int, str] = {}
        for delivery in deliveries:
            event, settled = self._triage(delivery)
            if event is None:
                results[id(delivery)] = settled
            else:
                ready.append((delivery, event))
        for start in range(0, len(ready), MAX_SAVEPOINTS_PER_TRANSACTION):
            self._process_chunk(ready[start:start + MAX_SAVEPOINTS_PER_TRANSACTION], keep, timeout, results)
        return [results[id(d)] for d in deliveries]

    def _process_chunk(self, ready: list[tuple[Delivery, ReceivedEvent]], keep: Any, timeout: float, results: dict[int, str]) -> None:
        if ready:
            self._keep = (keep, {e.id: d for d, e in ready})
            try:
                outcomes, error = self._run_until_db_answers(lambda: self._run_batch([e for _, e in ready], timeout), ready[0][1], timeout * len(ready))
            finally:
                self._keep = None
            if error is not None:  # the batch as a whole failed (e.g. the database went away for good)
                outcomes = {e.id: ("failed", error) for _, e in ready}
            acks = []
            for delivery, event in ready:
                outcome, failure = outcomes[event.id]
                if failure is None:
                    acks.append(delivery)
                    self.counts[outcome] += 1
                    results[id(delivery)] = outcome
                    self._send_handled(event, outcome)
                else:
                    results[id(delivery)] = self._conclude(delivery, event, outcome, failure)
            # After the commit, one trip through the loop for every ack.
            self._settle(lambda: self.transport.ack_many(acks), ready[0][1], "ack")

    def _run_batch(self, events: Sequence[ReceivedEvent], timeout: float) -> dict[uuid.UUID, tuple[str, BaseException | None]]:
        sub = self.subscription
        close_old_connections_for(self.using)
        timeout_ms = str(int(timeout * 1000))
        outcomes: dict[uuid.UUID, tuple[str, BaseException | None]] = {}
        failed: list[uuid.UUID] = []
        connection = connections[self.using]
        with transaction.atomic(using=self.using):
            with connection.cursor() as cursor:
                # Sorted: two workers claiming overlapping batches take the
                # unique-key locks in the same order, so they can't deadlock.
                # One array literal: psycopg would adapt a list item by item.
                ids = "{" + ",".join(str(i) for i in sorted({e.id for e in events})) + "}"
                cursor.execute(_BATCH_CLAIM_SQL, [sub.name, ids, timeout_ms, timeout_ms])
                claimed = {row[0] for row in cursor.fetchall() if row[0] is not None}
                savepoint_open = False
                for event in events:
                    if event.id not in claimed or event.id in outcomes:
                        outcomes.setdefault(event.id, ("skipped", None))
                        continue
                    # One round trip per message: release the previous savepoint,
                    # open this one, set this event's tenant - every time, never
                    # "only if it changed": a rolled-back savepoint can leave an
                    # earlier event's tenant in force, and RLS must never see it.
                    # No parameters, so it also works with server-side binding;
                    # the tenant is a validated [A-Za-z0-9_-] token, safe as a literal.
                    sql = "RELEASE SAVEPOINT platformkit_message; " if savepoint_open else ""
                    sql += "SAVEPOINT platformkit_message"
                    if self._default_tenant_context:
                        sql += f"; SELECT set_config('platformkit.tenant', '{check_tenant(event.tenant) or ''}', true)"
                    cursor.execute(sql)
                    savepoint_open = True
                    try:
                        self._call_handler(event, timeout)
                    except Exception as exc:  # noqa: BLE001 - this message's outcome, not the batch's
                        if _connection_lost(exc, self.using):
                            raise
                        # An ORM error marks the whole transaction for rollback;
                        # ours is a savepoint's, as in Django's own atomic().
                        connection.needs_rollback = False
                        cursor.execute("ROLLBACK TO SAVEPOINT platformkit_message")  # _call_handler dropped its on_commit callbacks
                        outcomes[event.id] = ("failed", exc)
                        failed.append(event.id)
                    else:
                        outcomes[event.id] = ("handled", None)
                    finally:
                        self.handler_started = None
                if failed:
                    # Their claims were taken with the batch's; give them back.
                    cursor.execute(f"DELETE FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = ANY(%s)", [sub.name, failed])
        return outcomes

    def _send_handled(self, event: ReceivedEvent, outcome: str) -> None:
        sub = self.subscription
        signals.event_handled.send_robust(
            sender=sub, subscription=sub.name, event=event, outcome=outcome,
            duration_seconds=self._durations.pop(event.id, 0.0),
        )

    def _settle(self, action: Callable[[], None], event: ReceivedEvent, what: str) -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the claim decides; a lost ack only means a redelivery that skips
            logger.warning("%s failed subscription=%s event_id=%s error=%s", what, self.subscription.name, event.id, exc)

    def _run_until_db_answers(self, run: Callable[[], T], event: ReceivedEvent, timeout: float) -> tuple[T | str, BaseException | None]:
        """Run the claim and handler(s). A dead database session is not the
        event's fault: reconnect and try again, without counting an attempt."""
        wait = 0.2
        while True:
            started = time.monotonic()
            try:
                return run(), None
            except BaseException as exc:  # noqa: BLE001 - every failure of the handler is an outcome
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                elapsed = time.monotonic() - started
                if elapsed < timeout and _connection_lost(exc, self.using) and not self.stop.is_set():
                    logger.warning(
                        "database connection lost, reconnecting subscription=%s event_id=%s error=%s",
                        self.subscription.name, event.id, exc,
                    )
                    connections[self.using].close()
                    self.stop.wait(wait)
                    wait = min(wait * 2, 5.0)
                    continue
                return "failed", exc
            finally:
                self.handler_started = None

    def _run(self, event: ReceivedEvent, timeout: float) -> str:
        sub = self.subscription
        close_old_connections_for(self.using)
        timeout_ms = str(int(timeout * 1000))
        with transaction.atomic(using=self.using):
            with connections[self.using].cursor() as cursor:
                if self._default_tenant_context:
                    cursor.execute(_CLAIM_TENANT_SQL, [sub.name, event.id, timeout_ms, timeout_ms, event.tenant or ""])
                else:
                    cursor.execute(_CLAIM_SQL, [sub.name, event.id, timeout_ms, timeout_ms])
                claimed = cursor.fetchone()[0]
            if not claimed:
                return "skipped"
            self._call_handler(event, timeout)
        return "handled"

    # -- giving up --
    def _dead_letter(self, delivery: Delivery, event: ReceivedEvent, *, attempts: int, error: str, tb: str, exception: BaseException | None = None) -> str:
        sub = self.subscription
        try:
            written = record_dead_letter(
                subscription=sub.name, event_id=event.id, name=event.name, tenant=event.tenant,
                attempts=attempts, error=error, traceback=tb, using=self.using,
            )
        except DatabaseError as exc:
            # Not acked: the broker redelivers after the ack wait, and the next
            # delivery (over max_attempts) records it without running the handler.
            logger.error("dead letter not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc)
            connections[self.using].close()
            return "unacked"
        if written:
            logger.error(
                "dead letter subscription=%s event_id=%s name=%s attempts=%s error=%s\n%s",
                sub.name, event.id, event.name, attempts, error, tb,
            )
            self.counts["dead_lettered"] += 1
            signals.event_dead_lettered.send_robust(
                sender=sub, subscription=sub.name, event_id=event.id, name=event.name, tenant=event.tenant,
                attempts=attempts, error=error, exception=exception,
            )
        else:
            logger.info("already claimed, no dead letter subscription=%s event_id=%s", sub.name, event.id)
        self._settle(lambda: self.transport.term(delivery), event, "term")
        return "dead_lettered" if written else "skipped"

    def _malformed(self, delivery: Delivery, reason: str) -> str:
        sub = self.subscription
        body_id = None
        with contextlib.suppress(Exception):
            body_id = uuid.UUID(str(json.loads(delivery.data).get("id")))
        event_id = body_id or uuid.uuid5(_NAMESPACE_MALFORMED, f"{conf.settings.STREAM}:{delivery.stream_seq}")
        error = f"malformed message on subject={delivery.subject} stream_seq={delivery.stream_seq}: {reason}"
        logger.error("malformed message terminated subscription=%s subject=%s stream_seq=%s reason=%s", sub.name, delivery.subject, delivery.stream_seq, reason)
        try:
            with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
                cursor.execute(
                    _DEAD_LETTER_SQL,
                    # NUL can't be stored in PostgreSQL text: unescaped, a body holding one
                    # could never be recorded and would come back after every ack wait.
                    [event_id, sub.name, "(malformed)", None, delivery.attempt, error.replace("\x00", "\\x00"),
                     delivery.data[:4000].decode("utf-8", "replace").replace("\x00", "\\x00")],
                )
        except DatabaseError as exc:
            logger.error("malformed message not recorded, will retry subscription=%s stream_seq=%s error=%s", sub.name, delivery.stream_seq, exc)
            connections[self.using].close()
            return "unacked"
        with contextlib.suppress(Exception):
            self.transport.term(delivery)
        self.counts["malformed"] += 1
        return "malformed"


def close_old_connections_for(alias: str) -> None:
    """Before a unit of work in a worker thread: drop this thread's
    connection if it broke, or if it outlived a positive ``CONN_MAX_AGE``, so
    the next query reconnects. Unlike Django's request cycle, ``CONN_MAX_AGE
    = 0`` (the default) does NOT mean a new connection per message: a worker
    is one long "request", and reconnecting per event cost 3-8x throughput."""
    connection = connections[alias]
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.errors_occurred:
        if not connection.is_usable():
            connection.close()
            return
        connection.errors_occurred = False
    max_age = connection.settings_dict.get("CONN_MAX_AGE") or 0
    if max_age > 0 and connection.close_at is not None and time.monotonic() >= connection.close_at:
        connection.close()


def record_dead_letter(*, subscription: str, event_id: uuid.UUID, name: str, tenant: str | None, attempts: int, error: str, traceback: str, using: str | None = None) -> bool:
    """In one transaction: a terminal claim and, if the claim is new, the dead
    letter. Returns whether a dead letter was written (False: the event was
    already handled - its ack was lost - so there is nothing to report).
    Idempotent: both inserts are ``ON CONFLICT DO NOTHING``."""
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        # Hold the outbox row (it has the payload's only copy) while the dead
        # letter is written: purge locks FOR UPDATE SKIP LOCKED, so it skips it.
        cursor.execute(_TERMINAL_CLAIM_SQL, [event_id, subscription, event_id])
        if cursor.fetchone() is None:
            return False
        cursor.execute(_DEAD_LETTER_SQL, [event_id, subscription, name, tenant, attempts, error[:10000], traceback[:50000]])
    return True
