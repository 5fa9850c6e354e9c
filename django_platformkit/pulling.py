"""The consumer's receive path on the transport's loop: pull lanes, and
JetStream messages turned into ``Delivery`` values.

A lane asks the broker for no more than can start now, and waits on the
broker with a request, never a thread (ADR-13's pull protocol). The ack
subject is parsed here once per message; a message without JetStream
metadata can't be acked and is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
from nats.js import api

from . import conf
from ._retry import Backoff
from .exceptions import ConsumerDrift
from .wire import Delivery

if TYPE_CHECKING:
    from .transport import Transport

logger = logging.getLogger("django_platformkit.transport")  # the logger these lines always had


def to_deliveries(msgs: Sequence[Any]) -> list[Delivery]:
    """JetStream messages as ``Delivery`` values (a message without JetStream
    metadata can't be acked either: logged and skipped)."""
    out = []
    for msg in msgs:
        fields = _ack_reply_fields(msg.reply)
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


async def _next_msg(sub: Any, timeout: float) -> Any:
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


def _ack_reply_fields(reply: Any) -> tuple[int, int, int] | None:
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


def _pending_behind(msg: Any) -> bool:
    """Whether the broker had messages pending behind ``msg`` when it sent it
    (its reply subject's ``num_pending``); True when that can't be read."""
    fields = _ack_reply_fields(msg.reply)
    if fields is not None:
        return fields[2] > 0
    try:
        return int(msg.metadata.num_pending) > 0
    except Exception:
        return True


class PullLost(Exception):
    """A pull request went unanswered (no message, status or heartbeat in time)."""


class PullLane:
    """The pulls of one durable, run on the transport's loop: waiting on the
    broker costs a request, never a thread.

    While ``credit()`` (called on the loop; must be quick and thread-safe)
    is above 0, it asks for ``min(credit(), batch_size)`` messages with a
    ``no_wait`` request (what is there now); if none are there, one
    long-poll request for as many (``no_wait`` with ``expires`` =
    ``linger_seconds``, idle heartbeats every ``heartbeat_seconds``), re-sent
    as it expires: the server holds it until the first message arrives, then
    sends what is there with it and ends it (404), so it is handed over at
    once. The no_wait look is skipped when the last message said nothing was
    pending behind it (``num_pending`` of its metadata): a steady trickle
    costs one request per unit. So a fetch never asks for more than can
    start now, and nothing fetched waits for a message that isn't there.
    ``deliver(deliveries)`` gets each fetched unit (1 to ``batch_size``, on
    the loop thread: it must only hand them over) and must lower the credit.
    Status messages: 100 (heartbeat) is skipped, 404/408 end a request, 409
    and 503 (no responders: the durable or JetStream is gone) and a missed
    heartbeat make the lane re-ensure the durable with backoff. Each request
    has its own reply subject, so a late status of an abandoned request is
    recognised and ignored. Borrowed from the JetStream pull protocol
    (ADR-13) and nats-py's ``_fetch_n``, without its wait for a full batch.
    """

    def __init__(
        self,
        transport: Transport,
        want: api.ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        linger_seconds: float,
        heartbeat_seconds: float,
    ) -> None:
        self.transport = transport
        self.want = want
        self.durable = want.durable_name
        self._credit = credit
        self._deliver = deliver
        self.batch_size = max(1, int(batch_size))
        self.linger_seconds = float(linger_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.idle = threading.Event()  # set: the last look found nothing, and nothing fetched since
        self.error: BaseException | None = None  # an unexpected crash of the lane task (the worker exits on it)
        self._wake: asyncio.Event | None = None
        self._waiting = False  # blocked for credit: only then does wake() need the loop
        self._stopped = False
        self._seq = 0
        self._sub: Any = None
        self._inbox = ""
        self._held: list[Any] = []  # received, not yet handed over: NAKed if the lane stops in between
        self.future: Any = None

    def start(self) -> None:
        self.future = self.transport.submit(self._run())

    def wake(self) -> None:
        """Thread-safe: the credit may have grown; look again now. Costs
        nothing while the lane is in a request (it reads the credit again
        before it waits for more): the caller must have changed the credit
        before calling this."""
        if not self._waiting:
            return
        loop = self.transport._loop
        if loop is not None and self._wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def wake_on_loop(self) -> None:
        """``wake()`` from the transport's loop itself."""
        if self._wake is not None:
            self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling; NAK at once whatever was received but not handed over. Waits up to ``timeout`` s."""
        self._stopped = True
        if self.future is None:
            return
        loop = self.transport._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.future.cancel)
        with contextlib.suppress(Exception):
            self.future.result(timeout)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        delay = Backoff(0.5, 10.0)
        maybe_more = True  # unknown at start: look with a no_wait request first
        try:
            while not self._stopped:
                want = min(self._credit(), self.batch_size)
                if want <= 0:
                    self._wake.clear()
                    # Waiting, then the credit read again: a credit given after
                    # that read finds _waiting set and wakes us; one given before
                    # it is seen by the read.
                    self._waiting = True
                    try:
                        if min(self._credit(), self.batch_size) <= 0:
                            await self._wake.wait()
                    finally:
                        self._waiting = False
                    continue
                try:
                    # The last message said nothing was pending behind it
                    # (its metadata's num_pending): go straight to the
                    # long-poll, which gets whatever arrives (or falls due)
                    # meanwhile. A steady trickle then costs one request per
                    # message, not a no_wait request answered 404 and then one.
                    msgs = await self._request(want, linger=False) if maybe_more else []
                    if not msgs:
                        self.idle.set()
                        # Waits for the first message, then hands over at once
                        # what is there with it (up to the credit) and ends (404):
                        # a burst arrives as one unit, an isolated event alone.
                        msgs = await self._request(want, linger=True)
                    delay.reset()
                except (PullLost, TimeoutError, nats.errors.Error, OSError) as exc:
                    # The durable may be gone (deleted, the stream re-made): make it
                    # again after the wait. Otherwise the broker is away: just retry.
                    durable_lost = isinstance(exc, PullLost | nats.js.errors.APIError | nats.errors.NoRespondersError)
                    wait = delay.next()
                    logger.error(
                        "pull failed consumer=%s %s=%s; %s in %.1fs",
                        self.durable,
                        "error" if durable_lost else "broker error",
                        exc or type(exc).__name__,
                        "re-ensuring the durable" if durable_lost else "retrying",
                        wait,
                    )
                    await self._reset()
                    await asyncio.sleep(wait)
                    if durable_lost:
                        await self._reensure()
                    maybe_more = True
                    continue
                deliveries = to_deliveries(msgs)
                self._held = []
                maybe_more = _pending_behind(msgs[-1]) if msgs else True
                if deliveries:
                    self.idle.clear()
                    self._deliver(deliveries)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self.error = exc
            logger.exception("pull lane crashed consumer=%s", self.durable)
        finally:
            await self._nak_held()
            await self._reset()

    async def _ensure_sub(self) -> Any:
        if self._sub is None:
            nc = self.transport._nc
            self._inbox = nc.new_inbox()
            self._sub = await nc.subscribe(self._inbox + ".*")
        return self._sub

    async def _reset(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _nak_held(self) -> None:
        # A stopping worker hands back at once what it holds, not after the ack wait.
        held, self._held = self._held, []
        if self._sub is not None:
            while True:
                try:
                    msg = self._sub._pending_queue.get_nowait()
                except Exception:
                    break
                if not (msg.headers or {}).get("Status"):
                    held.append(msg)
        for msg in held:
            with contextlib.suppress(Exception):
                await msg.nak()

    async def _reensure(self) -> None:
        try:
            await self.transport._ensure_consumer(self.want)
        except ConsumerDrift:
            raise
        except Exception as exc:
            logger.error("durable not ensured consumer=%s error=%s", self.durable, exc or type(exc).__name__)

    async def _request(self, batch: int, *, linger: bool) -> list[Any]:
        sub = await self._ensure_sub()
        self._seq += 1
        reply = f"{self._inbox}.{self._seq}"
        request: dict[str, Any] = {"batch": int(batch)}
        if linger:
            # no_wait with expires: the server holds the request until the
            # first message (or the expiry: 408), sends what is there, then
            # ends it (404) instead of waiting to fill the batch.
            request["no_wait"] = True
            request["expires"] = int(self.linger_seconds * 1e9)
            request["idle_heartbeat"] = int(self.heartbeat_seconds * 1e9)
            # Two missed heartbeats: the request is gone; the expiry answers with a 408 first.
            gap = 2 * self.heartbeat_seconds + 1.0
        else:
            request["no_wait"] = True  # no expires: with one the server would linger
            gap = self.transport.request_timeout_seconds
        nc = self.transport._nc
        await nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{conf.settings.STREAM}.{self.durable}",
            json.dumps(request).encode(),
            reply=reply,
        )
        msgs = self._held = []
        while len(msgs) < batch and not self._stopped:
            try:
                msg = await _next_msg(sub, gap)
            except (TimeoutError, nats.errors.TimeoutError):
                if msgs:
                    return msgs
                raise PullLost(f"no answer to a pull request within {gap:g} s") from None
            status = (msg.headers or {}).get("Status")
            if not status:
                msgs.append(msg)
                gap = self.transport.request_timeout_seconds  # the rest (and the 404) follow at once
                continue
            if msg.subject != reply:
                continue  # a late status of an earlier request
            if status == "100":
                continue
            if status in ("404", "408"):
                break
            description = (msg.headers or {}).get("Description", "")
            if status == "503":
                raise PullLost(f"no responders for consumer {self.durable} (deleted, or JetStream down)")
            if msgs:
                return msgs  # hand over what came; the next request meets the error again
            raise nats.js.errors.APIError(code=int(status), description=description)
        return msgs
