"""Priority bands in the consumer pool: the lanes of one priority group (a
task queue's bands, ``Subscription.priority_group``) share the queue's
slots, and the highest band with work goes first.

What a worker keeps: a band fetches only while every higher band of its
queue has nothing fetched and not started, and its durable was last found
empty by a look that keeps a long-poll open (``PullLane.idle``: cleared
while the lane waits for credit, and the look after that wait is a fresh
one); a free slot starts the highest band's unit, and a lower band's unit
fetched earlier starts only once every band above it is known empty again.
A higher band's credit ignores the units of lower bands waiting here, so
they can't keep it from looking. So a task starts before every
lower-priority task this worker has fetched or could fetch, and what
already runs finishes first. What it can't keep: order across workers
(each orders what it fetches), nor a higher-priority task that reaches the
stream in the round trip between a band's empty look and a lower band's
start. A lane of its own (no group) pays nothing here: its ``Slots`` are
its own and it has no ``BandGroup``.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any, Protocol

from django_platformkit.broker.port import PullLane
from django_platformkit.consume.subscriptions import Subscription


class Lane(Protocol):
    """What the bands read and set of a pool lane (``pool.Lane``)."""

    slots: Slots
    band: Any  # the BandGroup it belongs to, or None

    @property
    def subscription(self) -> Subscription: ...
    @property
    def queue(self) -> Sized: ...  # units fetched and not started
    @property
    def free(self) -> Sized: ...  # consumers not running a unit
    @property
    def puller(self) -> PullLane | None: ...


class Slots:
    """The units one lane - or one priority group's lanes together - may
    hold at once (its ``concurrency``); guarded by the pool's lock.

    ``available``: slots neither running nor holding a queued unit (the
    credit; below 0 while a fetched unit waits for a lent slot);
    ``lent``: running units that lent their slot's credit to the next unit
    (early fetch); ``running``: units running now."""

    __slots__ = ("available", "capacity", "lent", "running")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.available = capacity
        self.lent = 0
        self.running = 0


class BandGroup[L: Lane]:
    """The lanes of one priority group, highest band first, sharing one ``Slots``.

    Args:
        lanes: The group's lanes, in any order (sorted here by ``priority_rank``).
    """

    def __init__(self, lanes: Sequence[L]) -> None:
        self.lanes = sorted(lanes, key=lambda lane: lane.subscription.priority_rank)
        self.slots = Slots(max(lane.subscription.concurrency for lane in self.lanes))

    def blocked(self, lane: L) -> bool:
        """Whether a higher band than ``lane``'s may have work: a unit fetched
        and not started, or a durable not seen empty by a look that holds
        its long-poll open now (caller holds the pool's lock)."""
        for higher in self.lanes:
            if higher is lane:
                return False
            if higher.queue or higher.puller is None or not higher.puller.idle.is_set():
                return True
        return False

    def credit(self, lane: L) -> int:
        """Units ``lane`` may fetch now: 0 while a higher band may have work,
        else the slots not running and not held by a unit of its own band or
        a higher one (a lower band's waiting unit yields to it), plus lent
        ones (caller holds the lock)."""
        if self.blocked(lane):
            return 0
        slots = self.slots
        held = 0
        for each in self.lanes:
            held += len(each.queue)
            if each is lane:
                break
        return slots.capacity - slots.running - held + slots.lent

    def first_ready(self) -> L | None:
        """The band whose unit starts next: the highest with a unit queued
        and a consumer free, provided every band above it is known empty;
        None while no slot is free or a band above may still have work (its
        look decides: ``PullLane.idle``). Caller holds the lock."""
        if self.slots.running >= self.slots.capacity:
            return None
        for lane in self.lanes:
            if lane.queue and lane.free:
                return lane
            if lane.queue or lane.puller is None or not lane.puller.idle.is_set():
                return None
        return None

    def lower(self, lane: L) -> list[L]:
        """The bands below ``lane``'s."""
        return self.lanes[self.lanes.index(lane) + 1 :]


def band_groups[L: Lane](lanes: Sequence[L]) -> list[BandGroup[L]]:
    """A ``BandGroup`` for each priority group among ``lanes``, each lane of
    it given the group's shared ``Slots`` and the group (``Lane.band``)."""
    by_group: dict[str, list[L]] = {}
    for lane in lanes:
        if lane.subscription.priority_group is not None:
            by_group.setdefault(lane.subscription.priority_group, []).append(lane)
    groups = []
    for members in by_group.values():
        group = BandGroup(members)
        for lane in members:
            lane.slots, lane.band = group.slots, group
        groups.append(group)
    return groups
