"""Django's Tasks API through the outbox (django_platformkit.tasks): enqueue
in the caller's transaction, exactly-once runs, retries into dead letters and
replay, deferred runs, results, signals, checks - real PostgreSQL and NATS."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

pytest.importorskip("django.tasks")

from django.tasks import TaskResultStatus, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started

from django_platformkit.consume import subscriptions as subscription_registry
from django_platformkit.exceptions import InvalidPayload
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.outbox.relay import Relay
from tests.conftest import wait_for
from tests.testapp import tasks
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default", "emails"]}}


@pytest.fixture
def outbox_tasks(broker):
    """TASKS -> OutboxBackend, with the queues' subscriptions registered (as
    AppConfig.ready() does when TASKS is in the settings); removed afterwards."""
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import register_task_queues

    with override_settings(TASKS=TASKS):
        names = register_task_queues()
        try:
            yield task_backends["default"]
        finally:
            for name in names:
                subscription_registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)


def task_subscriptions():
    from django_platformkit.consume.subscriptions import subscriptions

    return [s for s in subscriptions() if s.name.startswith("platformkit.task_")]


def effects(label):
    return Effect.objects.filter(subscription=label).count()


def test_a_rolled_back_enqueue_leaves_no_row_and_nothing_runs(outbox_tasks, run_worker):
    with transaction.atomic():
        result = tasks.record.enqueue("rolled")
        transaction.set_rollback(True)
    assert not OutboxEvent.objects.exists()
    run_worker(subscriptions=task_subscriptions())
    assert effects("rolled") == 0
    with pytest.raises(TaskResultDoesNotExist):
        outbox_tasks.get_result(result.id)


def test_a_committed_task_runs_once_and_its_result_says_successful(outbox_tasks, run_worker):
    with transaction.atomic():
        result = tasks.record.enqueue("committed", n=3)
    assert result.status == TaskResultStatus.READY
    assert result.id == str(OutboxEvent.objects.get().id)
    assert result.enqueued_at is not None and result.started_at is None
    assert tasks.record.get_result(result.id).status == TaskResultStatus.READY
    run_worker(subscriptions=task_subscriptions())
    assert effects("committed") == 1
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"label": "committed", "n": 3}
    assert result.args == ["committed"] and result.kwargs == {"n": 3}
    assert result.enqueued_at <= result.started_at <= result.last_attempted_at <= result.finished_at
    assert result.errors == [] and len(result.worker_ids) == 1


def test_enqueue_outside_atomic_commits_on_its_own(outbox_tasks, run_worker):
    assert not connection.in_atomic_block
    result = tasks.send_email.enqueue("a@example.com")
    # Seen from another connection: committed.
    from django.db import connections

    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT name FROM platformkit_outbox WHERE id = %s", [uuid.UUID(result.id)])
            assert cursor.fetchone() == ("platformkit.task_emails",)
    finally:
        other.close()
    run_worker(subscriptions=task_subscriptions())
    assert effects("emails") == 1
    assert outbox_tasks.get_result(result.id).return_value == "a@example.com"


def test_an_argument_json_cant_carry_raises_before_sql_and_the_transaction_stays_usable(
    outbox_tasks, django_assert_num_queries
):
    with transaction.atomic():
        with django_assert_num_queries(0), pytest.raises(InvalidPayload, match=r"\$\.args\[1\]"):
            tasks.record.enqueue("bad", object())
        with django_assert_num_queries(0), pytest.raises(InvalidPayload, match=r"\$\.kwargs\.n"):
            tasks.record.enqueue("bad", n=float("nan"))
        tasks.record.enqueue("good")  # the transaction still works
    assert OutboxEvent.objects.count() == 1


def test_arguments_follow_djangos_own_rule_so_a_task_runs_the_same_on_any_backend(
    outbox_tasks, django_assert_num_queries
):
    """Django's backends refuse a datetime or a Decimal argument
    (``normalize_json``) and turn UTF-8 bytes and tuples into str and lists:
    so do we, instead of storing a datetime as its ISO string."""
    import datetime
    import decimal

    with transaction.atomic():
        for bad, path in [
            (datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC), r"\$\.args\[1\]"),
            ({"nested": [decimal.Decimal("1.5")]}, r"\$\.args\[1\]\.nested\[0\]"),
            (b"\xff", r"\$\.args\[1\]"),
        ]:
            with django_assert_num_queries(0), pytest.raises(InvalidPayload, match=path) as refused:
                tasks.record.enqueue("bad", bad)
            assert "Django's task backends" in str(refused.value)
        with django_assert_num_queries(0), pytest.raises(InvalidPayload, match=r"\$\.kwargs\.n"):
            tasks.record.enqueue("bad", n=datetime.date(2026, 1, 1))
        result = tasks.record.enqueue(b"label", n=(1, 2))
    assert (result.args, result.kwargs) == (["label"], {"n": [1, 2]})
    stored = OutboxEvent.objects.get().payload
    assert (stored["args"], stored["kwargs"]) == (["label"], {"n": [1, 2]})


@pytest.mark.parametrize(
    ("args", "kwargs", "reason"),
    [
        ((), {}, "missing a required argument: 'label'"),
        (("x",), {"m": 1}, "got an unexpected keyword argument 'm'"),
        (("x", 1, 2), {}, "too many positional arguments"),
        (("x",), {"label": "y"}, "multiple values for argument 'label'"),
    ],
)
def test_arguments_the_function_cant_take_raise_type_error_at_enqueue_before_sql_and_the_transaction_stays_usable(
    outbox_tasks, django_assert_num_queries, args, kwargs, reason
):
    """As Celery's Task.typing does: the mistake surfaces at the call, not as
    MAX_ATTEMPTS failed runs on the worker and a dead letter."""
    with transaction.atomic():
        Effect.objects.create(subscription="caller", event_id=uuid.uuid4())
        with django_assert_num_queries(0), pytest.raises(TypeError) as refused:
            tasks.record.enqueue(*args, **kwargs)
        Effect.objects.create(subscription="caller", event_id=uuid.uuid4())  # the transaction is still usable
    assert str(refused.value) == (
        f"task tests.testapp.tasks.record(label, n=1) can't be called with these arguments: {reason}. "
        "Nothing was enqueued: pass enqueue() the arguments the function takes, or change the function "
        "(a task enqueued like this would fail on every attempt)."
    )
    assert not OutboxEvent.objects.exists()
    assert effects("caller") == 2


def test_a_call_the_function_cant_take_is_refused_before_its_values_are_looked_at(outbox_tasks):
    """Both wrong: the shape of the call is reported, as calling the function would."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'm'"):
        tasks.record.enqueue(object(), m=float("nan"))
    assert not OutboxEvent.objects.exists()


def test_a_context_task_binds_its_arguments_without_the_context_django_passes(outbox_tasks):
    after_context = r"the arguments the function takes after the context \(Django passes the TaskContext\)"
    with pytest.raises(TypeError, match=r"record_with_context\(context, label\) can't be called") as refused:
        tasks.record_with_context.enqueue()
    assert "missing a required argument: 'label'" in str(refused.value)
    with pytest.raises(TypeError, match=rf"too many positional arguments\. Nothing was enqueued: .*{after_context}"):
        tasks.record_with_context.enqueue("ctx", "extra")
    with pytest.raises(TypeError, match="multiple values for argument 'context'"):
        tasks.record_with_context.enqueue("ctx", context="mine")
    assert not OutboxEvent.objects.exists()
    result = tasks.record_with_context.enqueue("ctx_binds")
    assert OutboxEvent.objects.get().payload["args"] == ["ctx_binds"]
    assert result.args == ["ctx_binds"]


def test_a_task_taking_args_and_kwargs_accepts_any_arguments_and_runs(outbox_tasks, run_worker):
    results = [
        tasks.takes_anything.enqueue(),
        tasks.takes_anything.enqueue(1, 2, 3),
        tasks.takes_anything.enqueue("a", label="b", n=1),
    ]
    run_worker(subscriptions=task_subscriptions())
    assert [outbox_tasks.get_result(r.id).return_value for r in results] == [0, 3, 3]
    assert effects("anything") == 3


def test_a_decorated_task_is_checked_against_the_wrapper_not_the_function_it_wraps(outbox_tasks, run_worker):
    """functools.wraps sets __wrapped__; the wrapper here passes the wrapped
    function's first argument itself, so the inner signature would refuse
    every correct call."""
    result = tasks.decorated.enqueue("wrapped")
    run_worker(subscriptions=task_subscriptions())
    assert outbox_tasks.get_result(result.id).return_value == "unit"
    assert effects("wrapped") == 1


def test_a_function_without_a_readable_signature_is_not_checked():
    """Django refuses builtins as tasks; a Task built around one anyway
    (a builtin has no signature to bind to) is let through, not refused."""
    from types import SimpleNamespace

    from django_platformkit.tasks.arguments import refuse_arguments_it_cant_take

    stand_in = SimpleNamespace(func=max, takes_context=False, module_path="builtins.max")
    refuse_arguments_it_cant_take(stand_in, ["any", "thing"], {"whatever": 1})


def test_aenqueue_refuses_arguments_the_function_cant_take_too(outbox_tasks):
    import asyncio

    with pytest.raises(TypeError, match=r"tests\.testapp\.tasks\.record\(label, n=1\) can't be called"):
        asyncio.run(tasks.record.aenqueue(m=1))
    assert not OutboxEvent.objects.exists()


def test_a_queue_not_in_QUEUES_is_refused_at_enqueue(outbox_tasks):
    with pytest.raises(InvalidTask, match="Queue 'other' is not valid"):
        tasks.record.using(queue_name="other").enqueue("x")
    assert not OutboxEvent.objects.exists()


def test_the_same_message_delivered_three_more_times_writes_once(outbox_tasks, transport, run_worker):
    from django_platformkit.wire import envelope

    result = tasks.record.enqueue("dup")
    Relay(transport).drain()
    with connection.cursor() as cursor:
        cursor.execute("SELECT id, name, tenant, payload::text, headers, created_at FROM platformkit_outbox")
        message = envelope(*cursor.fetchone())
    for _ in range(3):
        assert not transport.publish_raw(
            message.subject, message.body, headers={"Nats-Msg-Id": str(uuid.uuid4())}
        ).duplicate
    run_worker(subscriptions=task_subscriptions())
    assert effects("dup") == 1
    assert outbox_tasks.get_result(result.id).status == TaskResultStatus.SUCCESSFUL


def test_a_task_that_always_fails_runs_max_attempts_then_fails_and_replay_after_a_fix_succeeds(
    outbox_tasks, run_worker, settings
):
    from django_platformkit import replay

    max_attempts = settings.PLATFORMKIT["MAX_ATTEMPTS"]
    result = tasks.fails_until_fixed.enqueue("flaky_task")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == max_attempts
    assert {e.exception_class_path for e in result.errors} == {"builtins.RuntimeError"}
    assert "not fixed yet" in result.errors[-1].traceback
    assert result.errors[0].exception_class is RuntimeError
    assert len(result.worker_ids) == max_attempts
    assert result.finished_at is not None
    assert effects("flaky_task") == 0  # every failed run's write rolled back
    dead = DeadLetter.objects.get()
    assert (dead.subscription, str(dead.event_id), dead.attempts) == (
        "platformkit.task_default",
        result.id,
        max_attempts,
    )
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value

    Effect.objects.create(subscription="flaky_task.fixed", event_id=uuid.uuid4())
    replay(result.id, actor="ops", reason="fixed")
    assert outbox_tasks.get_result(result.id).status == TaskResultStatus.READY
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "fixed"
    assert effects("flaky_task") == 1
    assert len(result.errors) == max_attempts  # the history stays


def test_a_task_removed_after_it_was_enqueued_fails_and_its_result_still_reads(outbox_tasks, run_worker, settings):
    """A rolling deploy can leave a task the running code doesn't have: it is
    retried (a newer worker may have it), then FAILED; get_result() and
    Django's task_finished still work, with the task's path as enqueued."""
    finished = []
    task_finished.connect(
        lambda sender, task_result, **kw: finished.append(task_result), weak=False, dispatch_uid="test.removed"
    )
    try:
        result = tasks.record.enqueue("removed")
        OutboxEvent.objects.filter(id=result.id).update(
            payload={"task": "tests.testapp.tasks.gone", "args": ["removed"], "kwargs": {}, "backend": "default"}
        )
        run_worker(subscriptions=task_subscriptions())
    finally:
        task_finished.disconnect(dispatch_uid="test.removed")
    read = outbox_tasks.get_result(result.id)
    assert read.status == TaskResultStatus.FAILED
    assert read.task.module_path == "tests.testapp.tasks.gone"
    assert len(read.errors) == settings.PLATFORMKIT["MAX_ATTEMPTS"]
    assert "can't be imported" in read.errors[-1].traceback
    with pytest.raises(ValueError, match="can't be imported"):
        read.task.func()
    # One task_finished per attempt, as for any failure (tasks/runner.py).
    assert [(r.id, r.status) for r in finished] == [(result.id, TaskResultStatus.FAILED)] * len(read.errors)
    assert effects("removed") == 0


def test_a_deferred_tasks_result_keeps_its_run_after(outbox_tasks):
    when = timezone.now() + dt.timedelta(hours=1)
    result = tasks.record.using(run_after=when).enqueue("later")
    assert outbox_tasks.get_result(result.id).task.run_after == when


def test_a_replayed_task_that_fails_again_gets_max_attempts_afresh_and_its_result_keeps_every_error(
    outbox_tasks, run_worker, settings
):
    from django_platformkit import replay
    from django_platformkit.models import Attempt

    max_attempts = settings.PLATFORMKIT["MAX_ATTEMPTS"]
    result = tasks.fails_until_fixed.enqueue("failing_twice")
    run_worker(subscriptions=task_subscriptions())
    replay(result.id, actor="ops", reason="try again, not fixed")
    # The replay deleted the attempt history: the re-send starts at attempt 1.
    assert not Attempt.objects.filter(event_id=result.id).exists()
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    dead = DeadLetter.objects.get()
    assert dead.attempts == max_attempts  # only the runs after the replay
    assert sorted(Attempt.objects.filter(event_id=result.id).values_list("attempt", flat=True)) == list(
        range(1, max_attempts + 1)
    )
    # The task's result is one row across the replay: both rounds' errors and runs.
    assert len(result.errors) == len(result.worker_ids) == 2 * max_attempts


def test_a_successful_task_replayed_with_include_handled_reads_ready_then_failed_when_the_rerun_fails(
    outbox_tasks, run_worker
):
    """README "Results": FAILED means dead-lettered, READY waiting for a run.
    A task run again on purpose (include_handled=True) is no longer the
    success it was: until the rerun it reads READY, and a rerun that ends as
    a dead letter reads FAILED - not the old SUCCESSFUL and return value."""
    from django_platformkit import replay

    marker = Effect.objects.create(subscription="rerun.fixed", event_id=uuid.uuid4())
    result = tasks.fails_until_fixed.enqueue("rerun")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "fixed")

    marker.delete()  # the rerun fails every time now
    replay(result.id, subscription="platformkit.task_default", include_handled=True, actor="ops", reason="rerun")
    assert outbox_tasks.get_result(result.id).status == TaskResultStatus.READY
    run_worker(subscriptions=task_subscriptions())
    assert DeadLetter.objects.filter(event_id=result.id).exists()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value


def test_a_return_value_json_cant_carry_fails_once_with_its_path_and_is_dead_lettered_without_retries(
    outbox_tasks, run_worker, settings
):
    assert settings.PLATFORMKIT["MAX_ATTEMPTS"] > 1  # else "not retried" would prove nothing
    result = tasks.returns_a_set.enqueue("set_task")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == 1  # one run: a retry would fail the same way
    # The class Django's backends record, not ours: portable code compares with TypeError.
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type" in result.errors[0].traceback and "at $.ok" in result.errors[0].traceback
    assert effects("set_task") == 0  # its write rolled back
    dead = DeadLetter.objects.get()
    assert dead.attempts == 1
    assert "return value" in dead.error and "at $.ok" in dead.error


@pytest.mark.parametrize(
    ("kind", "said"),
    [("nul", "NUL character"), ("nan", "not a JSON number"), ("huge", "more than 4300 digits")],
)
def test_a_return_value_jsonb_refuses_fails_once_with_its_path_beside_a_task_that_succeeds(
    outbox_tasks, run_worker, kind, said
):
    bad = tasks.returns_what_jsonb_refuses.enqueue(f"jsonb_{kind}", kind)
    good = tasks.record.enqueue("jsonb_neighbour")  # same queue, same unit
    run_worker(subscriptions=task_subscriptions())
    bad.refresh()
    assert bad.status == TaskResultStatus.FAILED
    assert len(bad.errors) == 1  # not retried: it would fail every time
    assert bad.errors[0].exception_class is ValueError  # a built-in's class, as Django's backends record
    assert said in bad.errors[0].traceback and "$.at" in bad.errors[0].traceback
    assert effects(f"jsonb_{kind}") == 0  # its write rolled back
    assert outbox_tasks.get_result(good.id).status == TaskResultStatus.SUCCESSFUL
    assert effects("jsonb_neighbour") == 1


def test_a_context_task_sees_the_handler_run_count_as_attempt(outbox_tasks, run_worker):
    result = tasks.record_with_context.enqueue("ctx")
    run_worker(subscriptions=task_subscriptions())
    assert Effect.objects.get(subscription="ctx").payload == {"attempt": 1}
    assert outbox_tasks.get_result(result.id).return_value == 1


def test_get_result_of_an_id_that_never_existed_raises(outbox_tasks):
    with pytest.raises(TaskResultDoesNotExist):
        outbox_tasks.get_result(str(uuid.uuid4()))
    with pytest.raises(TaskResultDoesNotExist):
        outbox_tasks.get_result("not-a-uuid")


def test_a_result_lives_as_long_as_its_outbox_row(outbox_tasks, run_worker):
    result = tasks.record.enqueue("purged")
    run_worker(subscriptions=task_subscriptions())
    assert outbox_tasks.get_result(result.id).status == TaskResultStatus.SUCCESSFUL
    OutboxEvent.objects.filter(id=result.id).delete()  # what purge does once the row is old
    with pytest.raises(TaskResultDoesNotExist):
        outbox_tasks.get_result(result.id)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM platformkit_task_results")
        assert cursor.fetchone()[0] == 0  # deleted with the row


def test_django_signals_are_sent_as_djangos_backends_send_them(outbox_tasks, run_worker, settings):
    seen = []

    def receiver(signal_name):
        def receive(sender, task_result, **kwargs):
            seen.append((signal_name, sender, task_result.id, task_result.status))

        return receive

    receivers = {
        task_enqueued: receiver("enqueued"),
        task_started: receiver("started"),
        task_finished: receiver("finished"),
    }
    for signal, func in receivers.items():
        signal.connect(func)
    try:
        with transaction.atomic():
            tasks.record.enqueue("rolled_back_signal")
            transaction.set_rollback(True)
        assert seen == []  # enqueued means committed
        ok = tasks.record.enqueue("signals")
        bad = tasks.fails_until_fixed.enqueue("signals_bad")
        run_worker(subscriptions=task_subscriptions())
    finally:
        for signal, func in receivers.items():
            signal.disconnect(func)
    backend_class = type(outbox_tasks)
    mine = [s for s in seen if s[2] == ok.id]
    assert mine == [
        ("enqueued", backend_class, ok.id, TaskResultStatus.READY),
        ("started", backend_class, ok.id, TaskResultStatus.RUNNING),
        ("finished", backend_class, ok.id, TaskResultStatus.SUCCESSFUL),
    ]
    # Paired per attempt: each run's task_started is followed by its task_finished (FAILED).
    failed = [(s[0], s[3]) for s in seen if s[2] == bad.id]
    runs = settings.PLATFORMKIT["MAX_ATTEMPTS"]
    assert (
        failed
        == [("enqueued", TaskResultStatus.READY)]
        + [
            ("started", TaskResultStatus.RUNNING),
            ("finished", TaskResultStatus.FAILED),
        ]
        * runs
    )


def test_a_running_task_reads_as_running(outbox_tasks):
    """RUNNING is the advisory lock the task's transaction holds."""
    from django.db import connections

    from django_platformkit.tasks.results import RUNNING_LOCK_NAMESPACE

    result = tasks.record.enqueue("running")
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            # The lock the claim takes (claim._claim_sql), as a statement of its own.
            cursor.execute(
                "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s::uuid::text))", [RUNNING_LOCK_NAMESPACE, result.id]
            )
        running = outbox_tasks.get_result(result.id)
        assert running.status == TaskResultStatus.RUNNING
        assert running.started_at is not None and running.last_attempted_at is not None
        other.rollback()
        assert outbox_tasks.get_result(result.id).status == TaskResultStatus.READY
    finally:
        other.close()


def test_a_task_a_worker_runs_reads_as_running_then_successful(outbox_tasks, background_worker):
    """The claim takes the RUNNING lock (no statement of the task's own): a
    worker's running task reads as RUNNING from another connection."""
    result = tasks.waits_for_release.enqueue("held")
    background_worker(subscriptions=task_subscriptions())
    running = wait_for(
        lambda: (r := outbox_tasks.get_result(result.id)).status == TaskResultStatus.RUNNING and r,
        timeout=15,
        interval=0.05,
        what="the task to read as RUNNING",
    )
    assert running.started_at is not None and running.finished_at is None
    Effect.objects.create(subscription="held.release", event_id=uuid.uuid4(), payload={})
    done = wait_for(
        lambda: (r := outbox_tasks.get_result(result.id)).is_finished and r, timeout=15, what="the task to finish"
    )
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == "released"
    assert done.started_at <= done.finished_at
    assert effects("held") == 1


def _default_queue_consumer(transport):
    from django_platformkit.consume.consumer import Consumer

    Relay(transport).drain()
    sub = next(s for s in task_subscriptions() if s.name == "platformkit.task_default")
    consumer = Consumer(sub, transport)
    consumer.ensure()
    return consumer


def test_a_unit_of_tasks_writes_its_results_in_one_statement_and_one_failure_keeps_the_others(
    outbox_tasks, transport, django_assert_max_num_queries
):
    """A batch's results are one statement before its commit; when one task
    raises, the redo with savepoints writes each other task's result with it."""
    with transaction.atomic():
        ok = [tasks.record.enqueue("unit", n=i) for i in range(5)]
    consumer = _default_queue_consumer(transport)
    # BEGIN, the claim, each task's own insert, one statement for the five results, COMMIT.
    with django_assert_max_num_queries(2 + 5 + 1 + 1):
        assert consumer.poll(timeout=2) == 5
    for i, result in enumerate(ok):
        done = outbox_tasks.get_result(result.id)
        assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == {"label": "unit", "n": i}
        assert done.started_at <= done.finished_at
    with transaction.atomic():
        mixed = [tasks.record.enqueue("mixed", n=i) for i in range(2)]
        failing = tasks.fails_until_fixed.enqueue("mixed_bad")
        mixed += [tasks.record.enqueue("mixed", n=i) for i in range(2, 4)]
    Relay(transport).drain()
    assert consumer.poll(timeout=2) == 5
    assert consumer.counts["retried"] == 1
    for result in mixed:
        assert outbox_tasks.get_result(result.id).status == TaskResultStatus.SUCCESSFUL
    assert effects("mixed") == 4 and effects("mixed_bad") == 0
    retried = outbox_tasks.get_result(failing.id)
    assert retried.status == TaskResultStatus.READY
    assert [e.exception_class_path for e in retried.errors] == ["builtins.RuntimeError"]


def test_run_after_is_honoured_by_a_running_worker_within_a_second(outbox_tasks, background_worker):
    background_worker(subscriptions=task_subscriptions())
    time.sleep(1.0)  # the worker is up and idle
    run_after = timezone.now() + dt.timedelta(seconds=3)
    result = tasks.record.using(run_after=run_after).enqueue("deferred")
    assert OutboxEvent.objects.get().not_before == run_after
    time.sleep(2.5)
    assert effects("deferred") == 0, "started before run_after"
    done = wait_for(
        lambda: outbox_tasks.get_result(result.id) if outbox_tasks.get_result(result.id).is_finished else None,
        timeout=10,
        interval=0.05,
        what="the deferred task",
    )
    assert done.status == TaskResultStatus.SUCCESSFUL
    late = (done.started_at - run_after).total_seconds()
    assert 0 <= late < 1.0, f"started {late:.3f}s after run_after"


def test_burst_runs_what_is_due_and_leaves_later_rows_pending(outbox_tasks, run_worker):
    later = tasks.record.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue("later")
    now = tasks.record.enqueue("now")
    run_worker(subscriptions=task_subscriptions(), timeout=30)
    assert effects("now") == 1 and effects("later") == 0
    assert outbox_tasks.get_result(now.id).status == TaskResultStatus.SUCCESSFUL
    assert OutboxEvent.objects.get(id=later.id).published_at is None
    assert outbox_tasks.get_result(later.id).status == TaskResultStatus.READY


def test_a_naive_run_after_is_refused_by_djangos_validation(outbox_tasks):
    with pytest.raises(InvalidTask, match="aware"):
        tasks.record.using(run_after=dt.datetime(2030, 1, 1)).enqueue("naive")


def test_aenqueue_and_aget_result_from_an_async_view(outbox_tasks, async_client, run_worker):
    import asyncio

    body = asyncio.run(async_client.get("/tasks/enqueue/?label=async_view"))
    assert body.status_code == 200, body.content
    result_id = body.json()["id"]
    assert body.json()["status"] == "READY"
    run_worker(subscriptions=task_subscriptions())
    body = asyncio.run(async_client.get(f"/tasks/result/{result_id}/"))
    assert body.json() == {"id": result_id, "status": "SUCCESSFUL", "return_value": {"label": "async_view", "n": 1}}
    assert effects("async_view") == 1
    # The views' ORM calls ran in asgiref's thread-sensitive executor thread: close its connection.
    from asgiref.sync import sync_to_async
    from django.db import connections

    asyncio.run(sync_to_async(connections.close_all)())


def test_check_errors_when_the_app_is_not_installed_or_a_queue_cant_be_an_event_name():
    from django_platformkit.tasks.backend import OutboxBackend

    backend = OutboxBackend("jobs", {"QUEUES": ["default", "High-Priority"]})
    assert [(e.id, e.msg) for e in backend.check()] == [
        ("platformkit.E102", "TASKS['jobs']: queue 'High-Priority' can't be an event name"),
    ]
    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth"]):
        errors = OutboxBackend("default", {"QUEUES": ["default"]}).check()
    assert [(e.id, e.msg) for e in errors] == [
        (
            "platformkit.E101",
            "TASKS['default'] uses django_platformkit.tasks.OutboxBackend but 'django_platformkit' is not in INSTALLED_APPS",
        ),
    ]
    assert [e.id for e in OutboxBackend("default", {"QUEUES": []}).check()] == ["platformkit.E103"]


def test_check_errors_for_an_options_batch_that_is_not_a_bool_and_for_an_unknown_option():
    from django_platformkit.tasks.backend import OutboxBackend

    assert OutboxBackend("default", {"QUEUES": ["default"], "OPTIONS": {"BATCH": False}}).check() == []
    errors = OutboxBackend("default", {"QUEUES": ["default"], "OPTIONS": {"BATCH": "no", "BACH": False}}).check()
    assert [(e.id, e.msg) for e in errors] == [
        ("platformkit.E104", "TASKS['default']['OPTIONS']['BATCH'] is 'no', not True or False"),
        (
            "platformkit.E105",
            "TASKS['default']['OPTIONS'] has 'BACH', which OutboxBackend doesn't know (did you mean 'BATCH'?)",
        ),
    ]
    assert OutboxBackend("default", {"QUEUES": ["default"], "OPTIONS": {"CONCURRENCY": 3}}).check() == []
    for bad in (0, "2", True, 1.5):
        errors = OutboxBackend("default", {"QUEUES": ["default"], "OPTIONS": {"CONCURRENCY": bad}}).check()
        assert [(e.id, e.msg) for e in errors] == [
            ("platformkit.E106", f"TASKS['default']['OPTIONS']['CONCURRENCY'] is {bad!r}, not a positive int")
        ]


def test_check_errors_for_queues_that_are_not_a_list_and_options_that_are_not_a_dict():
    from django_platformkit.tasks.backend import OutboxBackend

    errors = OutboxBackend("default", {"QUEUES": "emails"}).check()
    assert [(e.id, e.msg, e.hint) for e in errors] == [
        (
            "platformkit.E107",
            "TASKS['default']['QUEUES'] is 'emails', not a list of queue names",
            "Write it as a list, e.g. \"QUEUES\": ['emails'] (a string would be read as its letters).",
        )
    ]
    for bad in ([1], "BATCH"):
        errors = OutboxBackend("default", {"QUEUES": ["default"], "OPTIONS": bad}).check()
        assert [(e.id, e.msg) for e in errors] == [
            ("platformkit.E108", f"TASKS['default']['OPTIONS'] is {bad!r}, not a dict")
        ]


def test_a_task_on_a_backend_whose_queues_is_a_string_is_refused_saying_so_not_queue_not_valid():
    """`QUEUES: "emails"` is check E107, but `@task(queue_name="emails")` is
    validated when the module that declares it is imported - for most
    projects before the checks run (the URLconf imports the views, which
    import the tasks). The refusal then says what is wrong with QUEUES, not
    Django's "Queue 'emails' is not valid for backend"."""
    from django.tasks import task

    from django_platformkit.tasks.queues import BACKEND_PATH

    with override_settings(TASKS={"default": {"BACKEND": BACKEND_PATH, "QUEUES": "emails"}}):
        with pytest.raises(InvalidTask, match=r"QUEUES'\] is 'emails', not a list of queue names.*\['emails'\]"):
            task(queue_name="emails")(tasks.record.func)


def test_a_settings_options_list_or_queues_string_registers_no_letters_and_does_not_crash():
    from django_platformkit.tasks.queues import BACKEND_PATH, configured_queues
    from django_platformkit.tasks.registry import register_task_queues

    broken = {
        "letters": {"BACKEND": BACKEND_PATH, "QUEUES": "emails"},
        "listed": {"BACKEND": BACKEND_PATH, "QUEUES": ["reports"], "OPTIONS": [1]},
    }
    with override_settings(TASKS=broken):
        assert configured_queues() == {"reports": ["listed"]}

        names = register_task_queues()  # what AppConfig.ready() calls: it crashed on OPTIONS [1]
        try:
            assert [n for n in names if "__" not in n] == ["platformkit.task_reports"]  # and its priority bands
        finally:
            for name in names:
                subscription_registry._subscriptions.pop(name, None)


def test_check_errors_when_two_backends_serve_a_queue_with_different_options():
    from django_platformkit.tasks.backend import OutboxBackend
    from django_platformkit.tasks.queues import BACKEND_PATH

    shared = {
        "a": {"BACKEND": BACKEND_PATH, "QUEUES": ["default", "emails"], "OPTIONS": {"BATCH": False}},
        "b": {"BACKEND": BACKEND_PATH, "QUEUES": ["default"], "OPTIONS": {"CONCURRENCY": 3}},
        "c": {"BACKEND": BACKEND_PATH, "QUEUES": ["emails"], "OPTIONS": {"BATCH": False, "CONCURRENCY": 2}},
    }
    with override_settings(TASKS=shared):
        errors = [e for alias, params in shared.items() for e in OutboxBackend(alias, params).check()]
    assert [(e.id, e.msg) for e in errors] == [
        (
            "platformkit.E109",
            "TASKS: queue 'default' is served by 'a' and 'b' with different OPTIONS "
            "(BATCH False vs True, CONCURRENCY 2 vs 3)",
        ),
    ]  # 'a' and 'c' agree on 'emails' (CONCURRENCY 2 is the default); each pair once


def test_enqueue_refuses_when_the_app_is_not_installed():
    from django_platformkit.exceptions import ConfigurationError
    from django_platformkit.tasks.backend import OutboxBackend

    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth"]):
        backend = OutboxBackend("default", {"QUEUES": ["default"]})
        with pytest.raises(ConfigurationError, match="'django_platformkit' is not in INSTALLED_APPS: no worker"):
            backend.enqueue(tasks.record, ["never"], {})
    assert OutboxEvent.objects.count() == 0


def test_runworker_queue_runs_only_that_queues_tasks(outbox_tasks, run_worker):
    from django_platformkit.tasks.registry import queue_subscriptions

    tasks.record.enqueue("default_queue")
    tasks.send_email.enqueue("b@example.com")
    run_worker(subscriptions=queue_subscriptions(["emails"]))
    assert effects("emails") == 1 and effects("default_queue") == 0
    from django_platformkit.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="unknown queue"):
        queue_subscriptions(["nope"])


@pytest.mark.process
def test_runworker_queue_as_a_real_process_runs_only_that_queue(broker):
    """``manage.py runworker --burst --queue emails`` (TASKS from the settings, as a deploy has it)."""
    import subprocess

    from django_platformkit.tasks.registry import register_task_queues
    from tests.conftest import manage, worker_env

    with override_settings(TASKS=TASKS):
        from django_platformkit.outbox import events

        names = register_task_queues()
        try:
            tasks.record.enqueue("process_default")
            tasks.send_email.enqueue("c@example.com")
        finally:
            for name in names:
                subscription_registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)
    env = worker_env(broker, PLATFORMKIT_TEST_TASKS="1")
    proc = manage(
        "runworker",
        "--burst",
        "--burst-timeout",
        "60",
        "--queue",
        "emails",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-3000:]
    assert effects("emails") == 1 and effects("process_default") == 0
    proc = manage("runworker", "--burst", "--queue", "nope", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and b"unknown queue(s) nope" in err, err


def test_the_admin_shows_tasks_with_status_result_errors_and_replays_failed_ones(
    outbox_tasks, run_worker, admin_client
):
    ok = tasks.record.enqueue("admin_ok", n=7)
    bad = tasks.fails_until_fixed.enqueue("admin_bad")
    run_worker(subscriptions=task_subscriptions())
    page = admin_client.get("/admin/django_platformkit/outboxtask/").content.decode()
    assert "tests.testapp.tasks.record" in page and "tests.testapp.tasks.fails_until_fixed" in page
    assert ">Successful<" in page and ">Failed<" in page  # Django's words for TaskResultStatus
    failed_only = admin_client.get("/admin/django_platformkit/outboxtask/?task_status=failed").context["cl"]
    assert [row.pk for row in failed_only.result_list] == [uuid.UUID(bad.id)]
    detail = admin_client.get(f"/admin/django_platformkit/outboxtask/{ok.id}/change/").content.decode()
    assert "&quot;label&quot;: &quot;admin_ok&quot;" in detail or '"label": "admin_ok"' in detail
    detail = admin_client.get(f"/admin/django_platformkit/outboxtask/{bad.id}/change/").content.decode()
    assert "builtins.RuntimeError" in detail and "admin_bad: not fixed yet" in detail
    form = {"action": "replay_failed", "_selected_action": [bad.id, ok.id]}
    asked = admin_client.post("/admin/django_platformkit/outboxtask/", form)
    assert asked.status_code == 200 and b"Reason" in asked.content
    assert DeadLetter.objects.count() == 1  # nothing happened yet
    Effect.objects.create(subscription="admin_bad.fixed", event_id=uuid.uuid4())
    done = admin_client.post(
        "/admin/django_platformkit/outboxtask/", {**form, "confirm": "yes", "reason": "fixed the bug"}, follow=True
    )
    assert b"Replayed 1 failed task" in done.content
    assert not DeadLetter.objects.exists()
    # README "The admin": a replay leaves a LogEntry with the actor and the reason, here too.
    from django.contrib.admin.models import LogEntry

    entries = LogEntry.objects.filter(object_id=str(bad.id))
    assert entries.count() == 1 and "Reason: fixed the bug" in entries.get().change_message
    assert entries.get().user.username == "admin"
    run_worker(subscriptions=task_subscriptions())
    assert outbox_tasks.get_result(bad.id).status == TaskResultStatus.SUCCESSFUL


def test_the_task_admin_does_not_replay_a_task_of_a_queue_this_build_no_longer_has(outbox_tasks, admin_client):
    # The queue left TASKS: a replay would delete the dead letter and re-send
    # a task nothing handles. The dead letters' own Replay refuses it; so must this one.
    from django.utils import timezone

    from django_platformkit.models import OutboxEvent
    from django_platformkit.outbox.deadletters import record_dead_letter

    row = OutboxEvent.objects.create(
        name="platformkit.task_gone", payload={"task": "tests.testapp.tasks.record"}, published_at=timezone.now()
    )
    assert record_dead_letter(
        subscription="platformkit.task_gone",
        event_id=row.id,
        name=row.name,
        tenant=None,
        attempts=3,
        error="RuntimeError: boom",
        traceback="",
    )
    form = {"action": "replay_failed", "_selected_action": [str(row.id)], "confirm": "yes", "reason": "retry"}
    done = admin_client.post("/admin/django_platformkit/outboxtask/", form, follow=True)
    text = [str(m) for m in done.context["messages"]]
    assert len(text) == 1 and "declares no subscription 'platformkit.task_gone'" in text[0], text
    assert DeadLetter.objects.filter(event_id=row.id).exists()
    assert OutboxEvent.objects.get(id=row.id).published_at is not None


def test_with_options_batch_tasks_run_once_each_and_failures_are_recorded(broker, run_worker, settings):
    """OPTIONS {"BATCH": True}: the queue is a batch subscription (a savepoint per task)."""
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import register_task_queues

    batched = {"default": dict(TASKS["default"], OPTIONS={"BATCH": True})}
    with override_settings(TASKS=batched):
        names = register_task_queues()
        try:
            assert all(subscription_registry._subscriptions[n].batch for n in names)
            oks = [tasks.record.enqueue("batched", n=i) for i in range(30)]
            bad = tasks.fails_until_fixed.enqueue("batched_bad")
            run_worker(subscriptions=task_subscriptions())
            backend = task_backends["default"]
            assert effects("batched") == 30 and effects("batched_bad") == 0
            assert {backend.get_result(r.id).status for r in oks} == {TaskResultStatus.SUCCESSFUL}
            assert backend.get_result(oks[7].id).return_value == {"label": "batched", "n": 7}
            failed = backend.get_result(bad.id)
            assert failed.status == TaskResultStatus.FAILED
            assert len(failed.errors) == settings.PLATFORMKIT["MAX_ATTEMPTS"]
        finally:
            for name in names:
                subscription_registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)


@pytest.mark.parametrize(
    ("options", "batch"),
    [(None, True), ({}, True), ({"BATCH": True}, True), ({"BATCH": False}, False)],
)
def test_a_queue_is_a_batch_subscription_unless_options_say_batch_false(options, batch):
    """The tasks default follows @subscribe's (batch=True, units sized by run
    time); OPTIONS {"BATCH": False} gives every task a transaction of its own."""
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import register_task_queues

    params = dict(TASKS["default"])
    if options is not None:
        params["OPTIONS"] = options
    with override_settings(TASKS={"default": params}):
        names = register_task_queues()
        try:
            assert names and {subscription_registry._subscriptions[n].batch for n in names} == {batch}
        finally:
            for name in names:
                subscription_registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)


def test_rows_due_tomorrow_are_not_visited_by_the_relays_batch_query(outbox_tasks):
    """The deferred walk stops at the first row not yet due (its own partial
    index); due rows come off the pending index: no sequential scan, no sort,
    and the 20k rows due tomorrow cost the query nothing."""
    from django_platformkit.outbox.relay import _PLAN_SQL, _SELECT_SQL

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, not_before) "
            "SELECT gen_random_uuid(), 'platformkit.task_default', '{}'::jsonb, '{}'::jsonb, clock_timestamp(), now() + interval '1 day' "
            "FROM generate_series(1, 20000)"
        )
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, not_before) "
            "SELECT gen_random_uuid(), 'platformkit.task_default', '{}'::jsonb, '{}'::jsonb, clock_timestamp(), now() - interval '1 second' "
            "FROM generate_series(1, 3)"
        )
    tasks.record.enqueue("plain")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_PLAN_SQL)
        cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) " + _SELECT_SQL, [500])
        plan = "\n".join(r[0] for r in cursor.fetchall())
        cursor.execute(_SELECT_SQL, [500])
        rows = cursor.fetchall()
        transaction.set_rollback(True)
    assert len(rows) == 4, plan  # 3 due deferred rows first, then the plain one
    assert [r[2] for r in rows] == ["platformkit.task_default"] * 4
    assert "platformkit_outbox_deferred" in plan and "platformkit_outbox_pending" in plan, plan
    assert "Seq Scan" not in plan and "Sort" not in plan, plan
    # The deferred index scan returned the 3 due rows and stopped at the first future one.
    deferred_line = next(line for line in plan.splitlines() if "platformkit_outbox_deferred" in line)
    import re

    assert re.search(r"actual rows=3(\.00)? ", deferred_line), plan


def test_enqueue_inside_atomic_is_one_statement(outbox_tasks, django_assert_num_queries):
    with transaction.atomic(), django_assert_num_queries(1):  # the INSERT (with its NOTIFY), nothing else
        tasks.record.enqueue("one_statement")


def test_enqueue_on_an_unmigrated_outbox_says_to_migrate(outbox_tasks):
    from django.db import ProgrammingError

    # The rename is rolled back with the failed statement's transaction.
    with pytest.raises(ProgrammingError, match=r"migrate django_platformkit --database default"):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ALTER TABLE platformkit_outbox RENAME TO platformkit_outbox_away")
            tasks.record.enqueue("never")
    assert OutboxEvent.objects.count() == 0
    tasks.record.enqueue("after")
    assert OutboxEvent.objects.count() == 1


def test_enqueue_inside_atomic_on_another_database_than_the_outbox_is_refused(outbox_tasks, settings, monkeypatch):
    """Committed on its own on the outbox's database, the task would run
    whatever became of the caller's writes: refused before any SQL."""
    from django.db import connections

    from django_platformkit.exceptions import TransactionRequired

    monkeypatch.setitem(connections.settings, "outbox", dict(connections.settings["default"]))
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "DATABASE_ALIAS": "outbox"}
    try:
        with transaction.atomic():
            Effect.objects.create(subscription="caller", event_id=uuid.uuid4())
            with pytest.raises(TransactionRequired, match=r"atomic\(\) on 'default', but the outbox is on 'outbox'"):
                tasks.record.enqueue("refused")
            Effect.objects.create(subscription="caller", event_id=uuid.uuid4())  # the transaction is still usable
        assert OutboxEvent.objects.count() == 0
        assert Effect.objects.filter(subscription="caller").count() == 2
    finally:
        del connections["outbox"]  # never connected: refused before any SQL
