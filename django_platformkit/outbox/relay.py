"""The relay: pending outbox rows -> JetStream -> stamped; and its LISTEN wake-up.

A batch is selected ``FOR UPDATE SKIP LOCKED`` in relay order, published
pipelined with ``Nats-Msg-Id`` = the event id, and stamped in the same
transaction only after every ack arrived: a crash between the two re-sends
(the broker drops the duplicate within its window), it never loses. Several
relays run side by side; none waits on another's rows. There is no "last id
seen" cursor, so a row that commits late still goes out. The stamp
(``stamp.py``) also records where the stream stored each row, which
reconciliation reads.

Why one module: selecting, sending, settling and stamping a batch are one
transaction and one guarantee (stamped only after the broker stored it),
and the loop that paces those batches (its LISTEN wake-up, its interval,
its summary line) is their only caller.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections, transaction

from django_platformkit import conf, signals, tracing
from django_platformkit._retry import Backoff
from django_platformkit._tables import OUTBOX_TABLE
from django_platformkit.outage import Outage, is_database_error
from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS, record_dead_letter
from django_platformkit.outbox.listener import Listener
from django_platformkit.outbox.stamp import StampKey, stamp_sent
from django_platformkit.wire import OutgoingMessage, PublishOutcome, compose

if TYPE_CHECKING:
    from django_platformkit.broker.port import Broker, PendingPublish

logger = logging.getLogger(__name__)

#: The longest pause between two tries while the database is away: a
#: restart's end is noticed within this many seconds.
MAX_DATABASE_RETRY_SECONDS = 5.0

# Relay order is (created_at, id), walked on the pending-rows partial index.
# The plan must not depend on table statistics: right after a burst or a bulk
# load they still say the table is tiny, and the planner then sorts every
# pending row to find the oldest batch and stamps by a sequential scan - a
# cost that grows with the backlog and the table (measured: 64 ms instead of
# 0.5 ms per 500-row batch at 50k pending). Sorts and sequential scans are
# off for the relay's own transaction only (set_config(..., true) = SET
# LOCAL, so it is safe behind a transaction-pooling PgBouncer). JIT is off
# too: the disabled nodes' huge costs pass jit_above_cost, and compiling
# (measured: 290 ms on PG 15) dwarfs statements that take a millisecond.
_PLAN_SQL = (
    "SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true), "
    "set_config('jit', 'off', true)"
)
# Everything the envelope needs, as text: PostgreSQL formats the id and the
# time, so no UUID, datetime or JSON objects are built per row in Python.
# (ORDER BY names the table's columns: a bare "id" would be the id::text output column.)
#: The columns ``wire.compose`` takes after the subject prefix, over the alias
#: ``o``: every path that sends a row (this relay, reconciliation's re-send)
#: reads them alike.
ENVELOPE_COLUMNS_SQL = (
    "o.id::text, o.name, o.tenant, o.payload::text, "
    "to_char(o.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
    "o.headers->>'traceparent', o.headers->>'tracestate', o.headers->>'platformkit_replay'"
)
_COLUMNS_SQL = f"SELECT o.ctid::text, {ENVELOPE_COLUMNS_SQL} FROM {OUTBOX_TABLE} o "
# Two walks, each on its own partial index, so neither kind of row slows the
# other: deferred rows (a task's run_after) that are due, earliest due first,
# then rows without a not-before time in relay order. Deferred rows go first
# so a steady backlog can't starve them; the second walk runs only when the
# first left room in the batch (Append stops pulling once LIMIT is met, so
# it locks no row it won't send). A million rows due tomorrow are never
# visited: the first walk stops at the first row not yet due.
_SELECT_SQL = (
    # One parameter, the batch size, used by all three LIMITs.
    "SELECT b.* FROM (SELECT %s::bigint AS n) lim CROSS JOIN LATERAL ("
    f"SELECT * FROM ({_COLUMNS_SQL}WHERE o.published_at IS NULL AND o.not_before IS NOT NULL AND o.not_before <= now() "
    "ORDER BY o.not_before, o.id LIMIT lim.n FOR UPDATE SKIP LOCKED) deferred "
    f"UNION ALL SELECT * FROM ({_COLUMNS_SQL}WHERE o.published_at IS NULL AND o.not_before IS NULL "
    "ORDER BY o.created_at, o.id LIMIT lim.n FOR UPDATE SKIP LOCKED) plain LIMIT lim.n) b"
)
# The plan settings and the batch in one round trip, for a cursor that sends
# a statement with its parameters merged in (psycopg's ClientCursor, Django's
# default). In one simple query PostgreSQL plans each statement after the one
# before it ran, so the SELECT is planned with the settings in force. Under
# server-side binding (OPTIONS "server_side_binding") a statement can't carry
# another: there the two go one after the other (_merges_statements).
_PLAN_AND_SELECT_SQL = f"{_PLAN_SQL}; {_SELECT_SQL}"
# How long until the next deferred row is due (NULL: none), off the deferred
# index's first entry: the relay sleeps no longer than that.
_NEXT_DUE_SQL = (
    "SELECT EXTRACT(EPOCH FROM (min(not_before) - clock_timestamp()))::float8 "
    f"FROM {OUTBOX_TABLE} WHERE published_at IS NULL AND not_before IS NOT NULL"
)
# Pending rows not yet due (a task's run_after ahead), off the deferred index:
# `runrelay --once` reports them apart, so "left_pending=0" isn't read as "none left".
_DEFERRED_SQL = f"SELECT count(*) FROM {OUTBOX_TABLE} WHERE published_at IS NULL AND not_before > now()"


def _merges_statements(cursor: Any) -> bool:
    """Whether ``cursor`` (a Django cursor) binds parameters on the client,
    psycopg's ``ClientCursor``: then one ``execute`` may carry several
    statements, sent as one simple query (one round trip). Server-side
    binding sends one statement per ``execute``."""
    return isinstance(getattr(cursor, "cursor", cursor), psycopg.ClientCursor)


@dataclass
class RelayStats:
    """Row counts of one relay pass (``Relay.drain()``): rows ``selected``,
    ``stored`` by the stream (``duplicates`` among them), left pending after a
    ``temporary`` broker failure, and ``dead_lettered`` (refused for good).
    ``deferred``: rows still pending because they aren't due yet (a not-before
    time ahead, such as a task's ``run_after``), counted once after the pass
    by ``Worker.relay_once()``; ``drain()`` leaves it 0.
    ``+=`` adds another pass's counts."""

    selected: int = 0
    stored: int = 0
    duplicates: int = 0
    temporary: int = 0
    dead_lettered: int = 0
    deferred: int = 0

    def __iadd__(self, other: RelayStats) -> RelayStats:
        for key in self.__dataclass_fields__:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        return self


#: A busy relay logs what it relayed once per this many seconds at INFO
#: (each pass at DEBUG): 300 orders were 203 INFO lines, one per pass.
RELAY_SUMMARY_SECONDS = 10.0


class _RelaySummary:
    """What the relay sent since its last INFO line: one line per
    ``RELAY_SUMMARY_SECONDS`` while it relays, none while it is idle."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.since = time.monotonic()
        self.stored = self.duplicates = self.dead_lettered = self.passes = 0

    def add(self, stats: RelayStats) -> None:
        if stats.stored or stats.dead_lettered:
            self.stored += stats.stored
            self.duplicates += stats.duplicates
            self.dead_lettered += stats.dead_lettered
            self.passes += 1
        self.log()

    def log(self, *, force: bool = False) -> None:
        elapsed = time.monotonic() - self.since
        if not (force or elapsed >= RELAY_SUMMARY_SECONDS):
            return
        if self.passes:
            logger.info(
                "relayed count=%s duplicates=%s dead_lettered=%s passes=%s in the last %.0fs",
                self.stored,
                self.duplicates,
                self.dead_lettered,
                self.passes,
                elapsed,
            )
        self._start()


class Relay:
    """Moves pending outbox rows to JetStream.

    ``transport``: a connected ``Transport``. ``using``: the outbox's
    database alias. ``batch_size``: rows per transaction (``RELAY_BATCH_SIZE``).
    ``publish_timeout_seconds``: how long a batch waits for its acks before
    the missing ones count as temporary failures (rows stay pending).
    ``lanes``: batches in flight at once while a backlog drains
    (``RELAY_LANES``; 1 = one batch at a time).

    With a backlog, each lane runs its own batch transaction on its own
    connection: while one lane waits for its acks and stamps, the next
    selects and sends, so neither PostgreSQL nor NATS idles while the
    other works. Lanes select and send one after another, whole batches,
    so the stream receives rows in relay order as with one lane (while
    nothing fails: a row refused for now goes out again after the batches
    already sent behind it); a lane's rows are stamped only after all of
    its acks arrived.
    """

    def __init__(
        self,
        transport: Broker,
        *,
        using: str | None = None,
        batch_size: int | None = None,
        publish_timeout_seconds: float = 10.0,
        lanes: int | None = None,
    ) -> None:
        self.transport = transport
        self.using = using or conf.settings.DATABASE_ALIAS
        self.batch_size = batch_size or conf.settings.RELAY_BATCH_SIZE
        self.publish_timeout_seconds = publish_timeout_seconds
        self.lanes = lanes or conf.settings.RELAY_LANES
        self.totals = RelayStats()
        self.missing_stream = False
        self._turn = threading.Lock()  # held while a lane selects and sends: relay order
        self._totals_lock = threading.Lock()

    def _recreate_stream(self) -> None:
        """No stream answered: the broker may have lost it (a new server, a
        wiped store). Create it again rather than retrying into the void."""
        self.missing_stream = False
        try:
            from django_platformkit.identity import database_identity, database_instance

            self.transport.ensure_stream(owner=database_identity(self.using), instance=database_instance(self.using))
        except Exception as exc:
            logger.error("relay: stream check failed error=%s", exc)

    def next_wait_seconds(self, interval: float) -> float:
        """Seconds to sleep before the next pass: ``interval``, or less when
        a deferred row (a task's ``run_after``) falls due sooner, so it goes
        out on time rather than up to an interval late. One index probe."""
        try:
            with connections[self.using].cursor() as cursor:
                cursor.execute(_NEXT_DUE_SQL)
                due_in = cursor.fetchone()[0]
        except Exception as exc:
            if not is_database_error(exc):
                raise
            connections[self.using].close()
            return interval
        return interval if due_in is None else max(0.0, min(interval, due_in))

    def deferred_count(self) -> int:
        """Pending rows that aren't due yet (a not-before time ahead): rows a
        pass leaves alone, for a later one. One count on the deferred index."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(_DEFERRED_SQL)
            return int(cursor.fetchone()[0])

    def relay_batch(self) -> RelayStats:
        """Relay one batch of the oldest pending rows; return its counts.
        Safe to call from several threads at once (that is what lanes do)."""
        stats = RelayStats()
        # Outermost, so the producer spans end after the commit that stamps their rows.
        with (
            contextlib.ExitStack() as spans,
            transaction.atomic(using=self.using),
            connections[self.using].cursor() as cursor,
        ):
            with self._turn:
                if _merges_statements(cursor):
                    cursor.execute(_PLAN_AND_SELECT_SQL, [self.batch_size])
                    cursor.nextset()  # past the plan settings' row, to the batch
                else:
                    cursor.execute(_PLAN_SQL)
                    cursor.execute(_SELECT_SQL, [self.batch_size])
                rows = cursor.fetchall()
                stats.selected = len(rows)
                if not rows:
                    return stats
                prefix = conf.settings.SUBJECT_PREFIX
                messages = [compose(prefix, *row[1:]) for row in rows]
                spans.enter_context(tracing.producer_spans(messages, ((r[1], r[2], r[6], r[7]) for r in rows)))
                pending = self.transport.publish_start(messages, timeout=self.publish_timeout_seconds)
            first_temporary = self._settle(cursor, rows, messages, pending, stats)
        if stats.temporary:
            logger.error(
                "relay: %s of %s rows not accepted, left pending, will retry error=%s",
                stats.temporary,
                stats.selected,
                first_temporary,
            )
        with self._totals_lock:
            self.totals += stats
        if signals.events_relayed.receivers:
            signals.events_relayed.send_robust(
                sender=Relay,
                stored=stats.stored,
                duplicates=stats.duplicates,
                dead_lettered=stats.dead_lettered,
                temporary=stats.temporary,
            )
        return stats

    def _settle(
        self,
        cursor: Any,
        rows: list[tuple[Any, ...]],
        messages: list[OutgoingMessage],
        pending: PendingPublish,
        stats: RelayStats,
    ) -> str:
        """Wait for a batch's acks; dead-letter what the broker refused for
        good; stamp what it stored (and the dead-lettered rows). Returns the
        first temporary failure's error ("" when there was none)."""
        first_temporary = ""
        done: list[str] = []
        done_ids: list[str] = []
        done_seqs: list[int | None] = []
        for row, message, result in zip(rows, messages, pending.results(), strict=True):
            if result.outcome is PublishOutcome.STORED:
                stats.stored += 1
                stats.duplicates += result.duplicate
            elif result.outcome is PublishOutcome.PERMANENT:
                # Dead-letter it and stamp it, so the rows behind it go on.
                # The dead letter keeps the row from purge; replay() can send it again.
                event_id = uuid.UUID(row[1])
                record_dead_letter(
                    subscription=RELAY_DEAD_LETTERS,
                    event_id=event_id,
                    name=row[2],
                    tenant=row[3],
                    attempts=1,
                    error=f"the broker refused the message for good ({len(message.body)} bytes): {result.error}",
                    traceback="",
                    using=self.using,
                )
                logger.error(
                    "relay dead letter event_id=%s name=%s bytes=%s error=%s",
                    event_id,
                    row[2],
                    len(message.body),
                    result.error,
                )
                stats.dead_lettered += 1
            else:
                stats.temporary += 1
                first_temporary = first_temporary or result.error
                self.missing_stream = self.missing_stream or result.no_stream
                continue
            done.append(row[0])
            done_ids.append(row[1])
            done_seqs.append(result.seq)  # None for a dead-lettered row: never stored, never reconciled
        if done:
            # Stamp after the broker acknowledged: a crash before this line
            # re-sends (deduplicated by Nats-Msg-Id), it never loses.
            created = pending.stream_created
            stamped = stamp_sent(cursor, done, done_seqs, stream_created=created)
            if stamped != len(done):  # can't happen while the rows are locked; never leave one behind if it does
                logger.warning("relay: stamped %s of %s rows by ctid; stamping by id", stamped, len(done))
                stamp_sent(cursor, done_ids, done_seqs, stream_created=created, key=StampKey.ID)
        return first_temporary

    def drain(self, stop: threading.Event | None = None) -> RelayStats:
        """Relay batches until one comes back short (or the broker is
        refusing for now, or ``stop`` is set: a stopping worker doesn't
        drain a million-row backlog first). Returns the summed counts.

        The first batch runs alone in the calling thread; only when it is
        full (a backlog) do the other lanes start, each a thread with its
        own database connection, closed when the drain ends. Raises the
        first exception any lane met (typically a ``DatabaseError``) once
        every lane stopped; the others are logged."""
        total = RelayStats()
        stats = self.relay_batch()
        total += stats
        if self._finished(stats, stop):
            return total
        over = threading.Event()
        lock = threading.Lock()
        errors: list[BaseException] = []

        def lane() -> None:
            try:
                while not over.is_set():
                    stats = self.relay_batch()
                    with lock:
                        total.__iadd__(stats)
                    if self._finished(stats, stop):
                        over.set()
            except BaseException as exc:
                errors.append(exc)
                over.set()

        def helper() -> None:
            try:
                lane()
            finally:
                connections[self.using].close()  # this thread's own connection

        helpers = [
            threading.Thread(target=helper, name=f"platformkit-relay-lane-{i}", daemon=True)
            for i in range(1, self.lanes)
        ]
        for thread in helpers:
            thread.start()
        try:
            lane()
        finally:
            over.set()
            for thread in helpers:
                thread.join()
        for extra in errors[1:]:
            logger.error("relay lane failed too error=%s", extra)
        if errors:
            raise errors[0]
        return total

    def _finished(self, stats: RelayStats, stop: threading.Event | None) -> bool:
        return stats.selected < self.batch_size or bool(stats.temporary) or (stop is not None and stop.is_set())

    def run(self, stop: threading.Event) -> None:
        """Drain, then sleep until a ``publish()`` commit notifies us (LISTEN)
        or ``RELAY_INTERVAL_SECONDS`` pass; repeat until ``stop``. Database
        and broker errors are logged and retried with backoff; rows stay
        pending until they are relayed. A database outage of any length
        (restart, refused connections, ``max_connections``) is waited out:
        two log lines, its start and its end (``outage.Outage``)."""
        interval = float(conf.settings.RELAY_INTERVAL_SECONDS)
        listener = Listener(self.using) if conf.settings.RELAY_LISTEN else None
        broker_delay = Backoff(0.5, 10.0)
        database_delay = Backoff(0.5, MAX_DATABASE_RETRY_SECONDS)
        outage = Outage("relay", logger)
        # When the next deferred row falls due (monotonic; None: none within
        # the interval) and when that was last asked. A pass that relayed rows
        # reuses an answer younger than due_recheck_seconds: under a steady
        # stream of commits the probe was one more round trip per pass.
        due_at: float | None = None
        due_checked = float("-inf")
        due_recheck_seconds = min(interval, 0.25)
        logger.info(
            "relay started batch_size=%s listen=%s interval=%ss", self.batch_size, listener is not None, interval
        )
        summary = _RelaySummary()
        try:
            while not stop.is_set():
                try:
                    if listener is not None:
                        listener.ensure()
                    stats = self.drain(stop)
                    outage.recovered()
                    database_delay.reset()
                    if stats.stored or stats.dead_lettered:
                        logger.debug(
                            "relayed count=%s duplicates=%s dead_lettered=%s",
                            stats.stored,
                            stats.duplicates,
                            stats.dead_lettered,
                        )
                    summary.add(stats)
                    if stats.temporary:
                        if self.missing_stream:
                            self._recreate_stream()
                        stop.wait(broker_delay.next())
                        continue
                    broker_delay.reset()
                except Exception as exc:
                    # Django wraps the ORM's errors in DatabaseError, but the
                    # listener's psycopg connection raises psycopg's own: both
                    # are an outage to wait out, never a reason to exit.
                    if not is_database_error(exc):
                        raise
                    wait = database_delay.next()
                    outage.failed(exc, wait)
                    connections[self.using].close()
                    if listener is not None:
                        listener.close()
                    stop.wait(wait)
                    continue
                now = time.monotonic()
                if not stats.selected or now - due_checked >= due_recheck_seconds:
                    # An idle pass (a notify for a deferred row, or the interval) always asks:
                    # a row deferred by less than the interval goes out on time.
                    due_in = self.next_wait_seconds(interval)
                    due_checked = now
                    due_at = now + due_in if due_in < interval else None
                wait = interval if due_at is None else max(0.0, min(interval, due_at - now))
                if listener is not None:
                    listener.wait(wait, stop)
                else:
                    stop.wait(wait)
        finally:
            summary.log(force=True)
            if listener is not None:
                listener.close()
            connections[self.using].close()
            logger.info("relay stopped relayed=%s dead_lettered=%s", self.totals.stored, self.totals.dead_lettered)
