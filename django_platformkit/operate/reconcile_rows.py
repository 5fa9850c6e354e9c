"""Reconciliation's rows (``reconcile.py`` decides, this reads and writes):
each subscription's state in ``platformkit_subscriptions`` - where it began,
how far it is reconciled - and the outbox rows in its window, found on the
``platformkit_outbox_stream`` index in stream order, and their re-send.

The one write path of ``platformkit_subscriptions``. A window is read in
batches (keyset on the stream position), so a pass over a seven-day outbox
of millions of rows stays bounded by what is new since the last pass.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connections

from django_platformkit import conf
from django_platformkit._tables import HANDLED_TABLE, OUTBOX_TABLE, SUBSCRIPTIONS_TABLE
from django_platformkit.outbox.relay import ENVELOPE_COLUMNS_SQL

#: A stream position: (the stream's creation time, a sequence in it).
type Position = tuple[datetime, int]


@dataclass(frozen=True)
class SubscriptionRecord:
    """A subscription's row: where it began (``origin``: nothing at or before
    it is owed to it), how far its events are reconciled (``cursor``), the
    horizon a pass saw and when (``staged``, ``staged_at``: promoted to the
    cursor once no late stamp can land below it), and its last pass."""

    name: str
    origin: Position
    cursor: Position | None
    staged: Position | None
    staged_at: datetime | None
    reconciled_at: datetime | None

    @property
    def start(self) -> Position:
        """Where its window starts: past its cursor and its origin."""
        return max(self.origin, self.cursor) if self.cursor is not None else self.origin


_RECORD_ORIGIN_SQL = (
    f"INSERT INTO {SUBSCRIPTIONS_TABLE} (name, origin_stream_created, origin_seq) VALUES (%s, %s, %s) "
    "ON CONFLICT (name) DO NOTHING"
)
_READ_SQL = (
    "SELECT name, origin_stream_created, origin_seq, reconciled_stream_created, reconciled_seq, "
    f"staged_stream_created, staged_seq, staged_at, reconciled_at FROM {SUBSCRIPTIONS_TABLE} WHERE name = ANY(%s)"
)
# Taken for the pass over one event, so two workers never reconcile the same
# subscriptions at once; SKIP LOCKED: the other pass has them, this one moves on.
_LOCK_SQL = f"SELECT name FROM {SUBSCRIPTIONS_TABLE} WHERE name = ANY(%s) ORDER BY name FOR UPDATE SKIP LOCKED"
_PASSED_SQL = f"""
UPDATE {SUBSCRIPTIONS_TABLE} SET reconciled_at = %(at)s, note = %(note)s,
    reconciled_stream_created = %(cursor_created)s, reconciled_seq = %(cursor_seq)s,
    staged_stream_created = %(staged_created)s, staged_seq = %(staged_seq)s, staged_at = %(staged_at)s,
    resent_at = CASE WHEN %(resent)s::jsonb = '{{}}'::jsonb THEN resent_at ELSE %(at)s END,
    resent = CASE WHEN %(resent)s::jsonb = '{{}}'::jsonb THEN resent ELSE %(resent)s::jsonb END
WHERE name = %(name)s
"""
_NOTE_SQL = f"UPDATE {SUBSCRIPTIONS_TABLE} SET reconciled_at = %s, note = %s WHERE name = ANY(%s)"

# One batch of a subscription's window: rows of its event stored after
# ``start`` and at or before its horizon, that it has no claim for, the outbox
# still holds (RETENTION_DAYS from the event's creation: a re-send keeps that,
# so an event nobody consumes is never sent round for ever), in stream order.
# Each row comes with the event's other subscriptions that have a claim.
_WINDOW_SQL = f"""
SELECT o.id, o.stream_created, o.stream_seq, o.headers->>'platformkit_replay',
       ARRAY(SELECT c.subscription FROM {HANDLED_TABLE} c
             WHERE c.event_id = o.id AND c.subscription = ANY(%(others)s::text[]))
FROM {OUTBOX_TABLE} o
WHERE o.name = %(event)s AND o.stream_seq IS NOT NULL
  AND (o.stream_created, o.stream_seq) > (%(after_created)s, %(after_seq)s)
  AND (o.stream_created, o.stream_seq) <= (%(until_created)s, %(until_seq)s)
  AND o.created_at > now() - make_interval(days => %(retention_days)s)
  AND NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.subscription = %(subscription)s AND c.event_id = o.id)
ORDER BY o.stream_created, o.stream_seq
LIMIT %(batch)s
"""

# The re-send of a batch: each row still stamped where the window found it
# (a replay, a republish or another pass may have moved it meanwhile: then it
# is theirs), not pending, not held by another transaction, gets a fresh
# Nats-Msg-Id (the replay count one up) and comes back with its envelope's
# columns and the subscriptions it is still owed to (a claim may have landed).
_RESEND_SQL = f"""
WITH wanted AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(created)s::timestamptz[], %(seqs)s::bigint[], %(targets)s::text[])
        AS w(id, created, seq, targets)
), locked AS (
    SELECT o.id, w.targets FROM {OUTBOX_TABLE} o JOIN wanted w ON o.id = w.id
    WHERE o.published_at IS NOT NULL AND o.stream_created = w.created AND o.stream_seq = w.seq
    ORDER BY o.id
    FOR NO KEY UPDATE OF o SKIP LOCKED
), owed AS (
    SELECT l.id, ARRAY(
        SELECT t FROM unnest(string_to_array(l.targets, ',')) AS t
        WHERE NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.subscription = t AND c.event_id = l.id)
    ) AS targets FROM locked l
)
UPDATE {OUTBOX_TABLE} o
SET headers = o.headers || jsonb_build_object('platformkit_replay', COALESCE((o.headers->>'platformkit_replay')::int, 0) + 1)
FROM owed WHERE o.id = owed.id AND cardinality(owed.targets) > 0
RETURNING o.ctid::text, array_to_string(owed.targets, ','), {ENVELOPE_COLUMNS_SQL}
"""
# A row stamped with a stream that was replaced while its batch was sent, found
# in the current stream after all: its stamp is corrected, nothing is re-sent.
_RESTAMP_SQL = (
    f"UPDATE {OUTBOX_TABLE} SET stream_created = %s WHERE id = %s AND stream_created = %s AND stream_seq = %s"
)


@dataclass(frozen=True)
class WindowRow:
    """An outbox row of a window: its id, where its last send was stored,
    its replay count (its message's id) and which of the event's other
    subscriptions hold a claim for it."""

    id: uuid.UUID
    position: Position
    replay: str | None
    claimed_by: frozenset[str]


def record_origin(name: str, origin: Position, *, using: str | None = None) -> bool:
    """Record where a subscription began, once: ``origin`` is the stream and
    the sequence its durable started after (its first existence). Kept when
    the durable is deleted: one made again is owed what it missed, and a
    ``backfill=False`` subscription is never owed what came before it.
    Returns whether it was recorded now (False: it was already)."""
    with connections[using or conf.settings.DATABASE_ALIAS].cursor() as cursor:
        cursor.execute(_RECORD_ORIGIN_SQL, [name, origin[0], origin[1]])
        return bool(cursor.rowcount)


def read_records(names: Sequence[str], *, using: str) -> dict[str, SubscriptionRecord]:
    """The recorded subscriptions among ``names``."""
    with connections[using].cursor() as cursor:
        cursor.execute(_READ_SQL, [list(names)])
        rows = cursor.fetchall()
    records = {}
    for name, oc, os_, rc, rs, sc, ss, sat, at in rows:
        records[name] = SubscriptionRecord(
            name=name,
            origin=(oc, int(os_)),
            cursor=(rc, int(rs)) if rc is not None else None,
            staged=(sc, int(ss)) if sc is not None else None,
            staged_at=sat,
            reconciled_at=at,
        )
    return records


def lock_records(cursor: Any, names: Sequence[str]) -> set[str]:
    """Lock these subscriptions' rows for this transaction; the names locked (another pass holds the rest)."""
    cursor.execute(_LOCK_SQL, [list(names)])
    return {row[0] for row in cursor.fetchall()}


def window_batch(
    cursor: Any, *, subscription: str, event: str, others: Sequence[str], after: Position, until: Position, batch: int
) -> list[WindowRow]:
    """Up to ``batch`` of the subscription's unclaimed rows stored after
    ``after`` and at or before ``until``, in stream order: the next batch
    starts after the last row of this one (keyset pagination)."""
    cursor.execute(
        _WINDOW_SQL,
        {
            "event": event,
            "others": list(others),
            "subscription": subscription,
            "after_created": after[0],
            "after_seq": after[1],
            "until_created": until[0],
            "until_seq": until[1],
            "retention_days": int(conf.settings.RETENTION_DAYS),
            "batch": batch,
        },
    )
    return [WindowRow(r[0], (r[1], int(r[2])), r[3], frozenset(r[4])) for r in cursor.fetchall()]


def take_for_resend(cursor: Any, rows: Sequence[tuple[WindowRow, Sequence[str]]]) -> list[tuple[Any, ...]]:
    """Lock and re-id the rows to re-send (each with the subscriptions it is
    for); returns, per row still to send: ``(ctid, targets "a,b", <the
    envelope columns>)``. A row moved, pending or locked meanwhile is left out."""
    cursor.execute(
        _RESEND_SQL,
        {
            "ids": "{" + ",".join(str(row.id) for row, _ in rows) + "}",
            "created": [row.position[0] for row, _ in rows],
            "seqs": [row.position[1] for row, _ in rows],
            "targets": [",".join(targets) for _, targets in rows],
        },
    )
    return list(cursor.fetchall())


def restamp(cursor: Any, row: WindowRow, created: datetime) -> None:
    """Correct a row's stream: its send was found in the current one."""
    cursor.execute(_RESTAMP_SQL, [created, row.id, row.position[0], row.position[1]])


def record_pass(
    cursor: Any,
    record: SubscriptionRecord,
    *,
    at: datetime,
    cursor_position: Position | None,
    staged: Position | None,
    staged_at: datetime | None,
    resent: dict[str, int],
) -> None:
    """A subscription's pass is done: its cursor, staged horizon and what it re-sent (``{cause: count}``)."""
    cursor.execute(
        _PASSED_SQL,
        {
            "name": record.name,
            "at": at,
            "note": "",
            "cursor_created": cursor_position[0] if cursor_position else None,
            "cursor_seq": cursor_position[1] if cursor_position else 0,
            "staged_created": staged[0] if staged else None,
            "staged_seq": staged[1] if staged else 0,
            "staged_at": staged_at,
            "resent": json.dumps(resent),
        },
    )


def record_note(names: Sequence[str], note: str, *, at: datetime, using: str) -> None:
    """Why a pass did nothing for these subscriptions (a foreign or contested stream, ...)."""
    with connections[using].cursor() as cursor:
        cursor.execute(_NOTE_SQL, [at, note, list(names)])
