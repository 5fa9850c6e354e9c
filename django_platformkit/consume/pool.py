"""The consumer pool: how fetched deliveries reach handlers.

Each subscription is a *lane*: its pulls wait on the transport's event loop
(``PullLane``), and it asks only for what can start now (credit: one unit of
1 to ``CONSUMER_BATCH_SIZE`` deliveries per free slot of its
``concurrency``) - or within milliseconds: a slot whose unit of fast
handlers is about to end (its measured run time, less the lane's measured
fetch time) lends its credit to the next unit, so the fetch overlaps the
end of the unit instead of following it. ``CONSUMER_THREADS`` threads, each
with its own database connection, take units round-robin over the lanes
with one ready and a slot free, so a busy subscription can't starve the
others. The worker (``runtime/worker.py``) owns the lifecycle and is given
its pool.

A task queue's priority bands (``Subscription.priority_group``) share
one ``Slots`` and take turns by band: ``consume.bands`` says what that
keeps; here it is three checks (a band's credit, the take, a slot freed).

A paused subscription's lane gets no credit: its messages wait in the
stream, unfetched (``pausing`` says the rest).

A rate-limited subscription's lane (``ratelimit``) fetches one delivery per
free slot and never early, so a worker holds no more of it than it can
start next; the unit waits for its start slot beside the pool
(``turns.TurnKeeper``), its ack kept alive, and joins the lane's startable
units when its slot comes - no pool thread sleeps on a turn, so every other
lane starts as it would with no limit anywhere. Whether a unit may start
now is decided in one place, ``ConsumerPool._may_start``. A stopping
worker hands a waiting unit back uncounted.

Why one module: lanes, credit, early fetch, bands and rate-limit turns
all answer one question under one lock - which unit a free pool thread
takes next - and ``_may_start``, ``_credit`` and ``_take`` keep their
invariants together; split across files, that lock's rules would be read
in several places at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.db import DatabaseError, connections

from django_platformkit import conf
from django_platformkit.broker.port import Broker, KeepAlive, PullLane
from django_platformkit.consume.bands import BandGroup, Slots, band_groups
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.pausing import Pauses
from django_platformkit.consume.ratelimit import LATE_RETAKES, RateLimiter
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.turns import TurnKeeper
from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError
from django_platformkit.wire import Delivery

logger = logging.getLogger(__name__)

#: A unit (the deliveries one pool thread takes at once) is sized so it runs
#: about this long: fast handlers get whole batches (one transaction, one
#: claim statement), a slow one gets one message at a time, so nothing
#: fetched waits long behind a slow handler. Sizes start at 1 and at most
#: double per unit, so a backlog of slow events never arrives as one batch.
UNIT_TARGET_SECONDS = 0.1
#: How long a pool thread backs off after a database or broker error outside a handler.
POOL_ERROR_BACKOFF_SECONDS = 1.0
#: A lane fetches its next unit before the running one ends only while its
#: handlers ran at most this long per message in its last unit: the fetched
#: unit then waits for the end of the running one, milliseconds (behind it,
#: if a handler that was fast turns slow: one unit at most).
EARLY_FETCH_MAX_PER_MESSAGE_SECONDS = 0.01
#: The early fetch starts this many measured fetch times, plus this share of
#: the running unit's expected run time, before that unit's expected end: in
#: the topology drain a fetch took 3-5 ms after a ~80 ms unit, during which
#: the lane ran nothing, and a unit's run time varies by a fifth from the
#: last one's. The fetched unit waits that long at most, give or take.
EARLY_FETCH_LEAD_FETCHES = 2.0
EARLY_FETCH_LEAD_SHARE = 0.2


@dataclass(eq=False)
class Unit:
    """Deliveries fetched together, not started yet, and their keep-alive.

    A rate-limited lane's unit also carries its turn: ``waiting`` until its
    start slot comes (``turns.TurnKeeper``), then ``slot_at`` (monotonic
    seconds) is when it came; ``retakes`` counts the fresh slots it took
    for starting too late after one."""

    deliveries: list[Delivery]
    keep: KeepAlive
    waiting: bool = False
    slot_at: float | None = None
    retakes: int = 0


class Lane:
    """One subscription in the pool: its consumers (one per
    ``concurrency`` slot), the units fetched and not started, and its puller.
    Guarded by the pool's condition lock."""

    def __init__(self, subscription: Subscription, consumers: list[Consumer], *, using: str = "default") -> None:
        if subscription.rate_limit_error:
            # The checks refuse it (platformkit.E011); a worker started without them must not run it unlimited.
            raise ConfigurationError(subscription.rate_limit_error)
        self.subscription = subscription
        self.consumers = consumers
        rate = subscription.rate_limit
        #: The shared limiter of a rate-limited subscription, else None (no cost).
        self.limiter = RateLimiter(subscription.rate_limit_name, rate, using) if rate is not None else None
        self.free = list(consumers)  # not running a unit
        #: Its concurrency's slots; a priority group's lanes share one (``bands.band_groups``).
        self.slots = Slots(len(consumers))
        #: The priority group it is a band of, or None.
        self.band: BandGroup[Lane] | None = None
        #: Units fetched and not started, in order (a rate-limited lane's include those waiting for their turn).
        self.queue: collections.deque[Unit] = collections.deque()
        self.puller: PullLane | None = None
        self.unit_size = 1  # deliveries to fetch per unit; see UNIT_TARGET_SECONDS
        self.ready = False  # in the pool's ready deque: a unit queued and a consumer free
        self.per_message: float | None = None  # the last unit's run time per delivery, seconds
        self.fetch_seconds = 0.0  # how long a credit took to arrive as a unit, smoothed
        self.credit_since: float | None = None  # when credit last appeared with none outstanding
        self.early_fetches = 0  # units fetched on a lent slot's credit, before the running unit ended

    @property
    def startable(self) -> bool:
        """Whether a unit of this lane may be taken by a pool thread: one not
        waiting for its rate-limit turn (caller holds the lock)."""
        return any(not unit.waiting for unit in self.queue)

    def take_startable(self) -> Unit:
        """Remove and return the first unit not waiting for its turn (caller holds the lock; ``startable``)."""
        unit = next(unit for unit in self.queue if not unit.waiting)
        self.queue.remove(unit)
        return unit

    def measured(self, deliveries: int, elapsed_seconds: float, batch_size: int) -> None:
        """Resize the next units from how long this one took (caller holds the lock)."""
        per_message = self.per_message = max(elapsed_seconds / max(1, deliveries), 1e-5)
        fits = int(UNIT_TARGET_SECONDS / per_message)
        self.unit_size = max(1, min(batch_size, fits, self.unit_size * 2))

    def early_fetch_in(self, deliveries: int) -> float | None:
        """Seconds after a unit of ``deliveries`` starts at which its slot
        lends its credit to the next unit, or None (handlers not measured
        yet, or slow, or rate-limited: the next unit is fetched when this one ends)."""
        if (
            self.limiter is not None
            or self.per_message is None
            or self.per_message > EARLY_FETCH_MAX_PER_MESSAGE_SECONDS
        ):
            return None
        expected = deliveries * self.per_message
        return max(0.0, expected * (1 - EARLY_FETCH_LEAD_SHARE) - EARLY_FETCH_LEAD_FETCHES * self.fetch_seconds)

    @property
    def available(self) -> int:
        """Slots neither running nor holding a queued unit: the credit (below 0
        while a fetched unit waits for a lent slot)."""
        return self.slots.available

    @available.setter
    def available(self, value: int) -> None:
        self.slots.available = value

    @property
    def lent(self) -> int:
        """Running units that lent their slot's credit to the next unit (early fetch)."""
        return self.slots.lent

    @lent.setter
    def lent(self, value: int) -> None:
        self.slots.lent = value

    @property
    def busy(self) -> bool:
        return self.slots.available < self.slots.capacity

    @property
    def credit(self) -> int:
        """Units this lane may fetch now: free slots plus lent ones (caller holds the lock)."""
        return self.slots.available + self.slots.lent


class _Taken:
    """A unit a pool thread took: whether its slot lent its credit (early fetch)."""

    __slots__ = ("done", "lent")

    def __init__(self) -> None:
        self.done = False
        self.lent = False


def pool_thread_count(subscriptions: Sequence[Subscription]) -> int:
    """How many pool threads (each keeping a database connection) serve
    ``subscriptions``: ``CONSUMER_THREADS``, but no more than their units
    could ever run at once (the sum of their ``concurrency``, a priority
    group's bands counted once: they share its slots); 0 for none."""
    slots = {s.priority_group or s.name: s.concurrency for s in subscriptions}
    return min(int(conf.settings.CONSUMER_THREADS), sum(slots.values()))


def pool_connection_count(subscriptions: Sequence[Subscription]) -> int:
    """The database connections a pool serving ``subscriptions`` keeps: one
    per pool thread, and the turn keeper's where one is rate-limited."""
    limited = any(s.rate_limit is not None for s in subscriptions)
    return pool_thread_count(subscriptions) + (1 if limited and subscriptions else 0)


class ConsumerPool:
    """Lanes, credit, the round-robin take and the pool threads.

    Args:
        broker: Pulls each lane's durable and settles what the pool hands back.
        lanes: One per subscription, each with its consumers.
        using: The database alias of the pool threads' connections.
        stop_event: Set when the worker stops: nothing more is fetched or taken.
        spawn: Starts a named thread whose crash stops the process (the worker's).
        pauses: The paused subscriptions (their lanes fetch nothing), or None.
    """

    def __init__(
        self,
        broker: Broker,
        lanes: Sequence[Lane],
        *,
        using: str,
        stop_event: threading.Event,
        spawn: Callable[[str, Callable[[], object]], threading.Thread],
        pauses: Pauses | None = None,
    ) -> None:
        self.broker = broker
        self.pauses = pauses
        self.lanes = list(lanes)
        self.using = using
        self.stop_event = stop_event
        self._spawn = spawn
        self._cond = threading.Condition()
        self._ready: collections.deque[Lane] = collections.deque()  # lanes with a unit queued, in turn
        self._threads: list[threading.Thread] = []
        self._batch_size = int(conf.settings.CONSUMER_BATCH_SIZE)
        #: Where rate-limited units wait for their turn (None: no lane is limited).
        self.turns: TurnKeeper[tuple[Lane, Unit]] | None = None
        if any(lane.limiter is not None for lane in self.lanes):
            self.turns = TurnKeeper(using=using, stop_event=stop_event, release=self._turn_came)
        band_groups(self.lanes)  # a task queue's bands: shared slots, highest band first

    @property
    def consumers(self) -> list[Consumer]:
        """Every lane's consumers."""
        return [consumer for lane in self.lanes for consumer in lane.consumers]

    def start(self) -> None:
        """Start every lane's puller and the pool threads."""
        if not self.lanes:
            return
        batch_size = self._batch_size
        for lane in self.lanes:
            lane.puller = self.broker.pull_lane(
                lane.subscription.consumer_config(),
                credit=functools.partial(self._credit, lane, batch_size),
                deliver=functools.partial(self._delivered, lane),
                batch_size=batch_size,
                on_idle=None if lane.band is None else functools.partial(self._band_idle, lane),
            )
        for number in range(pool_thread_count([lane.subscription for lane in self.lanes])):
            self._threads.append(self._spawn(f"platformkit-consumer-{number}", self._pool_loop))
        if self.turns is not None:
            self._threads.append(self._spawn("platformkit-rate-turns", self.turns.run))

    def _credit(self, lane: Lane, batch_size: int) -> int:
        """Called on the loop: how many messages ``lane`` may fetch now."""
        if self.stop_event.is_set() or (self.pauses is not None and self.pauses.holds(lane.subscription)):
            return 0  # a paused lane's messages wait in the stream, unfetched: no ack wait runs
        with self._cond:
            # A priority band: 0 while a band above may have work (its look or take wakes this lane).
            if (lane.credit if lane.band is None else lane.band.credit(lane)) <= 0:
                return 0
            if lane.credit_since is None:
                lane.credit_since = time.monotonic()
            if lane.limiter is not None:
                return 1  # one start slot per delivery: fetch nothing the limit won't let start next
            return min(batch_size, lane.unit_size)

    def _delivered(self, lane: Lane, deliveries: list[Delivery]) -> None:
        """Called on the loop with a fetched unit: queue it for the pool."""
        # Acks extended from fetch time: a unit waiting for a thread ages against its ack wait too.
        keep = self.broker.keep_alive(deliveries, every_seconds=max(0.2, float(conf.settings.ACK_WAIT_SECONDS) / 3))
        with self._cond:
            if lane.credit_since is not None:
                # How long credit takes to become a unit: the lead of the next early fetch.
                # Capped: a long-poll that waited for the next event measures the event's
                # gap, not the fetch.
                waited = min(time.monotonic() - lane.credit_since, UNIT_TARGET_SECONDS)
                lane.fetch_seconds = waited if not lane.fetch_seconds else 0.8 * lane.fetch_seconds + 0.2 * waited
                lane.credit_since = None
            if lane.available <= 0:
                lane.early_fetches += 1
            lane.available -= 1  # below 0 while the unit holds a lent slot: it starts when that unit ends
            unit = Unit(deliveries, keep, waiting=lane.limiter is not None)
            lane.queue.append(unit)
            self._mark_ready(lane)
        if unit.waiting:
            self._ask_turn(lane, unit)

    def _ask_turn(self, lane: Lane, unit: Unit) -> None:
        """Hand ``unit`` to the turn keeper: it waits there, on no pool thread, for its start slot."""
        assert self.turns is not None  # a pool with a limited lane has a keeper
        assert lane.limiter is not None
        self.turns.ask(lane.limiter, (lane, unit))

    def _turn_came(self, waiting: tuple[Lane, Unit], slot_at: float) -> None:
        """The keeper's call: ``unit``'s start slot has come; a pool thread may take it."""
        lane, unit = waiting
        with self._cond:
            if unit not in lane.queue:
                return  # handed back meanwhile (a stopping worker)
            unit.waiting, unit.slot_at = False, slot_at
            self._mark_ready(lane)

    def _may_start(self, lane: Lane, unit: Unit) -> bool:
        """Whether ``unit``, just taken by a pool thread, may start now: the
        one place that decides it (caller holds the lock). A rate-limited
        unit taken later than ``late_after_seconds`` after its slot - every
        thread was busy - would share a window with the slots after it: it
        asks for a fresh slot instead (up to ``LATE_RETAKES`` times, then it
        starts anyway). False: the unit is back in the lane, waiting."""
        limiter = lane.limiter
        if limiter is None or unit.slot_at is None:
            return True
        late = time.monotonic() - unit.slot_at
        if late <= limiter.late_after_seconds or unit.retakes >= LATE_RETAKES:
            return True
        unit.waiting, unit.slot_at = True, None
        unit.retakes += 1
        lane.queue.appendleft(unit)
        return False

    def _mark_ready(self, lane: Lane) -> None:
        """Queue ``lane`` for a pool thread if it has a unit and a free consumer (caller holds the lock)."""
        if lane.startable and lane.free and lane.slots.running < lane.slots.capacity and not lane.ready:
            lane.ready = True
            self._ready.append(lane)
            self._cond.notify()

    def _take(self) -> tuple[Lane, Consumer, list[Delivery], KeepAlive] | None:
        """The next unit, round-robin over the lanes with one ready (a
        priority group's highest band first); None when stopping."""
        with self._cond:
            while True:
                while not self._ready and not self.stop_event.is_set():
                    self._cond.wait(1.0)
                if self.stop_event.is_set():
                    return None
                lane = self._ready.popleft()
                lane.ready = False
                if lane.band is not None:
                    best = lane.band.first_ready()
                    if best is None:
                        continue  # taken from by a band above it meanwhile: re-marked when a slot frees
                    if best is not lane:
                        self._mark_ready(lane)  # its unit waits behind the higher band's
                        lane = best
                if not lane.startable:
                    continue  # its unit went back to wait for a fresh turn meanwhile
                unit = lane.take_startable()
                retake: Unit | None = None if self._may_start(lane, unit) else unit
                if retake is not None:
                    self._mark_ready(lane)  # another of its units may be startable
                    break
                consumer = lane.free.pop()
                lane.slots.running += 1
                self._mark_ready(lane)  # its next unit waits for its turn
                lower = lane.band.lower(lane) if lane.band is not None and not lane.queue else []
                break
        if retake is not None:
            self._ask_turn(lane, retake)
            return self._take()
        for other in lower:  # nothing of this band waits now: a lower one may fetch if this one is idle
            if other.puller is not None:
                other.puller.wake()
        return lane, consumer, unit.deliveries, unit.keep

    def _band_idle(self, lane: Lane) -> None:
        """``lane``'s puller found its durable empty (on the loop): the bands
        below it may start what they hold, and fetch."""
        band = lane.band
        assert band is not None  # only a band's puller is given this callback
        with self._cond:
            for each in band.lanes:
                self._mark_ready(each)
        for other in band.lower(lane):
            if other.puller is not None:
                other.puller.wake_on_loop()

    def _lend(self, lane: Lane, running: _Taken, *, on_loop: bool = True) -> None:
        """Near the end of ``running``'s unit: let its slot's credit fetch the next unit."""
        with self._cond:
            if running.done or running.lent or self.stop_event.is_set():
                return
            running.lent = True
            lane.lent += 1
        if lane.puller is None:
            return
        if on_loop:
            lane.puller.wake_on_loop()
        else:
            lane.puller.wake()

    def _lend_later(self, lane: Lane, running: _Taken, deliveries: int) -> None:
        """Lend ``running``'s credit when its lane's early fetch is due: at
        once (a unit shorter than a fetch: no timer), or by a timer on the loop."""
        with self._cond:
            delay = lane.early_fetch_in(deliveries)
        if delay is None:
            return
        if delay <= 0:
            self._lend(lane, running, on_loop=False)
            return
        # On the broker's loop, where the lane's puller waits; a broker without
        # a loop (the in-memory one) schedules nothing: the next unit is
        # fetched when this one ends.
        self.broker.call_later(delay, functools.partial(self._lend, lane, running))

    def _pool_loop(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            lane, consumer, deliveries, keep = taken
            started = time.monotonic()
            running = _Taken()
            self._lend_later(lane, running, len(deliveries))
            try:
                self._handle(consumer, deliveries, keep)
            finally:
                with contextlib.suppress(Exception):
                    keep.stop()
                with self._cond:
                    lane.measured(len(deliveries), time.monotonic() - started, self._batch_size)
                    running.done = True
                    if running.lent:
                        lane.lent -= 1
                    lane.free.append(consumer)
                    lane.available += 1
                    lane.slots.running -= 1
                    # A priority group's slot is every band's: each may start or fetch.
                    freed = [lane] if lane.band is None else lane.band.lanes
                    for each in freed:
                        self._mark_ready(each)
                for each in freed:
                    if each.puller is not None:
                        each.puller.wake()

    def _handle(self, consumer: Consumer, deliveries: list[Delivery], keep: KeepAlive) -> None:
        try:
            consumer.handle(deliveries, keep)
        except (DatabaseError, BrokerUnavailable, TimeoutError, OSError) as exc:
            # Outside a handler (the consumer judges a handler's own errors):
            # an outage. Hand the unit back; the claim makes a redo harmless.
            logger.error(
                "consumer subscription=%s error=%s; handing back deliveries=%s, retrying in %.1fs",
                consumer.subscription.name,
                exc,
                len(deliveries),
                POOL_ERROR_BACKOFF_SECONDS,
            )
            with contextlib.suppress(Exception):
                connections[self.using].close()
            for delivery in deliveries:
                with contextlib.suppress(Exception):
                    self.broker.nak(delivery, POOL_ERROR_BACKOFF_SECONDS)
            self.stop_event.wait(POOL_ERROR_BACKOFF_SECONDS)

    def hand_back_queued(self, lanes: Sequence[Lane] | None = None) -> None:
        """NAK at once every unit fetched and not started (a stopping worker
        hands back what it must now, not after the ack wait), of ``lanes``
        only if given (a pause)."""
        with self._cond:
            chosen = self.lanes if lanes is None else list(lanes)
            units = [unit for lane in chosen for unit in lane.queue]
            for lane in chosen:
                # Their slots are free again: a unit's slot was taken when it was fetched.
                lane.available += len(lane.queue)
                lane.queue.clear()
                lane.ready = False
            self._ready = collections.deque(lane for lane in self._ready if lane not in chosen)
        for unit in units:
            with contextlib.suppress(Exception):
                unit.keep.stop()
            for delivery in unit.deliveries:
                with contextlib.suppress(Exception):
                    self.broker.nak(delivery)
        if units:
            logger.info("handed back unstarted deliveries=%s", sum(len(u.deliveries) for u in units))

    # -- what the worker asks of its pool --
    def stop_pulling(self) -> None:
        """Wake every waiting pool thread (they see the stop) and stop every lane's puller."""
        with self._cond:
            self._cond.notify_all()
        if self.turns is not None:
            self.turns.wake()
        for lane in self.lanes:
            if lane.puller is not None:
                lane.puller.stop()

    def busy(self) -> bool:
        """Whether any unit runs or waits for a pool thread."""
        with self._cond:
            return any(lane.busy or lane.queue for lane in self.lanes)

    def idle(self) -> bool:
        """Whether every lane's last look at its durable found nothing."""
        return all(lane.puller is None or lane.puller.idle.is_set() for lane in self.lanes)

    def dead_puller(self) -> tuple[str, BaseException] | None:
        """``(durable, error)`` of a lane that no longer pulls (crashed or ended), or None."""
        for lane in self.lanes:
            puller = lane.puller
            if puller is not None and (puller.error is not None or not puller.running()):
                return puller.durable, puller.error or RuntimeError("the pull lane ended")
        return None

    def stuck(self, timeout_seconds: float) -> list[str]:
        """The subscriptions with a handler running past ``timeout_seconds``, sorted."""
        now = time.monotonic()
        return sorted(
            {
                c.subscription.name
                for c in self.consumers
                if c.handler_started is not None and now - c.handler_started > timeout_seconds
            }
        )

    def notify_stopping(self) -> None:
        """Wake every pool thread waiting for a unit: the worker stops."""
        with self._cond:
            self._cond.notify_all()
