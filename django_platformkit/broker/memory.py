"""An in-memory JetStream for tests: the relay and the consumer runtime run
against it unchanged, so users' tests keep the real path (outbox -> relay ->
durable -> claim + handler -> ack / retry / dead letter) with no broker.

It keeps the JetStream semantics the runtime relies on: ``Nats-Msg-Id``
deduplication within ``DUPLICATE_WINDOW_SECONDS``, a delivery count per
message (``num_delivered``, so a redelivery is told from a first delivery),
deliver-all durables filtered by subject, NAK with a delay, redelivery after
the ack wait, TERM. Time is a ``ManualClock`` that moves only when told, so
a test never sleeps through a backoff. It imports no ``nats``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from django_platformkit import conf
from django_platformkit.broker.memory_stream import (
    CompletedPublish,
    ConsumerInfo,
    Durable,
    ManualClock,
    MemoryAck,
    MemoryPullLane,
    MessageLog,
    PubAck,
    StillKeepAlive,
    StoredMessage,
    StreamInfo,
    StreamSettings,
    subject_matches,
)
from django_platformkit.broker.port import DurableFacts, HeldMessage, StreamFacts
from django_platformkit.broker.standing import StreamStanding
from django_platformkit.exceptions import ConfigurationError, ConsumerDrift, ConsumerNotFound
from django_platformkit.wire import Delivery, OutgoingMessage, PublishOutcome, PublishResult

#: NATS's own default ``max_payload`` (bytes): what a server without a
#: ``max_payload`` line in its config accepts (nats-server docs, "Limits").
DEFAULT_MAX_PAYLOAD_BYTES = 1024 * 1024
#: The URL the transport reports in messages (it has no server).
MEMORY_URL = "memory://"


class InMemoryTransport:
    """A broker in this process, with the interface the relay, the consumer
    and the ``Worker`` use from ``transport.Transport``.

    ``clock``: a ``ManualClock`` (default: a new one at 0). ``auto_advance``
    (default True): when nothing can be delivered now and no delivery is in
    flight, the clock jumps to the next NAK delay's end, so retries happen
    without waiting and in the order their backoffs give; False holds the
    clock until the test calls ``clock.advance()``. ``max_payload``: the
    server's limit in bytes (body + headers); a bigger message is refused for
    good, as NATS does. Deviations from JetStream: one stream (``STREAM``),
    limits (``edit_stream``) are judged but never enforced, no start-up check of
    ``max_payload`` against ``MAX_PAYLOAD_BYTES``. Thread-safe.
    """

    url = MEMORY_URL

    def __init__(
        self,
        *,
        clock: ManualClock | None = None,
        auto_advance: bool = True,
        max_payload: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        self.clock = clock or ManualClock()
        self.auto_advance = auto_advance
        self._max_payload = int(max_payload)
        self._cond = threading.Condition()
        self._stream: str | None = None
        self._subjects: list[str] = []
        self._settings = StreamSettings()
        self._log = MessageLog()
        self._messages: list[StoredMessage] = self._log.messages
        self._durables: dict[str, Durable] = {}
        self._created: datetime | None = None  # the stream's creation time: which stream
        self._listeners: list[Callable[[str], None]] = []
        self.connected = threading.Event()
        self.closed = False

    # -- connection (there is none) --
    def connect(self) -> None:
        self.connected.set()

    def connect_until(
        self, stop: threading.Event, *, retry_seconds: float = 2.0, give_up_after_seconds: float | None = None
    ) -> bool:
        """Always connected at once: returns True (False if ``stop`` is already set)."""
        if stop.is_set():
            return False
        self.connect()
        return True

    def redact(self, text: str) -> str:
        """``text`` as it is: there are no credentials."""
        return text

    def loop_alive(self) -> bool:
        """True: there is no event loop to die."""
        return True

    def call_later(self, delay_seconds: float, callback: Callable[[], object]) -> bool:
        """False: there is no loop to schedule ``callback`` on (nothing is scheduled)."""
        return False

    @property
    def max_payload(self) -> int:
        """The largest message (body + headers, bytes) the broker accepts."""
        return self._max_payload

    def close(self) -> None:
        """Nothing to flush; the messages stay readable (``messages()``)."""
        self.connected.clear()
        self.closed = True

    # -- stream --
    def ensure_stream(self, *, owner: str | None = None, instance: str | None = None) -> StreamInfo:
        """Create the stream (``STREAM``, subjects ``<SUBJECT_PREFIX>.>``) if
        missing. ``owner``/``instance``: this database's identity and
        instance; a stream this database must not use (another identity's, a
        live copy's, limits set by ``edit_stream``) is refused with
        ``ConfigurationError``, as ``Transport.ensure_stream`` does."""
        s = conf.settings
        with self._cond:
            if self._stream is None:
                self._stream, self._subjects = s.STREAM, [f"{s.SUBJECT_PREFIX}.>"]
                self._created = datetime.now(UTC)
            elif self._stream != s.STREAM:
                raise ConfigurationError(
                    f"this InMemoryTransport holds the stream {self._stream!r}, not {s.STREAM!r}: use one per test"
                )
            standing = self._settings.standing(self._stream, self.url, owner, instance, self.clock.now())
            if standing.refused:
                raise ConfigurationError(standing.text)
            return StreamInfo(self._stream, list(self._subjects), len(self._messages), standing.tenure.identity)

    def stream_standing(self, *, owner: str, instance: str | None) -> StreamStanding:
        """How the stream stands for ``owner``/``instance`` now (``StreamStanding``; exists=False before ``ensure_stream``)."""
        with self._cond:
            if self._stream is None:
                return StreamStanding(exists=False)
            return self._settings.standing(self._stream, self.url, owner, instance, self.clock.now())

    def edit_stream(self, **settings: Any) -> None:
        """Change the stream's settings as an operator's ``nats stream edit``
        would (tests): ``retention``, ``max_msgs``, ``max_bytes``,
        ``max_msgs_per_subject``, ``max_age`` (seconds): JetStream's names. The twin only reports them."""
        with self._cond:
            for key, value in settings.items():
                if not hasattr(self._settings, key) or key == "tenure":
                    raise TypeError(f"edit_stream(): unknown setting {key!r}")
                setattr(self._settings, key, value)
        for listener in self._listeners:
            listener("modify")

    def watch_stream(self, listener: Callable[[str], None]) -> bool:
        """Call ``listener("modify")`` after each ``edit_stream``."""
        self._listeners.append(listener)
        return True

    # -- reconciliation (the twin discards nothing: every message it stored is held) --
    def stream_facts(self, *, owner: str | None, instance: str | None) -> StreamFacts | None:
        """The stream's creation time, its sequences and standing (recording nothing); None before ``ensure_stream``."""
        with self._cond:
            if self._stream is None:
                return None
            standing = self._settings.standing(self._stream, self.url, owner, instance, self.clock.now(), record=False)
            return StreamFacts(self._created, 1 if self._messages else 0, len(self._messages), standing)

    def durable_facts(self, durables: Sequence[str]) -> list[DurableFacts | None]:
        with self._cond:
            found = [self._durables.get(name) for name in durables]
            return [None if d is None else d.facts(self._pending(d)) for d in found]

    def messages_at(self, seqs: Sequence[int]) -> dict[int, HeldMessage | None]:
        with self._cond:
            return self._log.held(seqs)

    def messages(self) -> list[StoredMessage]:
        """Every message the stream holds, in stream order."""
        with self._cond:
            return list(self._messages)

    # -- publishing --
    def publish_start(self, messages: Sequence[OutgoingMessage], *, timeout: float = 10.0) -> CompletedPublish:
        """Store ``messages`` now; ``.results()`` gives one ``PublishResult``
        per message, in order: STORED (``duplicate=True`` for a
        ``Nats-Msg-Id`` seen within ``DUPLICATE_WINDOW_SECONDS``, with the
        first copy's ``seq``), PERMANENT for a message over ``max_payload``,
        TEMPORARY with ``no_stream=True`` when no stream holds its subject."""
        created = self._created
        results = [self._store(m.subject, m.body, m.headers()) for m in messages]
        return CompletedPublish(results, created)

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> PubAck:
        """Publish one message as another service would (tests: forged or
        malformed messages). Raises ``ConfigurationError`` when the broker refuses it."""
        result = self._store(subject, body, dict(headers or {}))
        if result.outcome is not PublishOutcome.STORED or result.seq is None:
            raise ConfigurationError(f"the in-memory broker refused the message: {result.error}")
        return PubAck(str(self._stream), result.seq, result.duplicate)

    def _store(self, subject: str, body: bytes, headers: dict[str, str]) -> PublishResult:
        size = len(body) + sum(len(k) + len(v) for k, v in headers.items())
        if size > self._max_payload:
            return PublishResult(
                PublishOutcome.PERMANENT, f"larger than the server's max_payload: {size} > {self._max_payload}"
            )
        with self._cond:
            if self._stream is None or not any(subject_matches(f, subject) for f in self._subjects):
                return PublishResult(
                    PublishOutcome.TEMPORARY,
                    "no stream answered (no responders): is the stream there, does it capture this subject, and is JetStream up?",
                    no_stream=True,
                )
            result = self._log.append(subject, body, headers, self.clock.now())
            self._cond.notify_all()
            return result

    # -- durables --
    def ensure_consumer(self, want: Any) -> ConsumerInfo:
        """Create the durable ``want.durable_name`` if missing (delivering
        from the stream's first message, or - ``deliver_policy`` new - from
        the next one stored); update ``ack_wait`` and
        ``max_ack_pending`` in place. ``want``: a ``ConsumerSpec`` or a
        ``nats.js.api.ConsumerConfig``. Raises ``ConsumerDrift`` when an
        existing durable filters another subject (the broker can't change that)."""
        name = str(want.durable_name)
        ack_wait = float(getattr(want, "ack_wait", None) or conf.settings.ACK_WAIT_SECONDS)
        max_ack_pending = getattr(want, "max_ack_pending", None)
        max_ack_pending = int(max_ack_pending) if max_ack_pending and int(max_ack_pending) > 0 else None
        with self._cond:
            durable = self._durables.get(name)
            if durable is None:
                durable = self._durables[name] = Durable(name, str(want.filter_subject), ack_wait, max_ack_pending)
                durable.created = datetime.now(UTC)
                policy = getattr(want, "deliver_policy", "all")
                if str(getattr(policy, "value", policy)) == "new":
                    durable.next_seq = len(self._messages) + 1
            elif durable.filter_subject != want.filter_subject:
                raise ConsumerDrift(
                    f"durable consumer {name!r} filters {durable.filter_subject!r}, this build wants "
                    f"{want.filter_subject!r}: the broker can't change a durable's filter"
                )
            else:
                durable.ack_wait, durable.max_ack_pending = ack_wait, max_ack_pending
            return self._info(durable)

    def consumer_info(self, durable: str) -> ConsumerInfo:
        """The durable's counts. Raises ``ConsumerNotFound`` (a ``LookupError``) if it doesn't exist."""
        with self._cond:
            return self._info(self._durable(durable))

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> list[ConsumerInfo | None]:
        """Several durables' counts: None for one that doesn't exist."""
        with self._cond:
            return [self._info(self._durables[d]) if d in self._durables else None for d in durables]

    def _durable(self, name: str) -> Durable:
        durable = self._durables.get(name)
        if durable is None:
            raise ConsumerNotFound(f"no durable consumer {name!r}: ensure_consumer() creates it")
        return durable

    def _pending(self, d: Durable) -> int:
        return sum(1 for m in self._messages[d.next_seq - 1 :] if subject_matches(d.filter_subject, m.subject))

    def _can_send_new(self, d: Durable) -> bool:
        """A first delivery is pending and ``max_ack_pending`` leaves room for it."""
        full = d.max_ack_pending is not None and len(d.in_flight) + len(d.waiting) >= d.max_ack_pending
        return not full and self._pending(d) > 0

    def _info(self, d: Durable) -> ConsumerInfo:
        self._expire(d)
        return d.info(str(self._stream), self._pending(d))

    def _expire(self, d: Durable) -> None:
        d.expire(self.clock.now())

    def _take(self, d: Durable, batch: int) -> list[Delivery]:
        """Under the lock: up to ``batch`` deliveries due now, redeliveries first (as JetStream sends them)."""
        self._expire(d)
        now = self.clock.now()
        taken: list[int] = []
        for seq, due in sorted(d.waiting.items(), key=lambda item: (item[1], item[0])):
            if len(taken) >= batch or due > now:
                break
            del d.waiting[seq]  # a redelivery: it was ack pending already
            taken.append(seq)
        # A first delivery adds to the ack-pending count; at max_ack_pending nothing new is sent.
        room = (
            batch if d.max_ack_pending is None else d.max_ack_pending - len(d.in_flight) - len(d.waiting) - len(taken)
        )
        new = 0
        while len(taken) < batch and new < room and d.next_seq <= len(self._messages):
            message = self._messages[d.next_seq - 1]
            d.next_seq += 1
            if subject_matches(d.filter_subject, message.subject):
                taken.append(message.seq)
                new += 1
        out = []
        for seq in taken:
            d.delivered[seq] = d.delivered.get(seq, 0) + 1
            d.in_flight[seq] = now + d.ack_wait
            message = self._messages[seq - 1]
            out.append(
                Delivery(
                    subject=message.subject,
                    data=message.body,
                    headers=dict(message.headers),
                    attempt=d.delivered[seq],
                    stream_seq=seq,
                    msg=MemoryAck(d.name, seq, d.delivered[seq]),
                )
            )
        return out

    def fetch(self, durable: str, batch: int, *, timeout: float = 1.0, puller: int = 0) -> list[Delivery]:
        """Up to ``batch`` deliveries of ``durable`` that are due now; waits
        up to ``timeout`` real seconds for one (0: look once). With
        ``auto_advance`` the clock moves to the next NAK delay's end when
        nothing is due and nothing is in flight. Raises ``ConsumerNotFound`` (a ``LookupError``) for
        an unknown durable."""
        with self._cond:
            d = self._durable(durable)
            out = self._take(d, batch)
            if not out and self.advance_if_idle():
                out = self._take(d, batch)
            if not out and timeout > 0:
                self._cond.wait(timeout)
                out = self._take(d, batch)
            return out

    # -- settling --
    def _settle(self, delivery: Delivery, redeliver_at: float | None) -> None:
        self._settle_all([delivery], redeliver_at)

    def _settle_all(self, deliveries: Sequence[Delivery], redeliver_at: float | None) -> None:
        acks = [delivery.msg for delivery in deliveries]
        for ack, delivery in zip(acks, deliveries, strict=True):
            if not isinstance(ack, MemoryAck):
                raise TypeError(f"not a delivery of this InMemoryTransport: {delivery!r}")
        with self._cond:
            expired: set[str] = set()
            for ack in acks:
                d = self._durable(ack.durable)
                if d.name not in expired:  # once per call: a unit's acks would otherwise rescan the pending list each
                    self._expire(d)
                    expired.add(d.name)
                # By stream sequence, as JetStream keys its pending list: an ack
                # from an earlier delivery of the message settles it too.
                if redeliver_at is None:
                    if ack.seq in d.in_flight or ack.seq in d.waiting:
                        d.in_flight.pop(ack.seq, None)
                        d.waiting.pop(ack.seq, None)
                        d.delivered.pop(ack.seq, None)
                elif ack.seq in d.in_flight:  # a NAK of a message already awaiting redelivery changes nothing
                    del d.in_flight[ack.seq]
                    d.waiting[ack.seq] = redeliver_at
            self._cond.notify_all()

    def ack(self, delivery: Delivery) -> None:
        """Done: never delivered again."""
        self._settle(delivery, None)

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        self._settle_all(deliveries, None)

    def nak(self, delivery: Delivery, delay_seconds: float | None = None) -> None:
        """Redeliver after ``delay_seconds`` on the clock (None: at once)."""
        self._settle(delivery, self.clock.now() + max(0.0, float(delay_seconds or 0.0)))

    def term(self, delivery: Delivery) -> None:
        """Never deliver this message again."""
        self._settle(delivery, None)

    def in_progress(self, delivery: Delivery) -> None:
        """Restart the delivery's ack wait from now."""
        ack = delivery.msg
        with self._cond:
            d = self._durable(ack.durable)
            if ack.seq in d.in_flight:
                d.in_flight[ack.seq] = self.clock.now() + d.ack_wait

    def keep_alive(self, deliveries: Sequence[Delivery], every_seconds: float) -> StillKeepAlive:
        """A no-op ``KeepAlive`` (see ``StillKeepAlive``)."""
        return StillKeepAlive()

    # -- time --
    def next_due(self, *, in_flight: bool = False) -> float | None:
        """The clock time of the next NAK delay's end (and, with
        ``in_flight``, of the next ack wait's end), or None when nothing waits."""
        with self._cond:
            times = [t for d in self._durables.values() for t in d.waiting.values()]
            if in_flight:
                times += [t for d in self._durables.values() for t in d.in_flight.values()]
            return min(times, default=None)

    def advance_if_idle(self) -> bool:
        """With ``auto_advance``: when no delivery is in flight and none is
        due now, move the clock to the next NAK delay's end. Returns whether it moved."""
        if not self.auto_advance:
            return False
        with self._cond:
            now = self.clock.now()
            if any(d.in_flight for d in self._durables.values()):
                return False
            waiting = [t for d in self._durables.values() for t in d.waiting.values()]
            if not waiting or min(waiting) <= now:
                return False
            if any(self._can_send_new(d) for d in self._durables.values()):
                return False  # a first delivery is there to send now
            self.clock.advance_to(min(waiting))
            self._cond.notify_all()
            return True

    # -- the Worker's pull lanes --
    def pull_lane(
        self,
        want: Any,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        linger_seconds: float = 30.0,
        heartbeat_seconds: float = 5.0,
        on_idle: Callable[[], None] | None = None,
    ) -> MemoryPullLane:
        """Pull ``want``'s durable from a thread of its own while ``credit()``
        allows, as ``transport.PullLane`` does (``Worker`` uses it)."""
        durable = str(want.durable_name)
        lane = MemoryPullLane(
            durable,
            cond=self._cond,
            take=lambda batch: self._take(self._durable(durable), batch),
            advance_if_idle=self.advance_if_idle,
            credit=credit,
            deliver=deliver,
            batch_size=batch_size,
            on_idle=on_idle,
        )
        lane.start()
        return lane
