"""Failure is a first-class path: retries with backoff, dead letters with a
terminal claim, lost acks, crashes, malformed messages, timeouts."""

import json
import signal
import time
import uuid

import pytest
from django.db import transaction
from django.test import override_settings

from django_platformkit import publish
from django_platformkit.broker.transport import Transport
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import Subscription, subscriptions
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import subject_for
from tests.conftest import manage, wait_for, worker_env
from tests.testapp.models import Attempt, Effect

pytestmark = pytest.mark.django_db(transaction=True)


def sub(name):
    return next(s for s in subscriptions() if s.name == name)


def attempts_of(event_id, subscription):
    return list(
        Attempt.objects.filter(event_id=event_id, subscription=subscription).order_by("at").values_list("attempt", "at")
    )


def test_a_handler_that_always_raises_runs_max_attempts_times_then_one_dead_letter(run_worker):
    with transaction.atomic():
        event_id = publish("testapp.flaky", {"always_fail": True})
    run_worker(subscriptions=[sub("testapp.flaky")])

    runs = attempts_of(event_id, "testapp.flaky")
    assert [a for a, _ in runs] == [1, 2, 3]  # max_attempts=3 on this subscription
    gaps = [(b - a).total_seconds() for (_, a), (_, b) in zip(runs, runs[1:])]
    assert all(gap >= 0.18 for gap in gaps), gaps  # backoff_seconds=[0.2, 0.2]
    dead = DeadLetter.objects.get()
    assert (dead.event_id, dead.subscription, dead.name, dead.attempts) == (
        event_id,
        "testapp.flaky",
        "testapp.flaky",
        3,
    )
    assert dead.error == "RuntimeError: flaky failure on attempt 3"
    assert "Traceback" in dead.traceback and "raise RuntimeError" in dead.traceback
    # only the terminal claim: the failed attempts' claims rolled back with their writes
    assert list(HandledEvent.objects.values_list("subscription", "event_id")) == [("testapp.flaky", event_id)]
    assert not Effect.objects.filter(subscription="testapp.flaky").exists()
    # nothing runs it again
    run_worker(subscriptions=[sub("testapp.flaky")])
    assert len(attempts_of(event_id, "testapp.flaky")) == 3
    assert DeadLetter.objects.count() == 1


def test_a_handler_that_fails_then_succeeds_is_handled_once_without_a_dead_letter(run_worker):
    with transaction.atomic():
        event_id = publish("testapp.flaky", {"fail_until": 2})
    run_worker(subscriptions=[sub("testapp.flaky")])
    assert [a for a, _ in attempts_of(event_id, "testapp.flaky")] == [1, 2, 3]
    assert Effect.objects.filter(subscription="testapp.flaky", event_id=event_id).count() == 1
    assert not DeadLetter.objects.exists()


class AckLosingTransport(Transport):
    """Fault injection: the handler's commit happens, its ack never reaches the broker."""

    def ack(self, delivery):
        pass

    def ack_many(self, deliveries):
        pass


@override_settings()
def test_a_lost_ack_after_success_runs_nothing_on_redelivery(broker, settings):
    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=1.5, HANDLER_TIMEOUT_SECONDS=1)
    lossy = AckLosingTransport()
    lossy.connect()
    lossy.ensure_stream()
    try:
        with transaction.atomic():
            event_id = publish("testapp.order_placed", {"n": 1})
        Relay(lossy).drain()
        record = sub("testapp.record_order")
        first = Consumer(record, lossy)
        first.ensure()
        assert first.poll(timeout=2) == 1
        assert first.counts["handled"] == 1
        # the ack was lost: after the ack wait the broker redelivers
        second = Consumer(record, lossy)
        second.transport = Transport()
        second.transport.connect()
        try:
            wait_for(lambda: second.poll(timeout=1) or second.counts["skipped"], timeout=10, what="redelivery")
            assert second.counts == {"handled": 0, "skipped": 1, "retried": 0, "dead_lettered": 0, "malformed": 0}
        finally:
            second.transport.close()
    finally:
        lossy.close()
    assert Effect.objects.filter(subscription="testapp.record_order", event_id=event_id).count() == 1
    assert not DeadLetter.objects.exists()


def test_twenty_failing_events_ahead_of_a_good_one_do_not_hold_it_up(broker, background_worker):
    seen = []

    def handler(event):
        if event.payload.get("fail"):
            raise RuntimeError("always fails")
        seen.append(time.monotonic())

    slow_retry = Subscription(
        name="testapp.slow_retry",
        event="testapp.flaky",
        handler=handler,
        max_attempts_override=5,
        backoff_seconds_override=(60,),
    )
    with transaction.atomic():
        for i in range(20):
            publish("testapp.flaky", {"fail": True, "n": i})
        publish("testapp.flaky", {"fail": False})
    start = time.monotonic()
    background_worker(subscriptions=[slow_retry])
    wait_for(lambda: seen, timeout=15, what="the good event")
    assert seen[0] - start < 10


def test_a_delivery_fetched_and_never_started_does_not_count_as_an_attempt(broker, settings):
    """A worker that fetched a message and died before starting it: the
    redelivery runs the handler as attempt 1, even with max_attempts=1."""
    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=1, HANDLER_TIMEOUT_SECONDS=0.5)
    ran = []
    once = Subscription(name="testapp.once_only", event="testapp.flaky", handler=ran.append, max_attempts_override=1)
    t = Transport()
    t.connect()
    t.ensure_stream()
    try:
        with transaction.atomic():
            event_id = publish("testapp.flaky", {})
        Relay(t).drain()
        consumer = Consumer(once, t)
        consumer.ensure()
        # delivery 1 is fetched and never settled, as if the worker died before starting it
        assert len(t.fetch(once.durable, 1, timeout=2)) == 1
        wait_for(lambda: consumer.poll(timeout=1), timeout=10, what="redelivery")
    finally:
        t.close()
    assert [(e.id, e.attempt) for e in ran] == [(event_id, 1)]
    assert not DeadLetter.objects.exists()
    assert HandledEvent.objects.filter(subscription="testapp.once_only", event_id=event_id).count() == 1


def test_a_redelivery_whose_runs_never_reported_is_dead_lettered_without_running(broker, settings):
    """The earlier runs started and never reported (the worker died or hung
    in them, leaving its ``running`` rows): the handler must not run again,
    and the dead letter says why, with the last real error and the history."""
    from django_platformkit.models import Attempt as RunAttempt

    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=1, HANDLER_TIMEOUT_SECONDS=0.5)
    ran = []
    twice = Subscription(name="testapp.twice_only", event="testapp.flaky", handler=ran.append, max_attempts_override=2)
    t = Transport()
    t.connect()
    t.ensure_stream()
    try:
        with transaction.atomic():
            event_id = publish("testapp.flaky", {})
        Relay(t).drain()
        # What two earlier runs left behind: one failure, then a worker that died in its run.
        RunAttempt.objects.create(
            subscription=twice.name,
            event_id=event_id,
            attempt=1,
            outcome="failed",
            error="RuntimeError: boom",
            traceback="Traceback: boom",
        )
        RunAttempt.objects.create(
            subscription=twice.name, event_id=event_id, attempt=2, outcome="running", worker="host:1"
        )
        consumer = Consumer(twice, t)
        consumer.ensure()
        (delivery,) = t.fetch(twice.durable, 1, timeout=2, puller=99)
        # Given back unsettled, as by a run that died: the broker redelivers it
        # at once (delivery count 2), not after an ack wait that races the polls.
        t.nak(delivery)
        wait_for(
            lambda: consumer.poll(timeout=1) and consumer.counts["dead_lettered"], timeout=30, what="the dead letter"
        )
    finally:
        t.close()
    assert ran == []
    dead = DeadLetter.objects.get()
    assert (dead.event_id, dead.attempts, dead.traceback) == (event_id, 2, "Traceback: boom")
    assert dead.error.splitlines()[0] == "RuntimeError: boom"
    assert "already started 2 times for this event (max_attempts=2)" in dead.error
    assert "run 2 started" in dead.error and "never reported" in dead.error
    assert HandledEvent.objects.filter(subscription="testapp.twice_only").count() == 1


@pytest.mark.process
def test_kill_9_mid_handler_then_restart_handles_once_and_counts_the_attempt(broker):
    env = worker_env(broker, PLATFORMKIT_TEST_ACK_WAIT="2", PLATFORMKIT_TEST_HANDLER_TIMEOUT="1.5")
    with transaction.atomic():
        event_id = publish("testapp.slow", {"kill_on_attempts": [1]})
    first = manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)
    assert first.wait(60) == -signal.SIGKILL
    # The first delivery's run is not recorded (the usual delivery pays
    # nothing extra), so its redelivery runs as attempt 1 again - this time
    # recorded before the handler starts, so the kill counts.
    second = manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)
    assert second.wait(60) == -signal.SIGKILL
    third = manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)
    try:
        wait_for(lambda: Effect.objects.filter(event_id=event_id).exists(), timeout=30, what="the handler's effect")
    finally:
        third.send_signal(signal.SIGTERM)
        assert third.wait(30) == 0
    assert [a for a, _ in attempts_of(event_id, "testapp.slow")] == [1, 1, 2]
    assert Effect.objects.filter(event_id=event_id).count() == 1
    assert not DeadLetter.objects.exists()


@pytest.mark.process
def test_a_slow_handler_with_two_workers_has_one_effect_and_no_redelivery(broker):
    """One worker fetches the whole batch; the last message waits behind the
    others for longer than the ack wait (4 x 1.2 s > 2 s). In-progress acks
    from fetch time keep the broker from redelivering it to the other worker."""
    env = worker_env(broker, PLATFORMKIT_TEST_ACK_WAIT="2", PLATFORMKIT_TEST_HANDLER_TIMEOUT="1.8")
    with transaction.atomic():
        event_ids = [publish("testapp.slow", {"sleep": 1.2}) for _ in range(4)]
    first = manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)
    wait_for(lambda: Attempt.objects.exists(), timeout=30, what="the first worker to start handling")
    workers = [first, manage("runworker", "--subscription", "testapp.slow", "--no-jobs", env=env)]
    try:
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.slow").count() >= 4, timeout=60, what="four effects"
        )
        time.sleep(2.5)  # longer than the ack wait: a redelivery would show now
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        assert [w.wait(30) for w in workers] == [0, 0]
    for event_id in event_ids:
        assert Effect.objects.filter(event_id=event_id).count() == 1
        assert [a for a, _ in attempts_of(event_id, "testapp.slow")] == [1]
    # The broker counts every delivery: a redelivery (even one the claim would
    # have made harmless) shows as a consumer sequence above 4.
    t = Transport()
    t.connect()
    try:
        assert t.consumer_info("testapp-slow").delivered.consumer_seq == 4
    finally:
        t.close()


def test_a_forged_message_whose_subject_tenant_differs_from_its_body_is_not_run(transport, broker, run_worker):
    good_tenant_body = {
        "specversion": "1.0",
        "id": str(uuid.uuid4()),
        "source": "/testapp",
        "type": "testapp.order_placed",
        "time": "2026-01-01T00:00:00Z",
        "datacontenttype": "application/json",
        "tenantid": "victim",
        "data": {"n": 1},
    }
    transport.publish_raw(subject_for("testapp.order_placed", "attacker"), json.dumps(good_tenant_body).encode())
    transport.publish_raw(subject_for("testapp.order_placed", None), b"not json at all")
    with transaction.atomic():
        good = publish("testapp.order_placed", {"n": 2}, tenant="acme")
    run_worker(subscriptions=[sub("testapp.record_order")])
    assert list(Effect.objects.values_list("event_id", flat=True)) == [good]
    dead = {d.error.split(": ", 1)[1][:40] for d in DeadLetter.objects.all()}
    assert DeadLetter.objects.filter(name="(malformed)").count() == 2
    assert any("tenantid 'victim' differs" in d.error for d in DeadLetter.objects.all()), dead


def test_a_replay_reruns_only_the_subscription_whose_dead_letter_it_cleared(run_worker):
    from django_platformkit import replay
    from django_platformkit.exceptions import ReplayRefused

    with transaction.atomic():
        event_id = publish("testapp.flaky", {"always_fail": True})
    run_worker(subscriptions=[sub("testapp.flaky")])
    assert DeadLetter.objects.count() == 1
    before = OutboxEvent.objects.count()
    for kwargs in [dict(actor="", reason="x"), dict(actor="ops", reason="  "), dict(actor=None, reason="x")]:
        with pytest.raises(ReplayRefused):
            replay(event_id, **kwargs)
    with pytest.raises(ReplayRefused, match="nothing to replay"):
        replay(event_id, subscription="testapp.record_order", actor="ops", reason="wrong sub")
    assert OutboxEvent.objects.count() == before and DeadLetter.objects.count() == 1

    # fix the cause, then replay
    OutboxEvent.objects.filter(id=event_id).update(payload={"always_fail": False})
    result = replay(event_id, actor="alice", reason="bug fixed in 1.2.3")
    assert result.subscriptions == ("testapp.flaky",)
    assert not DeadLetter.objects.exists()
    audit = OutboxEvent.objects.get(id=result.audit_event_id)
    assert audit.name == "platformkit.event_replayed"
    assert audit.payload == {
        "event_id": str(event_id),
        "name": "testapp.flaky",
        "subscription": None,
        "actor": "alice",
        "reason": "bug fixed in 1.2.3",
    }
    run_worker(subscriptions=[sub("testapp.flaky")])
    assert Effect.objects.filter(subscription="testapp.flaky", event_id=event_id).count() == 1
    assert OutboxEvent.objects.get(id=event_id).headers.get("platformkit_replay") == 1


def _consume_until_settled(subscription, timeout=20):
    t = Transport()
    t.connect()
    t.ensure_stream()
    try:
        Relay(t).drain()
        consumer = Consumer(subscription, t)
        consumer.ensure()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (consumer.counts["dead_lettered"] or consumer.counts["handled"]):
            consumer.poll(timeout=0.5)
        return consumer
    finally:
        t.close()


def test_a_handler_past_its_timeout_is_a_failed_attempt_and_its_writes_roll_back(broker, settings):
    settings.PLATFORMKIT = dict(broker, HANDLER_TIMEOUT_SECONDS=0.5, ACK_WAIT_SECONDS=5)

    def overruns(event):
        Effect.objects.create(subscription="testapp.overruns", event_id=event.id)
        time.sleep(0.7)

    overrun = Subscription(
        name="testapp.overruns",
        event="testapp.flaky",
        handler=overruns,
        max_attempts_override=2,
        backoff_seconds_override=(0.1,),
    )
    with transaction.atomic():
        event_id = publish("testapp.flaky", {})
    consumer = _consume_until_settled(overrun)
    assert consumer.counts["retried"] == 1 and consumer.counts["dead_lettered"] == 1
    dead = DeadLetter.objects.get()
    assert dead.event_id == event_id and "HANDLER_TIMEOUT_SECONDS=0.5" in dead.error
    assert not Effect.objects.exists()


def test_a_handlers_database_work_is_bounded_by_the_timeout(broker, settings):
    settings.PLATFORMKIT = dict(broker, HANDLER_TIMEOUT_SECONDS=0.5, ACK_WAIT_SECONDS=5)

    def sleeps_in_sql(event):
        from django.db import connection as conn

        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(10)")

    sleeper = Subscription(
        name="testapp.sql_sleeper", event="testapp.flaky", handler=sleeps_in_sql, max_attempts_override=1
    )
    with transaction.atomic():
        publish("testapp.flaky", {})
    started = time.monotonic()
    _consume_until_settled(sleeper)
    assert time.monotonic() - started < 8
    assert "statement timeout" in DeadLetter.objects.get().error


@pytest.mark.process
def test_a_worker_with_a_handler_stuck_past_timeout_and_grace_exits_non_zero(broker, tmp_path):
    health = tmp_path / "health.json"
    env = worker_env(
        broker, PLATFORMKIT_TEST_ACK_WAIT="3", PLATFORMKIT_TEST_HANDLER_TIMEOUT="1", PLATFORMKIT_TEST_STUCK_GRACE="2"
    )
    with transaction.atomic():
        event_id = publish("testapp.slow", {"sleep": 60})
    worker = manage(
        "runworker",
        "--subscription",
        "testapp.slow",
        "--no-jobs",
        "--health-file",
        str(health),
        env=env,
        stderr=__import__("subprocess").PIPE,
        text=True,
    )
    try:
        _, stderr = worker.communicate(timeout=40)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 3, stderr
    assert "handler stuck subscription=testapp.slow" in stderr
    state = json.loads(health.read_text())
    assert state["healthy"] is False and state["stuck_handlers"] == ["testapp.slow"]
    # The README's promise for every exit: the last state says so, with the status.
    assert state["stopped"] is True and state["exit_code"] == 3
    from django_platformkit.models import Attempt as RunAttempt

    # The run that never returned is recorded as failed by the timeout, with
    # the stack it hung in: its retries and dead letter say why, not "never reported".
    run = RunAttempt.objects.get(subscription="testapp.slow", event_id=event_id)
    assert (run.attempt, run.outcome) == (1, "failed")
    assert run.error.startswith("HandlerTimeout: the handler ran") and "HANDLER_TIMEOUT_SECONDS (1s)" in run.error
    assert "time.sleep(" in run.traceback and run.finished_at is not None


def test_a_dead_letter_that_cannot_be_written_is_retried_without_running_the_handler_again(broker, settings):
    from django.db import connection as conn

    settings.PLATFORMKIT = dict(broker, ACK_WAIT_SECONDS=1, HANDLER_TIMEOUT_SECONDS=0.5)
    runs = []

    def fails(event):
        runs.append(event.attempt)
        raise RuntimeError("boom")

    once = Subscription(name="testapp.fails_once", event="testapp.flaky", handler=fails, max_attempts_override=1)
    with conn.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION pk_no_dead_letters() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'disk full'; END $$;"
            "CREATE TRIGGER pk_no_dead_letters BEFORE INSERT ON platformkit_dead_letters FOR EACH ROW EXECUTE FUNCTION pk_no_dead_letters();"
        )
    with transaction.atomic():
        event_id = publish("testapp.flaky", {})
    t = Transport()
    t.connect()
    t.ensure_stream()
    try:
        Relay(t).drain()
        consumer = Consumer(once, t)
        consumer.ensure()
        wait_for(lambda: consumer.poll(timeout=0.5), timeout=10, what="first delivery")
        assert runs == [1] and not DeadLetter.objects.exists()
        with conn.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER pk_no_dead_letters ON platformkit_dead_letters; DROP FUNCTION pk_no_dead_letters();"
            )
        wait_for(
            lambda: consumer.poll(timeout=0.5) and DeadLetter.objects.exists(), timeout=10, what="the recording retried"
        )
    finally:
        t.close()
    assert runs == [1]
    assert DeadLetter.objects.get().event_id == event_id


def test_publish_inside_a_handler_defaults_to_the_handled_events_tenant(broker, settings):
    published = []

    def follow_up(event):
        published.append(publish("testapp.slow", {"from": str(event.id)}))

    sub_ = Subscription(name="testapp.follow_up", event="testapp.flaky", handler=follow_up)
    with transaction.atomic():
        publish("testapp.flaky", {}, tenant="tenant-42")
    _consume_until_settled(sub_)
    assert OutboxEvent.objects.get(id=published[0]).tenant == "tenant-42"


class RecordingTenantContext:
    entered = []

    def __init__(self, tenant):
        self.tenant = tenant

    def __enter__(self):
        from django.db import connection as conn

        RecordingTenantContext.entered.append((self.tenant, conn.in_atomic_block))

    def __exit__(self, *exc):
        return False


def test_a_custom_tenant_context_is_entered_inside_the_handlers_transaction(broker, settings):
    settings.PLATFORMKIT = dict(broker, TENANT_CONTEXT="tests.consume.test_failures.RecordingTenantContext")
    RecordingTenantContext.entered.clear()
    seen = []
    sub_ = Subscription(name="testapp.tenant_seen", event="testapp.flaky", handler=lambda e: seen.append(e.tenant))
    with transaction.atomic():
        publish("testapp.flaky", {}, tenant="acme")
    _consume_until_settled(sub_)
    assert seen == ["acme"]
    assert RecordingTenantContext.entered == [("acme", True)]


def test_replay_of_all_reruns_only_the_subscriptions_that_dead_lettered(run_worker):
    from django_platformkit import replay
    from django_platformkit.exceptions import ReplayRefused

    broken = [True]
    runs = {"a": 0, "b": 0}

    def a(event):
        runs["a"] += 1
        if broken[0]:
            raise RuntimeError("a is broken")

    def b(event):
        runs["b"] += 1

    subs = [
        Subscription(name="testapp.replay_a", event="testapp.flaky", handler=a, max_attempts_override=1),
        Subscription(name="testapp.replay_b", event="testapp.flaky", handler=b),
    ]
    with transaction.atomic():
        event_id = publish("testapp.flaky", {})
    run_worker(subscriptions=subs)
    assert runs == {"a": 1, "b": 1}
    with pytest.raises(ReplayRefused, match="no dead letter"):
        replay(event_id, subscription="testapp.replay_b", actor="ops", reason="b never failed")
    broken[0] = False
    result = replay(event_id, actor="ops", reason="a fixed")
    assert result.subscriptions == ("testapp.replay_a",)
    run_worker(subscriptions=subs)
    assert runs == {"a": 2, "b": 1}  # b held its claim and skipped the re-send
    # running a handler that succeeded again is possible, but only on purpose
    with pytest.raises(
        ReplayRefused, match=r"'testapp.replay_bb' neither handled .* testapp.replay_a, testapp.replay_b"
    ):
        replay(event_id, subscription="testapp.replay_bb", actor="ops", reason="typo", include_handled=True)
    replay(event_id, subscription="testapp.replay_b", actor="ops", reason="recompute", include_handled=True)
    run_worker(subscriptions=subs)
    assert runs == {"a": 2, "b": 2}


@pytest.mark.process
@pytest.mark.parametrize(
    "signals,expected", [(1, 3), (2, 1)], ids=["sigterm-waits-then-exits-3", "second-sigterm-exits-at-once"]
)
def test_sigterm_with_a_stuck_handler_still_ends_the_worker(broker, signals, expected):
    import subprocess

    env = worker_env(
        broker, PLATFORMKIT_TEST_ACK_WAIT="3", PLATFORMKIT_TEST_HANDLER_TIMEOUT="1", PLATFORMKIT_TEST_STUCK_GRACE="2"
    )
    with transaction.atomic():
        event_id = publish("testapp.slow", {"sleep": 120})
    worker = manage(
        "runworker", "--subscription", "testapp.slow", "--no-jobs", env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: Attempt.objects.filter(event_id=event_id).exists(), timeout=30, what="the handler to start")
        for _ in range(signals):
            worker.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        _, stderr = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == expected, stderr
