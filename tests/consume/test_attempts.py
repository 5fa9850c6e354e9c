"""Attempts count handler runs (DESIGN.md "Attempts"): the numbers a handler
sees, the Attempt rows behind them, dead letters that carry the last real
error, failures that are the database's and not the handler's (on the unit's
own connection or another alias's; a write through a read-only alias is the
handler's), and the batched path under psycopg server-side binding."""

import contextlib
import copy
import logging
import signal
import threading

import pytest
from django.db import connections, transaction

from django_platformkit import publish
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.models import Attempt, DeadLetter, HandledEvent
from django_platformkit.outbox.relay import Relay
from tests.conftest import manage, mirror_of_default, wait_for, worker_env
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def publish_and_relay(transport, sub, payloads):
    with transaction.atomic():
        ids = [publish(sub.event, p) for p in payloads]
    Relay(transport).drain()
    consumer = Consumer(sub, transport)
    consumer.ensure()
    return ids, consumer


def rows(event_id, subscription):
    return list(Attempt.objects.for_event(event_id, subscription).order_by("attempt").values_list("attempt", "outcome"))


def drain(consumer, until, timeout=20):
    wait_for(lambda: consumer.poll(timeout=0.5) is not None and until(), timeout=timeout, what="the consumer to settle")


@pytest.mark.parametrize("batch", [True, False])
def test_a_handler_that_fails_twice_then_succeeds_sees_attempts_1_2_3_and_the_rows_match(
    transport, settings, broker, batch
):
    seen = []

    def handler(event):
        seen.append((event.payload["n"], event.attempt))
        if event.payload["n"] == 1 and event.attempt < 3:
            raise RuntimeError(f"not yet on attempt {event.attempt}")

    sub = Subscription(
        name="testapp.twice_then_ok",
        event="testapp.flaky",
        handler=handler,
        batch=batch,
        max_attempts_override=3,
        backoff_seconds_override=(0.1,),
    )
    ids, consumer = publish_and_relay(transport, sub, [{"n": 0}, {"n": 1}, {"n": 2}])
    drain(consumer, lambda: HandledEvent.objects.filter(subscription=sub.name).count() == 3)
    assert [a for n, a in seen if n == 1] == [1, 2, 3]
    # The neighbours ran once each, as attempt 1 (a batch redo runs them again, still attempt 1).
    assert {a for n, a in seen if n != 1} == {1}
    assert rows(ids[1], sub.name) == [(1, "failed"), (2, "failed"), (3, "handled")]
    assert (
        Attempt.objects.for_event(ids[1], sub.name).filter(attempt=1).get().error
        == "RuntimeError: not yet on attempt 1"
    )
    # The first, usual delivery that succeeds writes no row at all.
    assert rows(ids[0], sub.name) == [] and rows(ids[2], sub.name) == []
    assert not DeadLetter.objects.exists()


def test_the_dead_letter_after_max_attempts_carries_the_last_error_and_traceback(transport, settings, broker):
    def handler(event):
        raise RuntimeError(f"broken on attempt {event.attempt}")

    sub = Subscription(
        name="testapp.always_broken",
        event="testapp.flaky",
        handler=handler,
        max_attempts_override=3,
        backoff_seconds_override=(0.1,),
    )
    (event_id,), consumer = publish_and_relay(transport, sub, [{}])
    drain(consumer, lambda: DeadLetter.objects.exists())
    dead = DeadLetter.objects.get()
    assert (dead.event_id, dead.attempts, dead.error) == (event_id, 3, "RuntimeError: broken on attempt 3")
    assert "Traceback" in dead.traceback and "broken on attempt" in dead.traceback
    assert rows(event_id, sub.name) == [(1, "failed"), (2, "failed"), (3, "failed")]
    assert Attempt.objects.counted().filter(event_id=event_id).count() == 3
    last = Attempt.objects.for_event(event_id, sub.name).last_failure()
    assert (last.attempt, last.error, last.traceback) == (3, dead.error, dead.traceback)
    assert not Attempt.objects.for_event(event_id).never_reported().exists()


def test_a_handler_raising_systemexit_fails_its_attempt_and_the_worker_keeps_consuming(run_worker):
    seen = []

    def handler(event):
        seen.append((event.payload["n"], event.attempt))
        if event.payload["n"] == 0 and event.attempt == 1:
            raise SystemExit(3)

    sub = Subscription(name="testapp.exits", event="testapp.flaky", handler=handler, backoff_seconds_override=(0.1,))
    with transaction.atomic():
        first = publish("testapp.flaky", {"n": 0})
        publish("testapp.flaky", {"n": 1})
    run_worker(subscriptions=[sub])
    assert sorted(seen) == [(0, 1), (0, 2), (1, 1)]
    assert rows(first, sub.name) == [(1, "failed"), (2, "handled")]
    assert Attempt.objects.get(event_id=first, attempt=1).error == "SystemExit: 3"
    assert HandledEvent.objects.filter(subscription=sub.name).count() == 2
    assert not DeadLetter.objects.exists()


def test_nul_characters_in_an_error_are_stored_escaped_in_the_attempt_and_the_dead_letter(transport, settings, broker):
    def handler(event):
        raise ValueError("a\x00b")

    sub = Subscription(name="testapp.nul_error", event="testapp.flaky", handler=handler, max_attempts_override=1)
    (event_id,), consumer = publish_and_relay(transport, sub, [{}])
    drain(consumer, lambda: DeadLetter.objects.exists())
    dead = DeadLetter.objects.get()
    assert dead.error == "ValueError: a\\x00b"
    assert "a\\x00b" in dead.traceback and "\x00" not in dead.traceback
    assert Attempt.objects.get(event_id=event_id).error == "ValueError: a\\x00b"


def _run_in_thread(consumer, stop):
    def loop():
        try:
            while not stop.is_set():
                consumer.poll(timeout=0.5)
        finally:
            connections.close_all()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_a_read_only_database_window_counts_no_attempt_and_everything_is_handled_after_it(
    transport, settings, broker, caplog
):
    """default_transaction_read_only (a failover, a replica promoted late):
    the claim is refused with SQLSTATE 25006. Not the handler's fault: wait
    and retry, never an attempt, never a dead letter - even with max_attempts=1."""
    seen = []
    sub = Subscription(
        name="testapp.read_only_window",
        event="testapp.flaky",
        handler=lambda e: seen.append(e.attempt),
        max_attempts_override=1,
    )
    ids, consumer = publish_and_relay(transport, sub, [{"n": i} for i in range(10)])
    name = connections["default"].settings_dict["NAME"]
    with connections["default"].cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    stop = threading.Event()
    try:
        with caplog.at_level(logging.WARNING, logger="django_platformkit"):
            thread = _run_in_thread(consumer, stop)
            wait_for(lambda: "read-only" in caplog.text, timeout=15, what="the consumer to meet the read-only database")
            assert seen == [] and not HandledEvent.objects.exists()
            with connections["default"].cursor() as cursor:
                cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            wait_for(
                lambda: HandledEvent.objects.filter(subscription=sub.name).count() == 10,
                timeout=20,
                what="every event handled",
            )
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        stop.set()
        thread.join(10)
    assert seen == [1] * 10
    assert not Attempt.objects.exists()
    assert not DeadLetter.objects.exists()
    assert "not an attempt" in caplog.text


#: A second alias on the test database whose sessions are read-only, as a
#: replica's are: ``.using(READ_ONLY)`` writes fail with SQLSTATE 25006.
READ_ONLY = "read_only"


@pytest.fixture(scope="module")
def read_only_alias(django_db_setup):
    """Registers ``READ_ONLY`` for this module's tests (a flush can't write through it either)."""
    with mirror_of_default(READ_ONLY, options="-c default_transaction_read_only=on") as alias:
        yield alias


@pytest.mark.django_db(transaction=True, databases=["default", READ_ONLY])
@pytest.mark.parametrize("batch", [True, False])
def test_a_handler_writing_through_a_read_only_alias_fails_its_attempts_and_becomes_a_dead_letter(
    transport, settings, broker, caplog, read_only_alias, batch
):
    """25006 from another alias than the unit's is the handler's mistake (a
    write sent to a replica): no wait cures it, so it fails each attempt,
    retries with backoff and ends as a dead letter carrying the error -
    never "database unavailable" forever. Its neighbours are handled."""
    seen = []

    def handler(event):
        seen.append((event.payload["n"], event.attempt))
        if event.payload["n"] == 0:
            Effect.objects.using(read_only_alias).create(subscription="replica", event_id=event.id)

    sub = Subscription(
        name="testapp.writes_to_replica",
        event="testapp.flaky",
        handler=handler,
        batch=batch,
        max_attempts_override=2,
        backoff_seconds_override=(0.1,),
    )
    with caplog.at_level(logging.WARNING, logger="django_platformkit"):
        ids, consumer = publish_and_relay(transport, sub, [{"n": 0}, {"n": 1}])
        drain(
            consumer,
            lambda: DeadLetter.objects.exists() and HandledEvent.objects.filter(subscription=sub.name).count() == 2,
        )
    dead = DeadLetter.objects.get()
    assert (dead.event_id, dead.attempts) == (ids[0], 2)
    assert dead.error == "InternalError: cannot execute INSERT in a read-only transaction"
    assert "read-only" in dead.traceback
    assert rows(ids[0], sub.name) == [(1, "failed"), (2, "failed")]
    assert [a for n, a in seen if n == 0] == [1, 2]
    assert {a for n, a in seen if n == 1} == {1} and rows(ids[1], sub.name) == []
    assert not Effect.objects.exists()
    assert "database unavailable" not in caplog.text and "not an attempt" not in caplog.text


@pytest.mark.django_db(transaction=True, databases=["default", READ_ONLY])
@pytest.mark.parametrize(
    ("alias", "errcode", "inner_atomic"),
    [
        pytest.param(READ_ONLY, "deadlock_detected", False, id="40P01-on-another-alias"),
        pytest.param("default", "read_only_sql_transaction", False, id="25006-on-the-units-connection"),
        pytest.param("default", "read_only_sql_transaction", True, id="25006-on-the-units-connection-in-atomic"),
    ],
)
def test_a_deadlock_anywhere_and_a_read_only_refusal_on_the_units_own_connection_are_waited_out_not_counted(
    transport, settings, broker, caplog, read_only_alias, alias, errcode, inner_atomic
):
    """What stays an outage: a deadlock is contention a rerun cures on any
    alias, and 25006 on the unit's own connection is a failover's read-only
    node - also when the handler's own ``atomic()`` rolled the statement
    back to its savepoint, which leaves the unit's transaction usable. The
    first run meets the error, the rerun succeeds: attempt 1 both times,
    no attempt row, no dead letter, even with max_attempts=1."""
    seen = []

    def handler(event):
        seen.append(event.attempt)
        if len(seen) == 1:
            with transaction.atomic(using=alias) if inner_atomic else contextlib.nullcontext():
                with connections[alias].cursor() as cursor:
                    cursor.execute(
                        f"DO $$ BEGIN RAISE EXCEPTION 'test: %', '{errcode}' USING ERRCODE = '{errcode}'; END $$"
                    )

    sub = Subscription(name="testapp.waits_out", event="testapp.flaky", handler=handler, max_attempts_override=1)
    with caplog.at_level(logging.WARNING, logger="django_platformkit"):
        (event_id,), consumer = publish_and_relay(transport, sub, [{}])
        drain(consumer, lambda: HandledEvent.objects.filter(subscription=sub.name).exists())
    assert seen == [1, 1]
    assert not Attempt.objects.exists() and not DeadLetter.objects.exists()
    assert f"test: {errcode}" in caplog.text and "not an attempt" in caplog.text


@pytest.mark.django_db(transaction=True, databases=["default", READ_ONLY])
def test_a_lost_connection_to_another_alias_is_waited_out_and_the_retry_reconnects(
    transport, settings, broker, caplog, read_only_alias
):
    """The handler's other database goes away (its session killed): an
    outage, not the handler's fault, and the rerun gets a new connection
    rather than "the connection is closed" on every retry for ever."""
    backends = []

    def handler(event):
        with connections[read_only_alias].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backends.append(cursor.fetchone()[0])
            if len(backends) == 1:
                with connections["default"].cursor() as killer:
                    killer.execute("SELECT pg_terminate_backend(%s, 5000)", [backends[0]])
                cursor.execute("SELECT 1")

    sub = Subscription(name="testapp.loses_replica", event="testapp.flaky", handler=handler, max_attempts_override=1)
    with caplog.at_level(logging.WARNING, logger="django_platformkit"):
        (event_id,), consumer = publish_and_relay(transport, sub, [{}])
        drain(consumer, lambda: HandledEvent.objects.filter(subscription=sub.name).exists())
    assert len(backends) == 2 and backends[0] != backends[1]
    assert not Attempt.objects.exists() and not DeadLetter.objects.exists()
    assert "database unavailable" in caplog.text and "not an attempt" in caplog.text


@pytest.fixture
def server_side_binding_alias(settings):
    """The test database's connections (this thread's and the consumer's)
    use psycopg server-side binding and prepare every statement at once."""
    alias = "default"
    config = connections[alias].settings_dict
    saved = copy.deepcopy(config.get("OPTIONS") or {})
    connections[alias].close()
    config["OPTIONS"] = dict(saved, server_side_binding=True, prepare_threshold=0)
    try:
        yield alias
    finally:
        connections[alias].close()
        config["OPTIONS"] = saved


@pytest.mark.parametrize("with_failure", [False, True])
def test_the_batched_path_handles_events_under_server_side_binding(
    transport, settings, broker, server_side_binding_alias, with_failure
):
    """Never several statements in one execute: with server-side binding (or
    a prepared statement) PostgreSQL refuses them. A failure exercises the
    redo with savepoints, a statement of its own each."""
    alias = server_side_binding_alias
    seen = []

    def handler(event):
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT current_setting('platformkit.tenant', true)")
            seen.append((event.payload["n"], event.attempt, cursor.fetchone()[0]))
        if with_failure and event.payload["n"] == 3 and event.attempt == 1:
            raise RuntimeError("once")

    sub = Subscription(
        name="testapp.server_side", event="testapp.flaky", handler=handler, backoff_seconds_override=(0.1,)
    )
    with transaction.atomic():
        ids = [publish("testapp.flaky", {"n": i}, tenant=f"t{i % 2}") for i in range(6)]
    Relay(transport).drain()
    consumer = Consumer(sub, transport, using=alias)
    consumer.ensure()
    assert (
        consumer.handle(transport.fetch(sub.durable, 10, timeout=2))
        == ["handled"] * 3 + (["retried"] if with_failure else ["handled"]) + ["handled"] * 2
    )
    if with_failure:
        wait_for(
            lambda: consumer.poll(timeout=0.5) and HandledEvent.objects.filter(subscription=sub.name).count() == 6,
            timeout=10,
            what="the retry",
        )
    assert HandledEvent.objects.filter(subscription=sub.name).count() == 6
    assert not DeadLetter.objects.exists()
    # each handler saw its own event's tenant, on the server-side-binding connection
    assert {(n, tenant) for n, _, tenant in seen} == {(i, f"t{i % 2}") for i in range(6)}
    assert connections[alias].settings_dict["OPTIONS"]["server_side_binding"] is True


@pytest.mark.process
def test_a_first_run_that_hangs_and_is_killed_counts_so_its_redelivery_is_attempt_2(broker):
    """The first delivery writes nothing - unless its run lasts: then its
    ``running`` row is written from the side, so a worker killed during a
    hang doesn't hand the event a free run."""
    from tests.testapp.models import Attempt as Seen

    env = worker_env(broker, PLATFORMKIT_TEST_ACK_WAIT="2", PLATFORMKIT_TEST_HANDLER_TIMEOUT="1.5")
    with transaction.atomic():
        event_id = publish("testapp.slow", {"sleep": 60})
    seen = lambda: sorted(Seen.objects.filter(event_id=event_id).values_list("attempt", flat=True))  # noqa: E731
    for expected in ([1], [1, 2]):
        worker = manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)
        try:
            wait_for(lambda: seen() == expected, timeout=60, what=f"runs {expected}")
            wait_for(
                lambda: Attempt.objects.for_event(event_id).never_reported().count() == len(expected),
                timeout=10,
                what="the running row",
            )
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
        assert list(Attempt.objects.for_event(event_id).values_list("attempt", "outcome")) == [
            (n, "running") for n in expected
        ]
    assert not HandledEvent.objects.filter(event_id=event_id).exists()
