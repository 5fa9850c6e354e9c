"""What the stream holds, as reconciliation asks it (``operate/reconcile.py``):
which stream it is (its creation time) and the sequences it keeps, how far
each durable is done, and whether a message is still there - and the
stream-change advisories that tell a running worker of an edit at once.

A transport part over the one ``Connection``; reads only (the standing is
judged without recording a tenure).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import nats.js.errors

from django_platformkit import conf
from django_platformkit.broker import jsapi
from django_platformkit.broker.connection import Connection
from django_platformkit.broker.port import DurableFacts, HeldMessage, StreamFacts
from django_platformkit.broker.standing import standing_of

logger = logging.getLogger(__name__)

#: JetStream's stream-change advisories (created, updated, deleted) of one stream.
ADVISORY_SUBJECT = "$JS.EVENT.ADVISORY.STREAM.*.{stream}"
#: Message lookups in flight at once (``messages_at``).
LOOKUPS_AT_ONCE = 64


class Holdings:
    """Reconciliation's reads and the stream watch's advisories, over ``connection``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._listeners: list[Callable[[str], None]] = []
        self._subscribed = False
        self._tasks: set[asyncio.Task[None]] = set()

    def stream_facts(self, *, owner: str | None, instance: str | None) -> StreamFacts | None:
        """The stream's creation time, first and last sequence and this
        database's standing (nothing recorded); None when there is none.
        Raises ``BrokerUnavailable`` when NATS doesn't answer."""

        async def ask() -> StreamFacts | None:
            try:
                info, created = await jsapi.stream_info(self.connection)
            except nats.js.errors.NotFoundError:
                return None
            state = info.state
            standing = standing_of(info.config, url=self.connection.url, owner=owner, instance=instance)
            return StreamFacts(created, int(state.first_seq or 0), int(state.last_seq or 0), standing)

        facts: StreamFacts | None = self.connection.call(ask(), timeout=self.connection.request_timeout_seconds + 1)
        return facts

    def durable_facts(self, durables: Sequence[str]) -> list[DurableFacts | None]:
        """Each durable's facts, in order, in one round trip through the loop
        (None: it doesn't exist). Raises ``BrokerUnavailable``."""

        async def ask() -> list[DurableFacts | None]:
            return list(await asyncio.gather(*(jsapi.durable_facts(self.connection, d) for d in durables)))

        facts: list[DurableFacts | None] = self.connection.call(
            ask(), timeout=self.connection.request_timeout_seconds * 2 + 1
        )
        return facts

    def messages_at(self, seqs: Sequence[int]) -> dict[int, HeldMessage | None]:
        """The messages at ``seqs`` (None where the stream holds none),
        ``LOOKUPS_AT_ONCE`` requests in flight. Raises ``BrokerUnavailable``."""
        wanted = sorted(set(seqs))

        async def ask() -> dict[int, HeldMessage | None]:
            found: dict[int, HeldMessage | None] = {}
            for start in range(0, len(wanted), LOOKUPS_AT_ONCE):
                chunk = wanted[start : start + LOOKUPS_AT_ONCE]
                held = await asyncio.gather(*(jsapi.message_at(self.connection, seq) for seq in chunk))
                found.update(zip(chunk, held, strict=True))
            return found

        timeout = self.connection.request_timeout_seconds * (len(wanted) // LOOKUPS_AT_ONCE + 1) + 1
        found: dict[int, HeldMessage | None] = self.connection.call(ask(), timeout=timeout)
        return found

    # -- advisories --
    def watch_stream(self, listener: Callable[[str], None]) -> bool:
        """Call ``listener(action)`` on the loop for each change of the stream
        (``create``, ``modify``, ``delete``; ``reconnect`` after the connection
        came back). The connection re-reads the stream's creation time first,
        so a send after a stream was made again is stamped with it. False
        when the subscription was refused (an account without the right to
        read ``$JS.EVENT.>``): the periodic look is then all there is."""
        self._listeners.append(listener)
        if self._subscribed:
            return True
        subject = ADVISORY_SUBJECT.format(stream=conf.settings.STREAM)

        async def subscribe() -> None:
            await self.connection.nc.subscribe(subject, cb=self._on_advisory)

        try:
            self.connection.call(subscribe(), timeout=self.connection.request_timeout_seconds + 1)
        except Exception as exc:
            logger.warning(
                "stream advisories not watched subject=%s error=%s: a stream edit is noticed by the look every "
                "30 s instead",
                subject,
                self.connection.redact(str(exc) or type(exc).__name__),
            )
            return False
        self._subscribed = True
        self.connection.after_reconnect(self._reconnected)
        return True

    def _reconnected(self) -> None:
        # On the loop, from nats-py's reconnected callback: an advisory sent
        # meanwhile was missed, so the stream is read afresh.
        task = asyncio.get_running_loop().create_task(self._refresh())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._tell("reconnect")

    async def _on_advisory(self, msg: Any) -> None:
        try:
            action = str(json.loads(msg.data).get("action") or "")
        except ValueError:
            action = ""
        logger.info("stream advisory stream=%s action=%s", conf.settings.STREAM, action or msg.subject)
        await self._refresh()
        self._tell(action or "modify")

    async def _refresh(self) -> None:
        """Re-read the stream's creation time (what the relay's stamp records)."""
        try:
            await jsapi.stream_info(self.connection)
        except Exception as exc:  # deleted (a worker makes it again), or NATS busy: the next read tells
            logger.debug("stream not re-read after an advisory error=%s", exc)

    def _tell(self, action: str) -> None:
        for listener in self._listeners:
            try:
                listener(action)
            except Exception:
                logger.exception("stream advisory listener failed")
