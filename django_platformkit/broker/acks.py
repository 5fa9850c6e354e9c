"""Settling deliveries on the broker: ack, nak, term, and in-progress acks.

A lost ack only means a redelivery that the claim skips, so acks are sent
without waiting; a message waiting its turn in a fetched batch, or held
through a database outage, keeps its ack alive with in-progress acks, so it
ages against the ack wait only while its handler runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from django_platformkit.broker.connection import Connection
from django_platformkit.wire import Delivery

logger = logging.getLogger(__name__)


#: The beat task's shortest pause between two looks for in-progress acks that
#: are due (the shortest beat the worker asks for is 0.2 s). It sleeps until
#: the next one is due, so an idle worker's loop isn't woken 20 times a second.
KEEP_ALIVE_TICK_SECONDS = 0.05


class KeepAlive:
    """In-progress acks for one fetched batch; see ``Transport.keep_alive``."""

    def __init__(
        self,
        deliveries: Sequence[Delivery],
        every_seconds: float = 10.0,
        on_done: Callable[[KeepAlive], None] | None = None,
    ) -> None:
        self._on_done = on_done  # told once nothing is left to extend (the beat task forgets it)
        self._lock = threading.Lock()
        self._pending: dict[int, Delivery] = {id(d): d for d in deliveries}
        self._deadlines: dict[int, float] = {}
        self.every_seconds = float(every_seconds)
        self._next_at = time.monotonic() + self.every_seconds

    def started(self, delivery: Delivery, timeout_seconds: float) -> None:
        """The delivery's handler starts now: extend its ack for ``timeout_seconds`` more, then stop."""
        # Twice per handler run: one dict store (atomic in CPython), no lock;
        # due() only reads this dict.
        self._deadlines[id(delivery)] = time.monotonic() + timeout_seconds

    def settled(self, delivery: Delivery) -> None:
        """The delivery was acked, naked or termed: stop extending it."""
        with self._lock:
            self._pending.pop(id(delivery), None)
            done = not self._pending
        if done and self._on_done is not None:
            self._on_done(self)

    def stop(self) -> None:
        """Stop extending every delivery of the batch."""
        with self._lock:
            self._pending.clear()
        if self._on_done is not None:
            self._on_done(self)

    @property
    def next_at(self) -> float:
        """When (``time.monotonic()``) its next in-progress acks are due."""
        return self._next_at

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


class Acks:
    """Settling deliveries over ``connection``: acks without waiting, nak,
    term, and the in-progress acks that keep fetched deliveries alive."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._keep_lock = threading.Lock()
        self._keeps: set[KeepAlive] = set()  # live KeepAlives, served by the loop's one beat task
        self._beater_loop: asyncio.AbstractEventLoop | None = None  # the loop whose beat task runs
        self._beater: Any = None
        self._shortest_every = float("inf")  # the shortest beat asked for: the longest the beat task may sleep
        self._in_flight: set[asyncio.Task[None]] = set()  # ack tasks, held until they end
        connection.before_close(self._stop_beating)

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
        loop = self.connection.ensure_loop()
        in_flight = self._in_flight

        async def _acks() -> None:
            for msg in msgs:
                try:
                    await msg.ack()
                except Exception as exc:  # lost: the message is redelivered and its claim skips it
                    logger.debug("ack failed subject=%s error=%s", msg.subject, exc)

        def start() -> None:
            task = loop.create_task(_acks())
            in_flight.add(task)  # a task only weakly referenced by the loop may be collected mid-run
            task.add_done_callback(in_flight.discard)

        loop.call_soon_threadsafe(start)

    def nak(self, delivery: Delivery, delay_seconds: float | None = None) -> None:
        """Hand a delivery back for redelivery after ``delay_seconds`` (None: at once). Raises ``BrokerUnavailable`` on timeout."""
        self.connection.call(delivery.msg.nak(delay=delay_seconds), timeout=self.connection.request_timeout_seconds)

    def term(self, delivery: Delivery) -> None:
        """Tell the broker never to deliver this message again. Raises ``BrokerUnavailable`` on timeout."""
        self.connection.call(delivery.msg.term(), timeout=self.connection.request_timeout_seconds)

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
        keep = KeepAlive(deliveries, every_seconds, on_done=self._forget)
        loop = self.connection.ensure_loop()
        with self._keep_lock:
            self._keeps.add(keep)
            self._shortest_every = min(self._shortest_every, keep.every_seconds)
            start = self._beater_loop is not loop
            if start:
                self._beater_loop = loop
        if start:
            self._beater = self.connection.submit(self._keep_beat(loop))
        return keep

    def _forget(self, keep: KeepAlive) -> None:
        """A ``KeepAlive`` with nothing left to extend: the beat task stops waking for it."""
        with self._keep_lock:
            self._keeps.discard(keep)

    async def _keep_beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop's one beat task: in-progress acks for every live ``KeepAlive`` that is due.

        It sleeps until the earliest is due, and never longer than the
        shortest beat asked for: a ``KeepAlive`` registered while it sleeps is
        first due one beat after its fetch, so it is never served late."""
        pause = KEEP_ALIVE_TICK_SECONDS
        while self._beater_loop is loop:
            await asyncio.sleep(pause)
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
            with self._keep_lock:
                next_due = min((keep.next_at for keep in self._keeps), default=float("inf"))
                longest = self._shortest_every
            pause = max(KEEP_ALIVE_TICK_SECONDS, min(next_due - time.monotonic(), longest))

    def _stop_beating(self) -> None:
        """Before the loop stops: end the beat task (never "Task was destroyed
        but it is pending"); a new loop starts its own."""
        beater, self._beater = self._beater, None
        if beater is not None:
            beater.cancel()
        with self._keep_lock:
            self._beater_loop = None
            self._keeps.clear()
