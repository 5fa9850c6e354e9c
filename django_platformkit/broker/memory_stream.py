"""What the in-memory JetStream (``memory.InMemoryTransport``) stores and
answers: its clock, its messages and durables, the info, ack and publish
values shaped as nats-py's (so code written against the broker port reads
them alike), and its pull lane.

``ManualClock`` moves only when told, so a test never sleeps through a backoff.
Plain values and threads: no ``nats``, no Django.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django_platformkit import conf, identity
from django_platformkit.broker.port import DurableFacts, HeldMessage
from django_platformkit.broker.standing import UNLIMITED, StreamLimits, StreamStanding, judge_stream
from django_platformkit.wire import TARGET_HEADER, Delivery, PublishOutcome, PublishResult


class ManualClock:
    """Seconds (a float, starting at ``start``) that pass only through
    ``advance()`` / ``advance_to()``: what the in-memory broker measures
    NAK delays, ack waits and the duplicate window on. Thread-safe."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` (>= 0) forward. Raises ``ValueError`` for a negative step."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward: advance({seconds!r})")
        with self._lock:
            self._now += float(seconds)

    def advance_to(self, when: float) -> None:
        """Move the clock to ``when`` if that is later than now (never back)."""
        with self._lock:
            self._now = max(self._now, float(when))


@dataclass(frozen=True)
class StoredMessage:
    """One message of the in-memory stream: ``seq`` (1-based stream
    sequence), ``subject``, ``body``, ``headers`` and ``stored_at`` (clock seconds)."""

    seq: int
    subject: str
    body: bytes
    headers: dict[str, str]
    stored_at: float

    def held(self) -> HeldMessage:
        """What ``messages_at`` says of it (the clock has no date: no ``stored_at``)."""
        targets = self.headers.get(TARGET_HEADER)
        return HeldMessage(
            self.seq, self.headers.get("Nats-Msg-Id"), tuple(targets.split(",")) if targets else (), None
        )


class MessageLog:
    """The in-memory stream's messages, in stream order, and the
    ``Nats-Msg-Id`` window in which a re-send is a duplicate of the first copy."""

    def __init__(self) -> None:
        self.messages: list[StoredMessage] = []
        self._msg_ids: dict[str, tuple[int, float]] = {}  # Nats-Msg-Id -> (seq, stored_at)

    def append(self, subject: str, body: bytes, headers: dict[str, str], now: float) -> PublishResult:
        """Store a message at ``now`` (clock seconds), or answer with the first
        copy's sequence for an id seen within ``DUPLICATE_WINDOW_SECONDS``."""
        msg_id = headers.get("Nats-Msg-Id")
        if msg_id:
            seen = self._msg_ids.get(msg_id)
            if seen is not None and now - seen[1] < float(conf.settings.DUPLICATE_WINDOW_SECONDS):
                return PublishResult(PublishOutcome.STORED, duplicate=True, seq=seen[0])
        seq = len(self.messages) + 1
        self.messages.append(StoredMessage(seq, subject, bytes(body), dict(headers), now))
        if msg_id:
            self._msg_ids[msg_id] = (seq, now)
        return PublishResult(PublishOutcome.STORED, seq=seq)

    def held(self, seqs: Sequence[int]) -> dict[int, HeldMessage | None]:
        """The messages at ``seqs`` (None where there is none: the twin discards nothing)."""
        return {seq: self.messages[seq - 1].held() if 0 < seq <= len(self.messages) else None for seq in seqs}


class StreamSettings:
    """The in-memory stream's settings that decide whether it may be used,
    and who holds it: judged by ``standing`` and ``identity.judge`` as a
    real stream is. Its limits are only ever read (the twin discards
    nothing): ``InMemoryTransport.edit_stream`` sets them, as an operator's
    ``nats stream edit`` would, so tests see the refusal."""

    def __init__(self) -> None:
        self.retention = "limits"
        self.max_msgs = UNLIMITED
        self.max_bytes = UNLIMITED
        self.max_msgs_per_subject = UNLIMITED
        self.max_age: float | None = None  # seconds, as JetStream names it
        self.tenure = identity.Tenure(None)

    def standing(
        self, stream: str, url: str, owner: str | None, instance: str | None, now: float, *, record: bool = True
    ) -> StreamStanding:
        """Judge the stream for ``owner``/``instance`` at ``now`` (clock
        seconds), recording the tenure it asks for (``record``: False, nothing)."""
        limits = StreamLimits(self.retention, self.max_msgs, self.max_bytes, self.max_msgs_per_subject, self.max_age)
        # Read back from the description it would carry, as a real stream's is.
        description = identity.describe(self.tenure.identity, self.tenure) if self.tenure.identity else ""
        standing = judge_stream(
            limits,
            name=stream,
            url=url,
            recorded=identity.Tenure.read(description, None),
            owner=owner,
            instance=instance,
            now=now,
        )
        judgement = standing.judgement
        if record and judgement is not None and judgement.tenure is not None:
            self.tenure = judgement.tenure
            standing = replace(standing, tenure=self.tenure)
        return standing


@dataclass(frozen=True)
class StreamInfo:
    """What ``ensure_stream()`` returns: the stream's ``name``, ``subjects``,
    how many ``messages`` it holds, and the recorded ``owner`` (a database identity or None)."""

    name: str
    subjects: list[str]
    messages: int
    owner: str | None


@dataclass(frozen=True)
class ConsumerInfo:
    """A durable's counts, named as JetStream's ``ConsumerInfo``:
    ``num_pending`` (matching messages never delivered), ``num_ack_pending``
    (delivered and not acked or termed: in flight or awaiting a redelivery),
    ``num_redelivered`` (messages delivered more than once and still unacked)."""

    name: str
    stream_name: str
    num_pending: int
    num_ack_pending: int
    num_redelivered: int
    filter_subject: str


@dataclass(frozen=True)
class PubAck:
    """The stream's answer to ``publish_raw()``: ``stream``, ``seq``, ``duplicate``."""

    stream: str
    seq: int
    duplicate: bool = False


@dataclass(frozen=True)
class ConsumerSpec:
    """The parts of a durable's config the in-memory broker honours, named
    as ``nats.js.api.ConsumerConfig`` (which ``ensure_consumer`` accepts as
    well): ``durable_name``, ``filter_subject``, ``ack_wait`` (seconds),
    ``max_ack_pending`` (None: unlimited), ``deliver_policy`` (``"all"``,
    or ``"new"``: a new durable starts after the last stored message)."""

    durable_name: str
    filter_subject: str
    ack_wait: float
    max_ack_pending: int | None = None
    deliver_policy: str = "all"


@dataclass(frozen=True)
class MemoryAck:
    """``Delivery.msg`` of an in-memory delivery: which message of which durable, and which delivery of it."""

    durable: str
    seq: int
    delivered: int


@dataclass
class Durable:
    name: str
    filter_subject: str
    ack_wait: float
    max_ack_pending: int | None
    next_seq: int = 1  # the next stream sequence this durable has not looked at (deliver all)
    delivered: dict[int, int] = field(default_factory=dict)  # seq -> num_delivered, while unsettled
    in_flight: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline (clock seconds)
    waiting: dict[int, float] = field(default_factory=dict)  # seq -> when it may be redelivered (naked)
    created: datetime | None = None

    def expire(self, now: float) -> None:
        """The ack wait ran out: the broker redelivers it (its count goes up then)."""
        for seq, deadline in list(self.in_flight.items()):
            if deadline <= now:
                del self.in_flight[seq]
                self.waiting[seq] = deadline

    def info(self, stream: str, pending: int) -> ConsumerInfo:
        """What ``consumer_info`` says of it (``pending``: matching messages not delivered yet)."""
        return ConsumerInfo(
            name=self.name,
            stream_name=stream,
            num_pending=pending,
            num_ack_pending=len(self.in_flight) + len(self.waiting),
            num_redelivered=sum(1 for n in self.delivered.values() if n > 1),
            filter_subject=self.filter_subject,
        )

    def facts(self, pending: int) -> DurableFacts:
        """What ``durable_facts`` says of it: its ack floor is just below its
        oldest unsettled message, else its last looked-at sequence."""
        floor = min(self.delivered) - 1 if self.delivered else self.next_seq - 1
        unsettled = len(self.in_flight) + len(self.waiting)
        return DurableFacts(self.name, self.created, floor, self.next_seq - 1, pending, unsettled)


def subject_matches(filter_subject: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = filter_subject.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(have) == len(want)


class CompletedPublish:
    """``publish_start()``'s answer, already complete (``.results()`` as ``transport.PendingPublish``)."""

    def __init__(self, results: list[PublishResult], stream_created: datetime | None) -> None:
        self._results = results
        self.stream_created = stream_created

    def results(self) -> list[PublishResult]:
        return list(self._results)


class StillKeepAlive:
    """``keep_alive()``'s answer. The clock stands still while a handler runs
    (it moves only when told, and ``auto_advance`` never moves it while a
    delivery is in flight), so an ack wait can't run out under a running
    handler and there is nothing to extend."""

    future: Any = None

    def started(self, delivery: Delivery, timeout_seconds: float) -> None:
        pass

    def settled(self, delivery: Delivery) -> None:
        pass

    def stop(self) -> None:
        pass

    def due(self, now: float) -> list[Delivery] | None:
        return None


class MemoryPullLane:
    """The in-memory broker's pull lane (``port.PullLane``): one thread per
    durable asks for ``min(credit(), batch_size)`` deliveries and hands them
    to ``deliver``; ``idle`` is set while nothing is due for it.

    Args:
        durable: The durable it pulls.
        cond: The broker's condition: ``take`` is called holding it, and a
            publish or a settle notifies it.
        take: Up to that many deliveries due now (called under ``cond``).
        advance_if_idle: Moves the broker's clock to the next retry when
            nothing else can happen; returns whether it moved.
        credit: How many deliveries may be fetched now.
        deliver: Gets each fetched unit.
        batch_size: The most deliveries of one unit.
    """

    _numbers = itertools.count(1)

    def __init__(
        self,
        durable: str,
        *,
        cond: threading.Condition,
        take: Callable[[int], list[Delivery]],
        advance_if_idle: Callable[[], bool],
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.durable = durable
        self._cond = cond
        self._take = take
        self._advance_if_idle = advance_if_idle
        self._credit = credit
        self._deliver = deliver
        self._on_idle = on_idle  # a priority band's: see Broker.pull_lane
        self.batch_size = max(1, int(batch_size))
        self.idle = threading.Event()
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"platformkit-memory-pull-{next(self._numbers)}", daemon=True
        )

    def start(self) -> None:
        """Start pulling in the lane's thread."""
        self._thread.start()

    def wake(self) -> None:
        """Look again now (the credit may have grown)."""
        with self._cond:
            self._cond.notify_all()

    def wake_on_loop(self) -> None:
        """``wake()``: there is no loop."""
        self.wake()

    def running(self) -> bool:
        """Whether the lane's thread still pulls."""
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling; waits up to ``timeout`` s for the thread."""
        self._stopped.set()
        self.wake()
        self._thread.join(timeout)

    def _run(self) -> None:
        cond = self._cond
        try:
            while not self._stopped.is_set():
                want = min(self._credit(), self.batch_size)
                went_idle = False
                with cond:
                    deliveries = self._take(want) if want > 0 else []
                    if not deliveries:
                        if want > 0:
                            went_idle = not self.idle.is_set()
                            self.idle.set()
                        elif self._on_idle is not None:
                            self.idle.clear()  # not looking: what arrives now isn't seen (Broker.pull_lane)
                if not deliveries:
                    if went_idle and self._on_idle is not None:
                        self._on_idle()
                    with cond:
                        if not self._advance_if_idle():
                            cond.wait(0.05)
                    continue
                self.idle.clear()
                self._deliver(deliveries)
        except BaseException as exc:
            self.error = exc
            raise
