"""Pausing a subscription or a task queue: ``pause()`` and ``resume()``,
the operator's verbs over ``platformkit_pauses`` (its one write path).

A pause is one row. Every worker reads the table every
``CONTROL_POLL_SECONDS`` (``runtime/controlwatch.py``; a worker started
later reads it before it starts a handler), so within that time no worker
fetches or starts the subscription's handler; runs in flight finish. Its
messages wait in the stream: the durable holds them unfetched (no ack wait
runs, the delivery count doesn't move), and what a worker had fetched and
not started is handed back uncounted, so nothing is lost, no attempt is
counted and nothing dead-letters for having waited. The row and its audit
event (``platformkit.subscription_paused`` / ``_resumed``) commit together.
The idea of a table of pauses is Solid Queue's and procrastinate's; shared
by every worker and kept across restarts, unlike Oban's local pause.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import PAUSES_TABLE
from django_platformkit.consume.pausing import pause_key
from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.exceptions import ControlRefused
from django_platformkit.models.controls import Pause
from django_platformkit.names import unknown_name
from django_platformkit.outbox.events import declare, publish
from django_platformkit.wire import TASK_EVENT_PREFIX

logger = logging.getLogger(__name__)

_PAUSED_SCHEMA = {
    "type": "object",
    "required": ["subscription", "queue", "actor", "reason"],
    "properties": {
        "subscription": {"type": "string"},
        "queue": {"type": ["string", "null"]},
        "actor": {"type": "string", "minLength": 1},
        "reason": {"type": "string", "minLength": 1},
    },
}
EVENT_PAUSED = declare(
    "platformkit.subscription_paused",
    schema=_PAUSED_SCHEMA,
    description="An operator paused a subscription or a task queue (queue: its name, else null): the audit record of pause().",
)
EVENT_RESUMED = declare(
    "platformkit.subscription_resumed",
    schema={
        "type": "object",
        "required": ["subscription", "queue", "actor", "paused_by", "paused_at"],
        "properties": {
            "subscription": {"type": "string"},
            "queue": {"type": ["string", "null"]},
            "actor": {"type": "string", "minLength": 1},
            "reason": {"type": "string"},
            "paused_by": {"type": "string"},
            "paused_at": {"type": "string", "format": "date-time"},
        },
    },
    description="An operator resumed a paused subscription or task queue: the audit record of resume().",
)

_INSERT_SQL = (
    f"INSERT INTO {PAUSES_TABLE} (name, paused_at, paused_by, reason) VALUES (%s, now(), %s, %s) "
    "ON CONFLICT (name) DO NOTHING RETURNING paused_at"
)
_DELETE_SQL = f"DELETE FROM {PAUSES_TABLE} WHERE name = %s RETURNING paused_at, paused_by, reason"
_SELECT_SQL = f"SELECT name, paused_at, paused_by, reason FROM {PAUSES_TABLE} ORDER BY name"


@dataclass(frozen=True)
class PauseChange:
    """What ``pause()`` or ``resume()`` did to one subscription.

    Attributes:
        name: The subscription name the pause is kept under (a task queue's:
            ``platformkit.task_<queue>``).
        queue: The task queue it is, or None for a plain subscription.
        changed: False when it was already paused (``pause()``) or not
            paused (``resume()``): nothing was written for it.
        paused_at: When it was paused (the new pause, the standing one, or
            the one ``resume()`` ended); None: it was not paused.
        paused_by: Who paused it ("" when not paused).
        reason: Why it was paused ("" when not paused).
        audit_event_id: The audit event published, or None when nothing changed.
    """

    name: str
    queue: str | None
    changed: bool
    paused_at: datetime | None
    paused_by: str
    reason: str
    audit_event_id: uuid.UUID | None


def queue_name(name: str) -> str | None:
    """The task queue whose pause ``name`` is, or None for a plain subscription."""
    return name[len(TASK_EVENT_PREFIX) :] if name.startswith(TASK_EVENT_PREFIX) else None


def pausable() -> dict[str, str]:
    """``{pause name: what it pauses}`` for every subscription this build
    declares: a plain subscription under its own name, a task queue under its
    queue's subscription name (its priority bands together)."""
    return {pause_key(s): s.name for s in subscriptions()}


def resolve(names: Iterable[str] = (), queues: Iterable[str] = (), *, known: Iterable[str] = ()) -> list[str]:
    """The pause names of ``names`` (subscriptions, as ``pause()`` takes
    them) and ``queues`` (task queues), in order, without repeats.

    Args:
        names: Subscription names; a task queue's subscription (or one of
            its priority bands) stands for the whole queue.
        queues: Task queue names (``TASKS[...]["QUEUES"]``).
        known: Further names that count as known (``resume()``: the pauses
            standing now, so a subscription removed from the code can be resumed).

    Raises:
        ControlRefused: A name this build doesn't declare, with the closest.
    """
    by_subscription = {s.name: pause_key(s) for s in subscriptions()}
    by_subscription.update({name: name for name in known})
    by_queue = {q: key for key in set(by_subscription.values()) if (q := queue_name(key)) is not None}
    found: list[str] = []
    for name in names:
        if name not in by_subscription:
            raise ControlRefused(
                f"{unknown_name('subscription', name, by_subscription)} Nothing was paused or resumed."
            )
        found.append(by_subscription[name])
    for queue in queues:
        if queue not in by_queue:
            raise ControlRefused(
                f"{unknown_name('task queue', queue, by_queue)} (a queue of TASKS[...]['QUEUES'] whose backend is "
                "django_platformkit's). Nothing was paused or resumed."
            )
        found.append(by_queue[queue])
    if not found:
        raise ControlRefused("name a subscription or a task queue (--queue) to pause or resume.")
    return list(dict.fromkeys(found))


def pause(
    names: Sequence[str] = (),
    *,
    queues: Sequence[str] = (),
    actor: str,
    reason: str,
    using: str | None = None,
) -> list[PauseChange]:
    """Pause subscriptions or task queues: within ``CONTROL_POLL_SECONDS`` no
    worker starts their handlers; their messages wait in the stream.

    All or nothing: every name is checked before anything is written. Per
    name, in one transaction: the ``platformkit_pauses`` row and the audit
    event ``platformkit.subscription_paused`` {subscription, queue, actor,
    reason}. A subscription already paused keeps its pause (who, when, why)
    and gets no second event.

    Args:
        names: Subscription names (a task queue's subscription pauses the queue).
        queues: Task queue names.
        actor: Who pauses (kept on the row and in the audit event).
        reason: Why (kept on the row, shown on the overview, in the event).
        using: The database alias (default ``DATABASE_ALIAS``).

    Returns:
        One ``PauseChange`` per name, in order.

    Raises:
        ControlRefused: (a ``ValueError``) writing nothing: no name, a name
            this build doesn't declare (the message names the closest), or
            an empty ``actor`` or ``reason``.
    """
    actor, reason = str(actor or "").strip(), str(reason or "").strip()
    if not actor:
        raise ControlRefused("pause() needs an actor: who is pausing (e.g. the operator's username).")
    if not reason:
        raise ControlRefused(
            "pause() needs a reason: say why (it is shown on the overview and kept in the audit event)."
        )
    keys = resolve(names, queues)
    alias = using or conf.settings.DATABASE_ALIAS
    changes = []
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        for key in keys:
            cursor.execute(_INSERT_SQL, [key, actor, reason])
            row = cursor.fetchone()
            if row is None:
                standing = Pause.objects.using(alias).get(name=key)
                changes.append(
                    PauseChange(
                        key, queue_name(key), False, standing.paused_at, standing.paused_by, standing.reason, None
                    )
                )
                continue
            payload = {"subscription": key, "queue": queue_name(key), "actor": actor, "reason": reason}
            audit = publish(EVENT_PAUSED, payload, using=alias)
            changes.append(PauseChange(key, queue_name(key), True, row[0], actor, reason, audit))
    for change in changes:
        if change.changed:
            logger.info(
                "subscription paused subscription=%s actor=%s reason=%s: no worker starts its handler until it is "
                "resumed; its messages wait in the stream",
                change.name,
                actor,
                reason,
            )
    return changes


def resume(
    names: Sequence[str] = (),
    *,
    queues: Sequence[str] = (),
    actor: str,
    reason: str = "",
    using: str | None = None,
) -> list[PauseChange]:
    """Resume paused subscriptions or task queues: within
    ``CONTROL_POLL_SECONDS`` every worker that serves them fetches and
    starts their waiting messages again.

    All or nothing, as ``pause()``. Per name, in one transaction: the pause
    row deleted and the audit event ``platformkit.subscription_resumed``
    {subscription, queue, actor, reason, paused_by, paused_at}. A name that
    is not paused is reported unchanged, with no event.

    Args:
        names: Subscription names; a name paused now counts as known even
            when this build no longer declares it.
        queues: Task queue names.
        actor: Who resumes (in the audit event).
        reason: Why, optional (in the audit event).
        using: The database alias (default ``DATABASE_ALIAS``).

    Returns:
        One ``PauseChange`` per name, in order (``paused_*``: the pause it ended).

    Raises:
        ControlRefused: (a ``ValueError``) writing nothing: no name, an
            unknown one (with the closest), or an empty ``actor``.
    """
    actor, reason = str(actor or "").strip(), str(reason or "").strip()
    if not actor:
        raise ControlRefused("resume() needs an actor: who is resuming (e.g. the operator's username).")
    alias = using or conf.settings.DATABASE_ALIAS
    keys = resolve(names, queues, known=[p.name for p in paused(using=alias)])
    changes = []
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        for key in keys:
            cursor.execute(_DELETE_SQL, [key])
            row = cursor.fetchone()
            if row is None:
                changes.append(PauseChange(key, queue_name(key), False, None, "", "", None))
                continue
            paused_at, paused_by, why = row
            payload = {
                "subscription": key,
                "queue": queue_name(key),
                "actor": actor,
                "reason": reason,
                "paused_by": paused_by,
                "paused_at": paused_at.isoformat(),
            }
            audit = publish(EVENT_RESUMED, payload, using=alias)
            changes.append(PauseChange(key, queue_name(key), True, paused_at, paused_by, why, audit))
    for change in changes:
        if change.changed:
            logger.info(
                "subscription resumed subscription=%s actor=%s paused_by=%s paused_at=%s",
                change.name,
                actor,
                change.paused_by,
                change.paused_at.isoformat() if change.paused_at else "-",
            )
    return changes


def paused(*, using: str | None = None) -> list[Pause]:
    """The pauses standing now, by name (one indexed read of a small table)."""
    alias = using or conf.settings.DATABASE_ALIAS
    with connections[alias].cursor() as cursor:
        cursor.execute(_SELECT_SQL)
        return [Pause(name=n, paused_at=at, paused_by=by, reason=why) for n, at, by, why in cursor.fetchall()]
