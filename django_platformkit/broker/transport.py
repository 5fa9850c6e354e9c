"""The NATS connection and its event loop: the one bridge between the
synchronous ORM side and asyncio.

NATS runs on one event loop in one background thread owned by ``Transport``.
Synchronous callers (relay, consumers, commands) reach it only through
``Transport.call``, which translates nats-py's errors into ours, so a reader
always knows where the event loop is. What travels over the connection is
split by stage, and ``Transport`` carries it all: ``streams`` (the stream and
durables this build wants), ``publishing`` (the relay's send path),
``pulling`` (the consumer's pull lanes) and ``acks`` (settling deliveries).
Only these five modules import ``nats``; a web process imports none of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
from nats.js import api
from nats.js.client import JetStreamContext

from django_platformkit import conf
from django_platformkit.broker.acks import KeepAlive, _Acks
from django_platformkit.broker.publishing import _Publishing, jetstream_context
from django_platformkit.broker.pulling import PullLane, to_deliveries
from django_platformkit.broker.streams import _jetstream_disabled, _no_jetstream_text, _Streams
from django_platformkit.exceptions import BrokerUnavailable

# The wire scheme and the values crossing the bridge live in wire.py (pure);
# re-exported here, where callers imported them from before.
from django_platformkit.wire import Delivery

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: A waiting pull request's expiry: an idle subscription costs one request
#: per this many seconds (re-issued as it expires), not a timer per 50 ms.
PULL_LINGER_SECONDS = 30.0
#: Idle heartbeats of a waiting pull: two missed mean the request is gone
#: (a reconnect, a durable deleted under us) and a new one is sent.
PULL_HEARTBEAT_SECONDS = 5.0


def event_loop_kind() -> str:
    """Which event loop the transport runs, from ``EVENT_LOOP``: ``"uvloop"``
    (``"auto"`` with uvloop installed, as it is with the package on Linux and
    macOS) or ``"asyncio"`` (the standard library's). uvloop's loop, its
    transports and its thread-safe wake-ups are C: in the topology drain it
    cut the worker's CPU per handling by 5-13 % and raised the rate by
    10-15 % (three interleaved pairs, 3 December 2026)."""
    kind = conf.settings.EVENT_LOOP
    if kind != "auto":
        return kind
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of ``event_loop_kind()``."""
    if event_loop_kind() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Transport(_Streams, _Publishing, _Acks):
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
            loop = new_event_loop()
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
        self._js = jetstream_context(self._nc, self.request_timeout_seconds)
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
        self._js = jetstream_context(self._nc, self.request_timeout_seconds)
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

    # -- pulling --
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
