"""Helpers for your own tests: see what a block of code published, and run
the subscribed handlers synchronously, with the same claim-in-transaction and
tenant semantics as the worker but no broker. Works inside Django's
``TestCase`` (its wrapping transaction) and ``TransactionTestCase``.

    with capture_events() as events:
        client.post("/orders/", ...)
    assert [e.name for e in events] == ["shop.order_placed"]
    run_pending()   # the handlers ran, once each
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from . import conf, signals
from ._tables import OUTBOX_TABLE
from .consumer import Consumer
from .subscriptions import Subscription
from .subscriptions import subscriptions as registered_subscriptions
from .wire import ReceivedEvent


@dataclass(frozen=True)
class CapturedEvent:
    """One ``publish()`` call: ``id``, ``name``, ``tenant``, ``payload`` (as
    encoded, i.e. what the handler will receive)."""

    id: uuid.UUID
    name: str
    tenant: str | None
    payload: dict[str, Any]


@contextlib.contextmanager
def capture_events() -> Iterator[list[CapturedEvent]]:
    """Collect every event ``publish()``/``publish_many()`` wrote inside the
    block, in order. Rolled-back events are collected too (the call
    happened); check the outbox for what committed."""
    captured: list[CapturedEvent] = []

    def listener(
        sender: Any, *, event_id: uuid.UUID, name: str, tenant: str | None, payload_text: str, **kwargs: Any
    ) -> None:
        captured.append(CapturedEvent(event_id, name, tenant, json.loads(payload_text)))

    # A uid of its own: nested or concurrent captures each get every event.
    uid = f"platformkit-capture-{id(captured)}"
    signals.event_published.connect(listener, weak=False, dispatch_uid=uid)
    try:
        yield captured
    finally:
        signals.event_published.disconnect(dispatch_uid=uid)


class _NoTransport:
    """run_pending() never talks to a broker."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("run_pending() handles events without a broker")


def run_pending(
    *, subscriptions: Iterable[Subscription] | None = None, using: str | None = None, max_rounds: int = 10
) -> int:
    """Handle every pending outbox event now, in this thread: for each event
    (relay order) and each subscription of its name, claim and run the handler
    in one transaction, as the worker does; then mark the rows published.
    Events the handlers publish are handled too, up to ``max_rounds`` rounds.
    Returns how many handler runs happened. A handler's exception propagates
    (after its transaction rolled back), so a test sees it.
    """
    alias = using or conf.settings.DATABASE_ALIAS
    subs = list(registered_subscriptions() if subscriptions is None else subscriptions)
    by_event: dict[str, list[Subscription]] = {}
    for sub in subs:
        by_event.setdefault(sub.event, []).append(sub)
    timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
    runs = 0
    for _ in range(max_rounds):
        with connections[alias].cursor() as cursor:
            cursor.execute(
                f"SELECT id, name, tenant, payload::text, headers::text, created_at FROM {OUTBOX_TABLE} "
                "WHERE published_at IS NULL ORDER BY created_at, id"
            )
            rows = cursor.fetchall()
        if not rows:
            break
        for event_id, name, tenant, payload, headers, created_at in rows:
            event = ReceivedEvent(
                id=event_id,
                name=name,
                tenant=tenant,
                payload=json.loads(payload),
                occurred_at=created_at,
                attempt=1,
                headers=json.loads(headers or "{}"),
            )
            for sub in by_event.get(name, []):
                if Consumer(sub, _NoTransport(), using=alias).run_event(event, timeout=timeout) == "handled":
                    runs += 1
            with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
                cursor.execute(f"UPDATE {OUTBOX_TABLE} SET published_at = now() WHERE id = %s", [event_id])
    return runs
