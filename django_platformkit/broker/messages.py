"""JetStream messages as ``Delivery`` values, read on the event loop once
per message: the delivery count, stream sequence and pending count come
from the ack subject (a string split, not nats-py's metadata objects), and
a message without JetStream metadata - which can't be acked - is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import nats.errors

from django_platformkit.wire import Delivery

logger = logging.getLogger(__name__)


def to_deliveries(msgs: Sequence[Any]) -> list[Delivery]:
    """JetStream messages as ``Delivery`` values (a message without JetStream
    metadata can't be acked either: logged and skipped)."""
    out = []
    for msg in msgs:
        fields = ack_reply_fields(msg.reply)
        try:
            if fields is not None:
                attempt, seq = fields[0], fields[1]
            else:
                metadata = msg.metadata
                attempt, seq = int(metadata.num_delivered), int(metadata.sequence.stream)
        except Exception:
            logger.warning("fetch got a non-JetStream message subject=%s", msg.subject)
            continue
        out.append(
            Delivery(
                subject=msg.subject,
                data=msg.data,
                headers=dict(msg.headers or {}),
                attempt=attempt,
                stream_seq=seq,
                msg=msg,
            )
        )
    return out


async def next_msg(sub: Any, timeout: float) -> Any:
    """``sub.next_msg(timeout)`` without its per-call cost: nats-py's
    ``next_msg`` makes a uuid4, a task and a ``wait_for`` per call, which in a
    fetched batch cost more loop time than the message. A message already
    queued is taken at once; else the queue is awaited under
    ``asyncio.timeout`` (raises ``TimeoutError``). The accounting is nats-py's
    own (``_pending_size``, ``task_done``)."""
    try:
        queue = sub._pending_queue
    except AttributeError:
        return await sub.next_msg(timeout=timeout)
    try:
        msg = queue.get_nowait()
    except asyncio.QueueEmpty:
        if sub._conn.is_closed:
            raise nats.errors.ConnectionClosedError from None
        # Waiting here (a long-poll's first message) without next_msg's task
        # and wait_for: one unit at a steady trickle is one such wait. A
        # connection closed meanwhile ends it by the timeout (the lane retries).
        async with asyncio.timeout(timeout):
            msg = await queue.get()
    sub._pending_size -= len(msg.data)
    sub._pending_queue.task_done()
    return msg


def ack_reply_fields(reply: Any) -> tuple[int, int, int] | None:
    """(delivery count, stream sequence, pending behind) from a JetStream
    ack subject, or None when it isn't one of the two known forms:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``
    and ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>...``
    (ADR-15). nats-py's ``msg.metadata`` parses the same, plus a datetime
    and two dataclasses per message we never read: on the loop, per message."""
    if not isinstance(reply, str) or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    try:
        if len(tokens) == 9:
            return int(tokens[4]), int(tokens[5]), int(tokens[8])
        if len(tokens) >= 11:
            return int(tokens[6]), int(tokens[7]), int(tokens[10])
    except ValueError:
        return None
    return None


def pending_behind(msg: Any) -> bool:
    """Whether the broker had messages pending behind ``msg`` when it sent it
    (its reply subject's ``num_pending``); True when that can't be read."""
    fields = ack_reply_fields(msg.reply)
    if fields is not None:
        return fields[2] > 0
    try:
        return int(msg.metadata.num_pending) > 0
    except Exception:
        return True
