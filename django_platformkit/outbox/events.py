"""The event catalogue and ``publish()``.

``publish()`` is one INSERT into the outbox inside the caller's transaction, so
an event exists exactly when the write that caused it commits. Everything that
can go wrong with the input is checked in Python *before* any SQL runs: a bad
call raises and the caller's transaction stays usable. ``write_event()`` is
the same INSERT for another room that checked its own input (a task's
``enqueue()``): the outbox has one write path, this module's.

Why one module: the catalogue and the write path keep one guarantee
together - a row reaches the outbox under a declared name with a payload its
schema accepted, before the one statement runs - and every INSERT into the
outbox is spelled here, beside the checks it relies on.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import ProgrammingError, connections

from django_platformkit import conf, signals
from django_platformkit._ids import uuid7
from django_platformkit._tables import OUTBOX_TABLE
from django_platformkit.exceptions import (
    ConfigurationError,
    InvalidEventName,
    PlatformKitError,
    TransactionRequired,
    UndeclaredEvent,
)
from django_platformkit.names import RESERVED_MODULE, check_event_name, check_tenant, closest_name
from django_platformkit.outbox.payload import encode_payload

if TYPE_CHECKING:
    from datetime import datetime

    from django.db.backends.base.base import BaseDatabaseWrapper
    from jsonschema.protocols import Validator

#: The LISTEN/NOTIFY channel ``publish()`` wakes the relay on.
NOTIFY_CHANNEL = "platformkit_outbox"

# The one INSERT of a single event, for publish() and a task's enqueue():
# ``not_before`` (a task's ``run_after``) is NULL for an event, due at once.
_ONE_SQL = (
    f"INSERT INTO {OUTBOX_TABLE} (id, name, tenant, payload, headers, created_at, not_before) "
    "VALUES (%s, %s, %s, %s::jsonb, %s::jsonb, clock_timestamp(), %s) RETURNING created_at"
)
_ONE_NOTIFY_SQL = f"WITH e AS ({_ONE_SQL}) SELECT e.created_at, pg_notify('{NOTIFY_CHANNEL}', '') FROM e"
# publish_many(): one statement for any number of rows. WITH ORDINALITY keeps
# the caller's order; clock_timestamp() is evaluated per row, in that order.
_MANY_SQL = (
    f"INSERT INTO {OUTBOX_TABLE} (id, name, tenant, payload, headers, created_at) "
    "SELECT u.id, u.name, u.tenant, u.payload::jsonb, u.headers::jsonb, clock_timestamp() "
    "FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[]) "
    "WITH ORDINALITY AS u(id, name, tenant, payload, headers, n) ORDER BY u.n"
)
_MANY_NOTIFY_SQL = f"WITH e AS ({_MANY_SQL} RETURNING 1) SELECT pg_notify('{NOTIFY_CHANNEL}', '') FROM e LIMIT 1"


@dataclass(frozen=True)
class EventType:
    """A declared event (what ``declare()`` returns; ``publish()`` takes it as well as a name).

    Attributes:
        name: ``<module>.<event>``.
        schema: The JSON Schema every payload must satisfy, or None.
        description: What the event means, for the catalogue.
        declared_in: The module that declared it.
    """

    name: str
    schema: Mapping[str, Any] | None = None
    description: str = ""
    declared_in: str = field(default="", compare=False)

    @property
    def module(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def validator(self) -> Validator | None:
        return _validators.get(self.name)

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        return hash(self.name)


_catalogue: dict[str, EventType] = {}
_validators: dict[str, Validator] = {}
_lock = threading.Lock()


def _caller_module(depth: int = 2) -> str:
    import sys

    frame = sys._getframe(depth)
    name: str = frame.f_globals.get("__name__", "?")
    return name


def declare(name: str, *, schema: Mapping[str, Any] | None = None, description: str = "") -> EventType:
    """Add an event to the catalogue.

    Declare events in an app's ``platformkit.py`` (imported at start-up, as
    ``admin.py`` is). Declaring the same name again with the same schema
    returns the same event; with another schema it raises.

    Args:
        name: ``<module>.<event>``, each part ``[a-z][a-z0-9_]*``, exactly
            one dot (``"shop.order_placed"``). The module ``platformkit`` is
            the package's own.
        schema: A JSON Schema (a dict, any draft ``jsonschema`` knows;
            2020-12 when ``$schema`` is absent) every payload must satisfy
            at ``publish()``; None: any JSON object.
        description: What the event means, for the catalogue and the
            AsyncAPI document.

    Returns:
        The declared ``EventType``.

    Raises:
        ConfigurationError: A malformed name, an invalid schema, or the name
            declared again with another schema; the message names the
            declaring module and the fix.
    """
    where = _caller_module()
    try:
        check_event_name(name)
    except InvalidEventName as exc:
        raise ConfigurationError(f"declare() in {where}: {exc}") from None
    if name.startswith(RESERVED_MODULE + ".") and not where.startswith("django_platformkit"):
        raise ConfigurationError(
            f"declare({name!r}) in {where}: the module {RESERVED_MODULE!r} belongs to django_platformkit's "
            "own events; name your event after your app (e.g. 'shop.order_placed')."
        )
    if schema is not None:
        if not isinstance(schema, Mapping):
            raise ConfigurationError(
                f"declare({name!r}) in {where}: schema must be a dict (a JSON Schema), got {type(schema).__name__}."
            )
        validator = _compile_schema(name, schema, where)
    else:
        validator = None
    if not isinstance(description, str):
        raise ConfigurationError(f"declare({name!r}) in {where}: description must be a string.")
    event = EventType(name=name, schema=schema, description=description, declared_in=where)
    with _lock:
        existing = _catalogue.get(name)
        if existing is not None:
            if _canonical(existing.schema) != _canonical(schema):
                raise ConfigurationError(
                    f"event {name!r} is declared twice with different schemas "
                    f"(in {existing.declared_in} and {where}): declare it once and import the EventType."
                )
            return existing
        _catalogue[name] = event
        if validator is not None:
            _validators[name] = validator
    return event


def _canonical(schema: Mapping[str, Any] | None) -> str:
    return json.dumps(schema, sort_keys=True, default=str)


def _compile_schema(name: str, schema: Mapping[str, Any], where: str) -> Validator:
    import jsonschema
    from jsonschema.validators import validator_for

    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(dict(schema))
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ConfigurationError(
            f"declare({name!r}) in {where}: the schema is not valid JSON Schema at {path}: {exc.message}. "
            "Fix the schema (check it with jsonschema's check_schema)."
        ) from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def catalogue() -> dict[str, EventType]:
    """A copy of the catalogue: event name -> ``EventType``."""
    return dict(_catalogue)


def get_event_type(event: str | EventType) -> EventType:
    """Resolve a name or ``EventType`` to the declared ``EventType``.
    Raises ``InvalidEventName`` or ``UndeclaredEvent``."""
    name = event.name if isinstance(event, EventType) else event
    check_event_name(name)
    try:
        return _catalogue[name]
    except KeyError:
        from django.apps import apps

        if not apps.is_installed("django_platformkit"):
            # Then no app's platformkit.py was imported: the declaration may well be there.
            raise UndeclaredEvent(
                f"event {name!r} is not declared, and 'django_platformkit' is not in INSTALLED_APPS, so no "
                "app's platformkit.py was imported: add 'django_platformkit' to INSTALLED_APPS (and run "
                "migrate)."
            ) from None
        suggestion = closest_name(name, _catalogue)
        if suggestion is not None:
            raise UndeclaredEvent(
                f"event {name!r} is not declared: did you mean {suggestion!r}? Else add declare({name!r}) to your "
                "app's platformkit.py."
            ) from None
        raise UndeclaredEvent(
            f"event {name!r} is not declared: add declare({name!r}) to your app's platformkit.py."
        ) from None


# --- publish -----------------------------------------------------------------

#: The event being handled in this thread (set by the consumer), so publish()
#: inside a handler defaults to the handled event's tenant.
current_event: ContextVar[Any] = ContextVar("platformkit_current_event", default=None)

_published = signals.event_published


def announce(event_type: EventType, event_id: uuid.UUID, tenant: str | None, payload_text: str, using: str) -> None:
    """Send ``signals.event_published`` for one outbox row just written (by
    ``publish()``, ``publish_many()`` or ``write_event()``). Callers test
    ``_published.receivers`` first, so nobody listening costs nothing."""
    _published.send_robust(
        sender=event_type,
        event_id=event_id,
        name=event_type.name,
        tenant=tenant,
        payload_text=payload_text,
        using=using,
    )


_propagate: Any = None


def _trace_headers() -> str:
    """The W3C trace context of the current span, if OpenTelemetry is installed."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate
        except ImportError:  # looked up once: a failed import costs a filesystem walk every time
            _propagate = False
        else:
            _propagate = propagate
    if _propagate is False:
        return "{}"
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    if not carrier:
        return "{}"
    return json.dumps({k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")})


def _prepare(event: str | EventType, payload: Any, tenant: Any) -> tuple[EventType, str | None, str]:
    event_type = get_event_type(event)
    if tenant is None:
        handled = current_event.get()
        if handled is not None:
            tenant = handled.tenant
    tenant = check_tenant(tenant)
    text, _ = encode_payload(payload, event_type)
    return event_type, tenant, text


def _connection(using: str | None) -> BaseDatabaseWrapper:
    alias = using or conf.settings.DATABASE_ALIAS
    connection = connections[alias]
    if not connection.in_atomic_block:
        raise TransactionRequired(
            f"publish() must run inside transaction.atomic(using={alias!r}), so the event commits "
            "or rolls back with the write that caused it. Wrap the write and the publish() in one atomic block."
        )
    return connection


def explain_unmigrated(exc: ProgrammingError, alias: str) -> None:
    """Raise a ``ProgrammingError`` that says to migrate if ``exc`` is
    PostgreSQL's ``undefined_table`` (SQLSTATE 42P01) for the outbox;
    return otherwise (the caller re-raises ``exc``). The caller's
    transaction is aborted either way: the statement failed in it."""
    if getattr(exc.__cause__, "sqlstate", None) == "42P01" and OUTBOX_TABLE in str(exc):
        outbox = conf.settings.DATABASE_ALIAS
        if alias != outbox:
            # Migrating there would make publish() work and its rows be lost:
            # the relay reads DATABASE_ALIAS's outbox and no other.
            raise ProgrammingError(
                f"the outbox table {OUTBOX_TABLE} does not exist in database {alias!r}, and it shouldn't: the relay "
                f"sends the rows of one outbox, on PLATFORMKIT['DATABASE_ALIAS'] ({outbox!r}), so a row written to "
                f"{alias!r} would never be sent. Publish inside transaction.atomic(using={outbox!r}) without "
                f"using=, or point DATABASE_ALIAS at {alias!r} and migrate it ({str(exc).splitlines()[0]})"
            ) from exc
        raise ProgrammingError(
            f"the outbox table {OUTBOX_TABLE} does not exist in database {alias!r}: run "
            f"`python manage.py migrate django_platformkit --database {alias}` ({str(exc).splitlines()[0]})"
        ) from exc


def publish(
    event: str | EventType, payload: Mapping[str, Any], *, tenant: str | None = None, using: str | None = None
) -> uuid.UUID:
    """Write one event into the outbox, in the caller's transaction.

    The event exists exactly when the caller's transaction commits: a
    rollback (savepoints included) leaves no row and sends nothing. One round
    trip: the INSERT and the relay's wake-up ``pg_notify`` travel in one
    statement, and PostgreSQL delivers the notification only on commit.
    Every check runs before any SQL, so a refused call leaves the caller's
    transaction usable.

    Args:
        event: A declared event name (``"shop.order_placed"``) or ``EventType``.
        payload: A JSON object (a dict), encoded as ``DjangoJSONEncoder``
            does (datetimes, decimals and UUIDs as strings); checked against
            the event's schema; at most ``MAX_PAYLOAD_BYTES``.
        tenant: ``[A-Za-z0-9_-]{1,64}`` (a UUID fits) or None; inside a
            handler it defaults to the handled event's tenant.
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).

    Returns:
        The event's id (a UUIDv7): the outbox key, the CloudEvents ``id``,
        the ``Nats-Msg-Id`` and the claim key.

    Raises:
        TransactionRequired: Outside ``transaction.atomic(using=using)``.
        UndeclaredEvent: ``event`` is not declared (the message suggests a close name).
        InvalidEventName: A malformed event name or tenant.
        InvalidPayload: Not encodable, NaN or Infinity, a NUL character,
            over ``MAX_PAYLOAD_BYTES`` or failing the schema; the message
            names the JSON path.
        ProgrammingError: From the INSERT, saying to migrate, when the
            outbox table is missing (the caller's transaction is then aborted).
    """
    event_type, tenant, text = _prepare(event, payload, tenant)
    return write_event(event_type, text, tenant=tenant, using=_connection(using).alias).event_id


@dataclass(frozen=True)
class WrittenEvent:
    """One outbox row just written by ``write_event()``.

    Attributes:
        event_id: The row's id (a UUIDv7), as ``publish()`` returns it.
        created_at: The row's ``created_at`` (``clock_timestamp()`` at the INSERT; aware).
    """

    event_id: uuid.UUID
    created_at: datetime


def write_event(
    event: str | EventType,
    payload_text: str,
    *,
    tenant: str | None,
    using: str,
    not_before: datetime | None = None,
) -> WrittenEvent:
    """Write one outbox row whose input the caller has already checked: the
    one write path for a room other than this one (a task's ``enqueue()``).

    ``publish()`` writes through it too: one statement (the relay's wake-up
    ``pg_notify`` included, delivered on commit) with the current trace
    context as its headers, then ``signals.event_published``. It doesn't
    require ``transaction.atomic()``: outside one, the row is an autocommit
    statement of its own; whether that is allowed is the caller's rule.

    Args:
        event: The event's name or ``EventType`` (its name is not checked
            here: the caller's own rules made it, as ``tasks.queues.event_name`` does).
        payload_text: The payload as ``outbox.payload.encode_payload()``
            returned it (a JSON object, within ``MAX_PAYLOAD_BYTES``).
        tenant: A tenant ``names.check_tenant()`` accepted, or None.
        using: The database alias that holds the outbox.
        not_before: The relay sends the row no earlier than this (aware), or None: at once.

    Returns:
        The row's id and ``created_at``.

    Raises:
        ProgrammingError: From the INSERT, saying to migrate, when the
            outbox table is missing (the caller's transaction is then aborted).
    """
    connection = connections[using]
    event_id = uuid7()
    name = event.name if isinstance(event, EventType) else event
    with connection.cursor() as cursor:
        try:
            cursor.execute(
                _ONE_NOTIFY_SQL if conf.settings.RELAY_LISTEN else _ONE_SQL,
                [event_id, name, tenant, payload_text, _trace_headers(), not_before],
            )
        except ProgrammingError as exc:
            explain_unmigrated(exc, using)
            raise
        created_at = cursor.fetchone()[0]
    if _published.receivers:  # one attribute test when nobody listens: publish() stays one INSERT
        event_type = event if isinstance(event, EventType) else get_event_type(event)
        announce(event_type, event_id, tenant, payload_text, using)
    return WrittenEvent(event_id, created_at)


def publish_many(
    event: str | EventType,
    payloads: Iterable[Mapping[str, Any]],
    *,
    tenant: str | None = None,
    using: str | None = None,
) -> list[uuid.UUID]:
    """Write many events of one name in one INSERT, in the caller's transaction.

    The same rules as ``publish()``; every payload is checked before the
    statement runs, so one bad payload writes nothing. The events relay in
    the order of ``payloads``.

    Args:
        event: A declared event name (``"shop.order_placed"``) or ``EventType``.
        payloads: JSON objects (dicts), encoded as ``DjangoJSONEncoder`` does.
        tenant: Every event's tenant (``[A-Za-z0-9_-]{1,64}``) or None;
            inside a handler it defaults to the handled event's tenant.
        using: The database alias holding the outbox (default ``DATABASE_ALIAS``).

    Returns:
        The events' ids (UUIDv7), in the order of ``payloads``.

    Raises:
        TransactionRequired: Outside ``transaction.atomic(using=using)``.
        UndeclaredEvent: ``event`` is not declared.
        InvalidEventName: A malformed event name or tenant.
        InvalidPayload: A payload that can't be stored; the message names
            which one (``publish_many() payload 217: ...``) and its JSON path.
    """
    prepared = []
    for index, payload in enumerate(payloads):
        try:
            prepared.append(_prepare(event, payload, tenant))
        except PlatformKitError as exc:
            # Which of the payloads: the message alone names a path, not an item.
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (f"publish_many() payload {index}: {exc.args[0]}", *exc.args[1:])
            raise
    connection = _connection(using)
    if not prepared:
        return []
    ids = [uuid7() for _ in prepared]
    names, tenants, texts = [e.name for e, _, _ in prepared], [t for _, t, _ in prepared], [p for _, _, p in prepared]
    headers = _trace_headers()  # one call, one trace context: every row's
    with connection.cursor() as cursor:
        try:
            cursor.execute(
                _MANY_NOTIFY_SQL if conf.settings.RELAY_LISTEN else _MANY_SQL,
                [ids, names, tenants, texts, [headers] * len(prepared)],
            )
        except ProgrammingError as exc:
            explain_unmigrated(exc, connection.alias)
            raise
    if _published.receivers:
        for event_id, (event_type, tenant, text) in zip(ids, prepared, strict=True):
            announce(event_type, event_id, tenant, text, connection.alias)
    return ids


#: The payload of the operator verbs' audit events (replay, discard, cancel);
#: ``subscription`` null: every subscription of the event.
_AUDIT_SCHEMA = {
    "type": "object",
    "required": ["event_id", "name", "subscription", "actor", "reason"],
    "properties": {
        "event_id": {"type": "string", "format": "uuid"},
        "name": {"type": "string"},
        "subscription": {"type": ["string", "null"]},
        "actor": {"type": "string", "minLength": 1},
        "reason": {"type": "string", "minLength": 1},
    },
}
EVENT_REPLAYED = declare(
    "platformkit.event_replayed",
    schema=_AUDIT_SCHEMA,
    description="An operator replayed an event: the audit record of replay().",
)
EVENT_DISCARDED = declare(
    "platformkit.event_discarded",
    schema=_AUDIT_SCHEMA,
    description="An operator discarded a dead letter for good: the audit record of discard().",
)
EVENT_CANCELLED = declare(
    "platformkit.event_cancelled",
    schema=_AUDIT_SCHEMA,
    description="An operator cancelled an event before its handler ran: the audit record of cancel().",
)
