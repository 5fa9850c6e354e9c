"""The event catalogue as an AsyncAPI 3.0 document.

Channels are the subjects (``<SUBJECT_PREFIX>.{tenant}.<module>.<event>``),
messages the CloudEvents envelope around each event's JSON Schema, operations
``publish()`` (send) and the subscriptions (receive). The django.tasks queues
of ``OutboxBackend`` are channels too (``platformkit.task_<queue>``, whose data
is the task ``enqueue()`` wrote), so the document names every subject the
worker consumes. The output depends only on the catalogue, the subscriptions
and the settings, never on the clock or dict order, so it can be committed
and diffed in CI.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from django_platformkit import conf
from django_platformkit.names import TENANT
from django_platformkit.outbox.events import EventType, catalogue
from django_platformkit.tasks.queues import configured_queues, queue_of, split_task_name
from django_platformkit.wire import NO_TENANT, subject_for

#: AsyncAPI 3.0.0, https://www.asyncapi.com/docs/reference/specification/v3.0.0
ASYNCAPI_VERSION = "3.0.0"
#: CloudEvents 1.0 structured content mode, JSON event format (spec section 3.1).
CONTENT_TYPE = "application/cloudevents+json"
ENVELOPE_SCHEMA = "CloudEvent"
#: The ``data`` of a django.tasks queue's events, shared by every queue.
TASK_SCHEMA = "DjangoTask"

_ENVELOPE: dict[str, Any] = {
    "type": "object",
    "description": "CloudEvents 1.0 envelope, structured JSON mode, as the relay sends it.",
    "required": ["specversion", "id", "source", "type", "subject", "time", "datacontenttype", "data"],
    "properties": {
        "specversion": {"const": "1.0"},
        "id": {
            "type": "string",
            "format": "uuid",
            "description": "The event id: outbox id, Nats-Msg-Id and claim key.",
        },
        "source": {"type": "string", "description": "'/<module>' of the event name."},
        "type": {"type": "string", "description": "The event name, '<module>.<event>'."},
        "subject": {"type": "string", "description": "The NATS subject the event travels on."},
        "time": {"type": "string", "format": "date-time", "description": "When the outbox row was written (UTC)."},
        "datacontenttype": {"const": "application/json"},
        "tenantid": {"type": "string", "pattern": TENANT.pattern, "description": "The tenant; absent for none."},
        "traceparent": {"type": "string", "description": "W3C trace context of the publisher, when it had one."},
        "tracestate": {"type": "string"},
        "data": {"type": "object", "description": "The payload passed to publish()."},
    },
}
_HEADERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "Nats-Msg-Id": {
            "type": "string",
            "description": "The event id (a re-send - replay, republish, reconciliation - '<id>:replay:<n>'): JetStream drops duplicates within the window.",
        },
        "Platformkit-Subscriptions": {
            "type": "string",
            "description": "Only on a reconciliation's re-send: the subscriptions (comma-separated) the broker lost the event for. Any other consumer has had it already: it may ack it unhandled (the CloudEvents id is the event's own).",
        },
    },
}

#: What ``OutboxBackend.enqueue()`` writes as the payload (``tasks/backend.py``),
#: and ``tasks.runner.run_task`` reads.
_TASK: dict[str, Any] = {
    "type": "object",
    "description": "A django.tasks task as OutboxBackend.enqueue() wrote it; its queue's subscription runs it.",
    "required": ["task", "args", "kwargs", "backend"],
    "additionalProperties": False,
    "properties": {
        "task": {"type": "string", "description": "The task function's dotted path (Task.module_path)."},
        "args": {
            "type": "array",
            "description": "Positional arguments, JSON as django.utils.json.normalize_json leaves them.",
        },
        "kwargs": {"type": "object", "description": "Keyword arguments, JSON as for args."},
        "backend": {"type": "string", "description": "The TASKS alias that enqueued it (its results are read there)."},
        "priority": {
            "type": "integer",
            "minimum": -100,
            "maximum": 100,
            "description": "Task.priority as enqueued, when not 0 (absent: 0); its band is the channel.",
        },
    },
}


def _rewrite_refs(schema: Any, base: str) -> Any:
    """Point local ``$ref``s (``#/$defs/x``) at the schema's new home under
    ``components/schemas``; without this they would resolve against the
    AsyncAPI document's root and break."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rewrite_refs(value, base)
        return out
    if isinstance(schema, list):
        return [_rewrite_refs(item, base) for item in schema]
    return schema


def _data_schema(event: EventType) -> dict[str, Any]:
    if event.schema is None:
        return {"type": "object"}
    schema = copy.deepcopy(dict(event.schema))
    if "$id" in schema:  # its refs resolve against its own $id: leave them
        return schema
    rewritten: dict[str, Any] = _rewrite_refs(schema, f"#/components/schemas/{event.name}")
    return rewritten


def document(*, title: str = "Event catalogue", version: str = "1.0.0") -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every declared event and subscription,
    as a dict, and of every django.tasks queue an ``OutboxBackend`` in
    ``TASKS`` serves (none on Django 5.2, which has no ``django.tasks``). A
    subscription to an undeclared event (``platformkit.E001``) is left out:
    it has no channel to point at."""
    settings = conf.settings
    # A task event is described while TASKS configures its queue: one left
    # in the catalogue by an earlier TASKS setting is no channel any more.
    queues = configured_queues()
    events = {name: event for name, event in catalogue().items() if queue_of(name) in (None, *queues)}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    schemas: dict[str, Any] = {ENVELOPE_SCHEMA: _ENVELOPE}
    for name, event in sorted(events.items()):
        queue = queue_of(name)
        message_ref = {"$ref": f"#/channels/{name}/messages/{name}"}
        channel: dict[str, Any] = {
            "address": subject_for(name, "{tenant}"),
            "messages": {name: {"$ref": f"#/components/messages/{name}"}},
            "parameters": {
                "tenant": {"description": f"The tenant token ([A-Za-z0-9_-]{{1,64}}), or '{NO_TENANT}' for none."},
            },
        }
        if queue is None:
            data_ref = f"#/components/schemas/{name}"
            schemas[name] = _data_schema(event)
            about = event.description
            send = "publish() writes it to the outbox in the caller's transaction; the relay sends it."
        else:
            # One schema for every queue: enqueue() writes the same shape to each.
            data_ref = f"#/components/schemas/{TASK_SCHEMA}"
            schemas[TASK_SCHEMA] = _TASK
            backends = ", ".join(repr(alias) for alias in sorted(queues[queue]))
            # The trust model, said where another team reads it: the worker
            # runs only tasks its own outbox holds (tasks aren't `external`).
            about = (
                f"The django.tasks queue {queue!r} of TASKS {backends} (OutboxBackend): this project's own "
                f"work, run by its worker (runworker --queue {queue}). Not for other services: a message "
                "that this project's outbox doesn't hold is recorded as malformed and never run."
            )
            send = (
                "Task.enqueue() on OutboxBackend writes it to the outbox in the caller's transaction "
                "(outside atomic(): on its own); the relay sends it, not before its run_after."
            )
            channel["x-platformkit-task-queue"] = queue
            split = split_task_name(name)
            assert split is not None  # queue_of(name) said it is a task's
            band = split[1]
            channel["x-platformkit-task-priority"] = {"minimum": band.lowest, "maximum": band.highest}
            priorities = str(band.lowest) if band.lowest == band.highest else f"{band.lowest}..{band.highest}"
            about += (
                f" This channel carries its tasks of priority {priorities}: a worker starts a "
                "higher band's waiting tasks first."
            )
        message: dict[str, Any] = {
            "name": name,
            "title": name,
            "contentType": CONTENT_TYPE,
            "headers": _HEADERS,
            "payload": {
                "allOf": [
                    {"$ref": f"#/components/schemas/{ENVELOPE_SCHEMA}"},
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": name},
                            "source": {"const": f"/{event.module}"},
                            "data": {"$ref": data_ref},
                        },
                    },
                ],
            },
        }
        if about:
            channel["description"] = about
        if event.description:
            message["summary"] = event.description
        if event.declared_in:
            message["x-platformkit-declared-in"] = event.declared_in
        channels[name] = channel
        messages[name] = message
        operations[f"send.{name}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{name}"},
            "messages": [message_ref],
            "summary": send,
        }
    from django_platformkit.consume.subscriptions import subscriptions

    for sub in subscriptions():
        if sub.event not in events:
            continue
        operations[f"receive.{sub.name}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{sub.event}"},
            "messages": [{"$ref": f"#/channels/{sub.event}/messages/{sub.event}"}],
            "summary": f"Subscription {sub.name}: {sub.declared_in}, once per event.",
            "x-platformkit-durable": sub.durable,
            "x-platformkit-filter-subject": sub.filter_subject,
            "x-platformkit-max-attempts": sub.max_attempts,
            "x-platformkit-backoff-seconds": list(sub.backoff_seconds),
        }
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": (
                f"Events published through django_platformkit: CloudEvents 1.0 (structured JSON) on the "
                f"NATS JetStream stream {settings.STREAM}, subjects '{settings.SUBJECT_PREFIX}.<tenant or {NO_TENANT}>.<module>.<event>'."
            ),
        },
        "defaultContentType": CONTENT_TYPE,
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def render(doc: dict[str, Any], *, fmt: str = "json") -> str:
    """``doc`` as text: JSON (2-space indent, sorted keys, trailing newline)
    or YAML (needs PyYAML). Raises ``ImportError`` for YAML without PyYAML."""
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(doc, sort_keys=True, allow_unicode=True, default_flow_style=False)
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
