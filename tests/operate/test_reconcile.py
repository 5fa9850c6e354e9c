"""Reconciliation against the real PostgreSQL and NATS: each way JetStream
drops a message the outbox still holds - a limit, an interior delete, a
durable made again, a stream reset - is found, named, and sent again to the
subscriptions that lost it only, each handled exactly once; what is merely
slow (pending, in flight, waiting for a retry) is never sent again, and a
stream this database must not use is left alone, saying why."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection, transaction
from django.db.models import Count

from django_platformkit import declare, identity, publish, subscribe
from django_platformkit.broker.transport import Transport
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.models import OutboxEvent
from django_platformkit.models.reconciliation import SubscriptionState
from django_platformkit.operate.reconcile import ReconcileCause, reconcile
from django_platformkit.outbox.relay import Relay
from django_platformkit.runtime.startup import StartUp
from django_platformkit.wire import HandlingOutcome
from tests.conftest import wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

ORDERS = ["testapp.record_order", "testapp.count_order"]


@pytest.fixture
def ours(broker):
    """This database's stream, with the order subscriptions' durables made
    as a worker makes them (their beginnings recorded)."""
    t = Transport()
    t.connect()
    start_up = StartUp(t, using="default", stop_event=threading.Event(), connect_timeout_seconds=5.0)
    start_up.connect_and_ensure_stream(give_up=True)
    for name in ORDERS:
        start_up.ensure_durable(get_subscription(name))
    yield t
    t.close()


def subs(*names: str):
    return [get_subscription(name) for name in names or ORDERS]


def pass_(t: Transport, *names: str, dry_run: bool = False):
    return reconcile(
        t,
        owner=identity.database_identity(),
        instance=identity.database_instance(),
        declared=subs(*names),
        dry_run=dry_run,
    )


def place(n: int) -> list[uuid.UUID]:
    with transaction.atomic():
        return [publish("testapp.order_placed", {"n": i}) for i in range(n)]


def edit(t: Transport, stream: str, **settings) -> None:
    async def change():
        config = (await t.connection.js.stream_info(stream)).config
        for key, value in settings.items():
            setattr(config, key, value)
        await t.connection.js.update_stream(config)

    t.connection.call(change(), timeout=10)


def effects(name: str) -> dict[uuid.UUID, int]:
    rows = Effect.objects.filter(subscription=name).values("event_id").annotate(n=Count("id"))
    return {row["event_id"]: row["n"] for row in rows}


def handle_all(t: Transport, *names: str) -> dict[HandlingOutcome, int]:
    """What each subscription's worker does: fetch and handle until its durable has nothing more."""
    outcomes: dict[HandlingOutcome, int] = {}
    for sub in subs(*names):
        consumer = Consumer(sub, t)
        while deliveries := t.fetch(sub.durable, 100, timeout=0.5):
            for outcome in consumer.handle(deliveries):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def test_events_a_limit_discarded_are_sent_again_and_each_handled_once(ours, broker):
    # `nats stream edit --max-msgs` while the relay runs: the stream dropped the oldest before any worker read them.
    ids = place(20)
    Relay(ours).drain()
    edit(ours, broker["STREAM"], max_msgs=5)
    refused = pass_(ours)
    assert refused.resent == 0 and "max_msgs=5" in refused.note  # nothing sent into a stream that discards it
    ours.upkeep.update()  # the operator lifts it (manage.py stream update)
    report = pass_(ours)
    for name in ORDERS:
        assert report.subscriptions[name].resent == {ReconcileCause.DISCARDED: 15}
    assert report.resent == 30
    assert pass_(ours).resent == 0  # moved on: never sent twice
    handle_all(ours)
    for name in ORDERS:
        assert effects(name) == dict.fromkeys(ids, 1)
    assert pass_(ours).resent == 0


def test_messages_deleted_inside_the_stream_are_sent_again_as_deleted(ours, broker):
    ids = place(10)
    Relay(ours).drain()
    rows = dict(OutboxEvent.objects.filter(id__in=ids).values_list("stream_seq", "id"))

    async def delete_some():
        for seq in sorted(rows)[3:6]:
            await ours.connection.js.delete_msg(broker["STREAM"], seq)

    ours.connection.call(delete_some(), timeout=10)
    assert pass_(ours).resent == 0  # not read yet: not known to be lost for them
    handle_all(ours)
    report = pass_(ours)
    for name in ORDERS:
        assert report.subscriptions[name].resent == {ReconcileCause.DELETED: 3}
    handle_all(ours)
    for name in ORDERS:
        assert effects(name) == dict.fromkeys(ids, 1)


def test_a_durable_made_again_later_gets_what_it_missed_and_a_backfill_false_one_is_never_backfilled(
    broker, registries
):
    declare("testapp.remade")

    @subscribe("testapp.remade", name="testapp.late", backfill=False)
    def late(event):
        Effect.objects.create(subscription="testapp.late", event_id=event.id)

    sub = get_subscription("testapp.late")
    t = Transport()
    t.connect()
    try:
        start_up = StartUp(t, using="default", stop_event=threading.Event(), connect_timeout_seconds=5.0)
        start_up.connect_and_ensure_stream(give_up=True)
        with transaction.atomic():
            before = publish("testapp.remade", {"n": 0})  # before the subscription began: never owed
        Relay(t).drain()
        start_up.ensure_durable(sub)
        with transaction.atomic():
            owed = [publish("testapp.remade", {"n": n}) for n in (1, 2)]
        Relay(t).drain()

        async def operator_deletes_the_durable():
            await t.connection.js.delete_consumer(broker["STREAM"], sub.durable)

        t.connection.call(operator_deletes_the_durable(), timeout=10)
        with transaction.atomic():
            owed.append(publish("testapp.remade", {"n": 3}))
        Relay(t).drain()
        start_up.ensure_durable(sub)  # a worker makes it again: backfill=False starts at "now"
        assert SubscriptionState.objects.filter(name=sub.name).count() == 1  # its beginning kept
        handle_all(t, sub.name)
        assert effects(sub.name) == {}  # it missed every one
        report = pass_(t, sub.name)
        assert report.subscriptions[sub.name].resent == {ReconcileCause.DURABLE_REMADE: 3}
        handle_all(t, sub.name)
        assert effects(sub.name) == dict.fromkeys(owed, 1)
        assert before not in effects(sub.name)
    finally:
        t.close()


def test_after_a_stream_reset_every_unhandled_event_is_sent_again_and_no_handled_one(ours, broker):
    handled = place(4)
    Relay(ours).drain()
    handle_all(ours)
    waiting = place(6)
    Relay(ours).drain()
    ours.upkeep.delete_stream()
    start_up = StartUp(ours, using="default", stop_event=threading.Event(), connect_timeout_seconds=5.0)
    start_up.connect_and_ensure_stream(give_up=True)
    for name in ORDERS:
        start_up.ensure_durable(get_subscription(name))
    report = pass_(ours)
    for name in ORDERS:
        assert report.subscriptions[name].resent == {ReconcileCause.STREAM_REPLACED: 6}
    assert report.resent == 12
    assert ours.stream_info().state.messages == 6  # one message per event, for both subscriptions
    handle_all(ours)
    for name in ORDERS:
        assert effects(name) == dict.fromkeys(handled + waiting, 1)


def test_what_is_merely_slow_is_never_sent_again(ours, broker):
    place(10)
    Relay(ours).drain()
    assert pass_(ours).resent == 0  # pending in the durables
    record = get_subscription("testapp.record_order")
    fetched = ours.fetch(record.durable, 6, timeout=1)  # in flight
    ours.nak(fetched[0], 3.0)  # waiting for a retry
    report = pass_(ours)
    assert report.subscriptions["testapp.count_order"].resent == {}  # pending
    assert report.subscriptions["testapp.record_order"].resent == {}  # in flight, waiting, pending
    ours.ack_many(fetched[1:])  # acked without a claim (as a foreign consumer of the durable would): that is lost
    wait_for(lambda: ours.consumer_info(record.durable).num_ack_pending == 1, what="the acks")
    report = pass_(ours)
    assert report.subscriptions["testapp.record_order"].resent == {}  # the floor stays below the one waiting

    def drained() -> bool:  # the retry and the 4 never delivered, acked as they come (no claims either)
        ours.ack_many(ours.fetch(record.durable, 10, timeout=0.5))
        return ours.consumer_info(record.durable).num_ack_pending == 0 == ours.consumer_info(record.durable).num_pending

    wait_for(drained, what="the retry")
    report = pass_(ours)
    assert report.subscriptions["testapp.record_order"].resent == {ReconcileCause.PASSED_OVER: 10}


def test_the_re_send_reaches_only_its_subscription_and_the_others_ack_it_without_running_or_counting(ours, broker):
    ids = place(3)
    Relay(ours).drain()
    handle_all(ours, "testapp.record_order")
    count = get_subscription("testapp.count_order")

    async def remake():  # count_order's durable deleted and made again from "now"
        await ours.connection.js.delete_consumer(broker["STREAM"], count.durable)

    ours.connection.call(remake(), timeout=10)
    want = count.consumer_config()
    from nats.js import api

    want.deliver_policy = api.DeliverPolicy.NEW
    ours.ensure_consumer(want)
    report = pass_(ours)
    assert report.subscriptions["testapp.count_order"].resent == {ReconcileCause.DURABLE_REMADE: 3}
    assert report.subscriptions["testapp.record_order"].resent == {}
    record_consumer = Consumer(get_subscription("testapp.record_order"), ours)
    deliveries = ours.fetch(record_consumer.subscription.durable, 10, timeout=1)
    assert len(deliveries) == 3  # record_order receives the re-sends too (one filter subject on NATS 2.9)...
    assert record_consumer.handle(deliveries) == [HandlingOutcome.ELSEWHERE] * 3  # ...and acks them unrun
    assert sum(record_consumer.counts.values()) == 0
    handle_all(ours)
    assert effects("testapp.record_order") == dict.fromkeys(ids, 1)
    assert effects("testapp.count_order") == dict.fromkeys(ids, 1)
    assert ours.consumer_info(record_consumer.subscription.durable).num_ack_pending == 0


def test_a_dry_run_names_what_it_would_send_and_sends_and_writes_nothing(ours, broker):
    ids = place(5)
    Relay(ours).drain()
    edit(ours, broker["STREAM"], max_msgs=2)
    ours.upkeep.update()
    stamps = list(OutboxEvent.objects.order_by("id").values_list("id", "stream_seq", "headers"))
    states = list(SubscriptionState.objects.order_by("name").values())
    messages = ours.stream_info().state.last_seq
    report = pass_(ours, dry_run=True)
    assert report.dry_run and report.resent == 6
    assert set(report.subscriptions["testapp.record_order"].examples) <= set(ids)
    assert list(OutboxEvent.objects.order_by("id").values_list("id", "stream_seq", "headers")) == stamps
    assert list(SubscriptionState.objects.order_by("name").values()) == states
    assert ours.stream_info().state.last_seq == messages
    assert pass_(ours).resent == 6


def test_a_stream_another_database_or_instance_holds_is_left_alone_saying_why(broker):
    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=str(uuid.uuid4()), instance="1:1")
        report = pass_(t)
        assert report.resent == 0 and "belongs to another project's database" in report.note
        assert all(r.note == report.note for r in report.subscriptions.values())
    finally:
        t.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def test_a_claim_or_a_replay_that_lands_after_the_window_was_read_is_never_sent_again(ours, broker):
    # River's rescuer rewrote jobs that completed after its snapshot (riverqueue/river#1302): the re-send
    # takes each row again under its lock, still stamped where the window found it, still owed.
    from django_platformkit.models import HandledEvent
    from django_platformkit.operate import reconcile_rows as rows

    ids = place(3)
    Relay(ours).drain()
    facts = ours.stream_facts(owner=identity.database_identity(), instance=identity.database_instance())
    record = rows.read_records(["testapp.record_order"], using="default")["testapp.record_order"]
    with transaction.atomic(), connection.cursor() as cursor:
        found = rows.window_batch(
            cursor,
            subscription="testapp.record_order",
            event="testapp.order_placed",
            others=ORDERS,
            after=record.start,
            until=(facts.created, facts.last_seq),
            batch=10,
        )
        assert sorted(r.id for r in found) == sorted(ids)
        transaction.set_rollback(True)
    HandledEvent.objects.create(subscription="testapp.record_order", event_id=ids[0])  # handled meanwhile
    OutboxEvent.objects.filter(id=ids[2]).update(published_at=None)  # set pending again by a replay meanwhile
    with transaction.atomic(), connection.cursor() as cursor:
        taken = rows.take_for_resend(cursor, [(row, ["testapp.record_order"]) for row in found])
        transaction.set_rollback(True)
    assert [uuid.UUID(t[2]) for t in taken] == [ids[1]]


def test_an_event_sent_again_after_a_failed_run_counts_that_run(broker):
    # Its message went while it waited for a retry; the re-send is the broker's first delivery of a new
    # message, but `attempt` counts handler runs (DESIGN.md "Attempts"): this is the second.
    from tests.testapp.models import Attempt

    flaky = get_subscription("testapp.flaky")
    t = Transport()
    t.connect()
    try:
        start_up = StartUp(t, using="default", stop_event=threading.Event(), connect_timeout_seconds=5.0)
        start_up.connect_and_ensure_stream(give_up=True)
        start_up.ensure_durable(flaky)
        with transaction.atomic():
            event_id = publish("testapp.flaky", {"fail_until": 1})
        Relay(t).drain()
        assert Consumer(flaky, t).handle(t.fetch(flaky.durable, 1, timeout=1)) == [HandlingOutcome.RETRIED]
        t.upkeep.delete_stream()  # gone while it waited for its retry
        start_up.connect_and_ensure_stream(give_up=True)
        start_up.ensure_durable(flaky)
        report = pass_(t, "testapp.flaky")
        assert report.subscriptions["testapp.flaky"].resent == {ReconcileCause.STREAM_REPLACED: 1}
        assert Consumer(flaky, t).handle(t.fetch(flaky.durable, 1, timeout=1)) == [HandlingOutcome.HANDLED]
    finally:
        t.close()
    runs = list(Attempt.objects.filter(event_id=event_id).order_by("at").values_list("attempt", flat=True))
    assert runs == [1, 2]
    assert effects("testapp.flaky") == {event_id: 1}  # the failed run's write rolled back with it
