"""The relay's send path: pipelined publishes and what a refusal means.

A batch is sent whole, in the order batches were started, before any ack is
awaited; each message's result says whether the row is stamped (STORED),
stays pending (TEMPORARY) or is dead-lettered by the relay (PERMANENT), so
one bad row never blocks the queue - and only a refusal that can never
succeed is PERMANENT: an answer that doesn't prove the message stored or
refused for good leaves the row pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.js import api

from django_platformkit.broker.connection import Connection
from django_platformkit.wire import OutgoingMessage, PublishOutcome, PublishResult

logger = logging.getLogger(__name__)


# nats-py bounds in-flight async publishes (publish_async_max_pending, 4000
# by default); below this many pending acks a publish can't stall.
_NO_STALL_BELOW = 3000


#: JetStream's refusals of a message that no later send of it can change
#: (nats-server's errors.json): the relay dead-letters its row. Every other
#: refusal is about the stream or the moment - a leader not decided yet
#: (10158, "duplicate message id is in process"), a stream full with discard
#: new (10077), sealed (10109), too busy (10167), an error code this build
#: doesn't know - and the row stays pending, to be sent again with the same
#: Nats-Msg-Id, until the stream stores it or refuses it for good.
REFUSED_FOR_GOOD = {
    10054: "JSStreamMessageExceedsMaximumErr",  # larger than the stream's max_msg_size (or the server's)
    10097: "JSStreamHeaderExceedsMaximumErr",  # headers over 64 KiB
}
#: JetStream's "duplicate message id is in process": a clustered leader has
#: proposed a message with this id and not committed it yet (paused,
#: partitioned, mid-election), or dropped a proposal it keeps the id of for
#: the duplicate window. The first copy may still be stored: only a later
#: answer says which. Dead-lettering it lost events (issue 27).
DUPLICATE_IN_PROCESS = 10158


def classify_publish_error(exc: BaseException) -> PublishResult:
    """A publish's failure as an outcome for its row.

    PERMANENT only when the same message can never be stored: larger than
    the server's ``max_payload``, or a refusal in ``REFUSED_FOR_GOOD``.
    Everything else - no answer, no responders, a lost connection, a 5xx,
    a 409 "in process", a refusal about the stream rather than the message,
    an error code unknown to this build - is TEMPORARY: the row stays
    pending and is sent again with the same ``Nats-Msg-Id``, so a first copy
    the stream did store makes the re-send a duplicate, never a second event."""
    if isinstance(exc, nats.errors.MaxPayloadError):
        return PublishResult(PublishOutcome.PERMANENT, f"larger than the server's max_payload: {exc}")
    if isinstance(exc, nats.js.errors.APIError) and exc.code is not None:
        said = f"{exc.description} (code {exc.code}, err_code {exc.err_code})"
        if exc.err_code in REFUSED_FOR_GOOD:
            return PublishResult(PublishOutcome.PERMANENT, f"the stream refused it for good: {said}")
        if exc.err_code == DUPLICATE_IN_PROCESS:
            return PublishResult(
                PublishOutcome.TEMPORARY,
                f"the stream has not decided an earlier send of this message yet: {said}; sent again until it does",
            )
        return PublishResult(PublishOutcome.TEMPORARY, f"the stream did not store it for now: {said}")
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishResult(
            PublishOutcome.TEMPORARY,
            "no stream answered (no responders): is the stream there, does it capture this subject, and is JetStream up?",
            no_stream=True,
        )
    return PublishResult(PublishOutcome.TEMPORARY, f"{type(exc).__name__}: {exc}".rstrip(": "))


class Publisher:
    """The relay's send path over ``connection``: pipelined, batches in the order they were started."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        # One per loop, made on it: an asyncio.Lock binds to the loop it first waits on.
        self._send_lock: asyncio.Lock | None = None
        self._send_lock_loop: asyncio.AbstractEventLoop | None = None

    def publish_start(self, messages: Sequence[OutgoingMessage], *, timeout: float = 10.0) -> PendingPublish:
        """Publish pipelined (every message is sent before any ack is awaited;
        in-flight acks are bounded by nats-py's pending limit): hand
        ``messages`` to the loop and return at once; ``.results()`` waits for
        the acks, one ``PublishResult`` per message, in order. Batches are sent in the order they were started,
        never interleaved, so a caller that starts batch N+1 while batch N's
        acks are outstanding keeps relay order on the wire (while nothing
        fails: a message refused for now is sent again later, after the
        batches behind it). ``timeout`` (seconds) bounds each stalled send
        and the wait for the acks; the first message that can't be sent for
        now ends the batch's sending, the rest counting as TEMPORARY."""
        # Which stream, read before anything is sent: if it is replaced during
        # the batch, the rows are stamped with the old one and reconciliation
        # re-sends what nobody handled, never the other way round.
        created = self.connection.stream_created
        if not messages:
            return PendingPublish(None, 0, timeout, created)
        future = self.connection.submit(self._publish_many(messages, timeout))
        return PendingPublish(future, len(messages), timeout, created)

    async def _publish_many(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        results: list[PublishResult | None] = [None] * len(messages)
        futures: list[tuple[int, asyncio.Future[api.PubAck]]] = []
        # FIFO: the batch started first sends first, whole (see publish_start).
        loop = asyncio.get_running_loop()
        if self._send_lock is None or self._send_lock_loop is not loop:
            self._send_lock, self._send_lock_loop = asyncio.Lock(), loop
        async with self._send_lock:
            nc = self.connection.nc
            if nc is None or nc.is_closed:
                return [PublishResult(PublishOutcome.TEMPORARY, "not connected to NATS")] * len(messages)
            js = self.connection.js
            task = asyncio.current_task()
            for i, message in enumerate(messages):
                if task is not None and task.cancelling():
                    # The caller gave up on this batch (its rows stay pending): send no more of it.
                    results[i:] = [PublishResult(PublishOutcome.TEMPORARY, "publish cancelled")] * (len(messages) - i)
                    break
                # A stall timeout costs a timer per message; it is only needed
                # when nats-py's in-flight limit could make publish_async wait.
                stall = timeout if js.publish_async_pending() >= _NO_STALL_BELOW else None
                try:
                    future = await js.publish_async(
                        message.subject, message.body, headers=message.headers(), wait_stall=stall
                    )
                except Exception as exc:
                    result = classify_publish_error(exc)
                    results[i] = result
                    if result.outcome is not PublishOutcome.PERMANENT:
                        # A stall, a lost connection, a cancel: the rest would fail
                        # the same way, one timeout each. They stay pending.
                        results[i + 1 :] = [result] * (len(messages) - i - 1)
                        break
                    continue
                futures.append((i, future))
        if futures:
            # Acks come back in order: wait for the last one, then for any stragglers.
            deadline = asyncio.get_running_loop().time() + timeout
            await asyncio.wait([futures[-1][1]], timeout=timeout)
            late = [f for _, f in futures if not f.done()]
            if late:
                await asyncio.wait(late, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        for i, future in futures:
            if not future.done():
                future.cancel()
                results[i] = PublishResult(PublishOutcome.TEMPORARY, f"no ack from the stream within {timeout} s")
            elif future.cancelled():
                results[i] = PublishResult(PublishOutcome.TEMPORARY, "publish cancelled")
            elif (error := future.exception()) is not None:
                results[i] = classify_publish_error(error)
            else:
                ack = future.result()
                results[i] = PublishResult(PublishOutcome.STORED, duplicate=bool(ack.duplicate), seq=ack.seq)
        return [r for r in results if r is not None]

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> api.PubAck:
        """Publish one message and wait for the stream's ack (tests and tools)."""
        connection = self.connection
        ack: api.PubAck = connection.call(
            connection.js.publish(subject, body, headers=headers), timeout=connection.request_timeout_seconds + 1
        )
        return ack


class PendingPublish:
    """A batch handed to the loop by ``Transport.publish_start()``."""

    def __init__(
        self,
        future: concurrent.futures.Future[list[PublishResult]] | None,
        count: int,
        timeout: float,
        stream_created: datetime | None = None,
    ) -> None:
        self._future = future
        self._count = count
        self._timeout = timeout
        #: The stream's creation time when the batch started (``port.PendingPublish``).
        self.stream_created = stream_created

    def results(self) -> list[PublishResult]:
        """Wait for the acks: one ``PublishResult`` per message, in order.
        Never raises: a loop that doesn't answer (a batch queued behind
        another's stalled send, then its own ack wait) makes every message
        TEMPORARY, so the rows stay pending."""
        if self._future is None:
            return []
        try:
            return self._future.result(2 * self._timeout + 5)
        except concurrent.futures.TimeoutError:
            self._future.cancel()
            return [
                PublishResult(PublishOutcome.TEMPORARY, f"NATS did not answer within {2 * self._timeout + 5:.0f} s")
            ] * self._count
        except Exception as exc:
            logger.exception("publish batch failed")
            return [PublishResult(PublishOutcome.TEMPORARY, f"{type(exc).__name__}: {exc}")] * self._count
