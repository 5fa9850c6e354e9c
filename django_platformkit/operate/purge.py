"""Retention: delete what no longer guards anything, never evidence.

Published outbox rows older than the cutoff go in bounded batches, each its
own short transaction that skips rows another transaction has locked (a
relay, a replay) instead of waiting; pending rows and rows a dead letter
describes stay. Then claims whose outbox row is gone go, except the terminal
claims of dead letters, and the attempt history of what they guarded. Dead
letters stay until an operator acts. Cutoffs are the database's ``now()``
minus an age, and age counts from ``published_at`` (claims: ``handled_at``).

What the stream can still deliver is guarded whatever ``older_than`` says.
The stream keeps a message for its max age - ``RETENTION_DAYS`` when a
worker made it, but whatever the broker holds now counts: a stream made
before ``RETENTION_DAYS`` was lowered keeps its longer max age - and any
durable - one re-created after drift, removed with ``manage.py stream
prune``, a new worker - may deliver it again until then. So the retention
is the longer of ``RETENTION_DAYS`` and the stream's real max age, read
from the broker (a purge that can't read it deletes nothing), and within it:

- a claim is kept (without it a redelivery runs the handler a second time);
- an outbox row is kept while a subscription of this build has not handled
  it yet (no claim: handlers run only for events the outbox holds, with its
  payload) or while a retry is in flight (an ``Attempt`` without a claim, of
  any subscription: the dead letter it may end as needs the row to replay).

"This build" is the subscriptions registered in the purging process (the
worker's or ``purgeoutbox``'s: the same project code); a subscription that
only another deployment has is still guarded by the in-flight rule once it
started, and by the stream's own max age before that.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import ATTEMPTS_TABLE, DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit.broker.figures import stream_standing

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 1000
#: A long purge logs how far it has got this often (INFO): 200,000 rows took
#: 32 s in silence, which reads as a hang.
PROGRESS_EVERY_SECONDS = 5.0


class _Progress:
    """One INFO line per ``every_seconds`` while a purge runs: the phase
    (outbox, claims, attempts), the rows deleted so far and the batches."""

    def __init__(self, every_seconds: float) -> None:
        self.every_seconds = every_seconds
        self.started = self._last = time.monotonic()

    def batch(self, phase: str, deleted: int, batches: int) -> None:
        now = time.monotonic()
        if now - self._last < self.every_seconds:
            return
        self._last = now
        logger.info(
            "purge running phase=%s deleted=%s batches=%s elapsed=%.0fs", phase, deleted, batches, now - self.started
        )


_NO_DEAD_LETTER = f"NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.event_id = o.id)"
# Inside the stream's retention, a row is kept while some subscription of
# this build has no claim for it, or while a retry is in flight (an attempt
# without a claim). Past the retention the stream holds no copy to deliver.
_DELIVERABLE_DONE = (
    f"(o.published_at < %(retention_cutoff)s OR ("
    f"NOT EXISTS (SELECT 1 FROM unnest(%(subscriptions)s::text[], %(names)s::text[]) AS s(subscription, name) "
    f"WHERE s.name = o.name AND NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.subscription = s.subscription AND c.event_id = o.id)) "
    f"AND NOT EXISTS (SELECT 1 FROM {ATTEMPTS_TABLE} a WHERE a.event_id = o.id "
    f"AND NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.subscription = a.subscription AND c.event_id = a.event_id))))"
)
_NOT_TERMINAL = f"NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.event_id = h.event_id AND d.subscription = h.subscription)"

# One batch of outbox rows, walked in (published_at, id) order from where the
# last batch stopped, so kept rows (dead-lettered, locked) and the dead tuples
# of deleted ones are never walked again. The lower bound on published_at
# keeps that walk on the partial index.
_OUTBOX_BATCH_SQL = f"""
WITH page AS (
    SELECT id, name, published_at FROM {OUTBOX_TABLE}
    WHERE published_at >= %(after_at)s AND published_at < %(cutoff)s AND (published_at, id) > (%(after_at)s, %(after_id)s)
    ORDER BY published_at, id LIMIT %(batch)s
), eligible AS (
    SELECT o.id FROM page o WHERE {_NO_DEAD_LETTER} AND {_DELIVERABLE_DONE}
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

_DRY_OUTBOX_SQL = f"SELECT count(*) FROM {OUTBOX_TABLE} o WHERE o.published_at < %(cutoff)s AND {_NO_DEAD_LETTER} AND {_DELIVERABLE_DONE}"
# A claim would go if its row is gone or would go itself.
_DRY_CLAIMS_SQL = f"""
SELECT count(*) FROM {HANDLED_TABLE} h
WHERE h.handled_at < %(cutoff)s AND {_NOT_TERMINAL}
  AND NOT EXISTS (
    SELECT 1 FROM {OUTBOX_TABLE} o WHERE o.id = h.event_id
      AND (o.published_at IS NULL OR o.published_at >= %(cutoff)s OR NOT {_NO_DEAD_LETTER} OR NOT {_DELIVERABLE_DONE})
  )
"""

# Attempt history lives as long as the claims: an attempt goes once it is
# older than the claims' cutoff, its row is gone, and no claim or dead letter
# of its (subscription, event) is left.
_ATTEMPTS_BATCH_SQL = f"""
WITH page AS (
    SELECT id, subscription, event_id FROM {ATTEMPTS_TABLE}
    WHERE id > %(after_id)s AND started_at < %(cutoff)s
    ORDER BY id LIMIT %(batch)s
), doomed AS (
    SELECT t.id FROM {ATTEMPTS_TABLE} t JOIN page a USING (id)
    WHERE NOT EXISTS (SELECT 1 FROM {OUTBOX_TABLE} o WHERE o.id = a.event_id)
      AND NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} c WHERE c.subscription = a.subscription AND c.event_id = a.event_id)
      AND NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.subscription = a.subscription AND d.event_id = a.event_id)
    FOR UPDATE OF t SKIP LOCKED
), gone AS (
    DELETE FROM {ATTEMPTS_TABLE} t USING doomed WHERE t.id = doomed.id RETURNING 1
)
SELECT (SELECT count(*) FROM page), (SELECT max(id) FROM page), (SELECT count(*) FROM gone)
"""


@dataclass(frozen=True)
class PurgeResult:
    """What a purge did (or, with ``dry_run``, would do).

    ``cutoff``: the database time before which rows count as old.
    ``outbox_deleted``/``claims_deleted``: rows deleted (would be deleted).
    ``skipped_locked``: old rows left because another transaction held them.
    ``attempts_deleted``: attempt history rows deleted with their claims.
    ``batches``: transactions used. ``retention``: what the stream can
    still deliver, kept whatever the cutoff says (None: forever, a stream
    without a max age).
    """

    cutoff: datetime
    dry_run: bool
    outbox_deleted: int = 0
    claims_deleted: int = 0
    skipped_locked: int = 0
    batches: int = 0
    attempts_deleted: int = 0
    retention: timedelta | None = None


def purge(
    *,
    older_than: timedelta | None = None,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    using: str | None = None,
    stream_max_age: timedelta | None = None,
    progress_every_seconds: float = PROGRESS_EVERY_SECONDS,
) -> PurgeResult:
    """Delete published outbox rows older than ``older_than`` (default: the
    retention), the claims that no longer guard a row and the attempt
    history that goes with them - never what the stream can still deliver
    (see the module docstring): within the retention, claims stay, and so
    do rows a subscription of this build has not handled yet or with a
    retry in flight, whatever ``older_than`` says.

    Args:
        older_than: Age from ``published_at`` (a positive ``timedelta``).
        dry_run: Count, delete nothing.
        batch_size: Rows per transaction (each batch commits on its own
            when called outside ``transaction.atomic``).
        using: The outbox's database alias.
        stream_max_age: The stream's max age, when the caller knows it
            (``timedelta.max``: no max age); None reads it from the broker.
            The retention is the longer of it and ``RETENTION_DAYS``.
        progress_every_seconds: A purge that runs longer logs how far it
            has got (INFO) this often.

    Raises:
        ValueError: An age that isn't a positive ``timedelta``, a batch size below 1.
        BrokerUnavailable: ``stream_max_age`` is None and NATS can't say it
            (nothing is deleted: a shorter guess could purge what the stream still delivers).
    """
    if older_than is not None and (not isinstance(older_than, timedelta) or older_than <= timedelta(0)):
        raise ValueError(f"older_than must be a positive timedelta, got {older_than!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    alias = using or conf.settings.DATABASE_ALIAS
    guards = _guards()
    with connections[alias].cursor() as cursor:
        # The outbox is read before NATS is asked: a database without our tables says so first.
        cursor.execute(f"SELECT now(), EXISTS (SELECT 1 FROM {OUTBOX_TABLE})")
        now = cursor.fetchone()[0]
        retention = retention_of(stream_max_age)
        if older_than is None:
            older_than = retention or timedelta(days=float(conf.settings.RETENTION_DAYS))
        cutoff = _before(now, older_than)
        retention_cutoff = _before(now, retention)
        # A claim lives as long as the stream can redeliver its message.
        claims_cutoff = min(cutoff, retention_cutoff)
        params: dict[str, Any] = {"cutoff": cutoff, "retention_cutoff": retention_cutoff, **guards}
        if dry_run:
            cursor.execute(_DRY_OUTBOX_SQL, params)
            outbox = cursor.fetchone()[0]
            cursor.execute(_DRY_CLAIMS_SQL, {**params, "cutoff": claims_cutoff})
            result = PurgeResult(
                cutoff=cutoff,
                dry_run=True,
                outbox_deleted=outbox,
                claims_deleted=cursor.fetchone()[0],
                retention=retention,
            )
            logger.info(
                "purge dry run outbox=%s claims=%s cutoff=%s",
                result.outbox_deleted,
                result.claims_deleted,
                cutoff.isoformat(),
            )
            return result
    progress = _Progress(progress_every_seconds)
    outbox, skipped, outbox_batches = _purge_outbox(alias, params, batch_size, progress)
    claims, claim_batches = _purge_by_id(alias, _CLAIMS_BATCH_SQL, claims_cutoff, batch_size, progress, "claims")
    attempts, attempt_batches = _purge_by_id(
        alias, _ATTEMPTS_BATCH_SQL, claims_cutoff, batch_size, progress, "attempts"
    )
    result = PurgeResult(
        cutoff=cutoff,
        dry_run=False,
        outbox_deleted=outbox,
        claims_deleted=claims,
        skipped_locked=skipped,
        batches=outbox_batches + claim_batches + attempt_batches,
        attempts_deleted=attempts,
        retention=retention,
    )
    level = logging.INFO if outbox or claims or skipped or attempts else logging.DEBUG
    logger.log(
        level,
        "purged outbox=%s claims=%s attempts=%s skipped_locked=%s batches=%s cutoff=%s claims_cutoff=%s",
        outbox,
        claims,
        attempts,
        skipped,
        result.batches,
        cutoff.isoformat(),
        claims_cutoff.isoformat(),
    )
    return result


def retention_of(stream_max_age: timedelta | None = None) -> timedelta | None:
    """How long the stream can still deliver a message: the longer of
    ``RETENTION_DAYS`` and the stream's real max age (``stream_max_age``,
    else read from the broker: ``broker.figures.stream_standing``); None
    for a stream that keeps messages forever. Logged at WARNING when the
    stream keeps them longer than ``RETENTION_DAYS`` (raised, or a stream
    made before the setting was lowered). Raises ``BrokerUnavailable`` when
    it has to ask NATS and NATS can't answer."""
    setting = timedelta(days=float(conf.settings.RETENTION_DAYS))
    if stream_max_age is None:
        standing = stream_standing()
        if not standing.exists:
            return setting  # no stream, no message to deliver: a worker makes it with RETENTION_DAYS
        seconds = standing.max_age_seconds
        stream_max_age = timedelta.max if seconds is None else timedelta(seconds=seconds)
    if stream_max_age > setting:
        kept = (
            "forever (no max age)"
            if stream_max_age == timedelta.max
            else f"{stream_max_age.total_seconds() / 86400:g} days"
        )
        logger.warning(
            "purge keeps what the stream can still deliver: it keeps messages %s, longer than RETENTION_DAYS=%s, "
            "so rows and claims younger than that stay (a re-created durable would meet them). `manage.py stream "
            "update` can't shorten a stream's max age for you; see the docs' operating guide, 'Retention'.",
            kept,
            conf.settings.RETENTION_DAYS,
        )
        return None if stream_max_age == timedelta.max else stream_max_age
    return setting


def _before(now: datetime, age: timedelta | None) -> datetime:
    """``now - age``; the earliest time there is for None (forever) or an age past it."""
    try:
        return now - age if age is not None else datetime.min.replace(tzinfo=UTC)
    except OverflowError:
        return datetime.min.replace(tzinfo=UTC)


def _guards() -> dict[str, list[str]]:
    """The (subscription, event name) pairs of this build whose handlers need
    the outbox row: every registered subscription but those that opted in to
    events from other services (``external``: they don't read our outbox)."""
    from django_platformkit.consume.subscriptions import subscriptions

    pairs = [(s.name, s.event) for s in subscriptions() if not getattr(s, "external", False)]
    return {"subscriptions": [p[0] for p in pairs], "names": [p[1] for p in pairs]}


def _purge_outbox(alias: str, params: dict[str, Any], batch_size: int, progress: _Progress) -> tuple[int, int, int]:
    after_at, after_id = datetime.min.replace(tzinfo=UTC), uuid.UUID(int=0)
    deleted = skipped = batches = 0
    while True:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(
                _OUTBOX_BATCH_SQL, {**params, "after_at": after_at, "after_id": after_id, "batch": batch_size}
            )
            paged, eligible, gone, last_at, last_id = cursor.fetchone()
        batches += 1
        deleted += gone
        skipped += eligible - gone
        progress.batch("outbox", deleted, batches)
        if paged < batch_size:
            return deleted, skipped, batches
        after_at, after_id = last_at, last_id


def _purge_by_id(
    alias: str, sql: str, cutoff: datetime, batch_size: int, progress: _Progress, phase: str
) -> tuple[int, int]:
    after_id, deleted, batches = 0, 0, 0
    while True:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(sql, {"after_id": after_id, "cutoff": cutoff, "batch": batch_size})
            paged, last_id, gone = cursor.fetchone()
        batches += 1
        deleted += gone
        progress.batch(phase, deleted, batches)
        if paged < batch_size:
            return deleted, batches
        after_id = last_id
