"""Dead letters: the record of an event a subscription gave up on, and the
operator verbs over it (``replay()``, ``discard()``; ``BatchLog`` for the
log of many at once).

A dead letter is written in one transaction with a terminal claim, so a lost
ack can never produce a false dead letter and nothing runs the event again
until an operator replays it. The payload's only copy stays the outbox row
(the dead letter keeps it from purge).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import (
    ATTEMPTS_TABLE,
    DEAD_LETTER_TABLE,
    HANDLED_TABLE,
    OUTBOX_TABLE,
    TASK_RESULTS_TABLE,
)
from django_platformkit.exceptions import ReplayRefused
from django_platformkit.outbox.deadletters import MALFORMED_NAME, RELAY_DEAD_LETTERS
from django_platformkit.outbox.events import EVENT_DISCARDED, EVENT_REPLAYED, publish

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    """What ``replay()`` did: the replayed ``event_id``, the
    ``subscriptions`` whose claim (and dead letter) it cleared, how many
    dead-letter rows that removed, and the id of the
    ``platformkit.event_replayed`` audit event it published."""

    event_id: uuid.UUID
    subscriptions: tuple[str, ...]  # whose claim (and dead letter) was cleared
    dead_letters_cleared: int
    audit_event_id: uuid.UUID


def replay_blocker(event_id: uuid.UUID | str, name: str, subscription: str, *, using: str | None = None) -> str | None:
    """Why the dead letter of ``event_id`` (event ``name``) for
    ``subscription`` can't usefully be replayed, or None: a malformed
    message or a purged row has nothing to send again, and a subscription
    this build doesn't declare would leave the re-sent event unhandled. The
    admin's Replay and ``manage.py deadletters replay`` (``--dry-run``
    too) ask this before offering or doing a replay; ``replay()`` itself
    refuses only the first two (raising ``ReplayRefused``)."""
    from django_platformkit.consume.subscriptions import subscriptions

    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {OUTBOX_TABLE} WHERE id = %s", [str(event_id)])
        in_outbox = cursor.fetchone() is not None
    if not in_outbox:
        if name == MALFORMED_NAME:
            return (
                "it is a malformed message (bytes on our subjects that were never an event of this project's outbox), "
                "so there is nothing to send again; Discard it to accept the failure."
            )
        return "its outbox row is gone (purged), so there is nothing to send again; Discard it to accept the failure."
    if subscription != RELAY_DEAD_LETTERS and subscription not in {s.name for s in subscriptions()}:
        return (
            f"this build declares no subscription {subscription!r} (removed or renamed?), so nothing would handle "
            "the re-sent event; deploy the subscription back first, or Discard the dead letter."
        )
    return None


def replay(
    event_id: uuid.UUID | str,
    *,
    subscription: str | None = None,
    actor: str,
    reason: str,
    include_handled: bool = False,
    using: str | None = None,
) -> ReplayResult:
    """Send an event again to the subscriptions that gave up on it.

    In one transaction: lock the outbox row; delete the dead letter and its
    terminal claim for ``subscription`` - or, when None, for every
    subscription that dead-lettered this event (the relay's
    ``platformkit.relay`` included); set the row pending again with a fresh
    ``Nats-Msg-Id`` (the broker would drop the old one); publish
    ``platformkit.event_replayed`` {event_id, name, subscription, actor,
    reason}. Subscriptions that handled the event keep their claims and skip
    the re-send.

    Args:
        event_id: The event's id.
        subscription: The subscription to replay for, or None for every one
            that dead-lettered the event.
        actor: Who replays (logged and in the audit event).
        reason: Why (logged and in the audit event).
        include_handled: With a named ``subscription``: also clear a success
            claim, to run a handler again on purpose.
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).

    Returns:
        What was replayed: the subscriptions cleared, the dead letters
        removed and the audit event's id.

    Raises:
        ReplayRefused: (a ``ValueError``) writing nothing, when ``actor`` or
            ``reason`` is empty, the event is unknown (or purged), or there
            is no dead letter to replay.
    """
    actor = str(actor or "").strip()
    reason = str(reason or "").strip()
    if not actor:
        raise ReplayRefused("replay() needs an actor: who is replaying (e.g. the operator's username).")
    if not reason:
        raise ReplayRefused(
            "replay() needs a reason: say why this event is sent again (it is kept in the audit event)."
        )
    if include_handled and subscription is None:
        raise ReplayRefused("include_handled=True needs a subscription: name the one handler to run again.")
    try:
        event_id = uuid.UUID(str(event_id))
    except ValueError:
        raise ReplayRefused(f"{event_id!r} is not an event id (a UUID).") from None
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT name, headers FROM {OUTBOX_TABLE} WHERE id = %s FOR UPDATE", [event_id])
        row = cursor.fetchone()
        if row is None:
            raise ReplayRefused(
                f"event {event_id} is not in the outbox (never published, or purged): nothing to replay."
            )
        name, headers = row
        if isinstance(headers, str):
            headers = json.loads(headers)
        where = "event_id = %s"
        params: list[uuid.UUID | str] = [event_id]
        if subscription is not None:
            where += " AND subscription = %s"
            params.append(subscription)
        cursor.execute(f"DELETE FROM {DEAD_LETTER_TABLE} WHERE {where} RETURNING subscription", params)
        dead = sorted(r[0] for r in cursor.fetchall())
        cleared = list(dead)
        if include_handled and not dead:
            cursor.execute(f"SELECT subscription FROM {HANDLED_TABLE} WHERE event_id = %s ORDER BY 1", [event_id])
            handled = [r[0] for r in cursor.fetchall()]
            if subscription not in handled:
                # A misspelt name would re-send the event, clear nothing and run nothing.
                raise ReplayRefused(
                    f"subscription {subscription!r} neither handled event {event_id} nor dead-lettered it: "
                    f"nothing to run again. Subscriptions that handled it: {', '.join(handled) or '(none)'}."
                )
            cleared = [subscription]
            # A task run again on purpose is no longer the success it was:
            # its result reads READY until the rerun, then what the rerun
            # ends as (errors and worker_ids keep the earlier runs).
            cursor.execute(
                f"UPDATE {TASK_RESULTS_TABLE} SET status = '', return_value = NULL, finished_at = NULL "
                "WHERE event_id = %s AND status = 'SUCCESSFUL'",
                [event_id],
            )
        if not cleared:
            target = f"subscription {subscription!r}" if subscription else "any subscription"
            raise ReplayRefused(
                f"event {event_id} has no dead letter for {target}: nothing to replay. "
                "(To run a handler that succeeded again, pass subscription=... and include_handled=True.)"
            )
        # Only the claims of what is replayed: a subscription that handled the
        # event keeps its claim and skips the re-send.
        cursor.execute(
            f"DELETE FROM {HANDLED_TABLE} WHERE event_id = %s AND subscription = ANY(%s)", [event_id, cleared]
        )
        # A replay starts the handler-run count afresh (DESIGN.md "Attempts"):
        # left in place, the old runs would dead-letter the re-send at once.
        cursor.execute(
            f"DELETE FROM {ATTEMPTS_TABLE} WHERE event_id = %s AND subscription = ANY(%s)", [event_id, cleared]
        )
        count = int((headers or {}).get("platformkit_replay") or 0) + 1
        cursor.execute(
            f"UPDATE {OUTBOX_TABLE} SET published_at = NULL, headers = headers || %s::jsonb WHERE id = %s",
            [json.dumps({"platformkit_replay": count}), event_id],
        )
        audit = publish(
            EVENT_REPLAYED,
            {"event_id": str(event_id), "name": name, "subscription": subscription, "actor": actor, "reason": reason},
            using=alias,
        )
    # One line per row at DEBUG: an operator's bulk replay logs its batches (``BatchLog``).
    logger.debug(
        "replayed event_id=%s name=%s subscriptions=%s actor=%s reason=%s",
        event_id,
        name,
        ",".join(cleared),
        actor,
        reason,
    )
    return ReplayResult(
        event_id=event_id, subscriptions=tuple(cleared), dead_letters_cleared=len(dead), audit_event_id=audit
    )


def discard(event_id: uuid.UUID | str, *, subscription: str, actor: str, reason: str, using: str | None = None) -> bool:
    """Accept a failure: close the dead letter of (``subscription``, ``event_id``) for good.

    Its terminal claim stays, so nothing runs the event for that
    subscription again, and the outbox row becomes purgeable once no dead
    letter describes it. In the same transaction it publishes the audit
    event ``platformkit.event_discarded`` {event_id, name, subscription,
    actor, reason}.

    Args:
        event_id: The event's id.
        subscription: Whose dead letter it is.
        actor: Who discards (logged and in the audit event: the dead letter was the evidence).
        reason: Why (logged and in the audit event).
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).

    Returns:
        Whether a dead letter was deleted (False: there was none).

    Raises:
        ReplayRefused: (a ``ValueError``) writing nothing, without an ``actor`` or a ``reason``.
    """
    actor = str(actor or "").strip()
    reason = str(reason or "").strip()
    if not actor or not reason:
        raise ReplayRefused("discard() needs an actor and a reason: who accepts this failure, and why.")
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {DEAD_LETTER_TABLE} WHERE event_id = %s AND subscription = %s RETURNING name",
            [uuid.UUID(str(event_id)), subscription],
        )
        row = cursor.fetchone()
        if row is not None:
            publish(
                EVENT_DISCARDED,
                {
                    "event_id": str(event_id),
                    "name": row[0],
                    "subscription": subscription,
                    "actor": actor,
                    "reason": reason,
                },
                using=alias,
            )
    if row is not None:
        logger.debug(
            "discarded dead letter event_id=%s name=%s subscription=%s actor=%s reason=%s",
            event_id,
            row[0],
            subscription,
            actor,
            reason,
        )
    return row is not None


#: An operator's replay or discard of many dead letters logs one INFO line per this many rows.
BATCH_LOG_ROWS = 100


class BatchLog:
    """The log of one operator's replay or discard of many dead letters (the
    admin's action, ``manage.py deadletters``): one INFO line per
    ``BATCH_LOG_ROWS`` rows done and one for the rest (``close()``); each
    row is logged at DEBUG by ``replay()`` / ``discard()`` themselves.

    Args:
        verb: ``"replay"`` or ``"discard"``.
        actor: Who acts.
        reason: Why.
    """

    def __init__(self, verb: str, *, actor: str, reason: str) -> None:
        self.past = {"replay": "replayed", "discard": "discarded"}[verb]
        self.actor = actor
        self.reason = reason
        self.total = 0
        self._unlogged = 0

    def done(self) -> None:
        """One more row done."""
        self.total += 1
        self._unlogged += 1
        if self._unlogged >= BATCH_LOG_ROWS:
            self._log()

    def close(self) -> None:
        """Log the rows done since the last line."""
        if self._unlogged:
            self._log()

    def _log(self) -> None:
        logger.info(
            "%s dead letters n=%s total=%s actor=%s reason=%s",
            self.past,
            self._unlogged,
            self.total,
            self.actor,
            self.reason,
        )
        self._unlogged = 0
