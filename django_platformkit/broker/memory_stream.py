"""What the in-memory JetStream (``testing_transport``) stores and answers:
its clock, its messages and durables, and the info, ack and publish values
shaped as nats-py's, so code written against ``Transport`` reads them alike.

``ManualClock`` moves only when told, so a test never sleeps through a backoff.
Plain values: no ``nats``, no Django.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from django_platformkit.wire import Delivery, PublishResult


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
    ``max_ack_pending`` (None: unlimited)."""

    durable_name: str
    filter_subject: str
    ack_wait: float
    max_ack_pending: int | None = None


@dataclass(frozen=True)
class _Ack:
    """``Delivery.msg`` of an in-memory delivery: which message of which durable, and which delivery of it."""

    durable: str
    seq: int
    delivered: int


@dataclass
class _Durable:
    name: str
    filter_subject: str
    ack_wait: float
    max_ack_pending: int | None
    next_seq: int = 1  # the next stream sequence this durable has not looked at (deliver all)
    delivered: dict[int, int] = field(default_factory=dict)  # seq -> num_delivered, while unsettled
    in_flight: dict[int, float] = field(default_factory=dict)  # seq -> ack deadline (clock seconds)
    waiting: dict[int, float] = field(default_factory=dict)  # seq -> when it may be redelivered (naked)


def subject_matches(filter_subject: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = filter_subject.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(have) == len(want)


class _Published:
    """``publish_start()``'s answer, already complete (``.results()`` as ``transport.PendingPublish``)."""

    def __init__(self, results: list[PublishResult]) -> None:
        self._results = results

    def results(self) -> list[PublishResult]:
        return list(self._results)


class _KeepAlive:
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
