"""Retention: delete what no longer guards anything, never evidence.

Published outbox rows older than the cutoff go in bounded batches, each its
own short transaction that skips rows another transaction has locked (a
relay, a replay) instead of waiting; pending rows and rows a dead letter
describes stay. Then claims older than the cutoff whose outbox row is gone go,
except the terminal claims of dead letters. Dead letters stay until an
operator acts. The cutoff is the database's ``now()`` minus the age, and age
counts from ``published_at``.

The stream's max age equals the retention (``RETENTION_DAYS``, set by
``transport.stream_config``), so a message can't outlive the claim that
guards it: a redelivery older than the retention can't arrive after its
claim is purged.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connections, transaction

from . import conf
from ._tables import DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 1000

_NO_DEAD_LETTER = f"NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.event_id = o.id)"
_NOT_TERMINAL = f"NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.event_id = h.event_id AND d.subscription = h.subscription)"

# One batch of outbox rows, walked in (published_at, id) order from where the
# last batch stopped, so kept rows (dead-lettered, locked) and the dead tuples
# of deleted ones are never walked again. The lower bound on published_at
# keeps that walk on the partial index.
_OUTBOX_BATCH_SQL = f"""
WITH page AS (
    SELECT id, published_at FROM {OUTBOX_TABLE}
    WHERE published_at >= %(after_at)s AND published_at < %(cutoff)s AND (published_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY published_at, id LIMIT %(batch)s
), eligible AS (
    SELECT o.id FROM page o WHERE {_NO_DEAD_LETTER}
), doomed AS (
    -- Re-checked on the row version we lock: a replay that made it pending
    -- again wins. SKIP LOCKED: a row in use is left for the next purge.
    SELECT o.id FROM {OUTBOX_TABLE} o JOIN eligible USING (id)
    WHERE o.published_at < %(cutoff)s
    FOR UPDATE OF o SKIP LOCKED
), gone AS (
    DELETE FROM {OUTBOX_TABLE} o USING doomed WHERE o.id = doomed.id RETURNING 1
), last AS (
    SELECT published_at, id FROM page ORDER BY published_at DESC, id DESC LIMIT 1
)
SELECT (SELECT count(*) FROM page), (SELECT count(*) FROM eligible), (SELECT count(*) FROM gone),
       (SELECT published_at FROM last), (SELECT id FROM last)
"""

# One batch of claims, walked in id order (the primary key) from where the
# last batch stopped.
_CLAIMS_BATCH_SQL = f"""
WITH page AS (
    SELECT id, subscription, event_id FROM {HANDLED_TABLE}
    WHERE id > %(after_id)s AND handled_at < %(cutoff)s
    ORDER BY id LIMIT %(batch)s
), doomed AS (
    SELECT c.id FROM {HANDLED_TABLE} c JOIN page h USING (id)
    WHERE NOT EXISTS (SELECT 1 FROM {OUTBOX_TABLE} o WHERE o.id = h.event_id) AND {_NOT_TERMINAL}
    FOR UPDATE OF c SKIP LOCKED
), gone AS (
    DELETE FROM {HANDLED_TABLE} c USING doomed WHERE c.id = doomed.id RETURNING 1
)
SELECT (SELECT count(*) FROM page), (SELECT max(id) FROM page), (SELECT count(*) FROM gone)
"""

_DRY_OUTBOX_SQL = f"SELECT count(*) FROM {OUTBOX_TABLE} o WHERE o.published_at < %(cutoff)s AND {_NO_DEAD_LETTER}"
# A claim would go if its row is gone or would go itself.
_DRY_CLAIMS_SQL = f"""
SELECT count(*) FROM {HANDLED_TABLE} h
WHERE h.handled_at < %(cutoff)s AND {_NOT_TERMINAL}
  AND NOT EXISTS (
    SELECT 1 FROM {OUTBOX_TABLE} o WHERE o.id = h.event_id
      AND (o.published_at IS NULL OR o.published_at >= %(cutoff)s OR NOT {_NO_DEAD_LETTER})
  )
"""


@dataclass(frozen=True)
class PurgeResult:
    """What a purge did (or, with ``dry_run``, would do).

    ``cutoff``: the database time before which rows count as old.
    ``outbox_deleted``/``claims_deleted``: rows deleted (would be deleted).
    ``skipped_locked``: old rows left because another transaction held them.
    ``batches``: transactions used.
    """

    cutoff: datetime
    dry_run: bool
    outbox_deleted: int = 0
    claims_deleted: int = 0
    skipped_locked: int = 0
    batches: int = 0


def purge(*, older_than: timedelta | None = None, dry_run: bool = False, batch_size: int = DEFAULT_BATCH_SIZE, using: str | None = None) -> PurgeResult:
    """Delete published outbox rows older than ``older_than`` (default
    ``RETENTION_DAYS``) and the claims that no longer guard a row.

    ``batch_size``: rows per transaction (each batch commits on its own when
    called outside ``transaction.atomic``). ``dry_run``: count, delete
    nothing. ``using``: the outbox's database alias. Raises ``ValueError``
    for an age that isn't a positive ``timedelta`` or a batch size below 1.
    """
    if older_than is None:
        older_than = timedelta(days=float(conf.settings.RETENTION_DAYS))
    if not isinstance(older_than, timedelta) or older_than <= timedelta(0):
        raise ValueError(f"older_than must be a positive timedelta, got {older_than!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT now() - make_interval(secs => %s)", [older_than.total_seconds()])
        cutoff = cursor.fetchone()[0]
        if dry_run:
            cursor.execute(_DRY_OUTBOX_SQL, {"cutoff": cutoff})
            outbox = cursor.fetchone()[0]
            cursor.execute(_DRY_CLAIMS_SQL, {"cutoff": cutoff})
            result = PurgeResult(cutoff=cutoff, dry_run=True, outbox_deleted=outbox, claims_deleted=cursor.fetchone()[0])
            logger.info("purge dry run outbox=%s claims=%s cutoff=%s", result.outbox_deleted, result.claims_deleted, cutoff.isoformat())
            return result
    outbox, skipped, outbox_batches = _purge_outbox(alias, cutoff, batch_size)
    claims, claim_batches = _purge_claims(alias, cutoff, batch_size)
    result = PurgeResult(
        cutoff=cutoff, dry_run=False, outbox_deleted=outbox, claims_deleted=claims,
        skipped_locked=skipped, batches=outbox_batches + claim_batches,
    )
    level = logging.INFO if outbox or claims or skipped else logging.DEBUG
    logger.log(
        level, "purged outbox=%s claims=%s skipped_locked=%s batches=%s cutoff=%s",
        outbox, claims, skipped, result.batches, cutoff.isoformat(),
    )
    return result


def _purge_outbox(alias: str, cutoff: datetime, batch_size: int) -> tuple[int, int, int]:
    after_at, after_id = datetime.min.replace(tzinfo=UTC), uuid.UUID(int=0)
    deleted = skipped = batches = 0
    while True:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(_OUTBOX_BATCH_SQL, {"after_at": after_at, "after_id": after_id, "cutoff": cutoff, "batch": batch_size})
            paged, eligible, gone, last_at, last_id = cursor.fetchone()
        batches += 1
        deleted += gone
        skipped += eligible - gone
        if paged < batch_size:
            return deleted, skipped, batches
        after_at, after_id = last_at, last_id


def _purge_claims(alias: str, cutoff: datetime, batch_size: int) -> tuple[int, int]:
    after_id, deleted, batches = 0, 0, 0
    while True:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(_CLAIMS_BATCH_SQL, {"after_id": after_id, "cutoff": cutoff, "batch": batch_size})
            paged, last_id, gone = cursor.fetchone()
        batches += 1
        deleted += gone
        if paged < batch_size:
            return deleted, batches
        after_id = last_id
