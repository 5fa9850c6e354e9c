"""The relay's send path: pipelined publishes and what a refusal means.

A batch is sent whole, in the order batches were started, before any ack is
awaited; each message's result says whether the row is stamped (STORED),
stays pending (TEMPORARY) or is dead-lettered by the relay (PERMANENT), so
one bad row never blocks the queue. ``Transport`` carries these methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js import api

from django_platformkit.wire import Outcome, OutgoingMessage, PublishResult

logger = logging.getLogger(__name__)

T = TypeVar("T")

# nats-py bounds in-flight async publishes (publish_async_max_pending, 4000
# by default); below this many pending acks a publish can't stall.
_NO_STALL_BELOW = 3000


def jetstream_context(nc: Any, timeout: float) -> Any:
    """``nc.jetstream(timeout=...)``, with publish_async's error acks delivered.

    nats-py's reply handler for ``publish_async`` builds the stream's error
    with ``APIError.from_error``, which raises instead of returning: the
    error goes to the connection's error callback and the ack's future is
    never resolved, so a 4xx (a message over the stream's ``max_msg_size``,
    ...) read as "no ack within the timeout" - temporary, the row sent again
    on every pass, never dead-lettered. The handler installed here sets that
    error on the future, where ``classify_publish_error`` sees it. It must be
    in place before the context's first ``publish_async`` subscribes it."""
    js = nc.jetstream(timeout=timeout)
    original = js._handle_async_reply

    async def handle_async_reply(msg: Any) -> None:
        try:
            await original(msg)
        except nats.js.errors.APIError as exc:
            token = msg.subject[len(js._nc._inbox_prefix) + 22 + 2 :]  # as nats-py reads it
            future = js._publish_async_futures.get(token)
            if future is not None and not future.done():
                future.set_exception(exc)

    js._handle_async_reply = handle_async_reply
    return js


def classify_publish_error(exc: BaseException) -> PublishResult:
    """A broker refusal is PERMANENT when the same message can never be
    stored (too big for the server or the stream, a 4xx from the stream);
    everything else - timeouts, no responders, lost connections, 5xx - is
    TEMPORARY and the row stays pending."""
    if isinstance(exc, nats.errors.MaxPayloadError):
        return PublishResult(Outcome.PERMANENT, f"larger than the server's max_payload: {exc}")
    if isinstance(exc, nats.js.errors.APIError) and exc.code is not None:
        if 400 <= int(exc.code) < 500 and int(exc.code) != 408:
            return PublishResult(
                Outcome.PERMANENT,
                f"the stream refused it: {exc.description} (code {exc.code}, err_code {exc.err_code})",
            )
        return PublishResult(Outcome.TEMPORARY, f"the stream is unavailable: {exc.description} (code {exc.code})")
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishResult(
            Outcome.TEMPORARY,
            "no stream answered (no responders): is the stream there, does it capture this subject, and is JetStream up?",
            no_stream=True,
        )
    return PublishResult(Outcome.TEMPORARY, f"{type(exc).__name__}: {exc}".rstrip(": "))


class _Publishing:
    """``Transport``'s publishing (see ``Transport``)."""

    request_timeout_seconds: float
    _nc: Any
    _js: Any
    _send_lock: asyncio.Lock | None

    if TYPE_CHECKING:

        def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T: ...

        def _ensure_loop(self) -> asyncio.AbstractEventLoop: ...

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
        if not messages:
            return PendingPublish(None, 0, timeout)
        future = asyncio.run_coroutine_threadsafe(self._publish_many(messages, timeout), self._ensure_loop())
        return PendingPublish(future, len(messages), timeout)

    async def _publish_many(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        results: list[PublishResult | None] = [None] * len(messages)
        futures: list[tuple[int, asyncio.Future[api.PubAck]]] = []
        # FIFO: the batch started first sends first, whole (see publish_start).
        if self._send_lock is None:  # made by _ensure_loop(), which scheduled this coroutine
            raise RuntimeError("Transport._publish_many ran outside the transport's loop")
        async with self._send_lock:
            if self._nc is None or self._nc.is_closed:
                return [PublishResult(Outcome.TEMPORARY, "not connected to NATS")] * len(messages)
            js = self._js
            task = asyncio.current_task()
            for i, message in enumerate(messages):
                if task is not None and task.cancelling():
                    # The caller gave up on this batch (its rows stay pending): send no more of it.
                    results[i:] = [PublishResult(Outcome.TEMPORARY, "publish cancelled")] * (len(messages) - i)
                    break
                # A stall timeout costs a timer per message; it is only needed
                # when nats-py's in-flight limit could make publish_async wait.
                stall = timeout if js.publish_async_pending() >= _NO_STALL_BELOW else None
                try:
                    future = await js.publish_async(
                        message.subject, message.body, headers={"Nats-Msg-Id": message.msg_id}, wait_stall=stall
                    )
                except Exception as exc:
                    result = classify_publish_error(exc)
                    results[i] = result
                    if result.outcome is not Outcome.PERMANENT:
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
                results[i] = PublishResult(Outcome.TEMPORARY, f"no ack from the stream within {timeout} s")
            elif future.cancelled():
                results[i] = PublishResult(Outcome.TEMPORARY, "publish cancelled")
            elif (error := future.exception()) is not None:
                results[i] = classify_publish_error(error)
            else:
                ack = future.result()
                results[i] = PublishResult(Outcome.STORED, duplicate=bool(ack.duplicate), seq=ack.seq)
        return [r for r in results if r is not None]

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> api.PubAck:
        """Publish one message and wait for the stream's ack (tests and tools)."""
        ack: api.PubAck = self.call(
            self._js.publish(subject, body, headers=headers), timeout=self.request_timeout_seconds + 1
        )
        return ack


class PendingPublish:
    """A batch handed to the loop by ``Transport.publish_start()``."""

    def __init__(
        self, future: concurrent.futures.Future[list[PublishResult]] | None, count: int, timeout: float
    ) -> None:
        self._future = future
        self._count = count
        self._timeout = timeout

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
                PublishResult(Outcome.TEMPORARY, f"NATS did not answer within {2 * self._timeout + 5:.0f} s")
            ] * self._count
        except Exception as exc:
            logger.exception("publish batch failed")
            return [PublishResult(Outcome.TEMPORARY, f"{type(exc).__name__}: {exc}")] * self._count
