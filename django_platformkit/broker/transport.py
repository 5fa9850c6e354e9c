"""``Transport``: the broker port over NATS JetStream.

It is composed of its parts, each given the one ``Connection`` (the event
loop and its thread): ``Streams`` (the stream and durables this build
wants), ``Publisher`` (the relay's send path), ``Puller`` (the consumer's
pull lanes) and ``Acks`` (settling deliveries); ``StreamUpkeep`` holds the
operator's verbs (``manage.py stream``), outside the port. Each method of the port
names the part that does the work. Only the broker package imports
``nats``; a web process imports none of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from nats.js import api

from django_platformkit.broker.acks import Acks, KeepAlive
from django_platformkit.broker.connection import Connection
from django_platformkit.broker.publishing import PendingPublish, Publisher
from django_platformkit.broker.pulling import Puller, PullLane
from django_platformkit.broker.standing import StreamStanding
from django_platformkit.broker.streams import Streams
from django_platformkit.broker.upkeep import StreamUpkeep
from django_platformkit.wire import Delivery, OutgoingMessage


class Transport:
    """A NATS connection and its event loop, behind the synchronous ``port.Broker`` API.

    Args:
        url: Comma-separated NATS URLs (default ``NATS_URL``).
        options: Credentials and TLS (default ``NATS_OPTIONS``).
        name: The client name the server shows.
        request_timeout_seconds: How long one JetStream API request may take.

    Every method blocks the calling thread until the loop answers or its
    timeout passes, and raises ``BrokerUnavailable`` when NATS can't be reached.
    """

    def __init__(
        self,
        url: str | None = None,
        options: dict[str, Any] | None = None,
        *,
        name: str = "django_platformkit",
        request_timeout_seconds: float = 5.0,
    ) -> None:
        self.connection = Connection(url, options, name=name, request_timeout_seconds=request_timeout_seconds)
        self.streams = Streams(self.connection)
        self.publisher = Publisher(self.connection)
        self.puller = Puller(self.connection, self.streams)
        self.acks = Acks(self.connection)
        #: The operator's verbs (``manage.py stream``); no worker uses them.
        self.upkeep = StreamUpkeep(self.connection)
        self.url = self.connection.url
        self.connected = self.connection.connected

    # -- connection --
    def connect(self) -> None:
        self.connection.connect()

    def connect_until(
        self, stop: threading.Event, *, retry_seconds: float = 2.0, give_up_after_seconds: float | None = None
    ) -> bool:
        return self.connection.connect_until(
            stop, retry_seconds=retry_seconds, give_up_after_seconds=give_up_after_seconds
        )

    def close(self) -> None:
        self.connection.close()

    def redact(self, text: str) -> str:
        return self.connection.redact(text)

    def loop_alive(self) -> bool:
        return self.connection.loop_alive()

    def call_later(self, delay_seconds: float, callback: Callable[[], object]) -> bool:
        return self.connection.call_later(delay_seconds, callback)

    @property
    def max_payload(self) -> int:
        """The connected server's ``max_payload`` in bytes."""
        return self.connection.max_payload

    # -- the stream and its durables --
    def ensure_stream(self, *, owner: str | None = None, instance: str | None = None) -> api.StreamInfo:
        return self.streams.ensure_stream(owner=owner, instance=instance)

    def stream_standing(self, *, owner: str, instance: str | None) -> StreamStanding:
        return self.streams.stream_standing(owner=owner, instance=instance)

    def stream_info(self) -> api.StreamInfo:
        return self.streams.stream_info()

    def ensure_consumer(self, want: api.ConsumerConfig) -> api.ConsumerInfo:
        return self.streams.ensure_consumer(want)

    def consumer_info(self, durable: str) -> api.ConsumerInfo:
        return self.streams.consumer_info(durable)

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> list[api.ConsumerInfo | None]:
        return self.streams.consumer_infos(durables, timeout=timeout)

    # -- publishing --
    def publish_start(self, messages: Sequence[OutgoingMessage], *, timeout: float = 10.0) -> PendingPublish:
        return self.publisher.publish_start(messages, timeout=timeout)

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> api.PubAck:
        return self.publisher.publish_raw(subject, body, headers)

    # -- receiving --
    def fetch(self, durable: str, batch: int, *, timeout: float = 1.0, puller: int = 0) -> list[Delivery]:
        return self.puller.fetch(durable, batch, timeout=timeout, puller=puller)

    def pull_lane(
        self,
        want: api.ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        on_idle: Callable[[], None] | None = None,
    ) -> PullLane:
        return self.puller.pull_lane(want, credit=credit, deliver=deliver, batch_size=batch_size, on_idle=on_idle)

    # -- settling --
    def ack(self, delivery: Delivery) -> None:
        self.acks.ack(delivery)

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        self.acks.ack_many(deliveries)

    def nak(self, delivery: Delivery, delay_seconds: float | None = None) -> None:
        self.acks.nak(delivery, delay_seconds)

    def term(self, delivery: Delivery) -> None:
        self.acks.term(delivery)

    def keep_alive(self, deliveries: Sequence[Delivery], every_seconds: float) -> KeepAlive:
        return self.acks.keep_alive(deliveries, every_seconds)
