"""Settling deliveries on the broker: ack, nak, term, and in-progress acks.

A lost ack only means a redelivery that the claim skips, so acks are sent
without waiting; a message waiting its turn in a fetched batch, or held
through a database outage, keeps its ack alive with in-progress acks, so it
ages against the ack wait only while its handler runs. ``Transport``
carries these methods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .wire import Delivery

logger = logging.getLogger("django_platformkit.transport")  # the logger these lines always had

T = TypeVar("T")

#: How often the one beat task looks for in-progress acks that are due (the
#: shortest beat the worker asks for is 0.2 s).
KEEP_ALIVE_TICK_SECONDS = 0.05


class KeepAlive:
    """In-progress acks for one fetched batch; see ``Transport.keep_alive``."""

    def __init__(self, deliveries: Sequence[Delivery], every_seconds: float = 10.0) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Delivery] = {id(d): d for d in deliveries}
        self._deadlines: dict[int, float] = {}
        self.every_seconds = float(every_seconds)
        self._next_at = time.monotonic() + self.every_seconds
        self.future: Any = None  # kept for compatibility: the transport's one beat task serves every KeepAlive

    def started(self, delivery: Delivery, timeout_seconds: float) -> None:
        """The delivery's handler starts now: extend its ack for ``timeout_seconds`` more, then stop."""
        # Twice per handler run: one dict store (atomic in CPython), no lock;
        # due() only reads this dict.
        self._deadlines[id(delivery)] = time.monotonic() + timeout_seconds

    def settled(self, delivery: Delivery) -> None:
        """The delivery was acked, naked or termed: stop extending it."""
        with self._lock:
            self._pending.pop(id(delivery), None)

    def stop(self) -> None:
        """Stop extending every delivery of the batch (the beat task drops it at its next tick)."""
        with self._lock:
            self._pending.clear()

    def due(self, now: float) -> list[Delivery] | None:
        """Called by the beat task: the deliveries to extend now ([] if not yet
        due), or None once nothing is left to extend."""
        with self._lock:
            if not self._pending:
                return None
            if now < self._next_at:
                return []
            self._next_at = now + self.every_seconds
            return [d for key, d in self._pending.items() if self._deadlines.get(key, now + 1) > now]


#: Ack tasks started by ``Transport.ack_many``, held until they end.
_ACKS_IN_FLIGHT: set[asyncio.Task[None]] = set()


class _Acks:
    """``Transport``'s acks and keep-alives (see ``Transport``)."""

    request_timeout_seconds: float
    _keep_lock: threading.Lock
    _keeps: set[KeepAlive]
    _keep_beater_loop: asyncio.AbstractEventLoop | None
    _keep_beater_future: Any

    if TYPE_CHECKING:

        def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T: ...

        def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]: ...

        def _ensure_loop(self) -> asyncio.AbstractEventLoop: ...

    def ack(self, delivery: Delivery) -> None:
        """Ack without waiting for the loop: an ack is a plain publish, and a
        lost one only means a redelivery that the claim skips."""
        self.ack_many([delivery])

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Ack several deliveries in one trip through the loop, without waiting (see ``ack``).

        No ``concurrent.futures.Future`` per call (``submit`` makes one,
        chains it to the task and notifies its condition when it ends):
        nobody waits for an ack, so the loop only gets a callback that
        starts one task for the unit's acks."""
        if not deliveries:
            return
        msgs = [d.msg for d in deliveries]
        loop = self._ensure_loop()

        async def _acks() -> None:
            for msg in msgs:
                try:
                    await msg.ack()
                except Exception as exc:  # lost: the message is redelivered and its claim skips it
                    logger.debug("ack failed subject=%s error=%s", msg.subject, exc)

        def start() -> None:
            task = loop.create_task(_acks())
            _ACKS_IN_FLIGHT.add(task)  # a task only weakly referenced by the loop may be collected mid-run
            task.add_done_callback(_ACKS_IN_FLIGHT.discard)

        loop.call_soon_threadsafe(start)

    def nak(self, delivery: Delivery, delay_seconds: float | None = None) -> None:
        """Hand a delivery back for redelivery after ``delay_seconds`` (None: at once). Raises ``BrokerUnavailable`` on timeout."""
        self.call(delivery.msg.nak(delay=delay_seconds), timeout=self.request_timeout_seconds)

    def term(self, delivery: Delivery) -> None:
        """Tell the broker never to deliver this message again. Raises ``BrokerUnavailable`` on timeout."""
        self.call(delivery.msg.term(), timeout=self.request_timeout_seconds)

    def keep_alive(self, deliveries: Sequence[Delivery], every_seconds: float) -> KeepAlive:
        """Send in-progress acks for every delivery of a fetched batch, from
        fetch time, every ``every_seconds``: a message waiting behind others
        in the batch ages against its ack wait too. Stops per delivery at
        ``settled()`` or past the deadline given to ``started()`` (the handler
        timeout: then the ack wait runs out and the broker may redeliver).

        One beat task per loop serves every live ``KeepAlive`` (ticking every
        ``KEEP_ALIVE_TICK_SECONDS``): registering and ``stop()`` only touch a
        set under a lock, so a unit costs no task and no cross-thread wake-up
        of the loop (a task per unit cost two self-pipe writes and a
        cancellation each, on the loop the pulls and acks wait on)."""
        keep = KeepAlive(deliveries, every_seconds)
        loop = self._ensure_loop()
        with self._keep_lock:
            self._keeps.add(keep)
            start = self._keep_beater_loop is not loop
            if start:
                self._keep_beater_loop = loop
        if start:
            self._keep_beater_future = self.submit(self._keep_beat(loop))
        return keep

    async def _keep_beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop's one beat task: in-progress acks for every live ``KeepAlive`` that is due."""
        import time

        while self._keep_beater_loop is loop:
            await asyncio.sleep(KEEP_ALIVE_TICK_SECONDS)
            now = time.monotonic()
            with self._keep_lock:
                keeps = list(self._keeps)
            for keep in keeps:
                due = keep.due(now)
                if due is None:
                    with self._keep_lock:
                        self._keeps.discard(keep)
                    continue
                for delivery in due:
                    try:
                        await delivery.msg.in_progress()
                    except Exception as exc:
                        logger.debug("in-progress ack failed seq=%s error=%s", delivery.stream_seq, exc)
