"""Recovery from a lost broker store: ``republish()`` puts outbox rows the
relay already sent back to pending, so it sends them again - for when the
broker lost them (one replica and its store lost, a stream deleted or
purged by hand). The outbox is the authority, and exactly once still holds: every
subscription's claim skips an event it already handled, and a dead
letter's terminal claim keeps that event a dead letter.

A republished row gets a fresh ``Nats-Msg-Id``, as a replay does (the
``platformkit_replay`` count, ``wire.message_id``). With the old id,
JetStream drops a re-send it saw less than ``DUPLICATE_WINDOW_SECONDS`` ago,
and a stream emptied by ``nats stream purge`` still remembers the ids it no
longer holds (measured against nats-server 2.9), so a re-send right after a
purge would be dropped and the message lost for good. Where the broker did
still have the message, a subscription gets it twice and its claim skips
the second.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS
from django_platformkit.outbox.events import NOTIFY_CHANNEL

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 1000

# A row the broker refused for good was dead-lettered by the relay and
# stamped without ever reaching the stream: nothing of it was lost, and a
# re-send would only be refused again. Its tool is replay(). Told by the
# relay's terminal claim, not its dead letter: discard() deletes the dead
# letter and keeps the claim (the refusal accepted: still never in the
# stream), replay() deletes both (the row is then the relay's again).
_NOT_REFUSED = (
    f"NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.event_id = o.id AND c.subscription = '{RELAY_DEAD_LETTERS}')"
)
_WINDOW = "o.published_at >= %(since)s AND o.published_at < %(until)s"
_NAMES = " AND o.name = ANY(%(names)s::text[])"


def _take(candidates: str) -> str:
    """The ``locked`` and ``done`` CTEs over the ids of CTE ``candidates``:
    lock those still in the window (skipping a row another transaction
    holds), set them pending with a fresh ``Nats-Msg-Id`` (the replay count
    one up), one row returned per row taken."""
    return f"""locked AS (
    SELECT o.id FROM {OUTBOX_TABLE} o JOIN {candidates} USING (id)
    WHERE {_WINDOW}
    FOR NO KEY UPDATE OF o SKIP LOCKED
), done AS (
    UPDATE {OUTBOX_TABLE} o SET published_at = NULL,
        headers = o.headers || jsonb_build_object('platformkit_replay', COALESCE((o.headers->>'platformkit_replay')::int, 0) + 1)
    FROM locked WHERE o.id = locked.id RETURNING 1
)"""


# One batch, walked in (published_at, id) order from where the last batch
# stopped, on the published-rows partial index. Rows are locked FOR NO KEY
# UPDATE SKIP LOCKED: a replay or purge holding a row is never waited for
# (its row is left, and counted), and the FOR KEY SHARE a dead letter takes
# on its row doesn't conflict. The window is re-checked on the row version
# we lock: a row replayed or re-relayed meanwhile is no longer ours to take.
_BATCH_SQL = f"""
WITH page AS (
    SELECT o.id, o.published_at FROM {OUTBOX_TABLE} o
    WHERE {_WINDOW} AND (o.published_at, o.id) > (%(after_at)s, %(after_id)s){{names}}
    ORDER BY o.published_at, o.id LIMIT %(batch)s
), eligible AS (
    SELECT o.id FROM page o WHERE {_NOT_REFUSED}
), {_take("eligible")}, last AS (
    SELECT published_at, id FROM page ORDER BY published_at DESC, id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM page), (SELECT count(*) FROM done),
       (SELECT published_at FROM last), (SELECT id FROM last),
       (SELECT coalesce(array_agg(e.id), ARRAY[]::uuid[]) FROM eligible e WHERE NOT EXISTS (SELECT 1 FROM locked l WHERE l.id = e.id))
"""
# The rows a batch did not take, once more when the walk is done: by then
# the transaction that held one has mostly ended. One a concurrent republish
# or replay set pending, a purge deleted, or the relay stamped again (out
# of the window) needs nothing and is not counted; what is still in the
# window and still held is the true skipped_locked. (``left`` reads the
# statement's snapshot, in which what ``done`` takes is still there.)
_RETRY_SQL = f"""
WITH left_ AS (
    SELECT o.id FROM {OUTBOX_TABLE} o WHERE o.id = ANY(%(ids)s::uuid[]) AND {_WINDOW} AND {_NOT_REFUSED}
), {_take("left_")}
SELECT (SELECT count(*) FROM left_), (SELECT count(*) FROM done)
"""
_DRY_SQL = f"SELECT count(*) FROM {OUTBOX_TABLE} o WHERE {_WINDOW} AND {_NOT_REFUSED}{{names}}"


@dataclass(frozen=True)
class RepublishResult:
    """What ``republish()`` did (or, with ``dry_run``, would do).

    ``since``/``until``: the window as the database resolved it (aware
    datetimes; rows with ``since <= published_at < until``).
    ``republished``: rows set pending again (would be). ``skipped_locked``:
    rows of the window another transaction (a replay, a purge, another
    republish) still held when tried once more at the end, left as they
    were; a skipped row that transaction set pending or deleted meanwhile
    needed nothing and is not counted. ``batches``: transactions used (0
    for a dry run).
    """

    since: datetime
    until: datetime
    dry_run: bool
    republished: int = 0
    skipped_locked: int = 0
    batches: int = 0


def republish(
    *,
    since: datetime | timedelta,
    until: datetime | timedelta | None = None,
    events: Sequence[str] | None = None,
    reason: str,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    using: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RepublishResult:
    """Set outbox rows published in a window pending again, so the relay sends them again.

    The tool for messages the broker lost after the relay stamped them (one
    replica and its store lost, a stream deleted or purged by hand; see the
    docs' "Running NATS in production"). Exactly once still holds: each
    subscription's claim skips an event it already handled, and a
    dead-lettered event keeps its terminal claim. The re-send gets a fresh
    ``Nats-Msg-Id``, so the broker's duplicate window can't drop it. Rows
    are taken ``FOR NO KEY UPDATE SKIP LOCKED``, so it never waits on the relay.

    Args:
        since: Where the window on ``published_at`` starts: an aware datetime,
            or a positive ``timedelta`` meaning that long before the database's clock.
        until: Where it ends (the same forms); default and at most now, so
            rows the relay stamps during the run are never taken again.
        events: Event names to limit it to (None: every event). A row the
            relay dead-lettered (it never reached the stream) is left to ``replay()``.
        reason: Why, logged at INFO with the window and the count.
        dry_run: Count, write nothing.
        batch_size: Rows per transaction (each commits on its own outside
            ``transaction.atomic``).
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).
        progress: Called as ``progress(republished_so_far, batches)`` after every batch but the last.

    Returns:
        How many rows were republished (or would be, with ``dry_run``), and
        how many were skipped because another transaction held them.

    Raises:
        ValueError: Writing nothing, for a blank ``reason``, a bound that is
            neither an aware datetime nor a positive timedelta, an empty
            window, ``events`` that isn't a non-empty list of names, or a
            batch size below 1.
    """
    reason = str(reason or "").strip()
    if not reason:
        raise ValueError("republish() needs a reason: say why these events are sent again (it is logged).")
    _check_bound("since", since)
    if until is not None:
        _check_bound("until", until)
    names = _names(events)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        # clock_timestamp(), not now(): the relay stamps with it, and inside
        # a caller's transaction now() would be that transaction's start.
        cursor.execute("SELECT clock_timestamp()")
        db_now = cursor.fetchone()[0]
    start = db_now - since if isinstance(since, timedelta) else since
    end = db_now if until is None else (db_now - until if isinstance(until, timedelta) else min(until, db_now))
    if end <= start:
        raise ValueError(
            f"the window is empty: since {start.isoformat()} is not before until {end.isoformat()} "
            "(until defaults to now): give a since before until."
        )
    params = {"since": start, "until": end, "names": names}
    where_names = _NAMES if names is not None else ""
    if dry_run:
        with connections[alias].cursor() as cursor:
            cursor.execute(_DRY_SQL.format(names=where_names), params)
            count = cursor.fetchone()[0]
        result = RepublishResult(since=start, until=end, dry_run=True, republished=count)
    else:
        result = _republish(alias, _BATCH_SQL.format(names=where_names), params, start, end, batch_size, progress)
    logger.info(
        "%s rows=%s skipped_locked=%s since=%s until=%s events=%s batches=%s reason=%s",
        "republish dry run" if dry_run else "republished",
        result.republished,
        result.skipped_locked,
        start.isoformat(),
        end.isoformat(),
        ",".join(names) if names is not None else "*",
        result.batches,
        reason,
    )
    return result


def _check_bound(name: str, value: object) -> None:
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise ValueError(f"{name} must be a positive timedelta (that long ago), got {value!r}")
    elif not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime or a positive timedelta, got {value!r}")


def _names(events: Sequence[str] | None) -> list[str] | None:
    if events is None:
        return None
    # A lone string would be read as its letters.
    if isinstance(events, str) or not all(isinstance(e, str) and e for e in events) or not events:
        raise ValueError(f"events must be a non-empty list of event names (None: every event), got {events!r}")
    return sorted(set(events))


def _republish(
    alias: str,
    sql: str,
    params: dict[str, Any],
    start: datetime,
    end: datetime,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
) -> RepublishResult:
    after_at, after_id = start, uuid.UUID(int=0)
    done = batches = 0
    skipped_ids: list[uuid.UUID] = []
    while True:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql, {**params, "after_at": after_at, "after_id": after_id, "batch": batch_size})
            paged, gone, last_at, last_id, skipped_now = cursor.fetchone()
            _notify(cursor, gone)
        batches += 1
        done += gone
        skipped_ids += skipped_now
        if paged < batch_size:
            break
        if progress is not None:
            progress(done, batches)
        after_at, after_id = last_at, last_id
    skipped = 0
    if skipped_ids:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(_RETRY_SQL, {**params, "ids": skipped_ids})
            left, gone = cursor.fetchone()
            _notify(cursor, gone)
        batches += 1
        done += gone
        skipped = left - gone
    return RepublishResult(
        since=start, until=end, dry_run=False, republished=done, skipped_locked=skipped, batches=batches
    )


def _notify(cursor: Any, taken: int) -> None:
    if taken and conf.settings.RELAY_LISTEN:
        # Delivered at commit: a listening relay starts on them now, not
        # after its RELAY_INTERVAL_SECONDS.
        cursor.execute("SELECT pg_notify(%s, '')", [NOTIFY_CHANNEL])
