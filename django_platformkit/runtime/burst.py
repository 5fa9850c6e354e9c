"""``runworker --burst``: drain, then stop. Drained means nothing pending in
the outbox (rows due later stay pending) and no durable with messages
pending, awaiting ack or awaiting a retry - seen twice in a row, so a unit
between two looks can't pass for a quiet queue. A paused subscription's
durable is left out: its messages wait for the resume, not for the burst.
"""

from __future__ import annotations

import logging
import threading
import time

from django.db import DatabaseError, connections

from django_platformkit.broker.port import Broker
from django_platformkit.consume.pool import ConsumerPool
from django_platformkit.models import OutboxEvent
from django_platformkit.outbox.relay import Relay

logger = logging.getLogger(__name__)

#: How often the drained check looks, seconds.
CHECK_EVERY_SECONDS = 0.2


def drain(
    *,
    relay: Relay | None,
    pool: ConsumerPool,
    broker: Broker,
    using: str,
    stop_event: threading.Event,
    timeout_seconds: float | None,
    wait_for_outbox: bool | None = None,
) -> int:
    """Relay and consume until drained (the pool already runs).

    Args:
        relay: Drains the outbox between looks; None: consume only.
        pool: The running consumer pool.
        broker: Asked for each durable's counts.
        using: The database alias of the outbox.
        stop_event: Set to stop early.
        timeout_seconds: Give up after this long (None: never).
        wait_for_outbox: Drained also needs no row due in the outbox
            (default: when relaying). True without ``relay``: a relay in
            another process (``runworker --processes N --burst``) still
            sends rows this process's consumers must then handle.

    Returns:
        0 when drained or stopped, 1 when not drained in time.
    """
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    held = [
        lane.subscription.name
        for lane in pool.lanes
        if pool.pauses is not None and pool.pauses.holds(lane.subscription)
    ]
    if held:
        logger.info(
            "burst: paused subscriptions are not drained subscriptions=%s (their messages wait)", ",".join(held)
        )
    quiet = 0
    outbox = relay is not None if wait_for_outbox is None else wait_for_outbox
    while not stop_event.is_set():
        if relay is not None:
            try:
                relay.drain(stop_event)
            except DatabaseError as exc:
                logger.error("relay database error=%s", exc)
                connections[using].close()
        if drained(relay_wanted=outbox, pool=pool, broker=broker, using=using):
            quiet += 1
            if quiet >= 2:
                return 0
        else:
            quiet = 0
        if deadline is not None and time.monotonic() > deadline:
            logger.error("burst: not drained after %ss; stopping", timeout_seconds)
            return 1
        stop_event.wait(CHECK_EVERY_SECONDS)
    return 0


def drained(*, relay_wanted: bool, pool: ConsumerPool, broker: Broker, using: str) -> bool:
    """Whether nothing is left to do now: no row due in the outbox (when
    relaying), no unit running or queued, every lane's last look empty, and
    every durable with nothing pending or awaiting ack."""
    try:
        if relay_wanted and OutboxEvent.objects.using(using).due().exists():  # rows due later stay pending
            return False
    except DatabaseError:
        connections[using].close()
        return False
    if pool.busy():
        return False
    if not pool.idle():
        logger.debug("burst check: consumers still fetching")
        return False
    for lane in pool.lanes:
        if pool.pauses is not None and pool.pauses.holds(lane.subscription):
            continue  # paused: what waits in its durable is not this drain's to handle
        try:
            info = broker.consumer_info(lane.subscription.durable)
        except Exception:
            return False
        logger.debug(
            "burst check consumer=%s pending=%s ack_pending=%s",
            lane.subscription.durable,
            info.num_pending,
            info.num_ack_pending,
        )
        if info.num_pending or info.num_ack_pending:
            return False
    return True
