"""OpenTelemetry spans for the relay's send and each handler run.

Keeps one trace from the request that published an event to every handler
that ran it: ``publish()`` stores the caller's W3C trace context with the row
(``outbox.events``, with every row it writes), the relay's send is a PRODUCER span per message
and each handler run a CONSUMER span, both children of that context.
Attributes follow OpenTelemetry's messaging semantic conventions (v1.27+,
"Semantic Conventions for Messaging Spans"): ``messaging.system=nats``,
``messaging.destination.name`` (the event name on both sides: the subject,
which carries the tenant, is ``messaging.nats.subject`` on the send),
``messaging.message.id``, ``messaging.operation.type`` (``send`` |
``process``), ``messaging.client.id`` (this process: ``<host>:<pid>``, as
the worker rows name it), ``server.address`` / ``server.port`` (the NATS
server the connection reached, as the broker reports it on each connect:
``broker_connected``), and on a handler run
``messaging.destination.subscription.name`` and
``messaging.consumer.group.name`` (both the subscription: its durable is
the stream's subscription and the group its workers share); each span is
also linked to the creation context (the conventions' link for a batch or
a retry, whose parent may differ), and a failed one carries ``error.type``
(the exception's class path). A ``django.tasks`` task's run also carries
``platformkit.task`` (its dotted path) and ``platformkit.task_priority``.

Without OpenTelemetry installed, or while no tracer provider is configured
(the API's default proxy), these are no-ops: the import is tried once and
cached, and nothing else runs on the hot path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from django_platformkit._process import worker_id

#: Instrumentation scope name of every span this package makes.
TRACER_NAME = "django_platformkit"
MESSAGING_SYSTEM = "nats"

_otel: Any = None  # None: not looked up yet; False: not installed; else the API pieces
_cached: tuple[Any, Any] = (None, None)  # (provider, its tracer)


#: getattr's default when the OpenTelemetry API has no ``_TRACER_PROVIDER``.
_UNKNOWN = object()


#: ``server.address`` / ``server.port`` of the NATS server this process is
#: connected to now ({} until the first connect): the broker sets it.
_server: dict[str, Any] = {}


def broker_connected(host: str | None, port: int | None) -> None:
    """The broker connection reached ``host:port`` (its first connect or a
    reconnect, possibly to another server of a cluster): later spans carry
    them as ``server.address`` and ``server.port``. Never credentials: the
    host and port only."""
    server: dict[str, Any] = {}
    if host:
        server["server.address"] = host
        if port:
            server["server.port"] = int(port)
    global _server
    _server = server


def _common() -> dict[str, Any]:
    """The attributes every span of this process shares now."""
    return {"messaging.system": MESSAGING_SYSTEM, "messaging.client.id": worker_id(), **_server}


def _api() -> Any:
    global _otel
    if _otel is None:
        try:
            from opentelemetry import propagate, trace
            from opentelemetry.trace import Link, ProxyTracerProvider, SpanKind, Status, StatusCode
        except ImportError:  # looked up once: a failed import costs a filesystem walk every time
            _otel = False
        else:
            _otel = SimpleNamespace(
                env_provider="OTEL_PYTHON_TRACER_PROVIDER" in os.environ,
                trace=trace,
                propagate=propagate,
                proxy=ProxyTracerProvider,
                kind=SpanKind,
                status=Status,
                code=StatusCode,
                link=Link,
            )
    return _otel


def _tracer() -> Any:
    """The package's tracer, or None when spans would go nowhere (OpenTelemetry
    missing, or no tracer provider set: ``get_tracer_provider()`` is still the
    API's proxy)."""
    global _cached
    api = _api()
    if not api:
        return None
    # Per handler run: read the API's global (set by set_tracer_provider())
    # first; get_tracer_provider() also looks OTEL_PYTHON_TRACER_PROVIDER up
    # in the environment on every call, for a provider to load lazily.
    # Only while get_tracer_provider is the API's own (a test may replace it).
    provider: Any = _UNKNOWN
    # Compared by module, not by the object first seen: a first call made while a test had
    # replaced it would otherwise take the replacement for the API's own (and trace nothing).
    if getattr(api.trace.get_tracer_provider, "__module__", "") == api.trace.__name__:
        provider = getattr(api.trace, "_TRACER_PROVIDER", _UNKNOWN)
        if provider is None and not api.env_provider:
            return None
    if provider is None or provider is _UNKNOWN:
        provider = api.trace.get_tracer_provider()
    if isinstance(provider, (api.proxy, api.trace.NoOpTracerProvider)):
        return None
    if _cached[0] is not provider:  # one tracer per provider, not one per handler run
        _cached = (provider, provider.get_tracer(TRACER_NAME))
    return _cached[1]


def enabled() -> bool:
    """Whether spans are recorded now (OpenTelemetry installed and a tracer provider set)."""
    return _tracer() is not None


def _parent(api: Any, traceparent: Any, tracestate: Any) -> Any:
    carrier = {}
    if isinstance(traceparent, str) and traceparent:
        carrier["traceparent"] = traceparent
        if isinstance(tracestate, str) and tracestate:
            carrier["tracestate"] = tracestate
    # No traceparent: an empty carrier extracts to an empty context, so the
    # span starts a trace of its own rather than joining whatever is current.
    return api.propagate.extract(carrier)


def _creation_links(api: Any, parent: Any) -> list[Any]:
    """A link to the creation context (the publisher's span), when there is one."""
    span_context = api.trace.get_current_span(parent).get_span_context()
    return [api.link(span_context)] if span_context.is_valid else []


def error_type(exc: BaseException) -> str:
    """``error.type`` of a failed span: the exception's class path (``builtins.ValueError``)."""
    kind = type(exc)
    return f"{kind.__module__}.{kind.__qualname__}"


@contextlib.contextmanager
def consumer_span(
    *,
    subscription: str,
    event_id: Any,
    name: str,
    headers: Mapping[str, str],
    attempt: int,
    task: str = "",
    task_priority: int | None = None,
) -> Iterator[Any]:
    """Wrap one handler run: a CONSUMER span ``process <event name>`` whose
    parent is the publisher's context (``traceparent``/``tracestate`` in
    ``headers``), current while the handler runs (spans the handler starts
    are its children). Attributes: the messaging ones above (the
    subscription as ``messaging.destination.subscription.name`` and
    ``messaging.consumer.group.name``), ``platformkit.attempt`` (int,
    1-based), and for a ``django.tasks`` task ``platformkit.task`` (its
    dotted path) and ``platformkit.task_priority`` (int, -100..100). Linked to the creation
    context too. Yields the span, or None when tracing is off. An exception
    leaving the block is recorded on the span (``record_exception``, status
    ERROR, ``error.type``) and re-raised unchanged."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    api = _otel
    attributes = {
        **_common(),
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": name,
        "messaging.message.id": str(event_id),
        "messaging.destination.subscription.name": subscription,
        "messaging.consumer.group.name": subscription,
        "platformkit.attempt": int(attempt),
    }
    if task:
        attributes["platformkit.task"] = task
        attributes["platformkit.task_priority"] = task_priority if isinstance(task_priority, int) else 0
    parent = _parent(api, headers.get("traceparent"), headers.get("tracestate"))
    with tracer.start_as_current_span(
        f"process {name}",
        context=parent,
        kind=api.kind.CONSUMER,
        attributes=attributes,
        links=_creation_links(api, parent),
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        try:
            yield span
        except BaseException as exc:
            span.set_attribute("error.type", error_type(exc))
            raise


class _ProducerSpans:
    """The PRODUCER spans of one relay batch, started when made, ended on
    ``__exit__`` (after the broker's acks and the stamp); an exception
    leaving the block is recorded on each of them."""

    def __init__(self, spans: list[Any]) -> None:
        self.spans = spans

    def __enter__(self) -> _ProducerSpans:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        api = _otel
        for span in self.spans:
            if exc is not None:
                span.record_exception(exc)
                span.set_attribute("error.type", error_type(exc))
                span.set_status(api.status(api.code.ERROR, f"{type(exc).__name__}: {exc}"))
            span.end()


_NO_SPANS = contextlib.nullcontext()


def producer_spans(
    messages: Sequence[Any], events: Iterable[tuple[Any, str, Any, Any]]
) -> contextlib.AbstractContextManager[Any]:
    """Start one PRODUCER span ``send <event name>`` per relayed message.

    ``messages``: the batch's ``OutgoingMessage`` objects (``subject``,
    ``msg_id``). ``events``: one ``(event_id, name, traceparent, tracestate)``
    per message, in the same order - only iterated when tracing is on, so
    the relay can pass a generator and pay nothing otherwise. Each span's
    parent is the publisher's context; attributes: the messaging ones,
    ``messaging.destination.name`` being the NATS subject,
    ``messaging.message.id`` the event id (``Nats-Msg-Id`` differs on a
    replay and is kept as ``platformkit.nats_msg_id``), the destination the
    event name, as the consumer's (the subject is ``messaging.nats.subject``),
    and a link to the creation context. Returns a context manager that ends them."""
    tracer = _tracer()
    if tracer is None:
        return _NO_SPANS
    api = _otel
    spans = []
    common = _common()
    for message, (event_id, name, traceparent, tracestate) in zip(messages, events, strict=True):
        parent = _parent(api, traceparent, tracestate)
        spans.append(
            tracer.start_span(
                f"send {name}",
                context=parent,
                kind=api.kind.PRODUCER,
                links=_creation_links(api, parent),
                attributes={
                    **common,
                    "messaging.operation.type": "send",
                    "messaging.operation.name": "send",
                    "messaging.destination.name": name,
                    "messaging.nats.subject": message.subject,
                    "messaging.message.id": str(event_id),
                    "messaging.message.body.size": len(message.body),
                    "platformkit.nats_msg_id": message.msg_id,
                },
            )
        )
    return _ProducerSpans(spans)
