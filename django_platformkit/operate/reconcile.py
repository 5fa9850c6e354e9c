"""Reconciliation (DESIGN.md "Reconciliation"): the outbox is the source of
truth, the stream a delivery channel that can lose messages - a limit or a
``max_age`` edited by hand, a durable deleted and made again, a stream reset
or lost. While the outbox holds an event, nothing the broker drops is lost:
a pass finds each event a declared subscription is owed (stored after the
subscription began), has not handled (no claim; a dead letter has its
terminal claim), and whose message the stream no longer holds for it, and
sends it again to that subscription only - a targeted re-send
(``wire.TARGET_HEADER``) with a fresh ``Nats-Msg-Id``, which every other
subscription of its event acks without running. Its claim keeps it exactly once.

How a pass knows, cheaply. The relay's stamp records where the stream
stored each row (``outbox/stamp.py``: the stream's creation time and the
sequence). A durable is done with every message at or below
``DurableFacts.settled_through``, and a message below the stream's first
sequence is gone for everyone. So a subscription's *horizon* is
``max(settled_through, first_seq - 1)`` in the current stream: an unclaimed
row stored at or below it, or in a stream since replaced, is lost for it;
nothing pending, in flight or waiting for a retry is ever below it, so what
is merely slow is never re-sent. A pass reads only the rows between the
subscription's cursor and its horizon, on an index in stream order
(``reconcile_rows``); the cursor follows the horizon ``late_stamp_seconds()``
behind, so a stamp that commits late (a batch waiting for its acks, a
re-send the broker answered as a duplicate of an older send) is still read,
and a row re-sent once has moved on (re-stamped), so it is never sent twice.

A pass does nothing, and says why, on a stream this database must not use
(another project's, another instance's, contested by a copy, or with limits
that would discard the re-sends). Passes of several workers never take the
same subscriptions at once (their rows are locked ``SKIP LOCKED``).
"""

from __future__ import annotations

import enum
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.db import connections, transaction
from django.utils.translation import gettext_noop

from django_platformkit import conf, signals
from django_platformkit.broker.port import Broker, DurableFacts, HeldMessage, StreamFacts
from django_platformkit.consume.subscriptions import Subscription, subscriptions
from django_platformkit.exceptions import BrokerUnavailable
from django_platformkit.operate import reconcile_rows as rows
from django_platformkit.outbox.stamp import stamp_sent
from django_platformkit.wire import PublishOutcome, compose, message_id

logger = logging.getLogger(__name__)

#: Unclaimed rows read per statement and re-sent per transaction.
BATCH_SIZE = 500


class ReconcileCause(enum.StrEnum):
    """Why the stream no longer held a subscription's message (the ``cause``
    label of ``platformkit_reconciled_total``)."""

    #: It was stored in a stream that has since been deleted and made again (a reset, a lost store).
    STREAM_REPLACED = "stream_replaced"
    #: Below the stream's first sequence: aged out (``max_age``), discarded by a limit (``max_msgs``, ``max_bytes``) or purged.
    DISCARDED = "discarded"
    #: Gone from inside the stream: ``max_msgs_per_subject``, or a message deleted by hand.
    DELETED = "deleted"
    #: Still in the stream, but stored before the subscription's durable was made again (it started after it).
    DURABLE_REMADE = "durable_remade"
    #: Still in the stream and passed by its durable without a claim here: another consumer of the
    #: durable acked it, or its own copy went before it read it and the one left was a re-send for others.
    PASSED_OVER = "passed_over"


#: What each cause means, in the WARNING and the command's output (English,
#: as the logs are); the overview translates it (``gettext_noop``: extracted).
CAUSE_TEXT = {
    ReconcileCause.STREAM_REPLACED: gettext_noop("the stream it was stored in was reset or lost"),
    ReconcileCause.DISCARDED: gettext_noop("aged out (max_age), dropped by a limit (max_msgs, max_bytes) or purged"),
    ReconcileCause.DELETED: gettext_noop("deleted from inside the stream (max_msgs_per_subject, or by hand)"),
    ReconcileCause.DURABLE_REMADE: gettext_noop("its durable was deleted and made again after it"),
    ReconcileCause.PASSED_OVER: gettext_noop("acknowledged on its durable without being handled here"),
}


def late_stamp_seconds() -> float:
    """How long after the stream stored a row its stamp may still commit with
    that sequence: a re-send within ``DUPLICATE_WINDOW_SECONDS`` is answered
    with the first copy's sequence, plus a batch's ack wait and commit."""
    return float(conf.settings.DUPLICATE_WINDOW_SECONDS) + 30.0


@dataclass
class SubscriptionReconciled:
    """What a pass did for one subscription: ``resent`` per cause (would
    re-send, for a dry run), ``examples`` (the first event ids), and
    ``note``: why it did nothing ("" when it was reconciled)."""

    name: str
    resent: Counter[ReconcileCause] = field(default_factory=Counter)
    examples: list[uuid.UUID] = field(default_factory=list)
    note: str = ""


@dataclass
class ReconcileReport:
    """One pass: when it began (the database's clock), the stream it judged
    by (``stream_created``), each subscription's result, and ``note``: why
    it did nothing at all ("" when it ran). ``failed``: the broker error that
    cut it short (what was re-sent before it stays re-sent)."""

    dry_run: bool
    started_at: datetime | None = None
    stream_created: datetime | None = None
    note: str = ""
    failed: str = ""
    subscriptions: dict[str, SubscriptionReconciled] = field(default_factory=dict)

    @property
    def resent(self) -> int:
        """Re-sends in all (a message for two subscriptions counts for each)."""
        return sum(sum(s.resent.values()) for s in self.subscriptions.values())

    def counts(self) -> str:
        """``subscription cause=count ...; ...`` of what was re-sent, with each cause's meaning once."""
        parts = [
            f"{s.name} " + " ".join(f"{cause}={n}" for cause, n in sorted(s.resent.items()))
            for s in self.subscriptions.values()
            if s.resent
        ]
        causes = sorted({cause for s in self.subscriptions.values() for cause in s.resent})
        return "; ".join(parts) + " (" + "; ".join(f"{c}: {CAUSE_TEXT[c]}" for c in causes) + ")"


def reconcile(
    broker: Broker,
    *,
    owner: str,
    instance: str | None,
    declared: Sequence[Subscription] | None = None,
    using: str | None = None,
    dry_run: bool = False,
    skip_reconciled_within_seconds: float = 0.0,
) -> ReconcileReport:
    """One reconciliation pass: re-send what the stream no longer holds for a
    subscription that is owed it and has not handled it.

    Args:
        broker: A connected broker.
        owner: This database's identity; ``instance``: its instance (a
            stream another database holds is left alone).
        declared: The subscriptions to reconcile (default: every declared one).
        using: The database alias of the outbox (default ``DATABASE_ALIAS``).
        dry_run: Find and count, send and write nothing.
        skip_reconciled_within_seconds: Leave a subscription another pass
            reconciled this recently (the workers' passes; 0 by hand).

    Returns:
        What the pass re-sent (or would), per subscription and cause, or why it did nothing.

    Raises:
        BrokerUnavailable: NATS didn't answer before anything was done.
    """
    alias = using or conf.settings.DATABASE_ALIAS
    subs = list(subscriptions() if declared is None else declared)
    report = ReconcileReport(dry_run=dry_run)
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        at = report.started_at = cursor.fetchone()[0]
    facts = broker.stream_facts(owner=owner, instance=instance)
    if facts is None:
        report.note = f"there is no stream {conf.settings.STREAM!r} yet: a worker or relay makes it"
    elif facts.standing.refused or facts.standing.contested:
        report.note = f"nothing re-sent into a stream this database must not use now: {facts.standing.text}"
    elif facts.created is None:
        report.note = "the broker gave no creation time for the stream: nothing can be reconciled"
    if facts is None or facts.created is None or report.note:
        for sub in subs:
            report.subscriptions[sub.name] = SubscriptionReconciled(sub.name, note=report.note)
        if not dry_run:
            rows.record_note([s.name for s in subs], report.note, at=at, using=alias)
        return report
    report.stream_created = created = facts.created
    durables = dict(zip([s.name for s in subs], broker.durable_facts([s.durable for s in subs]), strict=True))
    records = rows.read_records([s.name for s in subs], using=alias)
    for sub in subs:
        result = report.subscriptions[sub.name] = SubscriptionReconciled(sub.name)
        if sub.name not in records:
            if durables[sub.name] is None:
                result.note = "no durable yet: reconciled once a worker made it"
                continue
            # A durable made before this build recorded origins: owed what is stored from now on.
            if not dry_run:
                rows.record_origin(sub.name, (created, facts.last_seq), using=alias)
            result.note = "first seen now: reconciled from the next pass on"
    by_event = itertools.groupby(
        sorted((s for s in subs if s.name in records), key=lambda s: s.event), lambda s: s.event
    )
    try:
        for event, group in by_event:
            _EventPass(broker, event, list(group), facts, durables, records, report, alias, at).run(
                skip_within=skip_reconciled_within_seconds
            )
    except BrokerUnavailable as exc:
        report.failed = str(exc)
        logger.error("reconciliation cut short, tried again next pass error=%s", exc)
    _tell(report)
    return report


def horizon(facts: StreamFacts, durable: DurableFacts | None) -> int:
    """The stream sequence at or below which the subscription's durable
    will never deliver anything more (see the module docstring)."""
    below_first = max(0, facts.first_seq - 1)
    if durable is None:
        return below_first
    return min(facts.last_seq, max(durable.settled_through, below_first))


class _EventPass:
    """One pass over the subscriptions of one event: their windows read,
    their lost rows re-sent once for every subscription that lost them."""

    def __init__(
        self,
        broker: Broker,
        event: str,
        group: list[Subscription],
        facts: StreamFacts,
        durables: dict[str, DurableFacts | None],
        records: dict[str, rows.SubscriptionRecord],
        report: ReconcileReport,
        using: str,
        at: datetime,
    ) -> None:
        self.broker, self.event, self.group, self.facts = broker, event, group, facts
        self.durables, self.records, self.report, self.using, self.at = durables, records, report, using, at
        assert facts.created is not None
        self.created: datetime = facts.created
        self.horizons = {s.name: (self.created, horizon(facts, durables[s.name])) for s in group}

    def run(self, *, skip_within: float) -> None:
        names = [s.name for s in self.group]
        recent = [
            n for n in names if (r := self.records[n].reconciled_at) and r > self.at - timedelta(seconds=skip_within)
        ]
        if skip_within and recent:
            for name in names:
                self.report.subscriptions[name].note = "reconciled by another pass just now"
            return
        dry_run = self.report.dry_run
        for sub in self.group:
            record = self.records[sub.name]
            start, until = record.start, self.horizons[sub.name]
            while until > start:
                with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
                    if not dry_run and rows.lock_records(cursor, names) != set(names):
                        for name in names:
                            self.report.subscriptions[name].note = "another pass is reconciling it"
                        return
                    batch = rows.window_batch(
                        cursor,
                        subscription=sub.name,
                        event=self.event,
                        others=names,
                        after=start,
                        until=until,
                        batch=BATCH_SIZE,
                    )
                    self._judge(cursor, sub, batch)
                if len(batch) < BATCH_SIZE:
                    break
                start = batch[-1].position
        if not dry_run:
            self._passed()

    def _judge(self, cursor: object, sub: Subscription, batch: list[rows.WindowRow]) -> None:
        """Find whom each row of ``sub``'s window is lost for, and why; re-send it to them."""
        if not batch:
            return
        first, last = self.facts.first_seq, self.facts.last_seq
        held = self.broker.messages_at([r.position[1] for r in batch if first <= r.position[1] <= last])
        lost: list[tuple[rows.WindowRow, list[str], dict[str, ReconcileCause]]] = []
        for row in batch:
            message = held.get(row.position[1])
            if row.position[0] != self.created and self._held_after_all(row, message):
                if not self.report.dry_run:
                    rows.restamp(cursor, row, self.created)
                continue
            # One message for every subscription of the event that lost it, not one each. A dry run
            # counts each subscription in its own window only: nothing moves, so none is counted twice;
            # a real pass re-stamps what it sends, so another subscription's window no longer meets it.
            causes = {sub.name: self._cause(row, message, self.durables[sub.name])}
            for other in self.group if not self.report.dry_run else ():
                name = other.name
                owed = self.records[name].origin < row.position <= self.horizons[name]
                if name != sub.name and owed and name not in row.claimed_by:
                    causes[name] = self._cause(row, message, self.durables[name])
            lost.append((row, list(causes), causes))
        sent = lost if self.report.dry_run else self._resend(cursor, lost)
        for row, targets, causes in sent:
            for name in targets:
                result = self.report.subscriptions[name]
                result.resent[causes[name]] += 1
                if len(result.examples) < 5:
                    result.examples.append(row.id)

    def _held_after_all(self, row: rows.WindowRow, message: HeldMessage | None) -> bool:
        """A row stamped with a stream replaced while its batch was sent, whose
        message the current stream holds at its sequence after all."""
        return message is not None and message.msg_id == message_id(str(row.id), row.replay)

    def _cause(self, row: rows.WindowRow, message: HeldMessage | None, durable: DurableFacts | None) -> ReconcileCause:
        created, seq = row.position
        if created != self.created:
            return ReconcileCause.STREAM_REPLACED
        if seq < self.facts.first_seq:
            return ReconcileCause.DISCARDED
        if message is None:
            return ReconcileCause.DELETED
        if message.msg_id != message_id(str(row.id), row.replay):
            return ReconcileCause.STREAM_REPLACED  # another message there: the stamp named a replaced stream
        made, stored = (durable.created if durable else None), message.stored_at
        if made is not None and stored is not None and made > stored:
            return ReconcileCause.DURABLE_REMADE
        return ReconcileCause.PASSED_OVER

    def _resend(
        self, cursor: object, lost: list[tuple[rows.WindowRow, list[str], dict[str, ReconcileCause]]]
    ) -> list[tuple[rows.WindowRow, list[str], dict[str, ReconcileCause]]]:
        """Re-send ``lost`` (each to its subscriptions), in this transaction:
        taken, sent, stamped where the stream stored it now. Raises
        ``BrokerUnavailable`` (the transaction rolls back: the next pass sends
        again, under the same id, so the broker keeps one copy) when the
        stream did not store every one."""
        if not lost:
            return []
        taken = rows.take_for_resend(cursor, [(row, targets) for row, targets, _ in lost])
        prefix = conf.settings.SUBJECT_PREFIX
        messages = [replace(compose(prefix, *r[2:]), targets=tuple(r[1].split(","))) for r in taken]
        pending = self.broker.publish_start(messages)
        results = pending.results()
        refused = [r for r in results if r.outcome is not PublishOutcome.STORED]
        if refused:
            raise BrokerUnavailable(f"{len(refused)} of {len(results)} re-sends not stored: {refused[0].error}")
        stamp_sent(cursor, [r[0] for r in taken], [r.seq for r in results], stream_created=pending.stream_created)
        by_id = {row.id: (row, causes) for row, _, causes in lost}
        return [(by_id[uuid.UUID(r[2])][0], r[1].split(","), by_id[uuid.UUID(r[2])][1]) for r in taken]

    def _passed(self) -> None:
        """Record the pass: the staged horizon becomes the cursor once no late
        stamp can land below it, and the horizon seen now is staged."""
        late = timedelta(seconds=late_stamp_seconds())
        with transaction.atomic(using=self.using), connections[self.using].cursor() as cursor:
            for sub in self.group:
                record = self.records[sub.name]
                cursor_position, staged, staged_at = record.cursor, record.staged, record.staged_at
                if staged is not None and staged_at is not None and staged_at <= self.at - late:
                    cursor_position = max(cursor_position, staged) if cursor_position else staged
                    staged = None
                if staged is None:
                    staged, staged_at = self.horizons[sub.name], self.at
                resent = self.report.subscriptions[sub.name].resent
                rows.record_pass(
                    cursor,
                    record,
                    at=self.at,
                    cursor_position=cursor_position,
                    staged=staged,
                    staged_at=staged_at,
                    resent={str(cause): n for cause, n in resent.items()},
                )


def _tell(report: ReconcileReport) -> None:
    """The pass's one WARNING (when it re-sent) and the counters' signal."""
    if report.dry_run or not report.resent:
        return
    logger.warning(
        "reconciliation re-sent %s event(s) the stream no longer held for their subscriptions "
        "(to those subscriptions only; their claims keep each once): %s",
        report.resent,
        report.counts(),
    )
    for result in report.subscriptions.values():
        for cause, count in result.resent.items():
            signals.events_reconciled.send_robust(
                sender=ReconcileReport, subscription=result.name, cause=str(cause), count=count
            )
