"""OpenTelemetry (django_platformkit.tracing) with the SDK's in-memory
exporter: one publish -> one producer span at the relay's send and one
consumer span per subscription, all in the publisher's trace; real
PostgreSQL and NATS in between."""

import pytest
from django.db import transaction
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from django_platformkit import publish, tracing
from django_platformkit.consume.subscriptions import subscriptions

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def spans(monkeypatch):
    """An SDK tracer provider exporting to memory, in force for this test
    only: OpenTelemetry lets a process set its global provider once, so the
    lookup is patched instead, and every later test runs untraced again."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    yield exporter
    provider.shutdown()


def subs(*names):
    return [s for s in subscriptions() if s.name in names]


def test_one_publish_gives_one_producer_span_and_one_consumer_span_per_subscription_in_the_publishers_trace(
    spans, run_worker
):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request, transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    run_worker(subscriptions=subs("testapp.record_order", "testapp.count_order"))

    finished = spans.get_finished_spans()
    trace_id = request.get_span_context().trace_id
    producers = [s for s in finished if s.kind is SpanKind.PRODUCER]
    consumers = [s for s in finished if s.kind is SpanKind.CONSUMER]
    assert len(producers) == 1
    assert len(consumers) == 2
    for span in producers + consumers:
        assert span.context.trace_id == trace_id, span.name
        assert span.parent.span_id == request.get_span_context().span_id, span.name
        assert span.attributes["messaging.system"] == "nats"
        assert span.attributes["messaging.message.id"] == str(event_id)
    (producer,) = producers
    assert producer.name == "send testapp.order_placed"
    assert producer.attributes["messaging.operation.type"] == "send"
    assert producer.attributes["messaging.nats.subject"].endswith("._.testapp.order_placed")
    # One destination name on both sides: the event's.
    assert {s.attributes["messaging.destination.name"] for s in producers + consumers} == {"testapp.order_placed"}
    for span in producers + consumers:  # linked to the creation context as well as its child
        assert [link.context.span_id for link in span.links] == [request.get_span_context().span_id]
    assert {c.attributes["messaging.consumer.group.name"] for c in consumers} == {
        "testapp.record_order",
        "testapp.count_order",
    }
    for consumer in consumers:
        assert consumer.name == "process testapp.order_placed"
        assert consumer.attributes["messaging.operation.type"] == "process"
        assert consumer.status.status_code is not StatusCode.ERROR
        # The messaging conventions' subscription: the durable's, as the consumer group.
        name = consumer.attributes["messaging.consumer.group.name"]
        assert consumer.attributes["messaging.destination.subscription.name"] == name
        assert "platformkit.task" not in consumer.attributes


def test_every_span_names_the_nats_server_it_talked_to_and_this_process_as_the_client(spans, run_worker, settings):
    from urllib.parse import urlsplit

    from django_platformkit._process import worker_id

    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
    run_worker(subscriptions=subs("testapp.record_order"))
    server = urlsplit(settings.PLATFORMKIT["NATS_URL"].split(",")[0])
    tracing.broker_connected(server.hostname, server.port or 4222)  # as the relay's connection says it
    from django_platformkit.wire import compose

    message = compose(
        settings.PLATFORMKIT["SUBJECT_PREFIX"],
        "e1",
        "testapp.order_placed",
        None,
        "{}",
        "2026-01-01T00:00:00Z",
        None,
        None,
        None,
    )
    with tracing.producer_spans([message], [("e1", "testapp.order_placed", None, None)]):
        pass
    finished = spans.get_finished_spans()
    assert {s.kind for s in finished} == {SpanKind.PRODUCER, SpanKind.CONSUMER}
    for span in finished:
        assert span.attributes["server.address"] == server.hostname, span.name
        assert span.attributes["server.port"] == (server.port or 4222), span.name
        assert span.attributes["messaging.client.id"] == worker_id(), span.name


def test_a_django_task_run_names_its_task_and_priority_on_its_span(spans, run_worker, settings):
    pytest.importorskip("django.tasks")
    from django.test import override_settings

    from django_platformkit.consume import subscriptions as registry
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import queue_subscriptions, register_task_queues
    from tests.testapp import tasks

    with override_settings(TASKS={"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend"}}):
        names = register_task_queues()
        try:
            tasks.record.using(priority=30).enqueue("traced", n=1)
            run_worker(subscriptions=queue_subscriptions(["default"]))
        finally:
            for name in names:
                registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)
    (consumer,) = [s for s in spans.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert consumer.attributes["platformkit.task"] == "tests.testapp.tasks.record"
    assert consumer.attributes["platformkit.task_priority"] == 30
    assert consumer.attributes["messaging.destination.subscription.name"] == "platformkit.task_default__high"


def test_a_failing_handler_records_its_error_on_each_attempts_span(spans, run_worker):
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("job") as request, transaction.atomic():
        publish("testapp.flaky", {"always_fail": True})
    run_worker(subscriptions=subs("testapp.flaky"))

    consumers = [s for s in spans.get_finished_spans() if s.kind is SpanKind.CONSUMER]
    assert [c.attributes["platformkit.attempt"] for c in consumers] == [1, 2, 3]  # max_attempts=3
    for consumer in consumers:
        assert consumer.context.trace_id == request.get_span_context().trace_id
        assert consumer.status.status_code is StatusCode.ERROR
        assert consumer.attributes["error.type"] == "builtins.RuntimeError"
        (exception,) = [e for e in consumer.events if e.name == "exception"]
        assert exception.attributes["exception.type"] == "RuntimeError"
        assert "flaky failure on attempt" in exception.attributes["exception.message"]


def test_an_event_published_outside_any_trace_starts_a_trace_of_its_own(spans, run_worker):
    with transaction.atomic():
        publish("testapp.order_placed", {"n": 2})
    run_worker(subscriptions=subs("testapp.record_order"))
    finished = spans.get_finished_spans()
    assert {s.kind for s in finished} == {SpanKind.PRODUCER, SpanKind.CONSUMER}
    assert all(s.parent is None for s in finished)
    assert all(not s.links for s in finished)  # no creation context to link to


def test_without_a_tracer_provider_nothing_is_traced(monkeypatch):
    # The API's proxy provider (what an unconfigured process has) means "off".
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    assert not tracing.enabled()
    with tracing.consumer_span(subscription="s.x", event_id="e", name="a.b", headers={}, attempt=1) as span:
        assert span is None
    assert isinstance(tracing.producer_spans([], iter(())), type(tracing._NO_SPANS))


def test_a_provider_set_through_the_api_turns_tracing_on_and_none_turns_it_off(monkeypatch):
    # What set_tracer_provider() stores (it can be called once per process,
    # so the test sets the API's global itself): enabled() reads it directly.
    provider = TracerProvider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    assert tracing.enabled()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    assert not tracing.enabled()
    provider.shutdown()


def test_without_opentelemetry_installed_the_import_is_tried_once_and_nothing_is_traced(monkeypatch):
    import sys

    attempts = []

    class Refuse:
        """An import hook standing in for an environment without OpenTelemetry."""

        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                attempts.append(name)
                raise ImportError(f"No module named {name!r}")
            return None

    for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    monkeypatch.setattr(tracing, "_otel", None)
    for _ in range(3):
        with tracing.consumer_span(
            subscription="s.x",
            event_id="e",
            name="a.b",
            headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
            attempt=1,
        ) as span:
            assert span is None
        assert not tracing.enabled()
    assert attempts == ["opentelemetry"]  # looked up once, then cached
