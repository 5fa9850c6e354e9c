"""The claim: the one statement that starts a unit's transaction, and the
transaction that runs each handler after it (DESIGN.md: handling is exactly
once per (subscription, event) through a claim row committed with the
handler's own writes).

A trusted subscription's claim reads each event's row from the outbox in the
same round trip, so the handler runs with the outbox's payload and a message
the outbox doesn't know never runs. The tenant ``set_config`` is
``tenancy.TENANT_SET_CONFIG``, written once. The consumer gives each unit
to its ``UnitTransaction``, with how to run it (a ``UnitPass``).
"""

from __future__ import annotations

import functools
import json
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_platformkit._tables import ATTEMPTS_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit.consume.handler import HandlerRunner
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.tenancy import SET_TENANT_SQL, TENANT_SET_CONFIG
from django_platformkit.consume.units import MAX_SAVEPOINTS_PER_TRANSACTION, Redo, UnitWrites, Work, unit_writes_scope
from django_platformkit.names import check_tenant
from django_platformkit.outage import close_old_connections_for, not_the_handlers_fault
from django_platformkit.wire import AttemptOutcome, HandlingOutcome, ReceivedEvent


@functools.lru_cache(maxsize=8)
def _claim_sql(trust_outbox: bool, lock_namespace: int | None = None) -> str:
    """The one statement that starts a unit of work: claim every event of the
    unit, (trusted subscriptions) read each event's row from the outbox in the
    same round trip, mark a redelivery's ``running`` attempt handled when its
    claim is new, and bound the transaction by the handler timeout.
    ``lock_namespace`` (``Subscription.claim_lock_namespace``): also take the
    transaction-scoped advisory lock ``(lock_namespace, hashtext(event id))``
    on each event it claims, returned as a seventh column.

    Parameters, in order: ids (a ``{uuid,...}`` array literal), the event name
    (trusted) or any text (external), the subscription, the attempt row id
    (or None), statement timeout ms, idle-in-transaction timeout ms, tenant.
    One statement, never several: psycopg's server-side binding and prepared
    statements refuse "multiple commands in a prepared statement".
    """
    if trust_outbox:
        rows = f"SELECT id, name, tenant, payload::text AS payload, created_at, not_before FROM {OUTBOX_TABLE} WHERE id = ANY(%s::uuid[]) AND name = %s"
    else:
        rows = (
            "SELECT u.id, NULL::text AS name, NULL::text AS tenant, NULL::text AS payload, NULL::timestamptz AS created_at, "
            "NULL::timestamptz AS not_before "
            "FROM unnest(%s::uuid[]) AS u(id) WHERE %s::text IS NOT NULL"
        )
    return (
        f"WITH o AS ({rows}), "
        # Sorted: two workers claiming overlapping units take the unique-key
        # locks in the same order, so they can't deadlock.
        f"c AS (INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) SELECT %s, o.id, now() FROM o ORDER BY o.id "
        "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING event_id), "
        f"u AS (UPDATE {ATTEMPTS_TABLE} SET outcome = '{AttemptOutcome.HANDLED}', finished_at = clock_timestamp() WHERE id = %s::bigint AND EXISTS (SELECT 1 FROM c)) "
        # created_at as integer microseconds since the epoch: Django's
        # timestamptz loader is Python code per value, this is one C int.
        "SELECT o.id, o.name, o.tenant, o.payload, (EXTRACT(EPOCH FROM o.created_at) * 1000000)::bigint, "
        "c.event_id IS NOT NULL, (EXTRACT(EPOCH FROM o.not_before) * 1000000)::bigint"
        + (
            ""
            if lock_namespace is None
            else f", CASE WHEN c.event_id IS NOT NULL THEN pg_try_advisory_xact_lock({int(lock_namespace)}, hashtext(o.id::text)) END"
        )
        + " FROM "
        "(SELECT set_config('statement_timeout', %s, true) AS t, set_config('idle_in_transaction_session_timeout', %s, true) AS i, "
        f"{TENANT_SET_CONFIG} AS n) s LEFT JOIN o ON true LEFT JOIN c ON c.event_id = o.id"
    )


_ALREADY_CLAIMED_SQL = f"SELECT event_id FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = ANY(%s::uuid[])"
#: The claim returns created_at as microseconds since this instant.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: A unit's runs recorded as ``running`` (slow first runs, a redelivery) are
#: handled with the unit's commit, not after it.
_MARK_RUNS_HANDLED_SQL = f"UPDATE {ATTEMPTS_TABLE} SET outcome = '{AttemptOutcome.HANDLED}', finished_at = clock_timestamp() WHERE id = ANY(%s::bigint[])"
#: In a unit redone with savepoints, the claims of the failed handlers were
#: taken with the unit's: given back, so their retries can claim again.
_GIVE_BACK_CLAIMS_SQL = f"DELETE FROM {HANDLED_TABLE} WHERE subscription = %s AND event_id = ANY(%s::uuid[])"
#: The reason a trusted subscription gives for a message whose id the outbox doesn't hold (DESIGN.md "Trust model").
NOT_IN_OUTBOX = "not in this project's outbox: forged, from another project, or purged"


class ClaimRow(NamedTuple):
    """One row of the claim statement: the outbox's copy of the event
    (trusted subscriptions; NULLs for an external one) and whether this unit
    claimed it now (False: a claim existed)."""

    id: uuid.UUID
    name: str | None
    tenant: str | None
    payload: str | None  # the outbox's jsonb as text
    created_us: int | None  # created_at, microseconds since the epoch
    claimed: bool
    not_before_us: int | None  # a deferred task's run_after, microseconds since the epoch


@dataclass(frozen=True)
class UnitPass:
    """How one pass of a unit's transaction runs.

    Attributes:
        savepoints: A savepoint per message (a redo after a failure);
            otherwise a handler's failure raises ``Redo`` and everything rolls back.
        trust_outbox: Run with the outbox's copy of each event, and treat
            one the outbox doesn't hold as ``NOT_IN_OUTBOX`` (every
            subscription but an ``external`` one).
        timeout_seconds: Each handler's budget (``HANDLER_TIMEOUT_SECONDS``).
    """

    savepoints: bool
    trust_outbox: bool
    timeout_seconds: float


@dataclass
class _Claimed:
    """What one pass learnt inside its transaction, which holds only once it
    committed: the claim's rows, the tenant last set, and per work
    (``id()``) its outcome and the event its handler ran with."""

    rows: dict[uuid.UUID, ClaimRow]
    tenant: str | None
    outcomes: dict[int, HandlingOutcome] = field(default_factory=dict)
    events: dict[int, ReceivedEvent] = field(default_factory=dict)


class UnitTransaction:
    """One unit's transaction: the claim statement, then each claimed
    event's handler (through ``runner``), then the unit's last writes.

    Args:
        subscription: Whose claims it takes.
        using: The database alias of the claims and the handlers' writes.
        runner: Runs each handler inside the transaction.
    """

    def __init__(self, subscription: Subscription, using: str, runner: HandlerRunner) -> None:
        self.subscription = subscription
        self.using = using
        self.runner = runner

    def execute(self, unit: list[Work], *, how: UnitPass, skip: set[int]) -> None:
        """Run ``unit`` (less the works whose ``id()`` is in ``skip``) in one
        transaction and set each work's outcome once it committed.

        Args:
            unit: The works of one unit.
            how: Savepoints or not, trusting the outbox or not, the handler timeout.
            skip: ``id()`` of works already done (a redo leaves them out);
                a unit redone in chunks adds each chunk it committed.

        Raises:
            Redo: A handler failed without savepoints: the unit rolled back.
            DatabaseError: The database went away; nothing committed.
        """
        todo = [w for w in unit if id(w) not in skip]
        if not todo:
            return
        if how.savepoints and len(todo) > MAX_SAVEPOINTS_PER_TRANSACTION:
            # A savepoint per message, at most MAX_SAVEPOINTS_PER_TRANSACTION in
            # one transaction: the redo commits chunk by chunk. A chunk done is
            # skipped if the database goes away and the redo starts over.
            for start in range(0, len(todo), MAX_SAVEPOINTS_PER_TRANSACTION):
                chunk = todo[start : start + MAX_SAVEPOINTS_PER_TRANSACTION]
                self.execute(chunk, how=how, skip=skip)
                skip.update(id(w) for w in chunk)
            return
        close_old_connections_for(self.using)
        connection = connections[self.using]
        # Where a failure rolls the whole unit back, handlers may leave rows
        # for one statement before the commit (units.UnitWrites).
        writes = None if how.savepoints else UnitWrites(self.using)
        with transaction.atomic(using=self.using), unit_writes_scope(writes), connection.cursor() as cursor:
            claimed = self._claim(cursor, todo, how)
            failures = self._run_handlers(cursor, connection, todo, claimed, how)
            self._before_commit(cursor, todo, claimed.outcomes, failures, writes)
        # Committed: only now do the outcomes hold.
        for work in todo:
            if id(work) in claimed.outcomes:
                work.outcome = claimed.outcomes[id(work)]
                work.event = claimed.events.get(id(work), work.event)

    def _claim(self, cursor: Any, todo: list[Work], how: UnitPass) -> _Claimed:
        """The unit's claim statement: its rows by event id and the tenant it
        set. A delivery the claim returned no row for gets its outcome
        here: ``SKIPPED`` (claimed before) or ``NOT_IN_OUTBOX``."""
        sub = self.subscription
        timeout_ms = str(int(how.timeout_seconds * 1000))
        # One array literal: psycopg would adapt a list item by item.
        ids = "{" + ",".join(sorted({str(w.event.id) for w in todo})) + "}"
        tenant = check_tenant(todo[0].event.tenant) or ""
        cursor.execute(
            _claim_sql(how.trust_outbox, sub.claim_lock_namespace),
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
        claimed = _Claimed({row[0]: ClaimRow._make(row[:7]) for row in cursor.fetchall() if row[0] is not None}, tenant)
        missing = [w for w in todo if w.event.id not in claimed.rows]
        if missing:
            cursor.execute(_ALREADY_CLAIMED_SQL, [sub.name, "{" + ",".join(str(w.event.id) for w in missing) + "}"])
            claimed_before = {r[0] for r in cursor.fetchall()}
            for work in missing:
                claimed.outcomes[id(work)] = (
                    HandlingOutcome.SKIPPED if work.event.id in claimed_before else HandlingOutcome.NOT_IN_OUTBOX
                )
        return claimed

    def _run_handlers(
        self, cursor: Any, connection: BaseDatabaseWrapper, todo: list[Work], claimed: _Claimed, how: UnitPass
    ) -> list[Work]:
        """Run the handler of each delivery the claim claimed, in the unit's
        transaction; returns the failed ones (with ``how.savepoints``: each
        rolled back to its savepoint; else the first failure raises ``Redo``)."""
        outcomes, events = claimed.outcomes, claimed.events
        tenant = claimed.tenant
        safe, timeout = how.savepoints, how.timeout_seconds
        failures: list[Work] = []
        seen: set[uuid.UUID] = set()
        checked_tenant = tenant  # the last tenant check_tenant() passed: a unit is mostly one tenant
        default_tenant_context = self.runner.default_tenant_context
        for work in todo:
            if id(work) in outcomes:
                continue
            row = claimed.rows[work.event.id]
            if not row.claimed or work.event.id in seen:
                outcomes[id(work)] = HandlingOutcome.SKIPPED
                continue
            seen.add(work.event.id)
            event = work.event
            if how.trust_outbox:
                # The outbox is the authority: a same-id copy with another payload runs with ours.
                event = ReceivedEvent(
                    event.id,
                    row.name,  # type: ignore[arg-type]  # a trusted claim reads every column
                    row.tenant,
                    json.loads(row.payload),  # type: ignore[arg-type]
                    _EPOCH + timedelta(microseconds=row.created_us),  # type: ignore[arg-type]
                    event.attempt,
                    event.headers,
                )
            events[id(work)] = event
            # Due since its commit (created_at) or its run_after: the delivery latency's start.
            due_us = max(row.created_us or 0, row.not_before_us or 0)
            work.due_epoch = due_us / 1e6 if due_us else None
            event_tenant = event.tenant or ""
            if event_tenant != checked_tenant:
                event_tenant = check_tenant(event.tenant) or ""
                checked_tenant = event_tenant
            if safe:
                cursor.execute("SAVEPOINT platformkit_message")
            if default_tenant_context and (safe or event_tenant != tenant):
                # Every time in safe mode, never "only if it changed": a
                # rolled-back savepoint can leave an earlier event's tenant
                # in force, and RLS must never see it.
                cursor.execute(SET_TENANT_SQL, [event_tenant])
                tenant = event_tenant
            # Django sets errors_occurred on the connection whose statement
            # failed, even when a handler's own atomic() rolled the failure
            # back to its savepoint (the transaction is then not aborted, so
            # its status can't tell): cleared for the run, it says whether an
            # error came from the unit's connection or from another alias's.
            # An error the run caught on the unit's connection makes it err
            # towards an outage.
            errors_before, connection.errors_occurred = connection.errors_occurred, False
            try:
                self.runner.run(work, event, timeout, connection)
            except BaseException as exc:
                if not_the_handlers_fault(exc, self.using, own_connection=connection.errors_occurred):
                    raise
                work.error, work.tb, work.outcome = (
                    exc,
                    "".join(traceback.format_exception(exc)),
                    HandlingOutcome.FAILED,
                )
                work.event = event
                if not safe or getattr(connection, "closed_in_transaction", False):
                    # Closed by the handler (connection.close() and the like):
                    # no savepoint is left to roll back to, and the "connection
                    # is closed" it would raise reads as a database outage,
                    # retried forever. The transaction is gone: redo the rest.
                    raise Redo() from None
                # An ORM error marks the whole transaction for rollback;
                # ours is a savepoint's, as in Django's own atomic().
                connection.needs_rollback = False
                cursor.execute(
                    "ROLLBACK TO SAVEPOINT platformkit_message"
                )  # the runner dropped its on_commit callbacks
                failures.append(work)
                tenant = None  # unknown after the rollback: set it again
                continue
            finally:
                connection.errors_occurred = connection.errors_occurred or errors_before
            if safe:
                cursor.execute("RELEASE SAVEPOINT platformkit_message")
            outcomes[id(work)] = HandlingOutcome.HANDLED
            # Done, but acked only after the unit commits: keep its ack
            # alive while the rest of the unit runs (each within its timeout).
            self.runner.awaits_commit(work, timeout * (len(todo) + 1))
        return failures

    def _before_commit(
        self,
        cursor: Any,
        todo: list[Work],
        outcomes: dict[int, HandlingOutcome],
        failures: list[Work],
        writes: UnitWrites | None,
    ) -> None:
        """The unit's last statements before its commit: the rows its
        handlers left (``writes``), its recorded runs marked handled, and
        the claims of its failed handlers given back."""
        if writes is not None:
            try:
                writes.flush(cursor)
            except BaseException as exc:
                if not_the_handlers_fault(exc, self.using):
                    raise
                # Whose row it was is unknown here: redo the unit with a
                # savepoint per message, where each handler writes its own.
                raise Redo() from exc
        slow = [
            w.attempt_row for w in todo if outcomes.get(id(w)) == HandlingOutcome.HANDLED and w.attempt_row is not None
        ]
        if slow:
            # Slow first runs (and a redelivery) recorded as running: handled, with the unit's commit.
            cursor.execute(_MARK_RUNS_HANDLED_SQL, ["{" + ",".join(str(i) for i in slow) + "}"])
        if failures:
            # Their claims were taken with the unit's; give them back.
            cursor.execute(
                _GIVE_BACK_CLAIMS_SQL,
                [self.subscription.name, "{" + ",".join(str(w.event.id) for w in failures) + "}"],
            )
