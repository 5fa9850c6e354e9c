"""Through real NATS: publish -> relay -> JetStream -> durable consumers ->
every subscription's effect exactly once."""

import json
import uuid

import pytest
from django.db import transaction
from django.db.models import Count

from django_platformkit import publish
from django_platformkit.models import HandledEvent, OutboxEvent
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import subject_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

SUBS = ["testapp.record_order", "testapp.count_order"]


def order_subscriptions():
    from django_platformkit.consume.subscriptions import subscriptions

    return [s for s in subscriptions() if s.name in SUBS]


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_n_events_are_handled_exactly_once_by_every_subscription(run_worker, settings, event_loop):
    """On either event loop: uvloop ("auto", with the speed extra the tests install) and
    the standard library's, which EVENT_LOOP "asyncio" keeps."""
    import asyncio

    import uvloop

    from django_platformkit.broker.transport import Transport

    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, EVENT_LOOP=event_loop)
    transport = Transport()
    loop = transport.connection.ensure_loop()  # the loop the worker's NATS connection will run on
    assert isinstance(loop, uvloop.Loop) == (event_loop == "auto")
    assert isinstance(loop, asyncio.AbstractEventLoop)
    n = 300
    with transaction.atomic():
        ids = {publish("testapp.order_placed", {"n": i}, tenant="acme" if i % 2 else None) for i in range(n)}
    worker = run_worker(subscriptions=order_subscriptions(), transport=transport)
    assert OutboxEvent.objects.pending().count() == 0
    for sub in SUBS:
        effects = Effect.objects.filter(subscription=sub)
        assert effects.count() == n
        assert set(effects.values_list("event_id", flat=True)) == ids
    assert HandledEvent.objects.count() == 2 * n
    assert worker.counts()["handled"] == 2 * n
    # the handler saw its tenant through current_setting('platformkit.tenant')
    seen = dict(Effect.objects.filter(subscription="testapp.count_order").values_list("event_id", "tenant_seen"))
    tenants = dict(OutboxEvent.objects.values_list("id", "tenant"))
    assert all(seen[i] == (tenants[i] or "") for i in ids)


def test_the_message_on_the_wire_is_a_cloudevents_envelope(transport, broker):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"total": "9.99"}, tenant="acme")
    Relay(transport).drain()

    async def read():
        sub = await transport.connection.js.pull_subscribe(
            f"{broker['SUBJECT_PREFIX']}.>", durable=None, stream=broker["STREAM"]
        )
        msgs = await sub.fetch(1, timeout=5)
        return msgs[0]

    msg = transport.connection.call(read(), timeout=10)
    body = json.loads(msg.data)
    assert (
        msg.subject
        == subject_for("testapp.order_placed", "acme")
        == f"{broker['SUBJECT_PREFIX']}.acme.testapp.order_placed"
    )
    assert msg.headers["Nats-Msg-Id"] == str(event_id)
    assert body["specversion"] == "1.0"
    assert body["id"] == str(event_id)
    assert body["source"] == "/testapp"
    assert body["type"] == "testapp.order_placed"
    assert body["datacontenttype"] == "application/json"
    assert body["tenantid"] == "acme"
    assert body["data"] == {"total": "9.99"}
    assert body["time"].endswith("Z")


def test_the_same_message_put_on_the_stream_three_more_times_is_handled_once(transport, run_worker):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    Relay(transport).drain()
    row = OutboxEvent.objects.get()
    from django_platformkit.wire import envelope

    with __import__("django.db").db.connection.cursor() as cursor:
        cursor.execute("SELECT id, name, tenant, payload::text, headers, created_at FROM platformkit_outbox")
        message = envelope(*cursor.fetchone())
    for _ in range(3):
        ack = transport.publish_raw(message.subject, message.body, headers={"Nats-Msg-Id": str(uuid.uuid4())})
        assert not ack.duplicate
    run_worker(subscriptions=order_subscriptions())
    assert row.id == event_id
    counts = dict(Effect.objects.values("subscription").annotate(n=Count("id")).values_list("subscription", "n"))
    assert counts == {"testapp.record_order": 1, "testapp.count_order": 1}


def test_a_crash_between_broker_and_stamp_re_sends_deduplicated_and_handles_once(transport, run_worker, broker):
    from django.db import connection

    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(20)]
    # Make the stamp fail, as a crash right after the broker acked would.
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION pk_fail_stamp() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'crash before stamp'; END $$;"
            "CREATE TRIGGER pk_fail_stamp BEFORE UPDATE ON platformkit_outbox FOR EACH ROW EXECUTE FUNCTION pk_fail_stamp();"
        )
    try:
        with pytest.raises(Exception, match="crash before stamp"):
            Relay(transport).relay_batch()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER pk_fail_stamp ON platformkit_outbox; DROP FUNCTION pk_fail_stamp();")
    assert OutboxEvent.objects.pending().count() == 20
    assert transport.stream_info().state.messages == 20
    stats = Relay(transport).drain()
    assert stats.stored == 20 and stats.duplicates == 20
    assert transport.stream_info().state.messages == 20
    run_worker(subscriptions=order_subscriptions())
    for sub in SUBS:
        assert sorted(Effect.objects.filter(subscription=sub).values_list("event_id", flat=True)) == sorted(ids)


def test_a_row_that_commits_late_still_goes_out(transport):
    """No 'last id seen' cursor: an older row committed after newer ones relayed is relayed too."""
    import threading

    from django.db import connections

    started, release = threading.Event(), threading.Event()
    late = {}

    def slow_writer():
        try:
            with transaction.atomic():
                late["id"] = publish("testapp.order_placed", {"late": True})
                started.set()
                release.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=slow_writer)
    thread.start()
    started.wait(10)
    with transaction.atomic():
        publish("testapp.order_placed", {"late": False})
    assert Relay(transport).drain().stored == 1
    release.set()
    thread.join()
    assert Relay(transport).drain().stored == 1
    assert OutboxEvent.objects.pending().count() == 0


def test_more_subscriptions_than_consumer_threads_are_all_served(run_worker, settings, broker):
    from django_platformkit.consume.subscriptions import Subscription

    settings.PLATFORMKIT = dict(broker, CONSUMER_THREADS=2)
    seen = {f"testapp.many_{i}": [] for i in range(5)}
    subs = [
        Subscription(name=name, event="testapp.order_placed", handler=lambda e, name=name: seen[name].append(e.id))
        for name in seen
    ]
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(20)]
    worker = run_worker(subscriptions=subs)
    assert {t.name for t in worker.threads.started if t.name.startswith("platformkit-consumer")} == {
        "platformkit-consumer-0",
        "platformkit-consumer-1",
    }
    assert all(sorted(v) == sorted(ids) for v in seen.values())


def test_a_worker_keeps_its_connection_at_the_default_conn_max_age(run_worker, settings):
    """CONN_MAX_AGE = 0 means 'close after each request' to Django; a worker
    is one long request, and must not reconnect per event."""
    from django.db import connections

    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.consume.subscriptions import subscriptions

    assert connections["default"].settings_dict["CONN_MAX_AGE"] == 0
    with transaction.atomic():
        for i in range(30):
            publish("testapp.order_placed", {"n": i})
    from django_platformkit.broker.transport import Transport

    t = Transport()
    t.connect()
    t.ensure_stream()
    try:
        Relay(t).drain()
        consumer = Consumer(next(s for s in subscriptions() if s.name == "testapp.record_order"), t)
        consumer.ensure()
        backends = set()
        original = consumer.transaction.execute

        def run(unit, **kwargs):
            result = original(unit, **kwargs)
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                backends.add(cursor.fetchone()[0])
            return result

        consumer.transaction.execute = run
        while consumer.counts["handled"] < 30:
            consumer.poll(batch=5, timeout=1)  # several units, each its own transaction
    finally:
        t.close()
    assert len(backends) == 1
