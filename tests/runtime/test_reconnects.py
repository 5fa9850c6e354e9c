"""The worker rides out the broker and the database going away, without a
restart and without failed handlers or dead letters for healthy events; and a
row the broker refuses for good is dead-lettered without blocking the rest."""

import logging
import signal
import time

import pytest
from django.db import connection, transaction
from django.test import override_settings

from django_platformkit import publish
from django_platformkit.broker.streams import consumer_config
from django_platformkit.broker.transport import Transport
from django_platformkit.devservices import NatsServer
from django_platformkit.exceptions import ConfigurationError, ConsumerDrift
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS
from django_platformkit.outbox.relay import Relay
from tests.conftest import manage, wait_for, worker_env
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def own_nats():
    server = NatsServer().start()
    yield server
    server.cleanup()


def effects(sub="testapp.record_order"):
    return Effect.objects.filter(subscription=sub)


@pytest.mark.process
def test_nats_stopped_for_five_seconds_then_started_loses_and_doubles_nothing(broker, own_nats, settings):
    settings.PLATFORMKIT = dict(broker, NATS_URL=own_nats.url)
    env = worker_env(broker, NATS_URL=own_nats.url)
    worker = manage("runworker", "--subscription", "testapp.record_order", "--no-jobs", env=env)
    ids = []
    try:
        with transaction.atomic():
            ids.append(publish("testapp.order_placed", {"phase": "before"}))
        wait_for(lambda: effects().count() == 1, timeout=30, what="the first event")
        own_nats.stop()
        for i in range(5):  # publishing never fails while the broker is down
            with transaction.atomic():
                ids.append(publish("testapp.order_placed", {"phase": "during", "i": i}))
            time.sleep(1)
        own_nats.start()
        with transaction.atomic():
            ids.append(publish("testapp.order_placed", {"phase": "after"}))
        wait_for(lambda: effects().count() >= len(ids), timeout=60, what="every event handled")
        time.sleep(1)
        assert worker.poll() is None, "the worker must not have exited"
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert sorted(effects().values_list("event_id", flat=True)) == sorted(ids)
    assert not OutboxEvent.objects.pending().exists()
    assert not DeadLetter.objects.exists()


@pytest.mark.process
def test_terminating_every_worker_connection_while_idle_then_publishing_is_handled_once(broker):
    env = worker_env(broker)
    worker = manage("runworker", "--subscription", "testapp.record_order", "--no-jobs", env=env)
    try:
        with transaction.atomic():
            first = publish("testapp.order_placed", {"n": 1})
        wait_for(lambda: effects().filter(event_id=first).exists(), timeout=30, what="the first event")
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            assert cursor.fetchone()[0] >= 2  # the relay's, its listener's and the consumer's connections
        with transaction.atomic():
            second = publish("testapp.order_placed", {"n": 2})
        wait_for(
            lambda: effects().filter(event_id=second).exists(), timeout=30, what="the event after the terminations"
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    assert effects().count() == 2
    assert not DeadLetter.objects.exists()


def test_a_row_bigger_than_the_servers_max_payload_is_dead_lettered_and_the_rest_go_on(broker, settings, run_worker):
    server = NatsServer(config="max_payload: 65536\n").start()
    try:
        with transaction.atomic():
            before = publish("testapp.order_placed", {"n": "before"})
            # written while the limits allowed it (say, before the server was reconfigured)
            with override_settings(PLATFORMKIT=dict(broker, MAX_PAYLOAD_BYTES=512 * 1024)):
                big = publish("testapp.order_placed", {"blob": "x" * 100_000})
            after = publish("testapp.order_placed", {"n": "after"})
        settings.PLATFORMKIT = dict(broker, NATS_URL=server.url, MAX_PAYLOAD_BYTES=40_000)
        t = Transport()
        t.connect()
        t.ensure_stream()
        try:
            stats = Relay(t).drain()
        finally:
            t.close()
        assert (stats.stored, stats.dead_lettered, stats.temporary) == (2, 1, 0)
        dead = DeadLetter.objects.get()
        assert (dead.event_id, dead.subscription) == (big, RELAY_DEAD_LETTERS)
        assert "max_payload" in dead.error
        assert not OutboxEvent.objects.pending().exists()
        from django_platformkit.consume.subscriptions import subscriptions

        run_worker(subscriptions=[s for s in subscriptions() if s.name == "testapp.record_order"])
        assert sorted(effects().values_list("event_id", flat=True)) == sorted([before, after])
    finally:
        server.cleanup()


def test_the_relay_refuses_to_start_when_max_payload_cannot_carry_max_payload_bytes(broker, settings):
    server = NatsServer(config="max_payload: 65536\n").start()
    settings.PLATFORMKIT = dict(broker, NATS_URL=server.url)  # MAX_PAYLOAD_BYTES defaults to 512 KiB
    t = Transport()
    try:
        t.connect()
        with pytest.raises(ConfigurationError, match="max_payload is 65536 bytes.*MAX_PAYLOAD_BYTES"):
            t.ensure_stream()
    finally:
        t.close()
        server.cleanup()


def test_a_durable_is_updated_in_place_and_unfixable_drift_is_reported_not_deleted(transport, broker, settings):
    want = consumer_config("testapp.drifty", "testapp.flaky")
    transport.ensure_consumer(want)
    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=45)
    updated = transport.ensure_consumer(consumer_config("testapp.drifty", "testapp.flaky"))
    assert updated.config.ack_wait == 45
    with pytest.raises(ConsumerDrift) as info:
        transport.ensure_consumer(consumer_config("testapp.drifty", "testapp.slow"))
    message = str(info.value)
    assert "filter_subject" in message and "testapp.flaky" in message and "testapp.slow" in message
    assert "manage.py stream prune --durable testapp-drifty" in message and "nats consumer rm" not in message
    # still there, untouched
    assert transport.consumer_info("testapp-drifty").config.filter_subject.endswith("testapp.flaky")


def test_a_broker_that_lost_its_store_gets_the_stream_and_durable_back(broker, settings, monkeypatch):
    """A new, empty NATS on the same address: the relay re-creates the stream,
    the consumer its durable, and events published afterwards are handled."""
    server = NatsServer().start()
    port = server.port
    settings.PLATFORMKIT = dict(broker, NATS_URL=server.url)
    import threading

    from django_platformkit.consume.subscriptions import subscriptions
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker

    worker = Worker(
        WorkerOptions(scheduler=False, subscriptions=[s for s in subscriptions() if s.name == "testapp.record_order"])
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    replacement = None
    try:
        with transaction.atomic():
            first = publish("testapp.order_placed", {"n": 1})
        wait_for(lambda: effects().filter(event_id=first).exists(), timeout=30, what="the first event")
        server.cleanup()  # the store is gone with it
        replacement = NatsServer(port=port).start()
        with transaction.atomic():
            second = publish("testapp.order_placed", {"n": 2})
        wait_for(lambda: effects().filter(event_id=second).exists(), timeout=60, what="the event after the wipe")
    finally:
        worker.stop()
        thread.join(30)
        if replacement is not None:
            replacement.cleanup()
    assert effects().count() == 2


@pytest.mark.process
@pytest.mark.parametrize("down", ["nats", "database"])
def test_run_once_modes_fail_with_a_clear_error_naming_what_is_unreachable(broker, down):
    import subprocess

    from django_platformkit.devservices import free_port

    closed = free_port()
    if down == "nats":
        env = worker_env(broker, NATS_URL=f"nats://127.0.0.1:{closed}")
        expected = {"runrelay": "can't connect to NATS at nats://127.0.0.1:"}
        expected["runworker"] = expected["runrelay"]
    else:
        env = worker_env(broker, DATABASE_URL=f"postgres://postgres@127.0.0.1:{closed}/nowhere")
        del env["PLATFORMKIT_TEST_DB_NAME"]
        # runrelay --once gives the database one attempt (a script's step fails fast).
        expected = {
            "runrelay": f"the database at 127.0.0.1:{closed}/nowhere is unreachable",
            "runworker": "the database is not available",
        }
    for args in (
        ["runrelay", "--once", "--connect-timeout", "3"],
        ["runworker", "--burst", "--no-jobs", "--connect-timeout", "3"],
    ):
        proc = manage(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 1, (args, stderr)
        assert expected[args[0]] in stderr, (args, stderr)
        assert f"stream {broker['STREAM']}" not in stderr, (args, stderr)  # the stream is not what is down


def test_a_database_outage_longer_than_the_ack_wait_does_not_use_up_attempts(broker, settings, caplog):
    """While the worker waits for its database, it keeps extending the ack:
    the broker doesn't redeliver, the attempt count stays at 1, and a healthy
    event is handled once when the database is back - not dead-lettered."""
    import threading

    import psycopg

    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.consume.subscriptions import subscriptions

    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=1.5, HANDLER_TIMEOUT_SECONDS=1)
    flaky = next(s for s in subscriptions() if s.name == "testapp.flaky")  # max_attempts=3
    db = connection.settings_dict["NAME"]
    with transaction.atomic():
        event_id = publish("testapp.flaky", {})
    t = Transport()
    t.connect()
    t.ensure_stream()
    admin = psycopg.connect(
        host=connection.settings_dict["HOST"],
        port=connection.settings_dict["PORT"],
        user=connection.settings_dict["USER"],
        dbname="postgres",
        autocommit=True,
    )
    consumer = Consumer(flaky, t)
    try:
        Relay(t).drain()
        consumer.ensure()
        connection.close()
        admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS false')

        def consume():
            from django.db import connections

            try:
                # One message: a fetch of many waits out its timeout for more,
                # and past the ack wait (1.5 s) the broker redelivers into it.
                consumer.poll(batch=1, timeout=2)
            finally:
                connections.close_all()

        # A second worker pulls meanwhile: a redelivery would reach it.
        other = Consumer(flaky, t)
        done = threading.Event()

        def other_consumes():
            from django.db import connections

            try:
                while not done.is_set():
                    other.poll(timeout=0.5)
            finally:
                connections.close_all()

        caplog.set_level(logging.INFO, logger="django_platformkit")
        threads = [threading.Thread(target=consume), threading.Thread(target=other_consumes)]
        for thread in threads:
            thread.start()
        time.sleep(10)  # several ack waits (the broker may take a few to redeliver)
        admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
        threads[0].join(30)
        done.set()
        threads[1].join(30)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        admin.execute(f'ALTER DATABASE "{db}" ALLOW_CONNECTIONS true')
        admin.close()
        t.close()
    # one delivery in all: the other worker never got a redelivery to skip
    assert sum(consumer.counts.values()) + sum(other.counts.values()) == 1, (consumer.counts, other.counts)
    from tests.testapp.models import Attempt

    assert list(Attempt.objects.filter(event_id=event_id).values_list("attempt", flat=True)) == [1]
    assert Effect.objects.filter(event_id=event_id).count() == 1
    assert not DeadLetter.objects.exists()
    # Two lines for the outage (README "The database goes away"), not a WARNING per retry.
    waits = [r for r in caplog.records if str(event_id) in r.getMessage() and r.levelno >= logging.WARNING]
    assert [r.getMessage().split(" subscription=")[0] for r in waits] == [
        "database unavailable, retrying (not an attempt)",
        "database back, handled after waiting (not an attempt)",
    ], [r.getMessage() for r in waits]


@pytest.mark.process
def test_runrelay_waits_for_a_stream_it_cannot_reach_yet_and_once_mode_gives_up_clearly(broker):
    """NATS answers but JetStream doesn't (here: an account without
    JetStream; in life also a cluster still electing its leader): the relay
    retries with a logged error instead of exiting, as the worker does."""
    import subprocess

    server = NatsServer(config="accounts { NOJS { users: [ { user: nojs, password: nojs } ] } }\n").start()
    try:
        env = worker_env(broker, NATS_URL=f"nats://nojs:nojs@127.0.0.1:{server.port}")
        proc = manage("runrelay", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            seen = ""
            while "waiting for" not in seen and time.monotonic() < deadline and proc.poll() is None:
                seen += proc.stderr.readline()
            assert proc.poll() is None, f"runrelay exited {proc.returncode}: {seen}"
            assert f"waiting for stream {broker['STREAM']} error=" in seen, seen
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=60)
        assert proc.returncode == 0
        # Both run-once modes share the worker's start-up: each gives up on the stream too.
        for args in (["runrelay", "--once"], ["runworker", "--burst", "--no-jobs"]):
            once = manage(
                *args,
                "--connect-timeout",
                "3",
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            _, stderr = once.communicate(timeout=90)
            assert once.returncode == 1, (args, stderr)
            assert f"the stream {broker['STREAM']} is not available" in stderr, (args, stderr)
            # Its waiting line says nothing is lost, not that jobs run meanwhile: a run-once mode runs none.
            assert "nothing is lost" in stderr and "run meanwhile" not in stderr, (args, stderr)
    finally:
        server.cleanup()
