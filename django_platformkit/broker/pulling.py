"""The consumer's receive path on the connection's loop: pull lanes for the
worker's pool, and one-off fetches for tools and tests.

A lane asks the broker for no more than can start now, and waits on the
broker with a request, never a thread (ADR-13's pull protocol).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from django_platformkit import conf
from django_platformkit._retry import Backoff
from django_platformkit.broker.connection import Connection
from django_platformkit.broker.messages import next_msg, pending_behind, to_deliveries
from django_platformkit.broker.streams import Streams
from django_platformkit.exceptions import BrokerUnavailable, ConsumerDrift
from django_platformkit.wire import Delivery

logger = logging.getLogger(__name__)

#: A waiting pull request's expiry: an idle subscription costs one request
#: per this many seconds (re-issued as it expires), not a timer per 50 ms.
PULL_LINGER_SECONDS = 30.0
#: Idle heartbeats of a waiting pull: two missed mean the request is gone
#: (a reconnect, a durable deleted under us) and a new one is sent.
PULL_HEARTBEAT_SECONDS = 5.0


class PullLost(Exception):
    """A pull request went unanswered (no message, status or heartbeat in time)."""


class PullLane:
    """The pulls of one durable, run on the connection's loop: waiting on the
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
        connection: Connection,
        streams: Streams,
        want: api.ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        linger_seconds: float,
        heartbeat_seconds: float,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.connection = connection
        self.streams = streams
        self.want = want
        self.durable = str(want.durable_name)
        self._credit = credit
        self._deliver = deliver
        self._on_idle = on_idle  # a priority band's: see Broker.pull_lane
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
        self.future = self.connection.submit(self._run())

    def wake(self) -> None:
        """Thread-safe: the credit may have grown; look again now. Costs
        nothing while the lane is in a request (it reads the credit again
        before it waits for more): the caller must have changed the credit
        before calling this."""
        if not self._waiting:
            return
        loop = self.connection.loop
        if loop is not None and self._wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def running(self) -> bool:
        """Whether the lane still pulls (False once stopped, ended or crashed)."""
        return self.future is not None and not self.future.done() and self.error is None

    def wake_on_loop(self) -> None:
        """``wake()`` from the connection's loop itself."""
        if self._wake is not None:
            self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling; NAK at once whatever was received but not handed over. Waits up to ``timeout`` s."""
        self._stopped = True
        if self.future is None:
            return
        loop = self.connection.loop
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
                    if self._on_idle is not None:
                        # No request open: what arrives now isn't seen, so a
                        # lower band must not take this durable for empty.
                        self.idle.clear()
                        maybe_more = True  # and the look after the wait is a fresh one
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
                        if self._on_idle is not None:
                            self._on_idle()
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
                maybe_more = pending_behind(msgs[-1]) if msgs else True
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
            nc = self.connection.nc
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
            await self.streams.ensure_consumer_async(self.want)
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
            gap = self.connection.request_timeout_seconds
        nc = self.connection.nc
        await nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{conf.settings.STREAM}.{self.durable}",
            json.dumps(request).encode(),
            reply=reply,
        )
        msgs = self._held = []
        while len(msgs) < batch and not self._stopped:
            try:
                msg = await next_msg(sub, gap)
            except (TimeoutError, nats.errors.TimeoutError):
                if msgs:
                    return msgs
                raise PullLost(f"no answer to a pull request within {gap:g} s") from None
            status = (msg.headers or {}).get("Status")
            if not status:
                msgs.append(msg)
                gap = self.connection.request_timeout_seconds  # the rest (and the 404) follow at once
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


class Puller:
    """The consumer's receive path over ``connection``: pull lanes for the
    worker, and one-off fetches for tools and tests."""

    def __init__(self, connection: Connection, streams: Streams) -> None:
        self.connection = connection
        self.streams = streams
        self._pulls: dict[tuple[str, int], Any] = {}  # (durable, puller) -> pull subscription
        self._generation = -1  # the connection's, when _pulls was filled

    async def _pull(self, durable: str, puller: int = 0) -> Any:
        # One pull subscription per (durable, puller): nats-py's fetch() is not
        # safe for two concurrent callers on one subscription.
        if self._generation != self.connection.generation:
            self._pulls.clear()  # bound to a connection that is gone
            self._generation = self.connection.generation
        sub = self._pulls.get((durable, puller))
        if sub is None:
            sub = await self.connection.js.pull_subscribe_bind(durable=durable, stream=conf.settings.STREAM)
            self._pulls[(durable, puller)] = sub
        return sub

    def fetch(self, durable: str, batch: int, *, timeout: float = 1.0, puller: int = 0) -> list[Delivery]:
        """Up to ``batch`` messages for ``durable``, waiting at most
        ``timeout`` seconds; ``[]`` when there is nothing. A pull request
        always carries an expiry, so an orphaned one can't hang the loop.
        Threads fetching the same durable at once pass distinct ``puller``
        numbers (each gets a pull subscription of its own)."""
        return self.connection.call(
            self._fetch(durable, batch, timeout, puller),
            timeout=timeout + self.connection.request_timeout_seconds + 5,
        )

    async def _fetch(self, durable: str, batch: int, timeout: float, puller: int = 0) -> list[Delivery]:
        sub = await self._pull(durable, puller)
        try:
            msgs = await sub.fetch(batch, timeout=timeout, heartbeat=1.0 if timeout >= 3.0 else None)
        except (TimeoutError, nats.errors.TimeoutError):
            return []
        return to_deliveries(msgs)

    def pull_lane(
        self,
        want: api.ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        linger_seconds: float = PULL_LINGER_SECONDS,
        heartbeat_seconds: float = PULL_HEARTBEAT_SECONDS,
        on_idle: Callable[[], None] | None = None,
    ) -> PullLane:
        """Start pulling ``want``'s durable on the loop, for as long as the
        connection lives or until ``PullLane.stop()``; see ``PullLane``."""
        lane = PullLane(
            self.connection,
            self.streams,
            want,
            credit=credit,
            deliver=deliver,
            batch_size=batch_size,
            linger_seconds=linger_seconds,
            heartbeat_seconds=heartbeat_seconds,
            on_idle=on_idle,
        )
        lane.start()
        return lane

    def forget_pull(self, durable: str) -> None:
        """Drop a cached pull subscription (after the durable was recreated)."""

        async def _forget() -> None:
            for key in [k for k in self._pulls if k[0] == durable]:
                try:
                    await self._pulls.pop(key).unsubscribe()
                except Exception:
                    pass

        try:
            self.connection.call(_forget(), timeout=5)
        except BrokerUnavailable:
            pass
