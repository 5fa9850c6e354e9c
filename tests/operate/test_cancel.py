"""``cancel()``: an event that has not run yet never runs once cancelled -
waiting for a retry, deferred, or racing a running handler (exactly one of
the two wins, and cancel says which); idempotent, audited, refused without
actor and reason. Real PostgreSQL and NATS."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_platformkit import cancel, declare, publish, subscribe
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.exceptions import Cancelled, CancelRefused, PlatformKitError
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from tests.conftest import wait_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def audits():
    return list(OutboxEvent.objects.filter(name="platformkit.event_cancelled").values_list("payload", flat=True))


def test_a_failing_event_waiting_for_a_retry_cancelled_never_runs_again_and_leaves_no_dead_letter(
    broker, registries, background_worker
):
    declare("testapp.doomed")
    runs = []

    # The retry waits 3 s (long for a test): the cancel lands while it is parked on the broker.
    @subscribe("testapp.doomed", name="testapp.doomed", max_attempts=5, backoff_seconds=[3])
    def doomed(event):
        runs.append(event.attempt)
        raise RuntimeError("fails until cancelled")

    with transaction.atomic():
        event_id = publish("testapp.doomed", {})
    worker = background_worker(subscriptions=[get_subscription("testapp.doomed")])
    wait_for(lambda: runs, what="the first, failing run")
    result = cancel(event_id, actor="alice", reason="customer withdrew the order")
    assert result.cancelled == ("testapp.doomed",) and result.too_late == ()
    assert audits() == [
        {
            "event_id": str(event_id),
            "name": "testapp.doomed",
            "subscription": None,
            "actor": "alice",
            "reason": "customer withdrew the order",
        }
    ]
    assert HandledEvent.objects.get(event_id=event_id).outcome == "cancelled"
    # Idempotent: nothing written, nothing published again.
    again = cancel(event_id, actor="bob", reason="twice")
    assert again.cancelled == () and again.already_cancelled == ("testapp.doomed",) and again.audit_event_id is None
    assert len(audits()) == 1
    # The parked retry comes back, finds the cancel's claim, and is acked without running.
    durable = get_subscription("testapp.doomed").durable
    wait_for(
        lambda: (
            worker.consumers[0].counts["skipped"] == 1 and worker.transport.consumer_info(durable).num_ack_pending == 0
        ),
        timeout=20,
        what="the redelivery skipped and acked",
    )
    assert runs == [1]
    assert not DeadLetter.objects.exists()


def test_an_event_cancelled_before_it_ran_never_runs(broker, registries, run_worker):
    declare("testapp.unwanted")
    runs = []

    @subscribe("testapp.unwanted", name="testapp.unwanted")
    def unwanted(event):
        runs.append(event.id)

    with transaction.atomic():
        event_id = publish("testapp.unwanted", {})
    cancel(event_id, actor="alice", reason="before it ran")
    run_worker(subscriptions=[get_subscription("testapp.unwanted")])
    assert runs == [] and not DeadLetter.objects.exists()


@pytest.mark.skipif(not __import__("importlib").util.find_spec("django.tasks"), reason="Django 6")
def test_a_deferred_task_cancelled_reads_failed_cancelled_and_its_function_never_runs(broker, run_worker):
    from django.tasks import TaskResultStatus, task_backends

    from django_platformkit.consume import subscriptions as registry
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import register_task_queues
    from tests.testapp import tasks

    with override_settings(
        TASKS={"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default", "emails"]}}
    ):
        names = register_task_queues()
        try:
            result = tasks.record.using(run_after=timezone.now() + dt.timedelta(seconds=1)).enqueue("cancelled_task")
            outcome = cancel(result.id, actor="alice", reason="not needed any more")
            assert outcome.cancelled == ("platformkit.task_default",)
            time.sleep(1.2)  # due now: the relay sends it, the worker skips it
            run_worker(subscriptions=[s for s in registry.subscriptions() if s.name in names])
            assert Effect.objects.filter(subscription="cancelled_task").count() == 0
            read = task_backends["default"].get_result(result.id)
            assert read.status == TaskResultStatus.FAILED
            assert read.errors[-1].exception_class is Cancelled
            assert "alice: not needed any more" in read.errors[-1].traceback
            assert issubclass(Cancelled, PlatformKitError)
        finally:
            for name in names:
                registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)


def test_cancel_racing_a_running_handler_exactly_one_wins_and_cancel_says_which(broker, registries, background_worker):
    declare("testapp.racing")
    started, release = threading.Event(), threading.Event()

    @subscribe("testapp.racing", name="testapp.racing")
    def racing(event):
        started.set()
        release.wait(10)
        Effect.objects.create(subscription="testapp.racing", event_id=event.id)

    with transaction.atomic():
        running_id = publish("testapp.racing", {})
    background_worker(subscriptions=[get_subscription("testapp.racing")])
    assert started.wait(20)
    results = []

    def cancel_in_a_thread():
        try:
            results.append(cancel(running_id, actor="a", reason="race"))
        finally:
            connection.close()  # this thread's own connection

    canceller = threading.Thread(target=cancel_in_a_thread)
    canceller.start()
    time.sleep(0.5)
    assert results == []  # waits for the running handler's transaction
    release.set()
    canceller.join(20)
    (result,) = results
    assert result.too_late == ("testapp.racing",) and result.cancelled == ()  # the handler committed first
    assert Effect.objects.filter(event_id=running_id).count() == 1
    assert HandledEvent.objects.get(event_id=running_id).outcome == "handled"
    assert audits() == []  # nothing was cancelled: nothing to audit


def test_cancel_refuses_without_actor_reason_or_a_known_event_and_writes_nothing(broker, registries):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {})
    for kwargs in [dict(actor="", reason="x"), dict(actor="ops", reason=" ")]:
        with pytest.raises(CancelRefused):
            cancel(event_id, **kwargs)
    with pytest.raises(CancelRefused, match="not in the outbox"):
        cancel("00000000-0000-7000-8000-000000000000", actor="ops", reason="x")
    with pytest.raises(CancelRefused, match="does not receive"):
        cancel(event_id, subscription="testapp.flaky", actor="ops", reason="x")
    assert not HandledEvent.objects.exists() and audits() == []
    assert isinstance(CancelRefused("x"), ValueError)


@pytest.fixture
def ops():
    """``--actor ops``: an active user holding the permission the admin's Cancel needs."""
    from tests.management.test_deadletters_command import operator

    return operator("ops")


def test_manage_py_cancel_cancels_one_subscription_and_says_so(broker, capsys, ops):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {})
    call_command("cancel", str(event_id), "--subscription", "testapp.count_order", "--actor", "ops", "--reason", "why")
    out = capsys.readouterr().out
    assert f"cancelled event={event_id} subscription=testapp.count_order" in out
    assert list(HandledEvent.objects.values_list("subscription", "outcome")) == [("testapp.count_order", "cancelled")]
    assert audits()[0]["subscription"] == "testapp.count_order"
    # The options it misses, by name: not cancel()'s own words ("cancel() needs an actor and a reason").
    with pytest.raises(CommandError, match="required: --reason"):
        call_command("cancel", str(event_id), "--actor", "ops")
    with pytest.raises(CommandError, match="required: --actor, --reason"):
        call_command("cancel", str(event_id))
    with pytest.raises(CommandError, match=r"give --actor USERNAME and --reason TEXT: who cancels"):
        call_command("cancel", str(event_id), "--actor", " ", "--reason", "")
    assert len(audits()) == 1


def test_manage_py_cancel_of_an_event_every_subscription_finished_says_how_to_close_a_dead_letter(
    broker, registries, run_worker, capsys, ops
):
    declare("testapp.finished")

    @subscribe("testapp.finished", name="testapp.finished")
    def finished(event):
        pass

    with transaction.atomic():
        event_id = publish("testapp.finished", {})
    run_worker(subscriptions=[get_subscription("testapp.finished")])
    with pytest.raises(CommandError) as refused:
        call_command("cancel", str(event_id), "--actor", "ops", "--reason", "too late")
    assert str(refused.value) == (
        f"nothing cancelled: every subscription of event {event_id} had handled or dead-lettered it first. "
        f"A dead letter is closed with `manage.py deadletters discard {event_id} --reason TEXT`."
    )
    assert f"too late event={event_id} subscription=testapp.finished" in capsys.readouterr().out
    assert audits() == []  # nothing cancelled: no audit event


@pytest.mark.process
@pytest.mark.parametrize(
    ("actor", "why"),
    [
        ("pager-bot", "no such user"),  # accepted before: the audit event recorded a user nobody is
        ("ivan", "the user is inactive"),
        ("nora", "lacks the permission 'django_platformkit.replay_deadletter'"),
    ],
)
def test_manage_py_cancel_checks_the_actor_as_deadletters_does_and_writes_nothing(broker, actor, why):
    from tests.conftest import run_to_exit, worker_env
    from tests.management.test_deadletters_command import operator

    operator("ivan", active=False)
    operator("nora", permitted=False)
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {})
    code, output = run_to_exit("cancel", str(event_id), "--actor", actor, "--reason", "why", env=worker_env(broker))
    assert code == 1 and "Traceback" not in output, output
    assert f"cancel --actor {actor}: refused, nothing written: " in output and why in output, output
    assert HandledEvent.objects.count() == 0 and audits() == []


@pytest.mark.process
def test_manage_py_cancel_of_an_unknown_event_or_subscription_is_a_clear_error_writing_nothing(broker, ops):
    from tests.conftest import run_to_exit, worker_env

    with transaction.atomic():
        event_id = publish("testapp.order_placed", {})
    env = worker_env(broker)
    unknown = "0192f1c2-0000-7000-8000-000000000000"
    for args, says in (
        ((unknown,), f"event {unknown} is not in the outbox (never published, or purged): nothing to cancel."),
        (("not-an-id",), "'not-an-id' is not an event id (a UUID)."),
        ((str(event_id), "--subscription", "testapp.nope"), "subscription 'testapp.nope' does not receive"),
    ):
        code, output = run_to_exit("cancel", *args, "--actor", "ops", "--reason", "why", env=env)
        assert code == 1 and "Traceback" not in output, output
        assert f"CommandError: {says}" in output, output
    assert HandledEvent.objects.count() == 0 and audits() == []
