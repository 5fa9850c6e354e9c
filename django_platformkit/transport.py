"""The only NATS and asyncio code in the package.

The ORM and ``transaction.atomic`` stay synchronous; NATS runs on one event
loop in one background thread owned by ``Transport``. Synchronous callers
(relay, consumers, commands) reach it only through ``Transport.call``, so a
reader always knows where the event loop is. Everything both sides must
agree on - the stream config, the subject scheme, the consumer config used to
create a durable *and* to compare an existing one - is defined here once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import json
import logging
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.client import JetStreamContext

from . import conf
from .exceptions import BrokerUnavailable, ConfigurationError, ConsumerDrift

# The wire scheme and the values crossing the bridge live in wire.py (pure);
# re-exported here, where callers imported them from before.
from .wire import (  # noqa: F401
    ENVELOPE_OVERHEAD_BYTES,
    JSONB_TEXT_GROWTH,
    NO_TENANT,
    Delivery,
    Outcome,
    OutgoingMessage,
    PublishResult,
    durable_name,
    filter_subject_for,
    parse_subject,
    subject_for,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A waiting pull request's expiry: an idle subscription costs one request
#: per this many seconds (re-issued as it expires), not a timer per 50 ms.
PULL_LINGER_SECONDS = 30.0
#: Idle heartbeats of a waiting pull: two missed mean the request is gone
#: (a reconnect, a durable deleted under us) and a new one is sent.
PULL_HEARTBEAT_SECONDS = 5.0
#: How often the one beat task looks for in-progress acks that are due (the
#: shortest beat the worker asks for is 0.2 s).
KEEP_ALIVE_TICK_SECONDS = 0.05


def stream_config() -> api.StreamConfig:
    """The stream this build wants (DESIGN.md, "On the wire"). Max age equals
    the outbox retention, so a message can't outlive the claim guarding it."""
    s = conf.settings
    return api.StreamConfig(
        name=s.STREAM,
        subjects=[f"{s.SUBJECT_PREFIX}.>"],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=float(s.RETENTION_DAYS) * 86400.0,
        duplicate_window=float(s.DUPLICATE_WINDOW_SECONDS),
        num_replicas=s.STREAM_REPLICAS,
        discard=api.DiscardPolicy.OLD,
    )


#: Room above the in-flight credit for events parked for retry: a NAK with a
#: delay keeps a message "ack pending" on the broker until it comes back, and
#: at max_ack_pending the broker delivers nothing else (1,100 parked retries
#: under JetStream's default 1,000 held a healthy event back for 44 s).
RETRY_BACKLOG_HEADROOM = 20_000


def max_ack_pending_for(concurrency: int = 1, override: int | None = None) -> int:
    """The ``max_ack_pending`` of a subscription's durable: its
    ``subscribe(max_ack_pending=...)`` override, else ``MAX_ACK_PENDING``,
    else derived: ``CONSUMER_BATCH_SIZE x concurrency x 2`` (what can be in
    flight, twice over) plus ``RETRY_BACKLOG_HEADROOM`` for parked retries."""
    if override:
        return int(override)
    configured = conf.settings.MAX_ACK_PENDING
    if configured is not None:
        return int(configured)
    return int(conf.settings.CONSUMER_BATCH_SIZE) * max(1, int(concurrency)) * 2 + RETRY_BACKLOG_HEADROOM


def consumer_config(
    subscription_name: str, event_name: str, *, max_ack_pending: int | None = None
) -> api.ConsumerConfig:
    """The durable consumer of one subscription, used to create it and to
    compare an existing one. ``max_deliver`` is unlimited on purpose: the
    worker counts attempts itself and dead-letters, so the broker never drops
    a message silently after its own count. ``max_ack_pending`` None: the
    ``max_ack_pending_for()`` default (a change is applied in place)."""
    if max_ack_pending is None:
        max_ack_pending = max_ack_pending_for()
    durable = durable_name(subscription_name)
    return api.ConsumerConfig(
        durable_name=durable,
        name=durable,
        description=f"django_platformkit subscription {subscription_name}",
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=float(conf.settings.ACK_WAIT_SECONDS),
        max_deliver=-1,
        filter_subject=filter_subject_for(event_name),
        replay_policy=api.ReplayPolicy.INSTANT,
        max_ack_pending=max_ack_pending,
        max_waiting=512,
    )


# Fields the server lets us change on an existing durable, and the ones it
# doesn't (changing those needs a new durable; we never delete one for you).
_UPDATABLE = ("description", "ack_wait", "max_deliver", "max_ack_pending", "max_waiting")
_FIXED = ("deliver_policy", "ack_policy", "filter_subject", "replay_policy")


def consumer_differences(
    want: api.ConsumerConfig, have: api.ConsumerConfig
) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """``(updatable, fixed)`` dicts of field -> (have, want) that differ."""

    def norm(value: Any) -> Any:
        return value.value if isinstance(value, enum.Enum) else value

    def differs(name: str) -> bool:
        a, b = norm(getattr(have, name, None)), norm(getattr(want, name, None))
        if isinstance(a, float) or isinstance(b, float):
            return a is None or b is None or abs(float(a) - float(b)) > 1e-6
        return bool(a != b)

    updatable = {n: (norm(getattr(have, n, None)), norm(getattr(want, n))) for n in _UPDATABLE if differs(n)}
    fixed = {n: (norm(getattr(have, n, None)), norm(getattr(want, n))) for n in _FIXED if differs(n)}
    return updatable, fixed


# nats-py bounds in-flight async publishes (publish_async_max_pending, 4000
# by default); below this many pending acks a publish can't stall.
_NO_STALL_BELOW = 3000


def to_deliveries(msgs: Sequence[Any]) -> list[Delivery]:
    """JetStream messages as ``Delivery`` values (a message without JetStream
    metadata can't be acked either: logged and skipped)."""
    out = []
    for msg in msgs:
        fields = _ack_reply_fields(msg.reply)
        try:
            if fields is not None:
                attempt, seq = fields[0], fields[1]
            else:
                metadata = msg.metadata
                attempt, seq = int(metadata.num_delivered), int(metadata.sequence.stream)
        except Exception:
            logger.warning("fetch got a non-JetStream message subject=%s", msg.subject)
            continue
        out.append(
            Delivery(
                subject=msg.subject,
                data=msg.data,
                headers=dict(msg.headers or {}),
                attempt=attempt,
                stream_seq=seq,
                msg=msg,
            )
        )
    return out


def classify_publish_error(exc: BaseException) -> PublishResult:
    """A broker refusal is PERMANENT when the same message can never be
    stored (too big for the server or the stream, a 4xx from the stream);
    everything else - timeouts, no responders, lost connections, 5xx - is
    TEMPORARY and the row stays pending."""
    if isinstance(exc, nats.errors.MaxPayloadError):
        return PublishResult(Outcome.PERMANENT, f"larger than the server's max_payload: {exc}")
    if isinstance(exc, nats.js.errors.APIError) and exc.code is not None:
        if 400 <= int(exc.code) < 500 and int(exc.code) != 408:
            return PublishResult(
                Outcome.PERMANENT,
                f"the stream refused it: {exc.description} (code {exc.code}, err_code {exc.err_code})",
            )
        return PublishResult(Outcome.TEMPORARY, f"the stream is unavailable: {exc.description} (code {exc.code})")
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishResult(
            Outcome.TEMPORARY,
            "no stream answered (no responders): is the stream there and JetStream up?",
            no_stream=True,
        )
    return PublishResult(Outcome.TEMPORARY, f"{type(exc).__name__}: {exc}".rstrip(": "))


def _no_jetstream_text(url: str) -> str:
    return f"JetStream is not enabled on {conf.redact_url(url)}: start nats-server with -js (or jetstream {{}} in its config)."


def _jetstream_disabled(exc: BaseException | None) -> bool:
    return exc is not None and "jetstream not enabled" in str(exc).lower()


# --- the transport -----------------------------------------------------------


class Transport:
    """A NATS connection and its event loop, behind a synchronous API.

    ``url``: comma-separated NATS URLs (default ``NATS_URL``); ``options``:
    credentials and TLS (default ``NATS_OPTIONS``). Every method blocks the
    calling thread until the loop answers or ``timeout`` seconds pass, and
    raises ``BrokerUnavailable`` when NATS can't be reached.
    """

    def __init__(
        self,
        url: str | None = None,
        options: dict[str, Any] | None = None,
        *,
        name: str = "django_platformkit",
        request_timeout_seconds: float = 5.0,
    ) -> None:
        self.url = url or conf.settings.NATS_URL
        self.options = dict(conf.settings.NATS_OPTIONS if options is None else options)
        self.name = self.options.pop("name", name)
        self.request_timeout_seconds = request_timeout_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Any = None
        self._js: Any = None
        self._pulls: dict[tuple[str, int], Any] = {}
        self._send_lock: asyncio.Lock | None = None
        self._keep_lock = threading.Lock()
        self._keeps: set[KeepAlive] = set()  # live KeepAlives, served by the loop's one beat task
        self._keep_beater_loop: asyncio.AbstractEventLoop | None = None  # the loop whose beat task runs
        self._keep_beater_future: Any = None
        self.connected = threading.Event()
        self._error_logged = False
        self._last_error: BaseException | None = (
            None  # the server's reason, for a failed connect (first error since connecting began)
        )
        self._closing = False

    # -- the bridge --
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                try:
                    loop.run_forever()
                finally:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.close()

            self._thread = threading.Thread(target=run, name="platformkit-nats", daemon=True)
            self._thread.start()
            ready.wait()
            self._send_lock = asyncio.Lock()  # one per loop: an asyncio.Lock binds to the loop it first waits on
            self._loop = loop
        return self._loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the transport's loop and wait for its result.

        Raises ``BrokerUnavailable`` when NATS doesn't answer within
        ``timeout`` seconds or nats-py fails the call: its errors are
        translated here, so no code outside this module handles a ``nats``
        type (the original is the ``__cause__``). Our own errors
        (``ConsumerDrift``, ``ConfigurationError``) pass through."""
        try:
            return self._call_nats(coro, timeout)
        except nats.errors.Error as exc:
            raise BrokerUnavailable(self.redact(str(exc) or type(exc).__name__)) from exc

    def _call_nats(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """``call()`` without the translation: for ``connect()``, which words nats-py's refusal itself."""
        future = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise BrokerUnavailable(f"NATS did not answer within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Schedule ``coro`` on the loop without waiting (fire and forget)."""
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    # -- connection --
    def _connect_kwargs(self) -> dict[str, Any]:
        o = self.options
        kwargs: dict[str, Any] = {
            "servers": [u.strip() for u in self.url.split(",") if u.strip()],
            "name": self.name,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,  # reconnect forever: an outage is waited out, never fatal
            "reconnect_time_wait": 0.5,
            "connect_timeout": 2,
            "ping_interval": 5,
            "max_outstanding_pings": 3,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
        }
        for key in ("user", "password", "token", "user_credentials", "nkeys_seed"):
            if o.get(key):
                kwargs[key] = o[key]
        if o.get("tls_ca_file") or o.get("tls_cert_file"):
            context = ssl.create_default_context(cafile=o.get("tls_ca_file"))
            if o.get("tls_cert_file"):
                context.load_cert_chain(o["tls_cert_file"], o.get("tls_key_file"))
            kwargs["tls"] = context
            if o.get("tls_hostname"):
                kwargs["tls_hostname"] = o["tls_hostname"]
        return kwargs

    async def _on_error(self, exc: Exception) -> None:
        # One line per outage, not one per reconnect attempt (twice a second).
        level = logging.DEBUG if self._error_logged else logging.WARNING
        self._error_logged = True
        # Keep the first: a refused connect retries, and the later errors
        # ("connection reset") hide the reason ('Authorization Violation').
        self._last_error = self._last_error or exc
        logger.log(level, "nats error=%s", self.redact(str(exc) or type(exc).__name__))

    async def _on_disconnected(self) -> None:
        self.connected.clear()
        if not self._closing:
            logger.warning("nats disconnected url=%s; reconnecting", conf.redact_url(self.url))

    async def _on_reconnected(self) -> None:
        # A fresh JetStream context: nats-py registers a publish's ack future
        # before it writes, so a publish that failed in the outage can leave a
        # future (and an in-flight permit) that never completes.
        self._js = self._nc.jetstream(timeout=self.request_timeout_seconds)
        self.connected.set()
        self._error_logged = False
        # netloc carries the user info: never log it as it is.
        where = self._nc.connected_url.geturl() if self._nc and self._nc.connected_url else self.url
        logger.info("nats reconnected url=%s", conf.redact_url(where))

    async def _connect(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            return
        self._last_error = None
        kwargs = self._connect_kwargs()
        # nats-py applies max_reconnect_attempts to the FIRST connect too, so
        # "forever" would hang here; try each server a few times, then say so.
        kwargs["max_reconnect_attempts"] = 2
        self._nc = await nats.connect(**kwargs)
        self._nc.options["max_reconnect_attempts"] = -1  # from now on, ride out any outage
        self._js = self._nc.jetstream(timeout=self.request_timeout_seconds)
        self._pulls.clear()
        self.connected.set()

    def connect(self) -> None:
        """Connect once. Raises ``BrokerUnavailable`` if NATS can't be reached
        (after the first connection, reconnects happen by themselves)."""
        try:
            self._call_nats(self._connect(), timeout=15)
        except BrokerUnavailable as exc:
            # nats-py never returns from a first connect whose TLS handshake
            # failed verification: the bridge's timeout ends it; say why.
            if self._last_error is not None:
                raise BrokerUnavailable(
                    self.redact(f"can't connect to NATS at {self.url}: {exc} (last error: {self._last_error})")
                ) from exc
            raise
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            # nats-py ends with "no servers available"; the server's reason
            # ('Authorization Violation', a TLS failure) came to error_cb.
            cause = self._last_error
            why = f"{exc or type(exc).__name__}" + (
                f" (last error: {cause})" if cause and str(cause) != str(exc) else ""
            )
            if _jetstream_disabled(exc) or _jetstream_disabled(cause):
                raise BrokerUnavailable(self.redact(_no_jetstream_text(self.url))) from exc
            raise BrokerUnavailable(self.redact(f"can't connect to NATS at {self.url}: {why}")) from exc

    def redact(self, text: str) -> str:
        """``text`` with this transport's URLs shown without user info and
        any configured password, token or nkeys seed replaced by ``***``: for
        every log line and error that could carry them."""
        for part in self.url.split(","):
            part = part.strip()
            if part:
                text = text.replace(part, conf.redact_url(part))
        for key in ("password", "token", "nkeys_seed"):
            secret = self.options.get(key)
            if isinstance(secret, str) and len(secret) >= 3:
                text = text.replace(secret, "***")
        return text

    def connect_until(
        self, stop: threading.Event, *, retry_seconds: float = 2.0, give_up_after_seconds: float | None = None
    ) -> bool:
        """Connect, retrying with a logged error until it works or ``stop`` is
        set. Returns whether it connected: a worker started during a broker
        outage waits for the broker instead of crash-looping. With
        ``give_up_after_seconds`` (run-once modes), raises the last
        ``BrokerUnavailable`` after that long instead."""
        import time

        deadline = None if give_up_after_seconds is None else time.monotonic() + give_up_after_seconds
        while not stop.is_set():
            try:
                self.connect()
                return True
            except BrokerUnavailable as exc:
                if deadline is not None and time.monotonic() + retry_seconds > deadline:
                    raise
                logger.error(
                    "nats unreachable url=%s error=%s; retrying in %.0f s",
                    conf.redact_url(self.url),
                    self.redact(str(exc)),
                    retry_seconds,
                )
                stop.wait(retry_seconds)
        return False

    @property
    def max_payload(self) -> int:
        """The connected server's ``max_payload`` in bytes (from its INFO)."""
        return int(self._nc.max_payload)

    def close(self) -> None:
        """Flush pending acks and close; stop the loop thread."""
        if self._loop is None:
            return
        self._closing = True
        beater, self._keep_beater_future = self._keep_beater_future, None
        if beater is not None:
            beater.cancel()  # before the loop stops: never "Task was destroyed but it is pending"

        async def _close() -> None:
            if self._nc is not None and not self._nc.is_closed:
                try:
                    # flush, not drain: the acks are out once flushed, and
                    # draining would wait out every lingering pull request.
                    await self._nc.flush(timeout=2)
                except Exception:
                    pass
                await self._nc.close()

        try:
            self.call(_close(), timeout=10)
        except Exception as exc:
            logger.debug("nats close error=%s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None
        self._nc = None
        with self._keep_lock:
            self._keep_beater_loop = None  # a new loop starts its own beat task
            self._keeps.clear()

    # -- stream --
    def ensure_stream(self, *, owner: str | None = None) -> api.StreamInfo:
        """Create the stream if missing; report (never fix by deleting) drift.

        ``owner``: this project's database identity (``identity.database_identity()``;
        relay and worker pass it). A new stream records it; an existing one
        recording another identity is refused; one recording none (made
        before identities existed) is adopted - ours recorded, logged at
        WARNING. None: no ownership check (tests, tools).

        Raises ``ConfigurationError`` (the process should end: retrying can't
        help) when the stream belongs to another database, when NATS refuses
        to create it (e.g. its subjects overlap another stream's), when
        JetStream is not enabled, or when the server's ``max_payload`` can't
        carry ``MAX_PAYLOAD_BYTES`` plus the envelope; ``BrokerUnavailable``
        on a timeout."""
        needed = int(conf.settings.MAX_PAYLOAD_BYTES * JSONB_TEXT_GROWTH) + ENVELOPE_OVERHEAD_BYTES
        if self.max_payload < needed:
            raise ConfigurationError(
                f"the NATS server's max_payload is {self.max_payload} bytes, but MAX_PAYLOAD_BYTES "
                f"({conf.settings.MAX_PAYLOAD_BYTES}) needs {needed} with the envelope: raise max_payload "
                "in the server config, or lower PLATFORMKIT['MAX_PAYLOAD_BYTES']."
            )
        if not (self._nc._server_info or {}).get("jetstream"):
            # Without JetStream every stream call ends in a bare
            # ServiceUnavailableError (code None): say what is wrong instead.
            raise ConfigurationError(self.redact(_no_jetstream_text(self.url)))
        return self.call(self._ensure_stream(owner), timeout=30)

    def _has_stream_metadata(self) -> bool:
        version = str((self._nc._server_info or {}).get("version", "0.0"))
        try:
            major, minor = (int(part) for part in version.split(".")[:2])
        except ValueError:
            return False
        return (major, minor) >= (2, 10)

    async def _ensure_stream(self, owner: str | None = None) -> api.StreamInfo:
        from . import identity

        want = stream_config()
        if owner is not None:
            want.description = identity.describe(owner)
            if self._has_stream_metadata():
                want.metadata = {identity.METADATA_KEY: owner}
        try:
            info: api.StreamInfo = await self._js.stream_info(want.name)
        except nats.js.errors.NotFoundError:
            try:
                created: api.StreamInfo = await self._js.add_stream(want)
            except nats.js.errors.APIError as exc:
                if exc.code is not None and 400 <= int(exc.code) < 500:
                    # Permanent (e.g. 10065 "subjects overlap with an existing
                    # stream"): retrying forever as "unavailable" would hide it.
                    raise ConfigurationError(
                        f"NATS at {conf.redact_url(self.url)} refused to create the stream {want.name!r} with subjects "
                        f"{want.subjects}: {exc.description} (err_code {exc.err_code}). Another stream probably "
                        "holds these subjects already: give this project its own PLATFORMKIT['SUBJECT_PREFIX'] "
                        "(and PLATFORMKIT['STREAM'])."
                    ) from None
                raise
            # Only now: a refused create must not leave a false "created" line.
            logger.info(
                "stream created stream=%s subjects=%s replicas=%s owner=%s",
                want.name,
                want.subjects,
                want.num_replicas,
                owner or "-",
            )
            return created
        have = info.config
        if owner is not None:
            theirs = identity.recorded_identity(have.description, getattr(have, "metadata", None))
            if theirs is not None and theirs != owner:
                raise ConfigurationError(identity.foreign_stream_text(str(want.name), self.url, theirs, owner))
            if theirs is None:
                logger.warning(
                    "stream adopted stream=%s owner=%s: it recorded no owning database (made before identities); "
                    "this database is recorded now, and another project's worker will be refused",
                    want.name,
                    owner,
                )
                have.description = want.description
                if want.metadata:
                    have.metadata = {**(getattr(have, "metadata", None) or {}), **want.metadata}
                info = await self._js.update_stream(have)
                have = info.config
        drift = []
        if sorted(have.subjects or []) != sorted(want.subjects or []):
            drift.append(f"subjects {have.subjects} (want {want.subjects})")
        if have.max_age is not None and abs((have.max_age or 0) - (want.max_age or 0)) > 1:
            drift.append(f"max_age {have.max_age:.0f} s (want {want.max_age:.0f} s = RETENTION_DAYS)")
        if abs((have.duplicate_window or 0) - want.duplicate_window) > 0.5:
            drift.append(f"duplicate_window {have.duplicate_window} s (want {want.duplicate_window} s)")
        if (have.num_replicas or 1) != want.num_replicas:
            drift.append(f"replicas {have.num_replicas} (want {want.num_replicas})")
        if drift:
            logger.warning(
                "stream drift stream=%s differs: %s. Update it with `nats stream edit %s` "
                "(the stream is never deleted for you).",
                want.name,
                "; ".join(drift),
                want.name,
            )
        return info

    def stream_info(self) -> api.StreamInfo:
        """The stream's info (config, message counts, cluster). Raises ``BrokerUnavailable`` on timeout."""
        info: api.StreamInfo = self.call(
            self._js.stream_info(conf.settings.STREAM), timeout=self.request_timeout_seconds + 1
        )
        return info

    # -- publishing --
    def publish_start(self, messages: Sequence[OutgoingMessage], *, timeout: float = 10.0) -> PendingPublish:
        """Publish pipelined (every message is sent before any ack is awaited;
        in-flight acks are bounded by nats-py's pending limit): hand
        ``messages`` to the loop and return at once; ``.results()`` waits for
        the acks, one ``PublishResult`` per message, in order. Batches are sent in the order they were started,
        never interleaved, so a caller that starts batch N+1 while batch N's
        acks are outstanding keeps relay order on the wire (while nothing
        fails: a message refused for now is sent again later, after the
        batches behind it). ``timeout`` (seconds) bounds each stalled send
        and the wait for the acks; the first message that can't be sent for
        now ends the batch's sending, the rest counting as TEMPORARY."""
        if not messages:
            return PendingPublish(None, 0, timeout)
        future = asyncio.run_coroutine_threadsafe(self._publish_many(messages, timeout), self._ensure_loop())
        return PendingPublish(future, len(messages), timeout)

    async def _publish_many(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        results: list[PublishResult | None] = [None] * len(messages)
        futures: list[tuple[int, asyncio.Future[api.PubAck]]] = []
        # FIFO: the batch started first sends first, whole (see publish_start).
        if self._send_lock is None:  # made by _ensure_loop(), which scheduled this coroutine
            raise RuntimeError("Transport._publish_many ran outside the transport's loop")
        async with self._send_lock:
            if self._nc is None or self._nc.is_closed:
                return [PublishResult(Outcome.TEMPORARY, "not connected to NATS")] * len(messages)
            js = self._js
            task = asyncio.current_task()
            for i, message in enumerate(messages):
                if task is not None and task.cancelling():
                    # The caller gave up on this batch (its rows stay pending): send no more of it.
                    results[i:] = [PublishResult(Outcome.TEMPORARY, "publish cancelled")] * (len(messages) - i)
                    break
                # A stall timeout costs a timer per message; it is only needed
                # when nats-py's in-flight limit could make publish_async wait.
                stall = timeout if js.publish_async_pending() >= _NO_STALL_BELOW else None
                try:
                    future = await js.publish_async(
                        message.subject, message.body, headers={"Nats-Msg-Id": message.msg_id}, wait_stall=stall
                    )
                except Exception as exc:
                    result = classify_publish_error(exc)
                    results[i] = result
                    if result.outcome is not Outcome.PERMANENT:
                        # A stall, a lost connection, a cancel: the rest would fail
                        # the same way, one timeout each. They stay pending.
                        results[i + 1 :] = [result] * (len(messages) - i - 1)
                        break
                    continue
                futures.append((i, future))
        if futures:
            # Acks come back in order: wait for the last one, then for any stragglers.
            deadline = asyncio.get_running_loop().time() + timeout
            await asyncio.wait([futures[-1][1]], timeout=timeout)
            late = [f for _, f in futures if not f.done()]
            if late:
                await asyncio.wait(late, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
        for i, future in futures:
            if not future.done():
                future.cancel()
                results[i] = PublishResult(Outcome.TEMPORARY, f"no ack from the stream within {timeout} s")
            elif future.cancelled():
                results[i] = PublishResult(Outcome.TEMPORARY, "publish cancelled")
            elif (error := future.exception()) is not None:
                results[i] = classify_publish_error(error)
            else:
                ack = future.result()
                results[i] = PublishResult(Outcome.STORED, duplicate=bool(ack.duplicate), seq=ack.seq)
        return [r for r in results if r is not None]

    def publish_raw(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> api.PubAck:
        """Publish one message and wait for the stream's ack (tests and tools)."""
        ack: api.PubAck = self.call(
            self._js.publish(subject, body, headers=headers), timeout=self.request_timeout_seconds + 1
        )
        return ack

    # -- consumers --
    def ensure_consumer(self, want: api.ConsumerConfig) -> api.ConsumerInfo:
        """Create the durable if missing; update it in place when only
        updatable fields differ; raise ``ConsumerDrift`` saying what differs
        and what to do when the broker can't change it."""
        info: api.ConsumerInfo = self.call(self._ensure_consumer(want), timeout=30)
        return info

    async def _ensure_consumer(self, want: api.ConsumerConfig) -> api.ConsumerInfo:
        stream = conf.settings.STREAM
        try:
            info: api.ConsumerInfo = await self._js.consumer_info(stream, want.durable_name)
        except nats.js.errors.NotFoundError:
            logger.info("durable created consumer=%s filter=%s", want.durable_name, want.filter_subject)
            created: api.ConsumerInfo = await self._js.add_consumer(stream, want)
            return created
        updatable, fixed = consumer_differences(want, info.config)
        if fixed:
            what = "; ".join(f"{k}: broker has {a!r}, this build wants {b!r}" for k, (a, b) in fixed.items())
            raise ConsumerDrift(
                f"durable consumer {want.durable_name!r} on stream {stream!r} differs in fields the broker "
                f"can't update ({what}). Claims are keyed by the subscription's name, so a new name (a new "
                f"durable from the first retained message) runs the handler again for every event the stream "
                f"still holds (up to RETENTION_DAYS). To keep the name, delete the old durable once it is "
                f"drained with `nats consumer rm {stream} {want.durable_name}`: the durable made again under "
                "the same name meets its claims and skips what was handled."
            )
        if updatable:
            logger.info("durable updated consumer=%s changes=%s", want.durable_name, updatable)
            updated: api.ConsumerInfo = await self._js.add_consumer(stream, want)  # create-or-update, same name
            return updated
        return info

    def consumer_info(self, durable: str) -> api.ConsumerInfo:
        """A durable's info (pending, ack pending, delivered). Raises ``BrokerUnavailable`` on timeout, ``nats.js.errors.NotFoundError`` if it doesn't exist."""
        info: api.ConsumerInfo = self.call(
            self._js.consumer_info(conf.settings.STREAM, durable), timeout=self.request_timeout_seconds + 1
        )
        return info

    async def _pull(self, durable: str, puller: int = 0) -> JetStreamContext.PullSubscription:
        # One pull subscription per (durable, puller): nats-py's fetch() is not
        # safe for two concurrent callers on one subscription.
        sub: JetStreamContext.PullSubscription | None = self._pulls.get((durable, puller))
        if sub is None:
            sub = await self._js.pull_subscribe_bind(durable=durable, stream=conf.settings.STREAM)
            self._pulls[(durable, puller)] = sub
        return sub

    def fetch(self, durable: str, batch: int, *, timeout: float = 1.0, puller: int = 0) -> list[Delivery]:
        """Up to ``batch`` messages for ``durable``, waiting at most
        ``timeout`` seconds; ``[]`` when there is nothing. A pull request
        always carries an expiry, so an orphaned one can't hang the loop.
        Threads fetching the same durable at once pass distinct ``puller``
        numbers (each gets a pull subscription of its own)."""
        return self.call(
            self._fetch(durable, batch, timeout, puller), timeout=timeout + self.request_timeout_seconds + 5
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
    ) -> PullLane:
        """Start pulling ``want``'s durable on the loop, for as long as the
        transport lives or until ``PullLane.stop()``; see ``PullLane``."""
        lane = PullLane(
            self,
            want,
            credit=credit,
            deliver=deliver,
            batch_size=batch_size,
            linger_seconds=linger_seconds,
            heartbeat_seconds=heartbeat_seconds,
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
            self.call(_forget(), timeout=5)
        except BrokerUnavailable:
            pass

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


class PendingPublish:
    """A batch handed to the loop by ``Transport.publish_start()``."""

    def __init__(
        self, future: concurrent.futures.Future[list[PublishResult]] | None, count: int, timeout: float
    ) -> None:
        self._future = future
        self._count = count
        self._timeout = timeout

    def results(self) -> list[PublishResult]:
        """Wait for the acks: one ``PublishResult`` per message, in order.
        Never raises: a loop that doesn't answer (a batch queued behind
        another's stalled send, then its own ack wait) makes every message
        TEMPORARY, so the rows stay pending."""
        if self._future is None:
            return []
        try:
            return self._future.result(2 * self._timeout + 5)
        except concurrent.futures.TimeoutError:
            self._future.cancel()
            return [
                PublishResult(Outcome.TEMPORARY, f"NATS did not answer within {2 * self._timeout + 5:.0f} s")
            ] * self._count
        except Exception as exc:
            logger.exception("publish batch failed")
            return [PublishResult(Outcome.TEMPORARY, f"{type(exc).__name__}: {exc}")] * self._count


class KeepAlive:
    """In-progress acks for one fetched batch; see ``Transport.keep_alive``."""

    def __init__(self, deliveries: Sequence[Delivery], every_seconds: float = 10.0) -> None:
        import time

        self._lock = threading.Lock()
        self._pending: dict[int, Delivery] = {id(d): d for d in deliveries}
        self._deadlines: dict[int, float] = {}
        self.every_seconds = float(every_seconds)
        self._next_at = time.monotonic() + self.every_seconds
        self.future: Any = None  # kept for compatibility: the transport's one beat task serves every KeepAlive

    def started(self, delivery: Delivery, timeout_seconds: float) -> None:
        """The delivery's handler starts now: extend its ack for ``timeout_seconds`` more, then stop."""
        import time

        with self._lock:
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


async def _next_msg(sub: Any, timeout: float) -> Any:
    """``sub.next_msg(timeout)`` without its per-call cost: nats-py's
    ``next_msg`` makes a uuid4, a task and a ``wait_for`` per call, which in a
    fetched batch cost more loop time than the message. A message already
    queued is taken at once; else the queue is awaited under
    ``asyncio.timeout`` (raises ``TimeoutError``). The accounting is nats-py's
    own (``_pending_size``, ``task_done``)."""
    try:
        queue = sub._pending_queue
    except AttributeError:
        return await sub.next_msg(timeout=timeout)
    try:
        msg = queue.get_nowait()
    except asyncio.QueueEmpty:
        if sub._conn.is_closed:
            raise nats.errors.ConnectionClosedError from None
        # Waiting here (a long-poll's first message) without next_msg's task
        # and wait_for: one unit at a steady trickle is one such wait. A
        # connection closed meanwhile ends it by the timeout (the lane retries).
        async with asyncio.timeout(timeout):
            msg = await queue.get()
    sub._pending_size -= len(msg.data)
    sub._pending_queue.task_done()
    return msg


def _ack_reply_fields(reply: Any) -> tuple[int, int, int] | None:
    """(delivery count, stream sequence, pending behind) from a JetStream
    ack subject, or None when it isn't one of the two known forms:
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>``
    and ``$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>...``
    (ADR-15). nats-py's ``msg.metadata`` parses the same, plus a datetime
    and two dataclasses per message we never read: on the loop, per message."""
    if not isinstance(reply, str) or not reply.startswith("$JS.ACK."):
        return None
    tokens = reply.split(".")
    try:
        if len(tokens) == 9:
            return int(tokens[4]), int(tokens[5]), int(tokens[8])
        if len(tokens) >= 11:
            return int(tokens[6]), int(tokens[7]), int(tokens[10])
    except ValueError:
        return None
    return None


def _pending_behind(msg: Any) -> bool:
    """Whether the broker had messages pending behind ``msg`` when it sent it
    (its reply subject's ``num_pending``); True when that can't be read."""
    fields = _ack_reply_fields(msg.reply)
    if fields is not None:
        return fields[2] > 0
    try:
        return int(msg.metadata.num_pending) > 0
    except Exception:
        return True


class PullLost(Exception):
    """A pull request went unanswered (no message, status or heartbeat in time)."""


class PullLane:
    """The pulls of one durable, run on the transport's loop: waiting on the
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
        transport: Transport,
        want: api.ConsumerConfig,
        *,
        credit: Callable[[], int],
        deliver: Callable[[list[Delivery]], None],
        batch_size: int,
        linger_seconds: float,
        heartbeat_seconds: float,
    ) -> None:
        self.transport = transport
        self.want = want
        self.durable = want.durable_name
        self._credit = credit
        self._deliver = deliver
        self.batch_size = max(1, int(batch_size))
        self.linger_seconds = float(linger_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.idle = threading.Event()  # set: the last look found nothing, and nothing fetched since
        self.error: BaseException | None = None  # an unexpected crash of the lane task (the worker exits on it)
        self._wake: asyncio.Event | None = None
        self._stopped = False
        self._seq = 0
        self._sub: Any = None
        self._inbox = ""
        self._held: list[Any] = []  # received, not yet handed over: NAKed if the lane stops in between
        self.future: Any = None

    def start(self) -> None:
        self.future = self.transport.submit(self._run())

    def wake(self) -> None:
        """Thread-safe: the credit may have grown; look again now."""
        loop = self.transport._loop
        if loop is not None and self._wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling; NAK at once whatever was received but not handed over. Waits up to ``timeout`` s."""
        self._stopped = True
        if self.future is None:
            return
        loop = self.transport._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.future.cancel)
        with contextlib.suppress(Exception):
            self.future.result(timeout)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        delay = 0.5
        maybe_more = True  # unknown at start: look with a no_wait request first
        try:
            while not self._stopped:
                want = min(self._credit(), self.batch_size)
                if want <= 0:
                    self._wake.clear()
                    if (
                        min(self._credit(), self.batch_size) <= 0
                    ):  # re-read after clear(): a wake in between is not lost
                        await self._wake.wait()
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
                        # Waits for the first message, then hands over at once
                        # what is there with it (up to the credit) and ends (404):
                        # a burst arrives as one unit, an isolated event alone.
                        msgs = await self._request(want, linger=True)
                    delay = 0.5
                except (PullLost, nats.js.errors.APIError, nats.errors.NoRespondersError) as exc:
                    logger.error(
                        "pull failed consumer=%s error=%s; re-ensuring the durable in %.1fs",
                        self.durable,
                        exc or type(exc).__name__,
                        delay,
                    )
                    await self._reset()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    await self._reensure()
                    maybe_more = True
                    continue
                except (TimeoutError, nats.errors.Error, OSError) as exc:
                    logger.error(
                        "pull failed consumer=%s broker error=%s; retrying in %.1fs",
                        self.durable,
                        exc or type(exc).__name__,
                        delay,
                    )
                    await self._reset()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 10.0)
                    maybe_more = True
                    continue
                deliveries = to_deliveries(msgs)
                self._held = []
                maybe_more = _pending_behind(msgs[-1]) if msgs else True
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
            nc = self.transport._nc
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
            await self.transport._ensure_consumer(self.want)
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
            gap = self.transport.request_timeout_seconds
        nc = self.transport._nc
        await nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{conf.settings.STREAM}.{self.durable}",
            json.dumps(request).encode(),
            reply=reply,
        )
        msgs = self._held = []
        while len(msgs) < batch and not self._stopped:
            try:
                msg = await _next_msg(sub, gap)
            except (TimeoutError, nats.errors.TimeoutError):
                if msgs:
                    return msgs
                raise PullLost(f"no answer to a pull request within {gap:g} s") from None
            status = (msg.headers or {}).get("Status")
            if not status:
                msgs.append(msg)
                gap = self.transport.request_timeout_seconds  # the rest (and the 404) follow at once
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
