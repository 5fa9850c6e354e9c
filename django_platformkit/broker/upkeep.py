"""The operator's verbs on the stream (``manage.py stream info|prune|reset|update|takeover``):
the stream and every durable as the broker holds them, deleting durables no
declared subscription owns, deleting the stream, making what can change in
place match this build, and recording which database instance holds it -
without the ``nats`` CLI.

Never used by a worker: they act on the operator's word. Nothing here
deletes a message a subscription hasn't read except ``delete_stream`` (a
development reset, refused by the command without ``--yes``), and
``update`` only ever lifts limits and lengthens: it never shortens the max
age or narrows the subjects, which would discard or orphan stored messages.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import nats.js.errors
from nats.js import api

from django_platformkit import conf, identity
from django_platformkit.broker.connection import Connection
from django_platformkit.broker.standing import UNLIMITED
from django_platformkit.broker.streams import record_tenure, stream_config
from django_platformkit.exceptions import BrokerUnavailable

logger = logging.getLogger(__name__)

#: Our durables say so in their description (``streams.consumer_config``):
#: only those are ever pruned; another tool's consumer on the stream is listed, never deleted.
OUR_DURABLE = "django_platformkit subscription "
#: JetStream lists consumers in pages of this many.
_PAGE = 256


@dataclass(frozen=True)
class DurableReport:
    """One durable on the stream as the broker holds it: ``pending`` (never
    delivered), ``ack_pending`` (delivered, not acked: in flight or waiting
    for a retry), ``last_active`` (its last delivery, None: never), the
    subscription its description names (None: not made by django_platformkit),
    and ``ack_floor``: the stream sequence up to which it acked every message."""

    name: str
    filter_subject: str
    pending: int
    ack_pending: int
    last_active: datetime | None
    subscription: str | None
    ack_floor: int = 0


@dataclass(frozen=True)
class StreamReport:
    """The stream as the broker holds it (``config``: JetStream's own
    ``StreamConfig``), what this build wants (``want``), its message counts,
    its cluster leader, and every consumer on it."""

    config: Any
    want: Any
    messages: int
    bytes: int
    first_seq: int
    last_seq: int
    leader: str | None
    durables: list[DurableReport] = field(default_factory=list)


class StreamUpkeep:
    """The operator's verbs over ``connection`` (``Transport.upkeep``)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def report(self) -> StreamReport | None:
        """The stream and its durables now; None when there is no stream.
        Raises ``BrokerUnavailable`` when NATS doesn't answer."""

        async def ask() -> StreamReport | None:
            js = self.connection.js
            try:
                info = await js.stream_info(conf.settings.STREAM)
            except nats.js.errors.NotFoundError:
                return None
            consumers: list[api.ConsumerInfo] = []
            while True:
                page = await js.consumers_info(conf.settings.STREAM, offset=len(consumers) or None)
                consumers += page
                if len(page) < _PAGE:
                    break
            state = info.state
            return StreamReport(
                config=info.config,
                want=stream_config(),
                messages=int(state.messages or 0),
                bytes=int(state.bytes or 0),
                first_seq=int(state.first_seq or 0),
                last_seq=int(state.last_seq or 0),
                leader=info.cluster.leader if info.cluster else None,
                durables=sorted((_durable(c) for c in consumers), key=lambda d: d.name),
            )

        report: StreamReport | None = self.connection.call(ask(), timeout=4 * self.connection.request_timeout_seconds)
        return report

    def delete_durables(self, names: Sequence[str]) -> list[str]:
        """Delete these durables; returns those deleted (one already gone is skipped)."""

        async def delete() -> list[str]:
            gone = []
            for name in names:
                try:
                    await self.connection.js.delete_consumer(conf.settings.STREAM, name)
                except nats.js.errors.NotFoundError:
                    continue
                logger.warning("durable deleted consumer=%s stream=%s", name, conf.settings.STREAM)
                gone.append(name)
            return gone

        deleted: list[str] = self.connection.call(delete(), timeout=len(names) * 5 + 5)
        return deleted

    def create_durable_from(self, config: api.ConsumerConfig, stream_seq: int) -> None:
        """Create the durable ``config`` describes starting at ``stream_seq``
        (a durable deleted by name, made again where it stood: one that
        starts at "now" would skip what it had not handled)."""
        resumed = replace(config, deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, stream_seq))
        self.connection.call(self.connection.js.add_consumer(conf.settings.STREAM, resumed), timeout=30)
        logger.warning(
            "durable made again consumer=%s stream=%s from_stream_seq=%s",
            resumed.durable_name,
            conf.settings.STREAM,
            resumed.opt_start_seq,
        )

    def record_holder(self, tenure: identity.Tenure) -> None:
        """Record ``tenure`` as the stream's holder (``manage.py stream takeover``)."""

        async def record() -> None:
            info = await self.connection.js.stream_info(conf.settings.STREAM)
            await record_tenure(self.connection, info.config, tenure)

        self.connection.call(record(), timeout=30)
        logger.warning(
            "stream taken over stream=%s identity=%s instance=%s",
            conf.settings.STREAM,
            tenure.identity,
            tenure.instance,
        )

    def delete_stream(self) -> bool:
        """Delete the stream and every message it holds; False when there was none."""

        async def delete() -> bool:
            try:
                await self.connection.js.delete_stream(conf.settings.STREAM)
            except nats.js.errors.NotFoundError:
                return False
            return True

        deleted: bool = self.connection.call(delete(), timeout=30)
        if deleted:
            logger.warning("stream deleted stream=%s", conf.settings.STREAM)
        return deleted

    def update(self, *, dry_run: bool = False) -> tuple[list[str], list[str]]:
        """Make what can change in place match this build, losing nothing:
        limits that could discard unhandled events lifted, the duplicate
        window and replicas set, the subjects this build publishes on added,
        a shorter max age lengthened. Returns ``(changed, left)``: one line
        per change made (or, with ``dry_run``, that would be made), and per
        difference left as it is, saying why. Raises ``BrokerUnavailable``
        (no stream: a worker makes it) or NATS' refusal as ``BrokerUnavailable``."""
        report = self.report()
        if report is None:
            raise BrokerUnavailable(f"there is no stream {conf.settings.STREAM!r}: a worker or relay makes it")
        have, want = report.config, report.want
        changed: list[str] = []
        left: list[str] = []
        for setting in ("max_msgs", "max_bytes", "max_msgs_per_subject"):
            value = getattr(have, setting, None)
            if value is not None and int(value) > 0:
                changed.append(f"{setting}: {value} -> unlimited")
                setattr(have, setting, UNLIMITED)
        if abs(float(have.duplicate_window or 0) - float(want.duplicate_window)) > 0.5:
            changed.append(f"duplicate_window: {have.duplicate_window:g} s -> {want.duplicate_window:g} s")
            have.duplicate_window = want.duplicate_window
        if (have.num_replicas or 1) != want.num_replicas:
            changed.append(f"replicas: {have.num_replicas or 1} -> {want.num_replicas}")
            have.num_replicas = want.num_replicas
        missing = [s for s in want.subjects or [] if s not in (have.subjects or [])]
        if missing:
            changed.append(f"subjects: {have.subjects} -> {[*(have.subjects or []), *missing]}")
            have.subjects = [*(have.subjects or []), *missing]
        max_age, wanted_age = float(have.max_age or 0), float(want.max_age or 0)
        if max_age and max_age < wanted_age:
            changed.append(f"max_age: {max_age:g} s -> {wanted_age:g} s (RETENTION_DAYS)")
            have.max_age = want.max_age
        elif abs(max_age - wanted_age) > 1:
            left.append(f"max_age: {max_age:g} s (unlimited)" if not max_age else f"max_age: {max_age:g} s")
            left[-1] += (
                f", this build wants {wanted_age:g} s (RETENTION_DAYS): not shortened, which would discard the "
                "older messages whether handled or not; the purge keeps rows and claims as long as the stream "
                "keeps messages."
            )
        retention = getattr(have.retention, "value", have.retention)
        if retention and retention != "limits":
            left.append(
                f"retention: {retention}, this build wants limits: JetStream can't change it in place; once every "
                "durable has 0 pending and 0 ack pending, `manage.py stream reset --yes` deletes the stream and a "
                "worker makes it again."
            )
        if changed and not dry_run:

            async def apply() -> None:
                await self.connection.js.update_stream(have)

            self.connection.call(apply(), timeout=30)
            logger.warning("stream updated stream=%s changes=%s", conf.settings.STREAM, "; ".join(changed))
        return changed, left


def _durable(info: api.ConsumerInfo) -> DurableReport:
    config = info.config
    description = str(getattr(config, "description", "") or "")
    delivered = info.delivered
    return DurableReport(
        name=str(info.name),
        filter_subject=str(getattr(config, "filter_subject", "") or ""),
        pending=int(info.num_pending or 0),
        ack_pending=int(info.num_ack_pending or 0),
        last_active=delivered.last_active if delivered is not None else None,
        subscription=description[len(OUR_DURABLE) :] if description.startswith(OUR_DURABLE) else None,
        ack_floor=int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0,
    )
