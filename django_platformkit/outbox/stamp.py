"""The stamp: marking outbox rows as sent once the stream stored them, with
where it stored them. The one write of ``published_at``, ``stream_created``
and ``stream_seq`` after a send, so every path that sends a row - the relay's
batch, reconciliation's targeted re-send, a relay on another path - records
the same thing.

``published_at`` starts the row's retention (``purgeoutbox`` counts from it,
and a message can't outlive the claim that guards it); ``stream_created``
(which stream: a reset or lost one is made again with another creation time)
and ``stream_seq`` (the PubAck's sequence) are what reconciliation reads to
find a send the stream no longer holds. Written in the UPDATE the send
already makes, so the hot path pays two columns and one partial index, not a
statement: about 1.7 us per row (bench/README.md, "Reconciliation's cost").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django_platformkit._tables import OUTBOX_TABLE


class StampKey(enum.Enum):
    """How the rows to stamp are named."""

    #: By ``ctid``: rows this transaction selected ``FOR UPDATE`` (their ctid
    #: can't change meanwhile); a TID scan per row, whatever the plan settings.
    CTID = "tid"
    #: By id (rows the caller holds by other means, or a fallback), through the primary key.
    ID = "uuid"


#: The stamp, per way of naming the rows. clock_timestamp(): the moment the
#: acks were in, not the transaction's start.
STAMP_SQL = {
    StampKey.CTID: (
        f"UPDATE {OUTBOX_TABLE} o SET published_at = clock_timestamp(), stream_created = %s, stream_seq = s.seq "
        "FROM unnest(%s::tid[], %s::bigint[]) AS s(key, seq) WHERE o.ctid = s.key"
    ),
    # A join by id is planned as a hash join over the whole table when the
    # planner thinks it big: the key is looked up through the primary key instead.
    StampKey.ID: (
        f"UPDATE {OUTBOX_TABLE} o SET published_at = clock_timestamp(), stream_created = %s, stream_seq = s.seq "
        f"FROM unnest(%s::uuid[], %s::bigint[]) AS s(key, seq) WHERE o.id = s.key AND o.id = ANY(%s::uuid[])"
    ),
}


def _array(items: Sequence[Any]) -> str:
    """One PostgreSQL array literal: psycopg would adapt a list item by item."""
    return '{"' + '","'.join(str(item) for item in items) + '"}'


def stamp_sent(
    cursor: Any,
    keys: Sequence[str],
    seqs: Sequence[int | None],
    *,
    stream_created: datetime | None,
    key: StampKey = StampKey.CTID,
) -> int:
    """Stamp the rows named by ``keys`` as stored by the stream.

    Call it in the transaction that holds the rows (the relay's batch), after
    the broker acknowledged every one of them: a crash before the stamp
    re-sends, it never loses.

    Args:
        cursor: A cursor of the outbox's database, inside that transaction.
        keys: The rows' ctids (``StampKey.CTID``) or ids (``StampKey.ID``), as text.
        seqs: Each row's stream sequence from its PubAck (None: unknown, e.g.
            a broker that gave none), in the order of ``keys``.
        stream_created: The creation time of the stream the batch was sent
            to, as the broker knew it when the send started
            (``PendingPublish.stream_created``; None: unknown). A row stamped
            with an older stream than the one that stored it is re-sent by
            reconciliation if nobody handled it, never lost.
        key: How ``keys`` name the rows.

    Returns:
        How many rows were stamped.
    """
    if not keys:
        return 0
    if len(keys) != len(seqs):
        raise ValueError(f"stamp_sent(): {len(keys)} rows but {len(seqs)} sequences")
    numbers = "{" + ",".join("NULL" if seq is None else str(int(seq)) for seq in seqs) + "}"
    params: list[Any] = [stream_created, _array(keys), numbers]
    if key is StampKey.ID:
        params.append(params[1])
    cursor.execute(STAMP_SQL[key], params)
    return int(cursor.rowcount)
