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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import traceback as traceback_module
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from django.db import DatabaseError, connections, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from . import conf, signals, tracing
from ._tables import ATTEMPTS_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from ._text import storable_text as clean_text
from .attempts import (
    RECORD_SLOW_RUN_AFTER_SECONDS,  # noqa: F401 - imported from here before attempts.py
    WORKER_ID,  # noqa: F401
    history_text,
    mark_interrupted,
    record_failed_run,
    run_history,
    start_run,
)
from .attempts import slow_runs as _slow_runs
from .deadletters import malformed_id, record_dead_letter, record_malformed
from .events import check_tenant, current_event
from .outage import (  # noqa: F401 - NOT_THE_HANDLERS_FAULT, _connection_lost: imported from here before
    NOT_THE_HANDLERS_FAULT,
    _connection_lost,
    close_old_connections_for,
    not_the_handlers_fault,
)

# Re-exported: these lived here before subscriptions.py / wire.py, and users
# and jobs.py import them from this module.
from .subscriptions import (  # noqa: F401
    SET_TENANT_SQL,
    SUBSCRIPTION_NAME_PART,
    TENANT_SET_CONFIG,
    Subscription,
    _default_name,
    _subscriptions,
    check_subscription_name,
    set_config_tenant,
    subscribe,
    subscriptions,
    tenant_context_factory,
)
from .wire import Delivery, MalformedMessage, ReceivedEvent, parse_delivery

if TYPE_CHECKING:
    # The worker hands the consumer its transport: handling events imports no nats.
    from .transport import Transport

logger = logging.getLogger(__name__)
T = TypeVar("T")


# --- handling ----------------------------------------------------------------


def _claim_sql(trust_outbox: bool) -> str:
    """The one statement that starts a unit of work: claim every event of the
    unit, (trusted subscriptions) read each event's row from the outbox in the
    same round trip, mark a redelivery's ``running`` attempt handled when its
    claim is new, and bound the transaction by the handler timeout.

    Parameters, in order: ids (a ``{uuid,...}`` array literal), the event name
    (trusted) or any text (external), the subscription, the attempt row id
    (or None), statement timeout ms, idle-in-transaction timeout ms, tenant.
    One statement, never several: psycopg's server-side binding and prepared
    statements refuse "multiple commands in a prepared statement".
    """
    if trust_outbox:
        rows = f"SELECT id, name, tenant, payload::text AS payload, created_at FROM {OUTBOX_TABLE} WHERE id = ANY(%s::uuid[]) AND name = %s"
    else:
        rows = (
            "SELECT u.id, NULL::text AS name, NULL::text AS tenant, NULL::text AS payload, NULL::timestamptz AS created_at "
            "FROM unnest(%s::uuid[]) AS u(id) WHERE %s::text IS NOT NULL"
        )
    return (
        f"WITH o AS ({rows}), "
        # Sorted: two workers claiming overlapping units take the unique-key
        # locks in the same order, so they can't deadlock.
        f"c AS (INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) SELECT %s, o.id, now() FROM o ORDER BY o.id "
        "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING event_id), "
        f"u AS (UPDATE {ATTEMPTS_TABLE} SET outcome = 'handled', finished_at = clock_timestamp() WHERE id = %s::bigint AND EXISTS (SELECT 1 FROM c)) "
        "SELECT o.id, o.name, o.tenant, o.payload, o.created_at, c.event_id IS NOT NULL FROM "
        "(SELECT set_config('statement_timeout', %s, true) AS t, set_config('idle_in_transaction_session_timeout', %s, true) AS i, "
        "set_config('platformkit.tenant', %s, true) AS n) s LEFT JOIN o ON true LEFT JOIN c ON c.event_id = o.id"
    )


_CLAIM_TRUSTED_SQL = _claim_sql(True)
_CLAIM_EXTERNAL_SQL = _claim_sql(False)
_ALREADY_CLAIMED_SQL = f"SELECT event_id FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = ANY(%s::uuid[])"
_SET_TENANT_SQL = SET_TENANT_SQL
#: The reason a trusted subscription gives for a message whose id the outbox doesn't hold (DESIGN.md "Trust model").
NOT_IN_OUTBOX = "not in this project's outbox: forged, from another project, or purged"

#: A unit of work commits at most this many messages per transaction: after a
#: failure the unit is redone with a savepoint per message, and past 64
#: subtransactions with writes PostgreSQL's per-backend subxid cache
#: overflows and every other session's snapshots get slower.
MAX_SAVEPOINTS_PER_TRANSACTION = 50


class HandlerTimeout(Exception):
    """The handler ran past HANDLER_TIMEOUT_SECONDS: counted as a failed attempt."""


class _Redo(Exception):
    """Leave the unit's transaction (rolling everything back) to redo it
    without the message whose handler failed."""


class _Stopping(Exception):
    """The database is away and the worker is stopping: hand the unit back."""


@dataclass
class _Work:
    """One delivery on its way through handle()."""

    delivery: Delivery
    event: ReceivedEvent
    attempt_row: int | None = None  # our ``running`` Attempt row (redeliveries, slow first runs)
    started_at: datetime | None = None
    outcome: str = ""
    error: BaseException | None = None
    tb: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)  # handler end vs the slow-run recorder
    running: bool = False  # the handler is in its run now (the recorder may write its row)


class Consumer:
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
                if not self.subscription.batch or len(chunk) >= MAX_SAVEPOINTS_PER_TRANSACTION:
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
        from .events import catalogue

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
        wait = 0.2
        while True:
            started = time.monotonic()
            try:
                return run()
            except (_Redo, _Stopping):
                raise
            except BaseException as exc:
                # A session killed because the handler overran its timeout
                # (idle_in_transaction_session_timeout) is the handler's fault.
                if not (not_the_handlers_fault(exc, self.using) and time.monotonic() - started < timeout):
                    raise
                if self.stop.is_set():
                    raise _Stopping() from exc
                logger.warning(
                    "database unavailable, retrying (not an attempt) subscription=%s event_id=%s retry_in=%.1fs error=%s",
                    self.subscription.name,
                    unit[0].event.id,
                    wait,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                )
                with contextlib.suppress(Exception):
                    connections[self.using].close()
                if keep is not None:
                    for work in unit:
                        # The ack stays alive through the outage (+ one handler run).
                        with contextlib.suppress(Exception):
                            keep.started(work.delivery, wait + 5 + timeout)
                self.stop.wait(wait)
                wait = min(wait * 2, 5.0)
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

    def _dead_letter_without_running(
        self, work: _Work, rows: Sequence[tuple[Any, ...]], counted: Sequence[tuple[Any, ...]]
    ) -> str:
        sub = self.subscription
        last_failed = next((r for r in reversed(rows) if r[1] == "failed" and r[2]), None)
        why = (
            f"dead-lettered without running again: the handler already started {len(counted)} times for this event "
            f"(max_attempts={sub.max_attempts}); history: {history_text(rows)}"
        )
        error = f"{last_failed[2]}\n{why}" if last_failed else why
        return self._dead_letter(
            work.delivery, work.event, attempts=len(counted), error=error, tb=last_failed[3] if last_failed else ""
        )

    def _execute(self, unit: list[_Work], *, safe: bool, skip: set[int], trust_outbox: bool, timeout: float) -> None:
        """One transaction for the unit: one claim statement, then each
        handler. ``safe``: a savepoint per message (after a failure); else a
        handler's failure raises ``_Redo`` and everything rolls back."""
        todo = [w for w in unit if id(w) not in skip]
        if not todo:
            return
        sub = self.subscription
        close_old_connections_for(self.using)
        connection = connections[self.using]
        timeout_ms = str(int(timeout * 1000))
        outcomes: dict[int, str] = {}
        events: dict[int, ReceivedEvent] = {}
        failures: list[_Work] = []
        with transaction.atomic(using=self.using):  # noqa: SIM117 - the cursor lives inside the transaction, named separately for the blocks below
            with connection.cursor() as cursor:
                # One array literal: psycopg would adapt a list item by item.
                ids = "{" + ",".join(sorted({str(w.event.id) for w in todo})) + "}"
                tenant: str | None = check_tenant(todo[0].event.tenant) or ""
                cursor.execute(
                    _CLAIM_TRUSTED_SQL if trust_outbox else _CLAIM_EXTERNAL_SQL,
                    [
                        ids,
                        sub.event,
                        sub.name,
                        todo[0].attempt_row if len(todo) == 1 else None,
                        timeout_ms,
                        timeout_ms,
                        tenant,
                    ],
                )
                rows = {row[0]: row for row in cursor.fetchall() if row[0] is not None}
                missing = [w for w in todo if w.event.id not in rows]
                if missing:
                    cursor.execute(
                        _ALREADY_CLAIMED_SQL, [sub.name, "{" + ",".join(str(w.event.id) for w in missing) + "}"]
                    )
                    claimed_before = {r[0] for r in cursor.fetchall()}
                    for work in missing:
                        outcomes[id(work)] = "skipped" if work.event.id in claimed_before else "not_in_outbox"
                seen: set[uuid.UUID] = set()
                for work in todo:
                    if id(work) in outcomes:
                        continue
                    _, name, row_tenant, payload, created_at, claimed = rows[work.event.id]
                    if not claimed or work.event.id in seen:
                        outcomes[id(work)] = "skipped"
                        continue
                    seen.add(work.event.id)
                    event = work.event
                    if trust_outbox:
                        # The outbox is the authority: a same-id copy with another payload runs with ours.
                        event = replace(
                            event, name=name, tenant=row_tenant, payload=json.loads(payload), occurred_at=created_at
                        )
                    events[id(work)] = event
                    event_tenant = check_tenant(event.tenant) or ""
                    if safe:
                        cursor.execute("SAVEPOINT platformkit_message")
                    if self._default_tenant_context and (safe or event_tenant != tenant):
                        # Every time in safe mode, never "only if it changed": a
                        # rolled-back savepoint can leave an earlier event's tenant
                        # in force, and RLS must never see it.
                        cursor.execute(_SET_TENANT_SQL, [event_tenant])
                        tenant = event_tenant
                    work.started_at = timezone.now()
                    watched = work.delivery is not None and work.attempt_row is None
                    if watched:
                        work.running = True
                        _slow_runs.watch(work, sub.name, self.using)
                    try:
                        try:
                            self._call_handler(event, timeout)
                        finally:
                            if watched:
                                _slow_runs.unwatch(work)
                                with work.lock:  # waits for a row being written now
                                    work.running = False
                    except BaseException as exc:
                        if not_the_handlers_fault(exc, self.using):
                            raise
                        work.error, work.tb, work.outcome = (
                            exc,
                            "".join(traceback_module.format_exception(exc)),
                            "failed",
                        )
                        work.event = event
                        if not safe:
                            raise _Redo() from None
                        # An ORM error marks the whole transaction for rollback;
                        # ours is a savepoint's, as in Django's own atomic().
                        connection.needs_rollback = False
                        cursor.execute(
                            "ROLLBACK TO SAVEPOINT platformkit_message"
                        )  # _call_handler dropped its on_commit callbacks
                        failures.append(work)
                        tenant = None  # unknown after the rollback: set it again
                        continue
                    finally:
                        self.handler_started = None
                    if safe:
                        cursor.execute("RELEASE SAVEPOINT platformkit_message")
                    outcomes[id(work)] = "handled"
                    # Done, but acked only after the unit commits: keep its ack
                    # alive while the rest of the unit runs (each within its timeout).
                    self._awaits_commit(work, timeout * (len(todo) + 1))
                slow = [w.attempt_row for w in todo if outcomes.get(id(w)) == "handled" and w.attempt_row is not None]
                if slow:
                    # Slow first runs (and a redelivery) recorded as running: handled, with the unit's commit.
                    cursor.execute(
                        f"UPDATE {ATTEMPTS_TABLE} SET outcome = 'handled', finished_at = clock_timestamp() WHERE id = ANY(%s::bigint[])",
                        ["{" + ",".join(str(i) for i in slow) + "}"],
                    )
                if failures:
                    # Their claims were taken with the unit's; give them back.
                    cursor.execute(
                        f"DELETE FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = ANY(%s::uuid[])",
                        [sub.name, "{" + ",".join(str(w.event.id) for w in failures) + "}"],
                    )
        # Committed: only now do the outcomes hold.
        for work in todo:
            if id(work) in outcomes:
                work.outcome = outcomes[id(work)]
                work.event = events.get(id(work), work.event)

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
            # Tracing off (no tracer provider): no generator context manager per run.
            span = (
                tracing.consumer_span(
                    subscription=self.subscription.name,
                    event_id=event.id,
                    name=event.name,
                    headers=event.headers,
                    attempt=event.attempt,
                )
                if tracing.enabled()
                else contextlib.nullcontext()
            )
            try:
                with context, span:
                    self.subscription.handler(event)
            finally:
                self._durations[event.id] = time.monotonic() - (
                    self.handlers_started.get(threading.get_ident()) or time.monotonic()
                )
            if self._durations[event.id] > timeout:
                raise HandlerTimeout(f"handler ran past HANDLER_TIMEOUT_SECONDS={timeout:g}; its work was rolled back")
            if wrapper.needs_rollback or (
                wrapper.connection is not None
                and wrapper.connection.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
            ):
                # An ORM error marks the transaction for rollback; a raw cursor's
                # error leaves it aborted in PostgreSQL. Either way the commit
                # would roll back without a word, claim included, and the event
                # would be acked as handled: fail the attempt instead.
                raise TransactionManagementError(
                    "the handler caught a database error and returned, so its transaction can only roll back: "
                    "let the error propagate, or wrap the statement that may fail in transaction.atomic()"
                )
        except BaseException as exc:
            # A failed attempt's callbacks must never run. Django drops them
            # itself only for savepoints it made; a unit's are ours.
            del wrapper.run_on_commit[on_commit_mark:]
            if not isinstance(exc, HandlerTimeout) and self._durations.get(event.id, 0.0) > timeout:
                # Past its timeout the session is ended by the server
                # (idle_in_transaction_session_timeout / statement_timeout):
                # say why, rather than "terminating connection".
                raise HandlerTimeout(
                    f"handler ran past HANDLER_TIMEOUT_SECONDS={timeout:g}; its work was rolled back ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        finally:
            current_event.reset(token)
        # The handler's transaction.on_commit() callbacks run after the commit,
        # when the event is handled for good: one that raises is logged
        # (Django's robust=True) instead of failing an attempt that
        # succeeded - or, in a batch, skipping every later message's callbacks.
        # django-stubs types the entries as (sids, func); Django stores (sids, func, robust).
        wrapper.run_on_commit[on_commit_mark:] = [
            (sids, func, True)  # type: ignore[misc]
            for sids, func, *_ in wrapper.run_on_commit[on_commit_mark:]
        ]

    def _handler_starts(self, event: ReceivedEvent, timeout: float) -> None:
        """The claim is in; the handler starts now. From here its message's
        ack is extended for ``timeout`` seconds only. Not before: while the
        worker waits for a database that went away, the ack keeps being
        extended, so an outage can't push healthy events past MAX_ATTEMPTS."""
        self.handler_started = time.monotonic()
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None:
            delivery = keep[1].get(event.id)
            if delivery is not None:
                keep[0].started(delivery, timeout)

    def _awaits_commit(self, work: _Work, seconds: float) -> None:
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None and work.delivery is not None:
            keep[0].started(work.delivery, seconds)

    # -- settling --
    def _failed(self, work: _Work) -> str:
        """After the unit's transaction: record the failed run, then retry
        the message after its backoff or, at ``max_attempts``, dead-letter it."""
        sub = self.subscription
        event, error = work.event, work.error
        message = clean_text(f"{type(error).__name__}: {error}")
        tb = clean_text(work.tb)
        try:
            self._until_db_answers([work], lambda: self._record_failed_run(work, message, tb), 30.0, None)
        except _Stopping:
            return self._hand_back(work)
        except DatabaseError as exc:
            logger.error(
                "failed run not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc
            )
            connections[self.using].close()
            return "unacked"
        will_retry = event.attempt < sub.max_attempts
        signals.event_failed.send_robust(
            sender=sub,
            subscription=sub.name,
            event=event,
            error=error,
            attempt=event.attempt,
            will_retry=will_retry,
            duration_seconds=self._durations.pop(event.id, 0.0),
        )
        if not will_retry:
            return self._dead_letter(
                work.delivery, event, attempts=event.attempt, error=message, tb=tb, exception=error
            )
        delay = sub.delay_after(event.attempt)
        logger.warning(
            "handler failed, retrying subscription=%s event_id=%s attempt=%s/%s retry_in=%ss error=%s",
            sub.name,
            event.id,
            event.attempt,
            sub.max_attempts,
            delay,
            message,
        )
        self._settle(lambda: self.transport.nak(work.delivery, delay), event, "nak")
        self.counts["retried"] += 1
        return "retried"

    def _record_failed_run(self, work: _Work, message: str, tb: str) -> None:
        close_old_connections_for(self.using)
        record_failed_run(
            subscription=self.subscription.name,
            event_id=work.event.id,
            attempt_row=work.attempt_row,
            started_at=work.started_at,
            error=message,
            traceback=tb,
            using=self.using,
        )

    def _mark_interrupted(self, work: _Work) -> None:
        if work.attempt_row is None:
            return
        try:
            mark_interrupted(work.attempt_row, using=self.using)
        except DatabaseError as exc:
            logger.warning(
                "attempt not marked interrupted subscription=%s event_id=%s error=%s",
                self.subscription.name,
                work.event.id,
                exc,
            )

    def _hand_back(self, work: _Work) -> str:
        """The worker is stopping: nak at once (not counted: no run recorded)."""
        self._mark_interrupted(work)
        self._settle(lambda: self.transport.nak(work.delivery), work.event, "nak")
        return "handed_back"

    def _settled(self, keep: Any, delivery: Delivery) -> None:
        if keep is not None:
            with contextlib.suppress(Exception):
                keep.settled(delivery)

    def _send_handled(self, event: ReceivedEvent, outcome: str) -> None:
        sub = self.subscription
        signals.event_handled.send_robust(
            sender=sub,
            subscription=sub.name,
            event=event,
            outcome=outcome,
            duration_seconds=self._durations.pop(event.id, 0.0),
        )

    def _settle(self, action: Callable[[], None], event: ReceivedEvent, what: str) -> None:
        try:
            action()
        except Exception as exc:
            logger.warning(
                "%s failed subscription=%s event_id=%s error=%s", what, self.subscription.name, event.id, exc
            )

    # -- giving up --
    def _dead_letter(
        self,
        delivery: Delivery,
        event: ReceivedEvent,
        *,
        attempts: int,
        error: str,
        tb: str,
        exception: BaseException | None = None,
    ) -> str:
        sub = self.subscription
        try:
            written = record_dead_letter(
                subscription=sub.name,
                event_id=event.id,
                name=event.name,
                tenant=event.tenant,
                attempts=attempts,
                error=error,
                traceback=tb,
                using=self.using,
            )
        except DatabaseError as exc:
            # Not acked: the broker redelivers after the ack wait, and the
            # redelivery (counted runs at max_attempts) records it without running the handler.
            logger.error(
                "dead letter not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc
            )
            connections[self.using].close()
            return "unacked"
        if written:
            logger.error(
                "dead letter subscription=%s event_id=%s name=%s attempts=%s error=%s%s",
                sub.name,
                event.id,
                event.name,
                attempts,
                error,
                "" if exception is not None else "\n" + tb,
                exc_info=exception,  # error trackers (Sentry's logging integration) see the exception itself
            )
            self.counts["dead_lettered"] += 1
            signals.event_dead_lettered.send_robust(
                sender=sub,
                subscription=sub.name,
                event_id=event.id,
                name=event.name,
                tenant=event.tenant,
                attempts=attempts,
                error=error.splitlines()[0] if error else "",
                exception=exception,
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
        event_id = malformed_id(conf.settings.STREAM, delivery.stream_seq)
        claimed = f" claimed_id={body_id}" if body_id is not None else ""
        error = f"malformed message{claimed} on subject={delivery.subject} stream_seq={delivery.stream_seq}: {reason}"
        logger.error(
            "malformed message terminated subscription=%s subject=%s stream_seq=%s reason=%s",
            sub.name,
            delivery.subject,
            delivery.stream_seq,
            reason,
        )
        try:
            record_malformed(
                subscription=sub.name,
                event_id=event_id,
                attempts=delivery.attempt,
                error=error,
                body=delivery.data,
                using=self.using,
            )
        except DatabaseError as exc:
            logger.error(
                "malformed message not recorded, will retry subscription=%s stream_seq=%s error=%s",
                sub.name,
                delivery.stream_seq,
                exc,
            )
            connections[self.using].close()
            return "unacked"
        with contextlib.suppress(Exception):
            self.transport.term(delivery)
        self.counts["malformed"] += 1
        signals.event_malformed.send_robust(
            sender=sub,
            subscription=sub.name,
            subject=delivery.subject,
            stream_seq=delivery.stream_seq,
            reason=reason,
            event_id=event_id,
        )
        return "malformed"
