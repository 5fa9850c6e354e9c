"""Raw JetStream API requests for what nats-py's typed answers leave out:
the creation time of a stream and of a durable (nats-py before 2.14 parses
neither, and this project supports 2.9), and a message looked up by its
stream sequence with the time it was stored.

Reconciliation reads these (``Broker.stream_facts``, ``durable_facts``,
``messages_at``); every stream read also updates what the connection knows
of its stream's creation time (``Connection.stream_created``), which the
relay's stamp records. Called on the connection's loop.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from email.parser import BytesHeaderParser
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from django_platformkit import conf
from django_platformkit.broker.connection import Connection
from django_platformkit.broker.port import DurableFacts, HeldMessage
from django_platformkit.wire import TARGET_HEADER

#: The JetStream API's subject prefix (no JetStream domain).
API_PREFIX = "$JS.API"
#: JetStream's answer to a message lookup at a sequence it doesn't hold (JSNoMessageFoundErr).
NO_MESSAGE_FOUND = 10037
#: The status line of a NATS header block: ``NATS/1.0\r\n``.
_STATUS_LINE = len(b"NATS/1.0\r\n")


async def request(connection: Connection, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One JetStream API request (``$JS.API.<path>``); its JSON answer.

    Raises nats-py's own errors, as its typed calls do: ``NotFoundError``
    for a 404, ``APIError`` for another refusal, ``ServiceUnavailableError``
    when nothing answers (no JetStream), a timeout."""
    nc = connection.nc
    if nc is None:
        raise nats.errors.ConnectionClosedError
    payload = json.dumps(body).encode() if body else b""
    try:
        msg = await nc.request(f"{API_PREFIX}.{path}", payload, timeout=connection.request_timeout_seconds)
    except nats.errors.NoRespondersError:
        raise nats.js.errors.ServiceUnavailableError from None
    answer: dict[str, Any] = json.loads(msg.data)
    if "error" in answer:
        nats.js.errors.APIError.from_error(answer["error"])  # raises the matching subclass
    return answer


def timestamp(text: Any) -> datetime | None:
    """An RFC 3339 time as JetStream writes it (nanoseconds cut to
    microseconds, as PostgreSQL keeps them); None for none or Go's zero time."""
    if not isinstance(text, str) or not text or text.startswith("0001-01-01"):
        return None
    return datetime.fromisoformat(text)


async def stream_info(connection: Connection, name: str | None = None) -> tuple[api.StreamInfo, datetime | None]:
    """The stream's info and its creation time; the connection learns the
    creation time of this project's stream from it. Raises ``NotFoundError``
    when there is no stream."""
    name = name or conf.settings.STREAM
    answer = await request(connection, f"STREAM.INFO.{name}")
    created = timestamp(answer.get("created"))
    if name == conf.settings.STREAM:
        connection.stream_created = created
    return api.StreamInfo.from_response(answer), created


async def durable_facts(connection: Connection, durable: str) -> DurableFacts | None:
    """A durable's creation time, ack floor and counts; None when it doesn't exist."""
    try:
        answer = await request(connection, f"CONSUMER.INFO.{conf.settings.STREAM}.{durable}")
    except nats.js.errors.NotFoundError:
        return None
    delivered = answer.get("delivered") or {}
    floor = answer.get("ack_floor") or {}
    return DurableFacts(
        name=durable,
        created=timestamp(answer.get("created")),
        ack_floor=int(floor.get("stream_seq") or 0),
        delivered=int(delivered.get("stream_seq") or 0),
        num_pending=int(answer.get("num_pending") or 0),
        num_ack_pending=int(answer.get("num_ack_pending") or 0),
    )


async def message_at(connection: Connection, seq: int) -> HeldMessage | None:
    """The message the stream holds at ``seq``; None when it holds none there."""
    try:
        answer = await request(connection, f"STREAM.MSG.GET.{conf.settings.STREAM}", {"seq": int(seq)})
    except nats.js.errors.NotFoundError as exc:
        if exc.err_code in (NO_MESSAGE_FOUND, None):
            return None
        raise
    message = answer.get("message") or {}
    headers = _headers(message.get("hdrs"))
    targets = headers.get(TARGET_HEADER)
    return HeldMessage(
        seq=int(message.get("seq") or seq),
        msg_id=headers.get("Nats-Msg-Id"),
        targets=tuple(targets.split(",")) if targets else (),
        stored_at=timestamp(message.get("time")),
    )


def _headers(encoded: Any) -> dict[str, str]:
    """A stored message's headers (base64 of a NATS header block), as nats-py reads them."""
    if not encoded:
        return {}
    block = base64.b64decode(encoded)[_STATUS_LINE:]
    return {key: value.strip() for key, value in BytesHeaderParser().parsebytes(block).items()}
