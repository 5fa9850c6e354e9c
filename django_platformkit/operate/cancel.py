"""``cancel()``: an operator stops an event's handlers before they run.

A cancel is a terminal claim per subscription, with the outcome
``cancelled``, written in one transaction with the audit event. The claim
is what every handler run takes first, so from the cancel's commit on no
handler of that subscription starts the event - pending in the outbox,
deferred, parked for a retry or fetched by a worker: each finds the claim
and skips. A handler already running holds its own uncommitted claim: the
cancel's insert waits for it, and whichever commits first wins.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit.exceptions import CancelRefused
from django_platformkit.outbox.events import EVENT_CANCELLED, publish
from django_platformkit.wire import HandlingOutcome

logger = logging.getLogger(__name__)

#: One statement for every subscription: sorted, so two cancels (or a cancel
#: and a unit's claim) take the unique-key locks in the same order.
_CANCEL_SQL = (
    f"INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at, outcome) "
    f"SELECT s, %s, now(), '{HandlingOutcome.CANCELLED}' FROM unnest(%s::text[]) AS s ORDER BY s "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING subscription"
)
_CLAIMS_SQL = f"SELECT subscription, outcome FROM {HANDLED_TABLE} WHERE event_id = %s AND subscription = ANY(%s)"


@dataclass(frozen=True)
class CancelResult:
    """What ``cancel()`` did.

    Attributes:
        event_id: The event's id.
        name: The event's name.
        cancelled: The subscriptions this call cancelled (their handlers will never start it).
        already_cancelled: The subscriptions an earlier ``cancel()`` had cancelled.
        too_late: The subscriptions that had handled the event, or dead-lettered
            it, before the cancel (a handler that was running and committed first).
        audit_event_id: The ``platformkit.event_cancelled`` event published,
            or None when nothing new was cancelled (a repeated cancel).
    """

    event_id: uuid.UUID
    name: str
    cancelled: tuple[str, ...]
    already_cancelled: tuple[str, ...]
    too_late: tuple[str, ...]
    audit_event_id: uuid.UUID | None


def cancel(
    event_id: uuid.UUID | str,
    *,
    subscription: str | None = None,
    actor: str,
    reason: str,
    using: str | None = None,
) -> CancelResult:
    """Stop an event that has not been handled yet from running.

    From this call's commit on, no handler of ``subscription`` (or, with
    None, of any subscription this build declares for the event) starts
    it, wherever it is: pending, deferred (a task's ``run_after``), waiting
    for a retry, or fetched by a worker. In one transaction it writes a
    terminal claim with the outcome ``cancelled`` per subscription and
    publishes ``platformkit.event_cancelled`` {event_id, name, subscription
    (null for all), actor, reason}. A handler running now may finish: the
    cancel waits for its transaction (at most ``HANDLER_TIMEOUT_SECONDS``),
    and if it commits its claim wins and the result says ``too_late``. A
    cancelled task's result reads FAILED with the error class
    ``django_platformkit.exceptions.Cancelled``. Idempotent: a repeated
    cancel writes and publishes nothing. Effects outside the database of a
    run that had already failed are not undone.

    Args:
        event_id: The event's id (a task's result id).
        subscription: The one subscription to cancel for, or None for all.
        actor: Who cancels (logged and in the audit event).
        reason: Why (logged and in the audit event).
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).

    Returns:
        Which subscriptions were cancelled now, were already, or were too late.

    Raises:
        CancelRefused: (a ``ValueError``) writing nothing, without an actor
            or a reason, for an id that is not in the outbox, or for a
            subscription this build doesn't declare for the event.
    """
    from django_platformkit.consume.subscriptions import subscriptions

    actor = str(actor or "").strip()
    reason = str(reason or "").strip()
    if not actor or not reason:
        raise CancelRefused("cancel() needs an actor and a reason: who cancels this event, and why.")
    try:
        event_id = uuid.UUID(str(event_id))
    except ValueError:
        raise CancelRefused(f"{event_id!r} is not an event id (a UUID).") from None
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        # KEY SHARE: purge can't delete the row under the claims being written.
        cursor.execute(f"SELECT name FROM {OUTBOX_TABLE} WHERE id = %s FOR KEY SHARE", [event_id])
        row = cursor.fetchone()
        if row is None:
            raise CancelRefused(
                f"event {event_id} is not in the outbox (never published, or purged): nothing to cancel."
            )
        name = row[0]
        receiving = sorted(s.name for s in subscriptions() if s.event == name)
        if subscription is not None and subscription not in receiving:
            raise CancelRefused(
                f"subscription {subscription!r} does not receive {name!r} in this build; "
                f"its subscriptions are: {', '.join(receiving) or '(none)'}."
            )
        targets = [subscription] if subscription is not None else receiving
        if not targets:
            raise CancelRefused(f"no subscription of this build receives {name!r}: nothing to cancel.")
        cursor.execute(_CANCEL_SQL, [event_id, targets])
        cancelled = tuple(sorted(r[0] for r in cursor.fetchall()))
        cursor.execute(_CLAIMS_SQL, [event_id, [t for t in targets if t not in cancelled]])
        earlier = dict(cursor.fetchall())
        audit = None
        if cancelled:
            audit = publish(
                EVENT_CANCELLED,
                {
                    "event_id": str(event_id),
                    "name": name,
                    "subscription": subscription,
                    "actor": actor,
                    "reason": reason,
                },
                using=alias,
            )
    already = tuple(sorted(s for s, outcome in earlier.items() if outcome == HandlingOutcome.CANCELLED))
    too_late = tuple(sorted(s for s, outcome in earlier.items() if outcome != HandlingOutcome.CANCELLED))
    logger.info(
        "cancel event_id=%s name=%s cancelled=%s already_cancelled=%s too_late=%s actor=%s reason=%s",
        event_id,
        name,
        ",".join(cancelled) or "-",
        ",".join(already) or "-",
        ",".join(too_late) or "-",
        actor,
        reason,
    )
    return CancelResult(event_id, name, cancelled, already, too_late, audit)
