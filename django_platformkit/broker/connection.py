"""The NATS connection and its event loop: the one bridge between the
synchronous ORM side and asyncio.

NATS runs on one event loop in one background thread owned by
``Connection``. Synchronous callers reach it only through ``call`` (which
translates nats-py's errors into ``BrokerUnavailable``) or ``submit``, so a
reader always knows where the event loop is. The transport's parts
(streams, publishing, pulling, acks) each hold this connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors

from django_platformkit import conf, tracing
from django_platformkit._retry import WaitingLog
from django_platformkit.exceptions import BrokerUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


def event_loop_kind() -> str:
    """Which event loop the transport runs, from ``EVENT_LOOP``: ``"uvloop"``
    (``"auto"`` with uvloop installed, as it is with the package on Linux and
    macOS) or ``"asyncio"`` (the standard library's). uvloop's loop, its
    transports and its thread-safe wake-ups are C; bench/README.md has what
    it saves per handling."""
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


def jetstream_context(nc: Any, timeout: float) -> Any:
    """``nc.jetstream(timeout=...)``, with publish_async's error acks delivered.

    nats-py's reply handler for ``publish_async`` builds the stream's error
    with ``APIError.from_error``, which raises instead of returning: the
    error goes to the connection's error callback and the ack's future is
    never resolved, so a 4xx (a message over the stream's ``max_msg_size``,
    ...) read as "no ack within the timeout" - temporary, the row sent again
    on every pass, never dead-lettered. The handler installed here sets that
    error on the future, where ``publishing.classify_publish_error`` sees it.
    It must be in place before the context's first ``publish_async``
    subscribes it."""
    js = nc.jetstream(timeout=timeout)
    original = js._handle_async_reply

    async def handle_async_reply(msg: Any) -> None:
        try:
            await original(msg)
        except nats.js.errors.APIError as exc:
            token = msg.subject[len(js._nc._inbox_prefix) + 22 + 2 :]  # as nats-py reads it
            future = js._publish_async_futures.get(token)
            if future is not None and not future.done():
                future.set_exception(exc)

    js._handle_async_reply = handle_async_reply
    return js


def jetstream_disabled(exc: BaseException | None) -> bool:
    """Whether ``exc`` says the server runs without JetStream."""
    return exc is not None and "jetstream not enabled" in str(exc).lower()


def no_jetstream_text(url: str) -> str:
    """What to do about a server without JetStream."""
    return f"JetStream is not enabled on {conf.redact_url(url)}: start nats-server with -js (or jetstream {{}} in its config)."


class Connection:
    """A NATS connection and its event loop, behind a synchronous API.

    Args:
        url: Comma-separated NATS URLs (default ``NATS_URL``).
        options: Credentials and TLS (default ``NATS_OPTIONS``).
        name: The client name the server shows.
        request_timeout_seconds: How long one JetStream API request may take.
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
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.nc: Any = None
        self.js: Any = None
        #: Counts fresh connections (not reconnects): what was bound to an earlier one is gone.
        self.generation = 0
        self.connected = threading.Event()
        self.closing = False
        self._error_logged = False
        # The server's reason for a failed connect: the first error since connecting began.
        self._last_error: BaseException | None = None
        self._before_close: list[Callable[[], None]] = []

    # -- the bridge --
    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The connection's loop, started in its thread on first use."""
        if self.loop is None:
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

            self.thread = threading.Thread(target=run, name="platformkit-nats", daemon=True)
            self.thread.start()
            ready.wait()
            self.loop = loop
        return self.loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            BrokerUnavailable: NATS doesn't answer within ``timeout`` seconds
                or nats-py fails the call: its errors are translated here, so
                no code outside the broker package handles a ``nats`` type
                (the original is the ``__cause__``). Our own errors
                (``ConsumerDrift``, ``ConfigurationError``) pass through.
        """
        try:
            return self._call_nats(coro, timeout)
        except nats.errors.Error as exc:
            raise BrokerUnavailable(self.redact(str(exc) or type(exc).__name__)) from exc

    def _call_nats(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """``call()`` without the translation: for ``connect()``, which words nats-py's refusal itself."""
        future = asyncio.run_coroutine_threadsafe(coro, self.ensure_loop())
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise BrokerUnavailable(f"NATS did not answer within {timeout} s") from None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Schedule ``coro`` on the loop without waiting (fire and forget)."""
        return asyncio.run_coroutine_threadsafe(coro, self.ensure_loop())

    def soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` on the loop as soon as it can (thread-safe, no future)."""
        self.ensure_loop().call_soon_threadsafe(callback)

    def call_later(self, delay_seconds: float, callback: Callable[[], object]) -> bool:
        """Run ``callback`` on the loop after ``delay_seconds``; False (not
        scheduled) when the loop is not running."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        loop.call_soon_threadsafe(loop.call_later, delay_seconds, callback)
        return True

    def loop_alive(self) -> bool:
        """Whether the loop's thread still runs (True before it started)."""
        return self.thread is None or self.thread.is_alive()

    def before_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the closing thread) before the loop stops."""
        self._before_close.append(callback)

    # -- connecting --
    def connect_options(self) -> dict[str, Any]:
        """nats-py's ``connect()`` keyword arguments for this connection (servers, credentials, TLS, callbacks)."""
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
        if not self.closing:
            logger.warning("nats disconnected url=%s; reconnecting", conf.redact_url(self.url))

    async def _on_reconnected(self) -> None:
        # A fresh JetStream context: nats-py registers a publish's ack future
        # before it writes, so a publish that failed in the outage can leave a
        # future (and an in-flight permit) that never completes.
        self.js = jetstream_context(self.nc, self.request_timeout_seconds)
        self.connected.set()
        self._error_logged = False
        # netloc carries the user info: never log it as it is.
        where = self.nc.connected_url.geturl() if self.nc and self.nc.connected_url else self.url
        logger.info("nats reconnected url=%s", conf.redact_url(where))
        self._tell_tracing()

    async def _connect(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            return
        self._last_error = None
        kwargs = self.connect_options()
        # nats-py applies max_reconnect_attempts to the FIRST connect too, so
        # "forever" would hang here; try each server a few times, then say so.
        kwargs["max_reconnect_attempts"] = 2
        self.nc = await nats.connect(**kwargs)
        self.nc.options["max_reconnect_attempts"] = -1  # from now on, ride out any outage
        self.js = jetstream_context(self.nc, self.request_timeout_seconds)
        self.generation += 1
        self.connected.set()
        self._tell_tracing()

    def _tell_tracing(self) -> None:
        """The spans' ``server.address`` / ``server.port``: the server reached now (a cluster's may change)."""
        url = self.nc.connected_url if self.nc is not None else None
        tracing.broker_connected(url.hostname if url else None, url.port if url else None)

    def connect(self) -> None:
        """Connect once (after the first connection, reconnects happen by themselves).

        Raises:
            BrokerUnavailable: NATS can't be reached; the message says why
                (the server's own reason where it gave one).
        """
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
            if jetstream_disabled(exc) or jetstream_disabled(cause):
                raise BrokerUnavailable(self.redact(no_jetstream_text(self.url))) from exc
            raise BrokerUnavailable(self.redact(f"can't connect to NATS at {self.url}: {why}")) from exc

    def connect_until(
        self, stop: threading.Event, *, retry_seconds: float = 2.0, give_up_after_seconds: float | None = None
    ) -> bool:
        """Connect, retrying with a logged error until it works or ``stop`` is set.

        A worker started during a broker outage waits for the broker instead
        of crash-looping.

        Args:
            stop: Set to stop trying.
            retry_seconds: The wait between attempts.
            give_up_after_seconds: Run-once modes: raise the last
                ``BrokerUnavailable`` after this long instead of waiting on.

        Returns:
            Whether it connected (False: ``stop`` was set first).
        """
        deadline = None if give_up_after_seconds is None else time.monotonic() + give_up_after_seconds
        waiting = WaitingLog(logger, f"NATS server at {conf.redact_url(self.url)}")
        while not stop.is_set():
            try:
                self.connect()
                waiting.done()
                return True
            except BrokerUnavailable as exc:
                if deadline is not None and time.monotonic() + retry_seconds > deadline:
                    raise
                waiting.failed(self.redact(str(exc)))  # one line, then one a minute
                stop.wait(retry_seconds)
        return False

    def redact(self, text: str) -> str:
        """``text`` with this connection's URLs shown without user info, and
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

    @property
    def max_payload(self) -> int:
        """The connected server's ``max_payload`` in bytes (from its INFO)."""
        return int(self.nc.max_payload)

    @property
    def server_info(self) -> dict[str, Any]:
        """The connected server's INFO (version, jetstream, ...); {} before connecting."""
        return dict((self.nc._server_info if self.nc is not None else None) or {})

    def close(self) -> None:
        """Flush what is pending (acks), close, stop the loop thread."""
        if self.loop is None:
            return
        self.closing = True
        for callback in self._before_close:
            callback()

        async def _close() -> None:
            if self.nc is not None and not self.nc.is_closed:
                try:
                    # flush, not drain: the acks are out once flushed, and
                    # draining would wait out every lingering pull request.
                    await self.nc.flush(timeout=2)
                except Exception:
                    pass
                await self.nc.close()

        try:
            self.call(_close(), timeout=10)
        except Exception as exc:
            logger.debug("nats close error=%s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(5)
        self.loop = None
        self.nc = None
