"""The broker port: what the relay, the consumer and the runtime need of a
broker, and nothing else.

``transport.Transport`` implements it over NATS JetStream and
``memory.InMemoryTransport`` in this process; one behaviour suite
(``tests/broker/test_port.py``) holds both to it, as River's driver tests
and pgqueuer's port-conformance tests do. Callers type against ``Broker``,
so a reader of the relay or the consumer never meets a ``nats`` type.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from django_platformkit.broker.standing import StreamStanding
from django_platformkit.wire import Delivery, OutgoingMessage, PublishResult

if TYPE_CHECKING:
    # The durable's config is JetStream's own type (the in-memory broker
    # reads the same fields); imported for the annotations only, so the
    # consumer side never imports nats.
    from nats.js import api

    #: A durable consumer's config, as JetStream defines it.
    type ConsumerConfig = api.ConsumerConfig


class DurableInfo(Protocol):
    """A durable's counts, named as JetStream's ``ConsumerInfo``."""

    @property
    def num_pending(self) -> int | None:
        """Messages matching the durable's filter that it never delivered."""

    @property
    def num_ack_pending(self) -> int | None:
        """Delivered and neither acked nor termed: in flight, or awaiting a redelivery."""


class PendingPublish(Protocol):
    """A batch handed to the broker by ``Broker.publish_start``."""

    def results(self) -> list[PublishResult]:
        """Wait for the broker's answers: one ``PublishResult`` per message,
        in order. Never raises: a broker that doesn't answer makes every
        message TEMPORARY, so its row stays pending."""


class KeepAlive(Protocol):
    """In-progress acks for the deliveries of one fetched unit."""

    def started(self, delivery: Delivery, timeout_seconds: float) -> None:
        """The delivery's handler starts now: extend its ack for ``timeout_seconds`` more, then stop."""

    def settled(self, delivery: Delivery) -> None:
        """The delivery was acked, naked or termed: stop extending it."""

    def stop(self) -> None:
        """Stop extending every delivery of the unit."""


class PullLane(Protocol):
    """The pulls of one durable for the consumer pool (``Broker.pull_lane``)."""

    durable: str
    #: Set while the last look found nothing and nothing was fetched since.
    idle: threading.Event
    #: An unexpected crash of the lane (the worker exits on it).
    error: BaseException | None

    def wake(self) -> None:
        """Thread-safe: the credit may have grown; look again now."""

    def wake_on_loop(self) -> None:
        """``wake()`` from the broker's own loop (a callback scheduled with ``Broker.call_later``)."""

    def running(self) -> bool:
        """Whether the lane still pulls (False once stopped, ended or crashed)."""

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling, hand back at once what was received and not delivered, wait up to ``timeout`` s."""


class Broker(Protocol):
    """A JetStream-like broker behind a synchronous API.

    Every method may raise ``BrokerUnavailable`` when the broker can't be
    reached in time; ``ensure_stream`` raises ``ConfigurationError`` for a
    stream it must not use (another project's, a live copy's, or one whose
    limits could discard unhandled events), ``ensure_consumer``
    ``ConsumerDrift`` for a durable it can't change, ``consumer_info``
    ``ConsumerNotFound``.
    """

    #: Where the broker is, for messages (never with credentials).
    url: str
    #: Set while connected.
    connected: threading.Event

    # -- connection --
    def connect(self) -> None:
        """Connect once."""

    def connect_until(
        self, stop: threading.Event, *, retry_seconds: float = 2.0, give_up_after_seconds: float | None = None
    ) -> bool:
        """Connect, retrying until it works or ``stop`` is set; returns whether it connected."""

    def close(self) -> None:
        """Flush what is pending and disconnect."""

    def redact(self, text: str) -> str:
        """``text`` without this broker's credentials."""

    def loop_alive(self) -> bool:
        """Whether the broker's event loop (if it has one) still runs."""

    def call_later(self, delay_seconds: float, callback: Callable[[], object]) -> bool:
        """Run ``callback`` on the broker's loop after ``delay_seconds``;
        False when the broker has no loop to run it on (nothing scheduled)."""

    # -- the stream and its durables --
    def ensure_stream(self, *, owner: str | None = None, instance: str | None = None) -> Any:
        """Create the stream if missing; refuse one this database must not use (``owner``: its identity,
        ``instance``: the database instance behind it; see ``standing`` and ``identity.judge``)."""

    def stream_standing(self, *, owner: str, instance: str | None) -> StreamStanding:
        """How the stream stands for this database instance now, recording the holder's renewal (or a
        copy's attempt); a refusal is in the answer, not raised. Running workers ask every ``identity.RENEW_SECONDS``."""

    def ensure_consumer(self, want: ConsumerConfig) -> DurableInfo:
        """Create the durable if missing, update what may be updated in place."""

    def consumer_info(self, durable: str) -> DurableInfo:
        """A durable's counts."""

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> Sequence[DurableInfo | None]:
        """Several durables' counts at once, within ``timeout`` seconds: None where one failed."""

    # -- publishing (the relay) --
    def publish_start(self, messages: Sequence[OutgoingMessage], *, timeout: float = 10.0) -> PendingPublish:
        """Hand a batch to the broker in order and return at once."""

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> Any:
        """Publish one message and wait for the stream's ack (tools and tests)."""

    # -- receiving (the consumer) --
    def fetch(self, durable: str, batch: int, *, timeout: float = 1.0, puller: int = 0) -> list[Delivery]:
        """Up to ``batch`` deliveries of ``durable``, waiting at most ``timeout`` seconds."""

    def pull_lane(
        self,
        want: ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        on_idle: Callable[[], None] | None = None,
    ) -> PullLane:
        """Pull ``want``'s durable while ``credit()`` allows, handing each unit to ``deliver``.

        ``on_idle`` (a priority band's lane, ``consume.bands``): called each
        time a look finds the durable empty and the lane goes on watching it;
        given one, ``idle`` is also cleared while the lane waits for credit
        (it sees nothing arrive then), and the first look after that wait is
        a fresh one."""

    # -- settling --
    def ack(self, delivery: Delivery) -> None:
        """Done: never delivered again (sent without waiting: a lost ack is a redelivery the claim skips)."""

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """``ack`` for several deliveries at once."""

    def nak(self, delivery: Delivery, delay_seconds: float | None = None) -> None:
        """Deliver again after ``delay_seconds`` (None: at once)."""

    def term(self, delivery: Delivery) -> None:
        """Never deliver this message again."""

    def keep_alive(self, deliveries: Sequence[Delivery], every_seconds: float) -> KeepAlive:
        """In-progress acks for a fetched unit, from now, every ``every_seconds``."""
