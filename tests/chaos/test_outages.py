"""The servers go away mid-flow - NATS SIGKILLed and restarted on the same
port and store, every PostgreSQL session terminated - and the relay and
workers ride it out without being restarted by hand: every event reaches
every subscription exactly once."""

from __future__ import annotations

import time

import pytest

from .harness import scaled

# 1200 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]


def test_nats_sigkilled_and_restarted_and_database_sessions_terminated_mid_flow(make_rig, nats_server):
    events = scaled(5_000)
    rig = make_rig("outages", nats_server.url)
    relay = rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for process in [relay, *workers]:
        process.wait_for_log("started")
    writers = rig.writers(2, events, seconds=20)
    plan = [
        (3.0, "nats"),
        (6.0, "db"),
        (9.0, "nats"),
        (12.0, "db"),
        (14.0, "db"),
        (16.0, "nats"),
        (19.0, "db"),
    ]
    begun = time.monotonic()
    for at, what in plan:
        time.sleep(max(0.0, begun + at - time.monotonic()))
        if what == "nats":
            nats_server.kill()
            rig.fault("SIGKILL nats-server")
            time.sleep(2.0)
            nats_server.start()  # same port, same store directory
        else:
            assert rig.terminate_database_sessions() > 0
    rig.wait_for_writers(writers)
    events = rig.tally().events  # a writer whose commit was cut may have written a batch twice: count the outbox
    tally = rig.wait_until_settled(events, timeout=600)
    rig.report(tally)
    survivors = [p.role for p in (relay, *workers) if p.running and p.generation == 1]
    assert survivors == ["relay1", "worker1", "worker2"], rig.logs()
    for process in (relay, *workers):
        code, _ = process.terminate()
        assert code == 0, process.tail()
    rig.assert_exactly_once(tally)


@pytest.mark.django_db(transaction=True)
def test_a_session_terminated_mid_handler_is_retried_without_counting_an_attempt(transport):
    """Leaving the failed atomic block makes Django reconnect at once, so the
    connection looks healthy again afterwards; the attempt must still not
    count (with MAX_ATTEMPTS terminations in a row a healthy event would be
    dead-lettered)."""
    import psycopg
    from django.db import connection, transaction

    from django_platformkit import publish
    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.consume.subscriptions import Subscription
    from django_platformkit.outbox.relay import Relay
    from tests.testapp.models import Effect

    runs = []

    def handler(event):
        runs.append(event.attempt)
        if len(runs) == 1:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                pid = cursor.fetchone()[0]
            params = {
                k: v
                for k, v in connection.get_connection_params().items()
                if k not in ("cursor_factory", "context", "prepare_threshold")
            }
            with psycopg.connect(**params, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [pid])
        Effect.objects.create(subscription="testapp.terminated", event_id=event.id)

    terminated = Subscription(
        name="testapp.terminated", event="testapp.flaky", handler=handler, max_attempts_override=1
    )
    with transaction.atomic():
        event_id = publish("testapp.flaky", {})
    Relay(transport).drain()
    consumer = Consumer(terminated, transport)
    consumer.ensure()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not consumer.counts["handled"] and not consumer.counts["dead_lettered"]:
        consumer.poll(timeout=0.5)
    assert runs == [1, 1]  # run again at once, as the same attempt
    assert consumer.counts["handled"] == 1 and consumer.counts["retried"] == 0 and consumer.counts["dead_lettered"] == 0
    assert Effect.objects.filter(event_id=event_id).count() == 1
