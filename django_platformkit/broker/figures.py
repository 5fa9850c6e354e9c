"""The overview page's one broker round trip: each durable's counts, the
age of its oldest unacknowledged message and the stream's standing (limits
that could discard unhandled events, a live copy of this database), from a
one-off NATS connection under a hard total deadline
(``BROKER_TIMEOUT_SECONDS``) - and the same one-off read of the stream for
processes without a worker's connection (the purge's real max age).

Apart from the overview's database figures (``admin/figures.py``) because
it is the page's only ``nats`` code, which lives in the broker package: a
slow or unreachable NATS raises ``BrokerUnavailable`` here, and the page
renders the database figures without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from django_platformkit import conf
from django_platformkit.broker.standing import StreamStanding, standing_of
from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError
from django_platformkit.identity import Standing

#: The whole broker round trip (connect + every durable's info) must end
#: within this; a slow or unreachable NATS can't hold the page longer.
BROKER_TIMEOUT_SECONDS = 2.0


async def _one_off[T](
    url: str,
    options: dict[str, Any],
    timeout: float,
    connect_errors: list[BaseException],
    work: Callable[[Any], Awaitable[T]],
) -> T:
    """Connect once (no reconnects, no chatter), run ``work(js)``, close.
    ``connect_errors``: each failed connect attempt is appended (why nats-py's
    "no servers available" came, and what a timeout met on the way)."""
    from nats.aio.client import Client

    from django_platformkit.broker.connection import Connection

    kwargs = Connection(url, options).connect_options()

    async def quiet(*_: Any) -> None:  # one page view, no reconnect chatter in the worker's log
        return None

    async def record(exc: Exception) -> None:
        connect_errors.append(exc)

    # nats-py's own connect timeout ends first, so it closes its socket itself;
    # the caller's deadline is the backstop. Each server is tried twice with
    # no wait, then nats-py gives up: with max_reconnect_attempts=0 (no limit
    # to nats-py) its first connect retried a refused server every
    # reconnect_time_wait until the deadline, and NATS being down read as
    # "did not answer".
    kwargs.update(
        allow_reconnect=False,
        max_reconnect_attempts=1,
        reconnect_time_wait=0,
        connect_timeout=timeout * 0.75,
        error_cb=record,
        disconnected_cb=quiet,
        reconnected_cb=quiet,
    )
    kwargs["name"] = "django_platformkit-admin"
    nc = Client()
    try:
        await nc.connect(**kwargs)
        return await work(nc.jetstream(timeout=timeout))
    finally:
        # Also after a failed or cancelled connect: an open socket would leak per page view.
        try:
            await nc.close()
        except Exception:
            pass
        transport = getattr(nc, "_transport", None)
        if transport is not None:
            try:
                transport.close()
            except Exception:
                # nats-py before 2.15 raises AttributeError closing a socket that
                # never opened (a refused connect): that would hide why it failed.
                pass


async def _stream_standing(js: Any, owner: str | None, instance: str | None) -> StreamStanding:
    """The stream as the broker holds it, judged for ``owner``/``instance`` without recording anything."""
    import nats.js.errors

    settings = conf.settings
    try:
        have = (await js.stream_info(settings.STREAM)).config
    except nats.js.errors.NotFoundError:
        return StreamStanding(exists=False)
    return standing_of(have, url=settings.NATS_URL, owner=owner, instance=instance)


async def _durable_figures(js: Any, stream: str, subs: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Per durable: pending, ack pending, redelivered and the oldest
    unacknowledged message's age in seconds (or None)."""
    import nats.js.errors

    async def one(durable: str, filter_subject: str) -> dict[str, Any]:
        try:
            info = await js.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            return {"error": "no durable yet: no worker has started it"}
        figures: dict[str, Any] = {
            "num_pending": info.num_pending,
            "num_ack_pending": info.num_ack_pending,
            "num_redelivered": info.num_redelivered,
            "oldest_age_seconds": None,
        }
        if info.num_pending or info.num_ack_pending:
            floor = info.ack_floor.stream_seq if info.ack_floor else 0
            try:
                msg = await js.get_msg(stream, seq=floor + 1, subject=filter_subject, next=True)
                sent = json.loads(msg.data or b"{}").get("time")
                if sent:
                    then = datetime.fromisoformat(sent.replace("Z", "+00:00"))
                    figures["oldest_age_seconds"] = max(0.0, (timezone.now() - then).total_seconds())
            except (nats.js.errors.APIError, ValueError, AttributeError, TypeError):
                pass  # no age for this one (an old server without next_by_subj, a body not ours): the counts still stand
        return figures

    results = await asyncio.gather(*(one(d, f) for d, f in subs))
    return {durable: result for (durable, _), result in zip(subs, results, strict=True)}


@dataclass(frozen=True)
class BrokerFigures:
    """The overview's broker round trip: each durable's figures (by durable
    name; ``{"error": ...}`` for one that doesn't exist yet) and the stream's
    standing for this database (limits that could discard unhandled events,
    a live copy of this database, a contest)."""

    durables: dict[str, dict[str, Any]]
    stream: StreamStanding


def broker_figures(
    subs: list[tuple[str, str]],
    *,
    timeout: float = BROKER_TIMEOUT_SECONDS,
    owner: str | None = None,
    instance: str | None = None,
) -> BrokerFigures:
    """``subs``: (durable, filter subject) pairs. Returns ``BrokerFigures``.
    Raises ``BrokerUnavailable`` (message redacted) when NATS refuses the
    connection or can't be reached (at once, saying so) or doesn't answer
    within ``timeout`` seconds in total, ``ConfigurationError`` when
    ``owner`` (this project's ``identity.database_identity()``) is given and
    the stream is recorded as another project's (its figures are that
    project's). ``instance``: this database's instance, to judge a live
    copy or a contest (nothing is recorded)."""
    stream = conf.settings.STREAM

    async def work(js: Any) -> BrokerFigures:
        standing = await _stream_standing(js, owner, instance)
        if standing.standing is Standing.FOREIGN and standing.judgement is not None:
            raise ConfigurationError(standing.judgement.text)
        return BrokerFigures(await _durable_figures(js, stream, subs), standing)

    return _ask(work, timeout)


def stream_standing(
    *, timeout: float = BROKER_TIMEOUT_SECONDS, owner: str | None = None, instance: str | None = None
) -> StreamStanding:
    """The stream as the broker holds it now, over a one-off connection
    within ``timeout`` seconds, judged for ``owner``/``instance`` (None:
    its limits and real max age only) and recording nothing: for a process
    that holds no worker's connection (``purgeoutbox``, the hourly purge).
    Raises ``BrokerUnavailable`` (redacted) when NATS can't answer."""
    return _ask(lambda js: _stream_standing(js, owner, instance), timeout)


def _ask[T](work: Callable[[Any], Awaitable[T]], timeout: float) -> T:
    """Run ``work(js)`` on a one-off connection within ``timeout`` seconds in total."""
    # Here, not at the top: the admin imports this module, and a web process
    # loads nats only when the overview page asks the broker.
    from django_platformkit.broker.connection import Connection

    settings = conf.settings
    connect_errors: list[BaseException] = []
    # URLs without user info, and NATS_OPTIONS' password, token and seed hidden.
    redact = Connection(settings.NATS_URL, dict(settings.NATS_OPTIONS)).redact
    where = conf.redact_url(settings.NATS_URL)
    coro = _one_off(settings.NATS_URL, dict(settings.NATS_OPTIONS), timeout, connect_errors, work)
    # A thread of its own: the admin may run under ASGI with a loop in this
    # thread, and the deadline must hold however nats-py behaves.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="platformkit-overview")
    try:
        future = pool.submit(asyncio.run, asyncio.wait_for(coro, timeout))
        return future.result(timeout + 0.5)
    except ConfigurationError:
        raise
    except (concurrent.futures.TimeoutError, TimeoutError):
        # Connected and silent, or a host that drops packets: no answer at
        # all. A server of the URL list that refused on the way is named.
        refusals = [e for e in connect_errors if not isinstance(e, TimeoutError)]
        met = f" (on the way: {_text(refusals[-1])})" if refusals else ""
        raise BrokerUnavailable(redact(f"NATS at {where} did not answer within {timeout:g} s{met}")) from None
    except Exception as exc:
        raise BrokerUnavailable(redact(_unreachable_text(where, exc, connect_errors))) from None
    finally:
        # Don't wait for a thread stuck past the deadline: the page goes on, the thread ends on its own.
        pool.shutdown(wait=False)


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _unreachable_text(where: str, exc: BaseException, connect_errors: list[BaseException]) -> str:
    """What the page says when the connect failed before the deadline
    (``where``: the redacted URL). nats-py ends every server's failed connect
    with "no servers available"; its reasons came to the error callback."""
    import nats.errors

    reasons = connect_errors if isinstance(exc, nats.errors.NoServersError) and connect_errors else [exc]
    if all(isinstance(r, ConnectionRefusedError) for r in reasons):
        # Nothing listens there: NATS is down, or the URL names the wrong port.
        return f"NATS at {where} refused the connection: {_text(reasons[-1])}"
    return f"NATS at {where} is unreachable: {_text(reasons[-1])}"
