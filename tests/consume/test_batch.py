"""Batch mode: a fetched batch in one transaction, a savepoint per message.
Each message's claim and writes are undone alone when it fails; the rest
commit once and are acked."""

import pytest
from django.db import connection, transaction

from django_platformkit import publish
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.models import DeadLetter, HandledEvent
from django_platformkit.outbox.relay import Relay
from tests.conftest import wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def effect_writer(name, fail_when=lambda event: False):
    def handler(event):
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('platformkit.tenant', true)")
            seen = cursor.fetchone()[0]
        Effect.objects.create(subscription=name, event_id=event.id, tenant_seen=seen or "", payload=event.payload)
        if fail_when(event):
            raise ValueError(f"bad event {event.payload}")

    return handler


def publish_and_relay(transport, sub, count):
    """``count`` events ``{"n": i}`` published and relayed; returns their ids
    and a Consumer of ``sub`` whose durable exists."""
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(count)]
    Relay(transport).drain()
    consumer = Consumer(sub, transport)
    consumer.ensure()
    return ids, consumer


def test_a_batch_handles_every_event_once_with_each_events_tenant(transport, run_worker):
    sub = Subscription(
        name="testapp.batch_writer", event="testapp.order_placed", handler=effect_writer("b"), batch=True
    )
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}, tenant=["t1", None, "t2"][i % 3]) for i in range(250)]
    run_worker(subscriptions=[sub])
    rows = dict(Effect.objects.filter(subscription="b").values_list("event_id", "tenant_seen"))
    assert sorted(rows) == sorted(ids)
    assert Effect.objects.filter(subscription="b").count() == 250
    for i, event_id in enumerate(ids):
        assert rows[event_id] == ["t1", "", "t2"][i % 3]
    assert HandledEvent.objects.filter(subscription="testapp.batch_writer").count() == 250


def test_one_failing_message_is_undone_alone_and_retried_while_the_rest_commit(transport, settings, broker):
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[0.1])
    sub = Subscription(
        name="testapp.batch_flaky",
        event="testapp.order_placed",
        batch=True,
        max_attempts_override=2,
        handler=effect_writer("f", fail_when=lambda e: e.payload["n"] == 3),
    )
    ids, consumer = publish_and_relay(transport, sub, 6)
    assert consumer.poll(timeout=2) == 6
    assert consumer.counts["handled"] == 5 and consumer.counts["retried"] == 1
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted(ids[:3] + ids[4:])
    assert not HandledEvent.objects.filter(event_id=ids[3]).exists()  # its claim went with its savepoint
    wait_for(
        lambda: consumer.poll(timeout=0.5) and consumer.counts["dead_lettered"], timeout=10, what="the last attempt"
    )
    dead = DeadLetter.objects.get()
    assert dead.event_id == ids[3] and dead.attempts == 2 and "bad event" in dead.error
    assert Effect.objects.filter(event_id=ids[3]).count() == 0
    assert Effect.objects.count() == 5


def test_claim_is_one_statement_per_batch(transport, django_assert_max_num_queries):
    sub = Subscription(name="testapp.batch_count", event="testapp.order_placed", handler=lambda e: None, batch=True)
    with transaction.atomic():
        for i in range(50):
            publish("testapp.order_placed", {"n": i}, tenant=f"t{i % 2}")
    Relay(transport).drain()
    consumer = Consumer(sub, transport)
    consumer.ensure()
    # the claim statement and one savepoint statement per message: no query per claim
    with django_assert_max_num_queries(1 + 50 + 2):
        wait_for(lambda: consumer.poll(timeout=1), timeout=10)
    assert consumer.counts["handled"] == 50


def test_a_failed_message_never_leaks_its_tenant_to_the_next_one(transport, settings, broker):
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30])
    sub = Subscription(
        name="testapp.batch_tenants",
        event="testapp.order_placed",
        batch=True,
        handler=effect_writer("t", fail_when=lambda e: e.payload.get("fail")),
    )
    with transaction.atomic():
        ids = [
            publish("testapp.order_placed", {"n": 0}, tenant="t9"),
            publish("testapp.order_placed", {"n": 1, "fail": True}, tenant="t9"),
            publish("testapp.order_placed", {"n": 2}),
            publish("testapp.order_placed", {"n": 3}),
        ]
    Relay(transport).drain()
    consumer = Consumer(sub, transport)
    consumer.ensure()
    assert consumer.poll(timeout=2) == 4
    seen = dict(Effect.objects.values_list("event_id", "tenant_seen"))
    assert seen == {ids[0]: "t9", ids[2]: "", ids[3]: ""}


def test_a_failed_messages_on_commit_callbacks_never_run(transport, settings, broker):
    """A handler's ``transaction.on_commit()`` belongs to its savepoint: the
    batch commits, but the failed message's callback must not fire (it will
    be registered again by the retry that succeeds)."""
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30])
    fired: list[int] = []

    def handler(event):
        n = event.payload["n"]
        transaction.on_commit(lambda: fired.append(n))
        if n == 2:
            raise ValueError("bad event")

    sub = Subscription(name="testapp.batch_on_commit", event="testapp.order_placed", handler=handler, batch=True)
    _, consumer = publish_and_relay(transport, sub, 5)
    assert consumer.poll(timeout=2) == 5
    assert consumer.counts["handled"] == 4 and consumer.counts["retried"] == 1
    assert sorted(fired) == [0, 1, 3, 4]


@pytest.mark.parametrize("batch", [False, True])
def test_a_subscription_with_concurrency_is_handled_by_several_threads_exactly_once(run_worker, batch):
    import threading
    import time

    running, most, threads = [0], [0], set()
    lock = threading.Lock()

    def handler(event):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads.add(threading.current_thread().name)
        try:
            Effect.objects.create(subscription="c", event_id=event.id, tenant_seen="", payload=event.payload)
            time.sleep(0.005)  # long enough for the other consumers to be inside a handler too
        finally:
            with lock:
                running[0] -= 1

    sub = Subscription(
        name="testapp.concurrent", event="testapp.order_placed", handler=handler, batch=batch, concurrency=3
    )
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(300)]
    worker = run_worker(subscriptions=[sub])
    assert sorted(Effect.objects.filter(subscription="c").values_list("event_id", flat=True)) == sorted(ids)
    assert HandledEvent.objects.filter(subscription="testapp.concurrent").count() == 300
    assert worker.counts()["handled"] == 300
    assert len(threads) == 3 and most[0] >= 2, (threads, most)


def test_an_orm_error_in_one_message_fails_that_message_alone(transport, settings, broker):
    """Model.save() marks the transaction for rollback on an IntegrityError;
    in batch mode that is the message's savepoint, not the batch."""
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30])

    def handler(event):
        n = event.payload["n"]
        Effect.objects.create(subscription="orm", event_id=None if n == 2 else event.id)  # NOT NULL violation for n=2

    sub = Subscription(name="testapp.batch_orm_error", event="testapp.order_placed", handler=handler, batch=True)
    ids, consumer = publish_and_relay(transport, sub, 5)
    assert consumer.poll(timeout=2) == 5
    assert consumer.counts["handled"] == 4 and consumer.counts["retried"] == 1
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted(ids[:2] + ids[3:])
    assert not HandledEvent.objects.filter(event_id=ids[2]).exists()


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("error", ["orm", "raw"])
def test_a_handler_that_swallows_a_database_error_fails_its_attempt_instead_of_being_acked(
    transport, settings, broker, batch, error
):
    """After a caught database error the transaction can only roll back - an
    ORM error marks it so in Django, a raw cursor's error leaves it aborted
    in PostgreSQL. The commit would roll back silently, claim included, and
    the event would be acked as handled and never run again (in a batch, its
    neighbours too). The attempt fails instead; the neighbours are handled."""
    from django.db import DatabaseError

    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30])

    def handler(event):
        if event.payload["n"] != 1:
            Effect.objects.create(subscription="swallow", event_id=event.id)
            return
        try:
            if error == "orm":
                Effect.objects.create(subscription="swallow", event_id=None)
            else:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1/0")
        except DatabaseError:
            pass

    sub = Subscription(name="testapp.swallows", event="testapp.order_placed", handler=handler, batch=batch)
    ids, consumer = publish_and_relay(transport, sub, 3)
    assert consumer.poll(timeout=2) == 3
    assert consumer.counts["handled"] == 2 and consumer.counts["retried"] == 1
    assert sorted(HandledEvent.objects.values_list("event_id", flat=True)) == sorted([ids[0], ids[2]])
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted([ids[0], ids[2]])


@pytest.mark.parametrize("batch", [False, True])
def test_a_handler_that_closes_the_connection_fails_its_attempt_saying_so(transport, settings, broker, batch):
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30], MAX_ATTEMPTS=1)

    def handler(event):
        if event.payload["n"] == 1:
            connection.close()
            return
        Effect.objects.create(subscription="closes", event_id=event.id)

    sub = Subscription(name="testapp.closes", event="testapp.order_placed", handler=handler, batch=batch)
    ids, consumer = publish_and_relay(transport, sub, 3)
    assert consumer.poll(timeout=2) == 3
    assert consumer.counts["handled"] == 2 and consumer.counts["dead_lettered"] == 1
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted([ids[0], ids[2]])
    assert "the handler closed the database connection inside its transaction" in DeadLetter.objects.get().error


def _poll_or_fail(consumer, stalled: str) -> int:
    """``consumer.poll(timeout=2)`` in a thread of its own (with its own
    session, closed after): its result, or the test fails with ``stalled``
    if the poll is still running after 20 s (a unit retried as an outage)."""
    import threading

    from django.db import connections

    polled = []

    def poll():
        try:
            polled.append(consumer.poll(timeout=2))
        finally:
            connections.close_all()  # this thread's own session

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():
        consumer.stop.set()
        thread.join(20)
        pytest.fail(stalled)
    return polled[0]


@pytest.mark.parametrize("batch", [False, True])
def test_a_handler_that_closes_the_connection_and_queries_on_fails_its_attempt_not_the_database(
    transport, settings, broker, batch
):
    """connection.close() or close_old_connections() (which closes a
    connection inside a transaction) in a handler, then a query: the query's
    "the connection is closed" read as a database outage, so the event was
    retried forever, never an attempt, and the subscription stalled."""
    from django.db import close_old_connections

    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30], MAX_ATTEMPTS=1)

    def handler(event):
        if event.payload["n"] == 1:
            close_old_connections()  # what code written for the request cycle calls
        Effect.objects.create(subscription="closes_and_queries", event_id=event.id)

    sub = Subscription(name="testapp.closes_and_queries", event="testapp.order_placed", handler=handler, batch=batch)
    ids, consumer = publish_and_relay(transport, sub, 3)
    assert (
        _poll_or_fail(consumer, "the event was retried as a database outage instead of failing the handler's attempt")
        == 3
    )
    assert consumer.counts["handled"] == 2 and consumer.counts["dead_lettered"] == 1
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted([ids[0], ids[2]])
    dead = DeadLetter.objects.get()
    assert dead.event_id == ids[1]
    assert "the handler closed the database connection inside its transaction" in dead.error


def test_a_handler_that_closes_the_connection_in_the_savepoint_redo_fails_its_attempt_not_the_database(
    transport, settings, broker
):
    """After a neighbour's failure the unit is redone with a savepoint per
    message; a handler that closes the connection there left no savepoint to
    roll back to, and the "connection is closed" that followed was taken for
    a database outage: retried forever, never an attempt, the subscription
    stalled. It must fail its own attempt, as in the first pass."""
    settings.PLATFORMKIT = dict(broker, BACKOFF_SECONDS=[30], MAX_ATTEMPTS=1)

    def handler(event):
        if event.payload["n"] == 0:
            raise ValueError("the neighbour fails first")
        if event.payload["n"] == 1:
            connection.close()
            return
        Effect.objects.create(subscription="closes_in_redo", event_id=event.id)

    sub = Subscription(name="testapp.closes_in_redo", event="testapp.order_placed", handler=handler, batch=True)
    ids, consumer = publish_and_relay(transport, sub, 3)
    assert (
        _poll_or_fail(consumer, "the unit was retried as a database outage instead of failing the handler's attempt")
        == 3
    )
    assert consumer.counts["handled"] == 1 and consumer.counts["dead_lettered"] == 2
    assert list(Effect.objects.values_list("event_id", flat=True)) == [ids[2]]
    errors = dict(DeadLetter.objects.values_list("event_id", "error"))
    assert "the handler closed the database connection inside its transaction" in errors[ids[1]]
    assert "the neighbour fails first" in errors[ids[0]]


@pytest.mark.parametrize("batch", [False, True])
def test_a_failing_on_commit_callback_is_logged_and_touches_nothing_else(transport, batch):
    """A callback runs after the commit, when the event is handled for good:
    one that raises is logged, the attempt still counts as handled, and in a
    batch the other messages' callbacks still run (Django would otherwise
    skip every callback registered after it)."""
    fired: list[int] = []

    def handler(event):
        n = event.payload["n"]

        def callback():
            if n == 1:
                raise RuntimeError("callback failed")
            fired.append(n)

        transaction.on_commit(callback)

    sub = Subscription(name="testapp.robust_callbacks", event="testapp.order_placed", handler=handler, batch=batch)
    _, consumer = publish_and_relay(transport, sub, 5)
    assert consumer.poll(timeout=2) == 5
    assert consumer.counts["handled"] == 5 and consumer.counts["retried"] == 0
    assert sorted(fired) == [0, 2, 3, 4]


def test_a_subscriptions_concurrency_is_its_cap_of_units_in_flight(run_worker, settings, broker):
    """Handlers run on a shared pool (any thread may run any subscription's
    unit); ``concurrency=2`` lets two of A's units run at once, never three."""
    import threading
    import time

    settings.PLATFORMKIT = dict(broker, CONSUMER_THREADS=4)
    lock = threading.Lock()
    running = {"a": 0}
    most = {"a": 0}

    def recorder(name):
        def handler(event):
            if name != "a":
                return
            with lock:
                running["a"] += 1
                most["a"] = max(most["a"], running["a"])
            try:
                time.sleep(0.005)
            finally:
                with lock:
                    running["a"] -= 1

        return handler

    subs = [Subscription(name="testapp.conc_a", event="testapp.order_placed", handler=recorder("a"), concurrency=2)] + [
        Subscription(name=f"testapp.conc_{x}", event="testapp.order_placed", handler=recorder(x)) for x in "bcd"
    ]
    with transaction.atomic():
        for i in range(200):
            publish("testapp.order_placed", {"n": i})
    worker = run_worker(subscriptions=subs)
    assert worker.counts()["handled"] == 800
    assert len({c.instance for c in worker.consumers if c.subscription.name == "testapp.conc_a"}) == 2
    assert most["a"] == 2, most


def test_a_concurrent_subscription_beside_a_single_one_starts(run_worker):
    """Two subscriptions, one with concurrency=2: three consumers whose
    offsets leave a thread of the four without work (it used to divide by zero)."""
    subs = [
        Subscription(
            name="testapp.mixed_a", event="testapp.order_placed", handler=lambda e: None, batch=True, concurrency=2
        ),
        Subscription(name="testapp.mixed_b", event="testapp.order_placed", handler=lambda e: None),
    ]
    with transaction.atomic():
        for i in range(20):
            publish("testapp.order_placed", {"n": i})
    worker = run_worker(subscriptions=subs)
    assert worker.counts()["handled"] == 40


def test_a_full_unit_redone_after_a_failure_commits_at_most_50_savepoints_per_transaction(transport, settings, broker):
    """A unit is a whole fetched batch (CONSUMER_BATCH_SIZE, 100 here); its
    redo with a savepoint per message commits in chunks of
    MAX_SAVEPOINTS_PER_TRANSACTION, so no transaction overflows the subxid cache."""
    from django_platformkit.consume.units import MAX_SAVEPOINTS_PER_TRANSACTION

    settings.PLATFORMKIT = dict(broker, CONSUMER_BATCH_SIZE=100, BACKOFF_SECONDS=[60])

    def handler(event):
        with connection.cursor() as cursor:
            cursor.execute("SELECT txid_current()")
            txid = cursor.fetchone()[0]
        Effect.objects.create(subscription="chunks", event_id=event.id, payload={"txid": txid})
        if event.payload["n"] == 7:
            raise ValueError("bad event 7")

    sub = Subscription(name="testapp.batch_chunks", event="testapp.order_placed", handler=handler, batch=True)
    ids, consumer = publish_and_relay(transport, sub, 100)
    assert consumer.poll(batch=100, timeout=2) == 100
    assert consumer.counts["handled"] == 99 and consumer.counts["retried"] == 1
    rows = list(Effect.objects.filter(subscription="chunks").values_list("event_id", "payload"))
    assert sorted(e for e, _ in rows) == sorted(ids[:7] + ids[8:])
    per_transaction = {}
    for _, payload in rows:
        per_transaction[payload["txid"]] = per_transaction.get(payload["txid"], 0) + 1
    assert max(per_transaction.values()) <= MAX_SAVEPOINTS_PER_TRANSACTION
    assert len(per_transaction) == 2  # the 99 in two chunks: the first attempt rolled back entirely
    assert HandledEvent.objects.filter(subscription="testapp.batch_chunks").count() == 99
