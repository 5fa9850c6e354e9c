"""The wire format, defined once and pure (no ``nats`` import, no database):
the subject scheme, durable names, message ids, the CloudEvents envelope
(encode and decode) and the values that cross between the relay, the
transport and the consumer. The envelope, subjects and stream are the Go
platformkit's too, so services written with either share a broker; a web
process that publishes, and ``django.setup()``, never import the broker client.
"""

from __future__ import annotations

import enum
import functools
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django_platformkit import conf
from django_platformkit.exceptions import InvalidEventName
from django_platformkit.names import check_event_name, check_tenant

#: Bytes the CloudEvents envelope and headers add around a payload, at most.
ENVELOPE_OVERHEAD_BYTES = 4096
#: PostgreSQL prints jsonb with a space after each ``,`` and ``:``; the relay
#: sends that text as is, so a compact payload can grow by at most half.
JSONB_TEXT_GROWTH = 1.5
#: The tenant token of an event without a tenant, in its subject.
NO_TENANT = "_"


# --- the wire scheme, defined once ------------------------------------------


def subject_for(event_name: str, tenant: str | None, *, prefix: str | None = None) -> str:
    """``<SUBJECT_PREFIX>.<tenant or _>.<module>.<event>``: a tenant's backlog
    is an address. ``prefix``: the subject prefix, when the caller already
    read it (default ``SUBJECT_PREFIX``)."""
    return f"{conf.settings.SUBJECT_PREFIX if prefix is None else prefix}.{tenant or NO_TENANT}.{event_name}"


def filter_subject_for(event_name: str) -> str:
    """The subjects one event travels on, across every tenant."""
    return f"{conf.settings.SUBJECT_PREFIX}.*.{event_name}"


def parse_subject(subject: str) -> tuple[str | None, str] | None:
    """``(tenant or None, event name)`` of one of our subjects, or None."""
    prefix = conf.settings.SUBJECT_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    parts = subject[len(prefix) :].split(".")
    if len(parts) != 3:
        return None
    tenant, module, event = parts
    return (None if tenant == NO_TENANT else tenant), f"{module}.{event}"


#: ``platformkit.task_<queue>``: the event (and subscription) of a ``django.tasks`` queue.
TASK_EVENT_PREFIX = "platformkit.task_"


def task_path(name: str, payload: Mapping[str, Any]) -> str:
    """The dotted path of the ``django.tasks`` task an event carries
    (``payload["task"]`` of a ``platformkit.task_<queue>`` event), else ""
    - the ``task`` label of the metrics, log lines and spans."""
    if not name.startswith(TASK_EVENT_PREFIX):
        return ""
    path = payload.get("task")
    return path if isinstance(path, str) else ""


def durable_name(subscription_name: str) -> str:
    """The durable consumer of a subscription: its name with ``.`` -> ``-``
    (subscription names contain no ``-``, so this is one-to-one)."""
    return subscription_name.replace(".", "-")


#: The header of a targeted re-send (``operate.reconcile``): the names of the
#: subscriptions it is for, comma-separated (a subscription name has no comma).
#: Every other subscription of its event acks it without running or counting
#: it: JetStream 2.9 gives a durable one filter subject, so a message can't be
#: addressed to one durable by its subject.
TARGET_HEADER = "Platformkit-Subscriptions"


def meant_for(headers: Mapping[str, str], subscription: str) -> bool:
    """Whether a message with ``headers`` is for ``subscription``: every
    message is, but a targeted re-send (``TARGET_HEADER``) only for the
    subscriptions it names."""
    targets = headers.get(TARGET_HEADER)
    return targets is None or subscription in targets.split(",")


def message_id(event_id: str, replay: Any) -> str:
    """The ``Nats-Msg-Id`` of a row: the event id, or a fresh one per replay
    or republish (``replay``: the row's ``platformkit_replay`` count, which
    both bump; the broker would drop a re-send of the old id within its
    duplicate window)."""
    return event_id if not replay else f"{event_id}:replay:{replay}"


# --- values crossing between the relay, the transport and the consumer ---------


@dataclass(frozen=True)
class OutgoingMessage:
    """One outbox row on its way out: subject, CloudEvents body, the
    ``Nats-Msg-Id`` the broker deduplicates re-sends on, and - a targeted
    re-send only - the subscriptions it is for (``TARGET_HEADER``)."""

    subject: str
    body: bytes
    msg_id: str
    targets: tuple[str, ...] = ()

    def headers(self) -> dict[str, str]:
        """The NATS headers it is sent with."""
        if self.targets:
            return {"Nats-Msg-Id": self.msg_id, TARGET_HEADER: ",".join(self.targets)}
        return {"Nats-Msg-Id": self.msg_id}


class PublishOutcome(enum.StrEnum):
    """How the stream answered one publish: what the relay does with the row."""

    #: Acked by the stream (a duplicate counts: it is there): the row is stamped.
    STORED = "stored"
    #: Try again later (a timeout, no responders, a lost connection): the row stays pending.
    TEMPORARY = "temporary"
    #: Will never be accepted as it is: the relay dead-letters the row.
    PERMANENT = "permanent"


class HandlingOutcome(enum.StrEnum):
    """What became of one delivery in the consumer (``Consumer.handle()``),
    and the ``outcome`` of ``event_handled`` and ``platformkit_handled_total``."""

    #: The handler ran and committed with its claim; acked.
    HANDLED = "handled"
    #: A claim existed (handled before, or by another worker); acked, the handler not run.
    SKIPPED = "skipped"
    #: The handler failed; naked with its backoff, to run again.
    RETRIED = "retried"
    #: The handler failed its last attempt; a dead letter and a terminal claim were written, the message termed.
    DEAD_LETTERED = "dead_lettered"
    #: An operator cancelled it before it ran (``cancel()``): a terminal claim; acked, the handler not run.
    CANCELLED = "cancelled"
    #: Not a message this subscription can run (undecodable, or not in this project's outbox); recorded, termed.
    MALFORMED = "malformed"
    #: The database was gone: not settled, the broker redelivers it after the ack wait.
    UNACKED = "unacked"
    #: The worker is stopping: naked at once, not counted as an attempt.
    HANDED_BACK = "handed_back"
    #: A targeted re-send for other subscriptions of its event (reconciliation): acked, not run, not counted.
    ELSEWHERE = "elsewhere"
    #: Inside a unit only: the handler raised (settled as RETRIED or DEAD_LETTERED).
    FAILED = "failed"
    #: Inside a unit only: the claim found no outbox row (settled as MALFORMED).
    NOT_IN_OUTBOX = "not_in_outbox"


class JobOutcome(enum.StrEnum):
    """How a periodic job's run ended (``job_finished`` and ``platformkit_job_runs_total``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


class AttemptOutcome(enum.StrEnum):
    """A recorded run's ``outcome`` (``platformkit_attempts``, DESIGN.md "Attempts")."""

    #: Started, no outcome yet: counts (the worker died or hung in it, or is still in it).
    RUNNING = "running"
    #: The handler raised: counts.
    FAILED = "failed"
    #: The run committed.
    HANDLED = "handled"
    #: Cut short through no fault of the handler (a stopping worker, an outage): does not count.
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class PublishResult:
    """One message's publish answer: its ``PublishOutcome``, the broker's ``error``
    text, whether the stream had it already (``duplicate``, from the
    Nats-Msg-Id window), its stream sequence ``seq``, and ``no_stream`` when
    no stream answered at all."""

    outcome: PublishOutcome
    error: str = ""
    duplicate: bool = False
    seq: int | None = None
    no_stream: bool = False  # no stream answered: the broker may have lost it


@dataclass
class Delivery:
    """A JetStream message as the consumer sees it. ``attempt`` is the
    broker's delivery count, so it survives worker restarts."""

    subject: str
    data: bytes
    headers: dict[str, str]
    attempt: int
    stream_seq: int
    msg: Any = field(repr=False)


@dataclass(frozen=True)
class ReceivedEvent:
    """What a handler receives.

    Attributes:
        id: The event id: the outbox id, the CloudEvents ``id`` and the claim key.
        name: The event name (``"shop.order_placed"``).
        tenant: The tenant token, or None.
        payload: The JSON object published, as the outbox holds it.
        occurred_at: When the outbox row was inserted (aware, the database's clock).
        attempt: 1-based: how many times the handler has started for this
            (subscription, event), this run included. Hand-backs, outages and
            deliveries that never reached the handler don't count (DESIGN.md
            "Attempts").
        headers: The message headers (``traceparent``/``tracestate`` when
            the publisher had a trace).
    """

    id: uuid.UUID
    name: str
    tenant: str | None
    payload: dict[str, Any]
    occurred_at: datetime
    attempt: int
    headers: Mapping[str, str] = field(default_factory=dict)


# --- the CloudEvents envelope: encode -----------------------------------------


def envelope(
    event_id: uuid.UUID,
    name: str,
    tenant: str | None,
    payload_text: str,
    headers: dict[str, Any] | str | None,
    created_at: datetime,
) -> OutgoingMessage:
    """The CloudEvents 1.0 structured-mode message of one outbox row.

    Attributes per the CloudEvents spec (v1.0.2, "Required/Optional
    Attributes"): ``specversion``, ``id``, ``source`` (``/<module>``),
    ``type`` (the event name), ``subject`` (the NATS subject), ``time`` (RFC
    3339, UTC), ``datacontenttype``, ``data``; the ``tenantid`` extension, and
    ``traceparent``/``tracestate`` (the Distributed Tracing extension) when
    the publisher had a trace. The payload text from PostgreSQL is spliced in
    as it is, so it is never decoded and re-encoded on the hot path.
    """
    # Django's cursor hands jsonb back as text.
    fields: dict[str, Any] = (json.loads(headers) if isinstance(headers, str) else headers) or {}
    return compose(
        conf.settings.SUBJECT_PREFIX,
        str(event_id),
        name,
        tenant,
        payload_text,
        created_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        fields.get("traceparent"),
        fields.get("tracestate"),
        fields.get("platformkit_replay"),
    )


# (subject prefix, name, tenant) -> (subject, the attributes after "id", the
# attributes after "time"): the parts of an envelope that never change for
# one kind of event. Bounded: cleared when it outgrows _STATIC_LIMIT.
_static: dict[tuple[str, str, str | None], tuple[str, str, str]] = {}
_STATIC_LIMIT = 10_000


def _static_parts(prefix: str, name: str, tenant: str | None) -> tuple[str, str, str]:
    key = (prefix, name, tenant)
    parts = _static.get(key)
    if parts is None:
        subject = subject_for(name, tenant, prefix=prefix)
        middle = _json({"source": "/" + name.split(".", 1)[0], "type": name, "subject": subject})[1:-1]
        after_time = {"datacontenttype": "application/json"}
        if tenant:
            after_time["tenantid"] = tenant
        if len(_static) >= _STATIC_LIMIT:
            _static.clear()
        parts = _static[key] = (subject, middle, _json(after_time)[1:-1])
    return parts


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def compose(
    prefix: str,
    event_id: str,
    name: str,
    tenant: str | None,
    payload_text: str,
    time_text: str,
    traceparent: str | None,
    tracestate: str | None,
    replay: Any,
) -> OutgoingMessage:
    """``envelope()`` from the row's columns as PostgreSQL formats them (the
    relay's hot path): ``time_text`` is RFC 3339 UTC, ``payload_text`` the
    payload's JSON text, ``replay`` the replay count or None."""
    subject, middle, after_time = _static_parts(prefix, name, tenant)
    trace = ""
    if traceparent:
        trace += ',"traceparent":' + _json(traceparent)
    if tracestate:
        trace += ',"tracestate":' + _json(tracestate)
    body = f'{{"specversion":"1.0","id":"{event_id}",{middle},"time":"{time_text}",{after_time}{trace},"data":{payload_text}}}'
    return OutgoingMessage(subject=subject, body=body.encode("utf-8"), msg_id=message_id(event_id, replay))


# --- the CloudEvents envelope: decode -----------------------------------------


class MalformedMessage(Exception):
    """A message on our subjects that isn't a well-formed event of ours."""


@functools.lru_cache(maxsize=10_000)
def _checked_name_and_tenant(name: str, tenant: str | None) -> str | None:
    """``check_event_name(name)`` and ``check_tenant(tenant)``, remembered for
    the pairs that pass (a refusal raises, and is never cached): per message,
    a cache lookup instead of two regular expressions."""
    check_event_name(name)
    return check_tenant(tenant)


def parse_delivery(delivery: Delivery) -> ReceivedEvent:
    """Decode a CloudEvents structured-mode body and cross-check it with the
    subject. Raises ``MalformedMessage`` saying what is wrong."""
    parsed = parse_subject(delivery.subject)
    if parsed is None:
        raise MalformedMessage(f"subject {delivery.subject!r} is not <prefix>.<tenant>.<module>.<event>")
    subject_tenant, subject_name = parsed
    try:
        body = json.loads(delivery.data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise MalformedMessage("body is not a JSON object (not a CloudEvents envelope)")
    if body.get("specversion") != "1.0":
        raise MalformedMessage(f"specversion is {body.get('specversion')!r}, not '1.0'")
    try:
        event_id = uuid.UUID(str(body.get("id")))
    except ValueError:
        raise MalformedMessage(f"id {body.get('id')!r} is not a UUID") from None
    name = body.get("type")
    tenant = body.get("tenantid")
    try:
        if isinstance(name, str) and (tenant is None or isinstance(tenant, str)):
            tenant = _checked_name_and_tenant(name, tenant)
        else:  # not hashable, or not text: check_event_name says which
            check_event_name(name)
            tenant = check_tenant(tenant)
    except InvalidEventName as exc:
        raise MalformedMessage(str(exc)) from None
    if name != subject_name:
        raise MalformedMessage(f"type {name!r} differs from the subject's event {subject_name!r}")
    if tenant != subject_tenant:
        raise MalformedMessage(
            f"tenantid {tenant!r} differs from the subject's tenant {subject_tenant!r}: refusing to run it in either"
        )
    data = body.get("data")
    if not isinstance(data, dict):
        raise MalformedMessage("data is not a JSON object")
    try:
        occurred_at = datetime.fromisoformat(str(body.get("time")).replace("Z", "+00:00"))
    except ValueError:
        raise MalformedMessage(f"time {body.get('time')!r} is not RFC 3339") from None
    if occurred_at.tzinfo is None:
        raise MalformedMessage("time has no UTC offset")
    headers = {k: v for k, v in delivery.headers.items() if not k.startswith("Nats-") and k != TARGET_HEADER}
    for key in ("traceparent", "tracestate"):
        if isinstance(body.get(key), str):
            headers.setdefault(key, body[key])
    return ReceivedEvent(
        id=event_id,
        name=name,
        tenant=tenant,
        payload=data,
        occurred_at=occurred_at,
        attempt=delivery.attempt,
        headers=headers,
    )
