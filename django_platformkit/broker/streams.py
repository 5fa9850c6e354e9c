"""The stream and the durables this build wants, and making the broker match.

Defined once, used both to create and to compare (STYLE.md habit 4): the
stream config (DESIGN.md "On the wire") and each subscription's consumer
config. ``Streams.ensure_stream`` / ``Streams.ensure_consumer`` create what
is missing, update in place what the broker lets us, and report - never fix
by deleting - what it doesn't.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import nats.js.errors
from nats.js import api

from django_platformkit import conf, identity
from django_platformkit.broker import jsapi
from django_platformkit.broker.connection import Connection, no_jetstream_text
from django_platformkit.broker.standing import StreamStanding, standing_of
from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError, ConsumerDrift, ConsumerNotFound
from django_platformkit.wire import ENVELOPE_OVERHEAD_BYTES, JSONB_TEXT_GROWTH, durable_name, filter_subject_for

logger = logging.getLogger(__name__)


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
    subscription_name: str, event_name: str, *, max_ack_pending: int | None = None, backfill: bool = True
) -> api.ConsumerConfig:
    """The durable consumer of one subscription, used to create it and to
    compare an existing one. ``max_deliver`` is unlimited on purpose: the
    worker counts attempts itself and dead-letters, so the broker never drops
    a message silently after its own count. ``max_ack_pending`` None: the
    ``max_ack_pending_for()`` default (a change is applied in place).
    ``backfill`` False: a new durable starts with the messages stored after
    its creation (``deliver_policy=new``), not with every retained one."""
    if max_ack_pending is None:
        max_ack_pending = max_ack_pending_for()
    durable = durable_name(subscription_name)
    return api.ConsumerConfig(
        durable_name=durable,
        name=durable,
        description=f"django_platformkit subscription {subscription_name}",
        deliver_policy=api.DeliverPolicy.ALL if backfill else api.DeliverPolicy.NEW,
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
#: Where a new durable starts (``subscribe(backfill=...)``, or where a
#: ``backfill=False`` one stood when ``manage.py stream prune --durable`` made
#: it again): once it exists, a change between these is no drift - it has
#: started, and backfill changes nothing.
_START_POLICIES = {
    api.DeliverPolicy.ALL.value,
    api.DeliverPolicy.NEW.value,
    api.DeliverPolicy.BY_START_SEQUENCE.value,
}


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
    if set(fixed.get("deliver_policy", ())) <= _START_POLICIES:
        fixed.pop("deliver_policy", None)
    return updatable, fixed


#: JetStream's err_code for "subjects overlap with an existing stream"
#: (nats-server's JSStreamSubjectOverlapErr).
_SUBJECTS_OVERLAP = 10065
#: JetStream refusals of a stream's settings that come back as 500 but never
#: pass on a retry: err_code -> what to change.
_SETTINGS_REFUSED = {
    # JSStreamInvalidConfigF, e.g. "duplicates window can not be larger then max age".
    10052: (
        "The stream's settings come from PLATFORMKIT: its max age is RETENTION_DAYS ({max_age:g} s) and its "
        "duplicate window DUPLICATE_WINDOW_SECONDS ({window:g} s), which must not be longer; fix the setting it names."
    ),
    # JSStreamReplicasNotSupportedErr: "replicas > 1 not supported in non-clustered mode".
    10074: (
        "PLATFORMKIT['STREAM_REPLICAS'] is {replicas}, which needs a NATS cluster: set it to 1 for a single "
        "server, or list the cluster's nodes in PLATFORMKIT['NATS_URL']."
    ),
}


def has_stream_metadata(connection: Connection) -> bool:
    """Whether the connected server keeps a stream's metadata (NATS 2.10+)."""
    version = str(connection.server_info.get("version", "0.0"))
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 10)


async def record_tenure(connection: Connection, have: api.StreamConfig, tenure: identity.Tenure) -> None:
    """Write ``tenure`` into the stream's description (and its owner into its
    metadata): who holds the stream (``identity.judge``, ``stream takeover``)."""
    assert tenure.identity is not None
    have.description = identity.describe(tenure.identity, tenure)
    if has_stream_metadata(connection):
        have.metadata = {**(getattr(have, "metadata", None) or {}), identity.METADATA_KEY: tenure.identity}
    await connection.js.update_stream(have)


class Streams:
    """The transport's stream and durable management, over ``connection``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def ensure_stream(self, *, owner: str | None = None, instance: str | None = None) -> api.StreamInfo:
        """Create the stream if missing; refuse one this project must not
        use; report (never fix by deleting) drift.

        ``owner``: this project's database identity (``identity.database_identity()``;
        relay and worker pass it). A new stream records it; an existing one
        recording another identity is refused; one recording none (made
        before identities existed) is adopted - ours recorded, logged at
        WARNING. ``instance``: the database instance behind it
        (``identity.database_instance()``): refused while another live
        instance with the same identity holds the stream (a copy of the
        database, ``identity.judge``). None: no such check (tests, tools).

        Raises ``ConfigurationError`` (the process should end: retrying can't
        help) when the stream belongs to another database or a live copy of
        this one, when its limits could discard events nobody handled
        (``standing.StreamLimits.problems``), when NATS refuses to create it (e.g.
        its subjects overlap another stream's), when JetStream is not
        enabled, or when the server's ``max_payload`` can't carry
        ``MAX_PAYLOAD_BYTES`` plus the envelope; ``BrokerUnavailable`` on a
        timeout."""
        needed = int(conf.settings.MAX_PAYLOAD_BYTES * JSONB_TEXT_GROWTH) + ENVELOPE_OVERHEAD_BYTES
        if self.connection.max_payload < needed:
            raise ConfigurationError(
                f"the NATS server's max_payload is {self.connection.max_payload} bytes, but MAX_PAYLOAD_BYTES "
                f"({conf.settings.MAX_PAYLOAD_BYTES}) needs {needed} with the envelope: raise max_payload "
                "in the server config, or lower PLATFORMKIT['MAX_PAYLOAD_BYTES']."
            )
        if not self.connection.server_info.get("jetstream"):
            # Without JetStream every stream call ends in a bare
            # ServiceUnavailableError (code None): say what is wrong instead.
            raise ConfigurationError(self.connection.redact(no_jetstream_text(self.connection.url)))
        return self.connection.call(self._ensure_stream(owner, instance), timeout=30)

    async def _ensure_stream(self, owner: str | None = None, instance: str | None = None) -> api.StreamInfo:
        want = stream_config()
        if owner is not None:
            want.description = identity.describe(owner, identity.Tenure(owner, instance, time.time()))
            if has_stream_metadata(self.connection):
                want.metadata = {identity.METADATA_KEY: owner}
        try:
            info, _ = await jsapi.stream_info(self.connection, want.name)
        except nats.js.errors.NotFoundError:
            return await self._create(want, owner)
        standing = await self._judge(info, owner, instance)
        if standing.refused:
            raise ConfigurationError(standing.text)
        if standing.contested:
            logger.error("stream contested stream=%s: %s", want.name, standing.text)
        have = info.config
        drift = []
        if sorted(have.subjects or []) != sorted(want.subjects or []):
            drift.append(f"subjects {have.subjects} (want {want.subjects})")
            if not set(want.subjects or []) <= set(have.subjects or []):
                # Not cosmetic: nothing this project publishes is captured.
                logger.error(
                    "stream %s captures %s, not %s (SUBJECT_PREFIX changed?): every publish will fail with "
                    "'no responders' until the stream captures it. Restore SUBJECT_PREFIX, or make the stream "
                    "capture it with `manage.py stream update`.",
                    want.name,
                    have.subjects,
                    want.subjects,
                )
        if have.max_age is not None and abs((have.max_age or 0) - (want.max_age or 0)) > 1:
            drift.append(f"max_age {have.max_age:.0f} s (want {want.max_age:.0f} s = RETENTION_DAYS)")
        if abs((have.duplicate_window or 0) - want.duplicate_window) > 0.5:
            drift.append(f"duplicate_window {have.duplicate_window} s (want {want.duplicate_window} s)")
        if (have.num_replicas or 1) != want.num_replicas:
            drift.append(f"replicas {have.num_replicas} (want {want.num_replicas})")
        if drift:
            logger.warning(
                "stream drift stream=%s differs: %s. `manage.py stream update` makes what can change in place "
                "match (the stream is never deleted for you).",
                want.name,
                "; ".join(drift),
            )
        return info

    async def _create(self, want: api.StreamConfig, owner: str | None) -> api.StreamInfo:
        try:
            created: api.StreamInfo = await self.connection.js.add_stream(want)
        except nats.js.errors.APIError as exc:
            refused = f"NATS at {conf.redact_url(self.connection.url)} refused to create the stream {want.name!r}"
            if exc.err_code in _SETTINGS_REFUSED:
                # Permanent though NATS answers 500: these settings are never
                # accepted, and retrying them every 10 s would hide it.
                raise ConfigurationError(
                    f"{refused}: {exc.description} (err_code {exc.err_code}). "
                    + _SETTINGS_REFUSED[exc.err_code].format(
                        window=want.duplicate_window, max_age=want.max_age, replicas=want.num_replicas
                    )
                ) from None
            if exc.err_code == _SUBJECTS_OVERLAP:
                raise ConfigurationError(
                    f"{refused} with subjects "
                    f"{want.subjects}: {exc.description} (err_code {exc.err_code}). Another stream "
                    "holds these subjects already: give this project its own PLATFORMKIT['SUBJECT_PREFIX'] "
                    "(and PLATFORMKIT['STREAM'])."
                ) from None
            if exc.code is not None and 400 <= int(exc.code) < 500:
                # Permanent (an account's stream or storage limit, ...):
                # retrying forever as "unavailable" would hide it.
                raise ConfigurationError(
                    f"{refused}: {exc.description} (err_code {exc.err_code}). NATS refuses this for good: "
                    "check the account's JetStream limits and permissions (`nats account info`), "
                    "or ask its operator."
                ) from None
            raise
        await jsapi.stream_info(self.connection, want.name)  # its creation time: what the stamp records
        # Only now: a refused create must not leave a false "created" line.
        logger.info(
            "stream created stream=%s subjects=%s replicas=%s owner=%s",
            want.name,
            want.subjects,
            want.num_replicas,
            owner or "-",
        )
        return created

    def stream_standing(self, *, owner: str, instance: str | None) -> StreamStanding:
        """How the stream stands for this database instance now (its limits,
        who holds it), recording what ``identity.judge`` says to record: the
        holder's renewal, a copy's attempt. What a running worker checks every
        ``identity.RENEW_SECONDS``. Never raises for a refused stream (the
        standing says so); ``BrokerUnavailable`` when NATS doesn't answer."""

        async def ask() -> StreamStanding:
            try:
                info, _ = await jsapi.stream_info(self.connection)
            except nats.js.errors.NotFoundError:
                return StreamStanding(exists=False)
            return await self._judge(info, owner, instance)

        standing: StreamStanding = self.connection.call(ask(), timeout=2 * self.connection.request_timeout_seconds + 1)
        return standing

    async def _judge(self, info: api.StreamInfo, owner: str | None, instance: str | None) -> StreamStanding:
        """The stream's standing from ``info``; records the tenure ``identity.judge`` asks for."""
        have = info.config
        standing = standing_of(have, url=self.connection.url, owner=owner, instance=instance)
        judgement = standing.judgement
        if judgement is not None and judgement.tenure is not None:
            if standing.tenure.identity is None:
                logger.warning(
                    "stream adopted stream=%s owner=%s: it recorded no owning database (made before identities); "
                    "this database is recorded now, and another project's worker will be refused",
                    have.name,
                    owner,
                )
            await record_tenure(self.connection, have, judgement.tenure)
            standing = replace(standing, tenure=judgement.tenure)
        return standing

    def stream_info(self) -> api.StreamInfo:
        """The stream's info (config, message counts, cluster). Raises ``BrokerUnavailable`` on timeout."""
        info, _ = self.connection.call(
            jsapi.stream_info(self.connection), timeout=self.connection.request_timeout_seconds + 1
        )
        return info

    def ensure_consumer(self, want: api.ConsumerConfig) -> api.ConsumerInfo:
        """Create the durable if missing; update it in place when only
        updatable fields differ; raise ``ConsumerDrift`` saying what differs
        and what to do when the broker can't change it."""
        info: api.ConsumerInfo = self.connection.call(self.ensure_consumer_async(want), timeout=30)
        return info

    async def ensure_consumer_async(self, want: api.ConsumerConfig) -> api.ConsumerInfo:
        """``ensure_consumer`` on the connection's loop (a pull lane re-ensuring its durable)."""
        stream = conf.settings.STREAM
        try:
            info: api.ConsumerInfo = await self.connection.js.consumer_info(stream, want.durable_name)
        except nats.js.errors.NotFoundError:
            logger.info("durable created consumer=%s filter=%s", want.durable_name, want.filter_subject)
            created: api.ConsumerInfo = await self.connection.js.add_consumer(stream, want)
            return created
        updatable, fixed = consumer_differences(want, info.config)
        if fixed:
            what = "; ".join(f"{k}: broker has {a!r}, this build wants {b!r}" for k, (a, b) in fixed.items())
            raise ConsumerDrift(
                f"durable consumer {want.durable_name!r} on stream {stream!r} differs in fields the broker "
                f"can't update ({what}). Claims are keyed by the subscription's name, so a new name (a new "
                f"durable from the first retained message) runs the handler again for every event the stream "
                f"still holds (up to RETENTION_DAYS). To keep the name, delete the old durable once it is "
                f"drained with `manage.py stream prune --durable {want.durable_name}`: the durable made again "
                "under the same name meets its claims and skips what was handled."
            )
        if updatable:
            logger.info("durable updated consumer=%s changes=%s", want.durable_name, updatable)
            # Where it started is kept: the broker refuses to change a durable's start point.
            kept = replace(want, deliver_policy=info.config.deliver_policy, opt_start_seq=info.config.opt_start_seq)
            updated: api.ConsumerInfo = await self.connection.js.add_consumer(
                stream, kept
            )  # create-or-update, same name
            return updated
        return info

    def consumer_info(self, durable: str) -> api.ConsumerInfo:
        """A durable's info (pending, ack pending, delivered). Raises
        ``ConsumerNotFound`` if it doesn't exist, ``BrokerUnavailable`` when
        NATS fails or doesn't answer in time."""
        try:
            info: api.ConsumerInfo = self.connection.call(
                self.connection.js.consumer_info(conf.settings.STREAM, durable),
                timeout=self.connection.request_timeout_seconds + 1,
            )
        except BrokerUnavailable as exc:  # call() translated nats' error; the original is the cause
            if isinstance(exc.__cause__, nats.js.errors.NotFoundError):
                raise ConsumerNotFound(
                    f"no durable consumer {durable!r} on stream {conf.settings.STREAM!r}: ensure_consumer() creates it"
                ) from exc.__cause__
            raise
        return info

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> list[api.ConsumerInfo | None]:
        """Several durables' info in one round trip through the loop, all
        within ``timeout`` seconds: one per durable, in order, None where it
        failed (missing, or no answer in time). Raises ``BrokerUnavailable``
        when the loop doesn't answer at all."""
        stream = conf.settings.STREAM
        js = self.connection.js
        if js is None:  # a scrape before the worker's first connection
            raise BrokerUnavailable("not connected to NATS yet")

        async def ask() -> list[Any]:
            return await asyncio.wait_for(
                asyncio.gather(*(js.consumer_info(stream, d) for d in durables), return_exceptions=True), timeout
            )

        infos = self.connection.call(ask(), timeout=timeout + 0.5)
        return [None if isinstance(i, BaseException) else i for i in infos]
