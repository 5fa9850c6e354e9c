"""Dead letters: the record of an event a subscription gave up on, and the
operator verbs over it (``replay()``, ``discard()``).

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
from django_platformkit._text import storable_text
from django_platformkit.exceptions import ReplayRefused
from django_platformkit.outbox.events import EVENT_REPLAYED, publish

logger = logging.getLogger(__name__)

#: The ``name`` of a dead letter recording a message that isn't an event of ours.
MALFORMED_NAME = "(malformed)"
#: How much of a malformed message's body its dead letter keeps (in
#: ``traceback``): a body can be as large as the server's ``max_payload``.
MALFORMED_BODY_BYTES = 4000
_NAMESPACE_MALFORMED = uuid.UUID("8a1d6c61-3f5e-4c2c-9a59-1f0a3d6b7e21")

_TERMINAL_CLAIM_SQL = (
    f"WITH row AS (SELECT 1 FROM {OUTBOX_TABLE} WHERE id = %s FOR KEY SHARE) "
    f"INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at) "
    "SELECT %s, %s, now() FROM (SELECT count(*) FROM row) locked "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING 1"
)
_DEAD_LETTER_SQL = (
    f"INSERT INTO {DEAD_LETTER_TABLE} (event_id, subscription, name, tenant, attempts, error, traceback, failed_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, now()) ON CONFLICT (subscription, event_id) DO NOTHING"
)


def record_dead_letter(
    *,
    subscription: str,
    event_id: uuid.UUID,
    name: str,
    tenant: str | None,
    attempts: int,
    error: str,
    traceback: str,
    using: str | None = None,
) -> bool:
    """In one transaction: a terminal claim and, if the claim is new, the dead
    letter. Returns whether a dead letter was written (False: the event was
    already handled - its ack was lost - so there is nothing to report).
    Idempotent: both inserts are ``ON CONFLICT DO NOTHING``."""
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        # Hold the outbox row (it has the payload's only copy) while the dead
        # letter is written: purge locks FOR UPDATE SKIP LOCKED, so it skips it.
        cursor.execute(_TERMINAL_CLAIM_SQL, [event_id, subscription, event_id])
        if cursor.fetchone() is None:
            return False
        cursor.execute(
            _DEAD_LETTER_SQL,
            [
                event_id,
                subscription,
                name,
                tenant,
                attempts,
                storable_text(error, max_chars=10000),
                storable_text(traceback, max_chars=50000),
            ],
        )
    return True


def malformed_id(stream: str, stream_seq: int) -> uuid.UUID:
    """The dead-letter key of a malformed message: a UUIDv5 of its place in
    the stream (``<stream>:<stream_seq>``), never the id it claims - a forged
    or broken message claiming a real event's id must not take that event's
    (subscription, event_id) dead-letter slot, and two bad messages claiming
    one id are two records."""
    return uuid.uuid5(_NAMESPACE_MALFORMED, f"{stream}:{stream_seq}")


def record_malformed(
    *, subscription: str, event_id: uuid.UUID, attempts: int, error: str, body: bytes, using: str | None = None
) -> None:
    """Write the dead letter (name ``(malformed)``, no tenant) of a message on
    our subjects that isn't a well-formed event of ours: ``event_id`` from
    ``malformed_id()``, ``error`` what is wrong, the first
    ``MALFORMED_BODY_BYTES`` of ``body`` (as UTF-8, undecodable bytes as
    U+FFFD) as its traceback. Idempotent (``ON CONFLICT DO NOTHING``).
    Raises Django's ``DatabaseError`` when the database can't take it."""
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(
            _DEAD_LETTER_SQL,
            # NUL can't be stored in PostgreSQL text: unescaped, a body holding one
            # could never be recorded and would come back after every ack wait.
            [
                event_id,
                subscription,
                MALFORMED_NAME,
                None,
                attempts,
                storable_text(error, max_chars=10000),
                storable_text(body[:MALFORMED_BODY_BYTES].decode("utf-8", "replace")),
            ],
        )


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


#: The dead letters the relay writes (the broker refused a row for good):
#: replayable, though no ``@subscribe`` has this name (relay.RELAY_SUBSCRIPTION).
RELAY_DEAD_LETTERS = "platformkit.relay"


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
    ``Nats-Msg-Id``; and publish ``platformkit.event_replayed`` {event_id,
    name, subscription, actor, reason}. Subscriptions that handled the event
    keep their claims and skip the re-send. ``include_handled=True`` (with a
    named ``subscription``) also clears a success claim, to run a handler
    again on purpose.

    Raises ``ReplayRefused`` (a ``ValueError``), writing nothing, when
    ``actor`` or ``reason`` is empty, the event is unknown (or purged), or
    there is no dead letter to replay.
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
    logger.info(
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
    """Accept a failure: delete the dead letter of (``subscription``,
    ``event_id``). Its terminal claim stays, so nothing runs the event for
    that subscription again, and the outbox row becomes purgeable once no
    dead letter describes it. Returns whether a dead letter was deleted.

    Raises ``ReplayRefused`` (a ``ValueError``), writing nothing, without an
    ``actor`` or a ``reason`` (both are logged: the dead letter was the evidence).
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
        logger.info(
            "discarded dead letter event_id=%s name=%s subscription=%s actor=%s reason=%s",
            event_id,
            row[0],
            subscription,
            actor,
            reason,
        )
    return row is not None
