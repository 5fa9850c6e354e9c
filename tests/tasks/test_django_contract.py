"""Django's own ``tests/tasks`` (6.1) and django-tasks-db's database-backend
tests, ported to ``OutboxBackend``: the behaviours portable code relies on.
Adapted only where a worker must run between ``enqueue()`` and the result
(the ImmediateBackend runs the task inside ``enqueue()``; here ``runworker
--burst`` runs it), and the queue ``django`` gives a failing task one
attempt (``OPTIONS["QUEUES"]["django"]["MAX_ATTEMPTS"] = 1``), as Django's
backends have no retries. Each test names its source. Real PostgreSQL and NATS.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import pickle
import uuid

import django
import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

pytest.importorskip("django.tasks")

from django.tasks import TaskResultStatus, task_backends
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist, TaskResultMismatch

from django_platformkit.consume import subscriptions as subscription_registry
from django_platformkit.exceptions import InvalidPayload
from tests.testapp import tasks as test_tasks

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = {
    "default": {
        "BACKEND": "django_platformkit.tasks.OutboxBackend",
        "QUEUES": ["django"],
        "OPTIONS": {"QUEUES": {"django": {"MAX_ATTEMPTS": 1}}},
    }
}


@pytest.fixture
def backend(broker):
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


def on_queue(task):
    return task.using(queue_name="django")


@pytest.fixture
def work(run_worker):
    """What ImmediateBackend does inside enqueue(): run the task (a burst worker over the queue)."""

    def run():
        from django_platformkit.tasks.registry import queue_subscriptions

        run_worker(subscriptions=queue_subscriptions(["django"]))  # every priority band of the queue

    return run


# --- Django tests/tasks/test_tasks.py -----------------------------------------------


def test_enqueue_task(backend):
    result = on_queue(test_tasks.noop_task).enqueue()
    assert result.status == TaskResultStatus.READY
    assert result.task == on_queue(test_tasks.noop_task)
    assert result.args == [] and result.kwargs == {}


def in_a_loop(coroutine):
    """Run ``coroutine`` as an async view would (no pytest-asyncio here), closing the thread's connections after."""
    import asyncio

    from asgiref.sync import sync_to_async

    async def run():
        try:
            return await coroutine
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(run())


def test_enqueue_task_async(backend):
    result = in_a_loop(on_queue(test_tasks.noop_task).aenqueue())
    assert result.status == TaskResultStatus.READY and result.args == []


def test_enqueue_with_invalid_argument(backend):
    with pytest.raises(TypeError, match="Unsupported type") as refused:
        on_queue(test_tasks.noop_task).enqueue(dt.datetime.now())
    assert isinstance(refused.value, InvalidPayload)  # ours too: the JSON path is named
    assert refused.value.path == "$.args[0]"


def test_aenqueue_with_invalid_argument(backend):
    with pytest.raises(TypeError, match="Unsupported type"):
        in_a_loop(on_queue(test_tasks.noop_task).aenqueue(dt.datetime.now()))


def test_refresh_result(backend):
    result = on_queue(test_tasks.noop_task).enqueue()
    original = dataclasses.asdict(result)
    result.refresh()
    assert dataclasses.asdict(result) == original


def test_get_result(backend):
    result = backend.enqueue(on_queue(test_tasks.noop_task), (), {})
    assert on_queue(test_tasks.noop_task).get_result(result.id) == result


def test_get_missing_result(backend):
    with pytest.raises(TaskResultDoesNotExist):
        on_queue(test_tasks.noop_task).get_result("123")


def test_get_incorrect_result(backend):
    result = backend.enqueue(on_queue(test_tasks.calculate_meaning_of_life), (), {})
    with pytest.raises(TaskResultMismatch, match="Task does not match"):
        on_queue(test_tasks.noop_task).get_result(result.id)


def test_naive_datetime(backend):
    with pytest.raises(InvalidTask, match="run_after must be an aware datetime"):
        on_queue(test_tasks.noop_task).using(run_after=dt.datetime.now())


def test_unknown_queue_name(backend):
    with pytest.raises(InvalidTask, match="Queue 'queue-2' is not valid for backend"):
        test_tasks.noop_task.using(queue_name="queue-2")


@pytest.mark.skipif(django.VERSION < (6, 1), reason="Django 6.1 made a Task picklable (Task.__reduce__); 6.0's is not")
def test_pickle_task_result(backend):
    result = on_queue(test_tasks.noop_task).enqueue()
    assert pickle.loads(pickle.dumps(result)) == result


# --- Django tests/tasks/test_immediate_backend.py, a worker between enqueue and result -------------


def test_immediate_enqueue_task(backend, work):
    result = on_queue(test_tasks.noop_task).enqueue(1, two=3)
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.is_finished
    assert result.started_at >= result.enqueued_at and result.finished_at >= result.started_at
    assert result.return_value is None
    assert result.args == [1] and result.kwargs == {"two": 3}
    assert result.attempts == 1


@pytest.mark.parametrize(
    ("task", "exception", "message"),
    [
        (test_tasks.failing_task_value_error, ValueError, "This task failed due to ValueError"),
        (test_tasks.failing_task_system_exit, SystemExit, "This task failed due to SystemExit"),
    ],
)
def test_catches_exception(backend, work, caplog, task, exception, message):
    result = on_queue(task).enqueue()
    with caplog.at_level(logging.ERROR, logger="django.tasks"):
        work()
    errors = [r for r in caplog.records if r.name == "django.tasks" and r.levelno >= logging.ERROR]
    assert len(errors) == 1
    # The failure log line carries the traceback: task_finished is sent inside the exception handler.
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is exception
    assert message in caplog.text
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value
    assert result.is_finished
    assert result.started_at >= result.enqueued_at and result.finished_at >= result.started_at
    assert result.errors[0].exception_class is exception
    assert result.errors[0].traceback.endswith(f"{exception.__name__}: {message}\n")


def test_complex_exception(backend, work):
    result = on_queue(test_tasks.complex_exception).enqueue()
    work()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result._return_value is None
    assert result.errors[0].exception_class is ValueError
    assert 'ValueError(ValueError("This task failed"))' in result.errors[0].traceback


def test_complex_return_value(backend, work, caplog):
    result = on_queue(test_tasks.complex_return_value).enqueue()
    with caplog.at_level(logging.ERROR, logger="django.tasks"):
        work()
    assert any(r.name == "django.tasks" and r.levelno == logging.ERROR for r in caplog.records)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.started_at >= result.enqueued_at and result.finished_at >= result.started_at
    assert result._return_value is None
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type" in result.errors[0].traceback


def test_result(backend, work):
    result = backend.enqueue(on_queue(test_tasks.calculate_meaning_of_life), [], {})
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 42


def test_enqueue_logs_and_failed_logs(backend, work, caplog):
    with caplog.at_level(logging.DEBUG, logger="django.tasks"):
        ok = on_queue(test_tasks.noop_task).enqueue()
        bad = on_queue(test_tasks.failing_task_value_error).enqueue()
        work()
    lines = [r.getMessage() for r in caplog.records if r.name == "django.tasks"]
    for result, last in ((ok, "state=SUCCESSFUL"), (bad, "state=FAILED")):
        mine = [line for line in lines if result.id in line]
        assert len(mine) == 3, mine
        assert "enqueued" in mine[0] and "state=RUNNING" in mine[1] and last in mine[2]
        assert not any("NoneType" in line for line in mine)


def test_takes_context(backend, work):
    result = on_queue(test_tasks.get_task_id).enqueue()
    work()
    result.refresh()
    assert result.return_value == result.id


def test_context(backend, work):
    result = on_queue(test_tasks.check_context).enqueue(1)
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_validate_on_enqueue(backend):
    with pytest.raises(InvalidTask, match="Queue 'unknown_queue' is not valid for backend"):
        test_tasks.noop_task.using(queue_name="unknown_queue").enqueue()


# --- django-tasks-db tests/tests.py (DatabaseBackendTestCase, DatabaseBackendWorkerTestCase) -------------


def get_task_count_in_new_connection() -> int:
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM platformkit_outbox WHERE name LIKE 'platformkit.task%%'")
            return cursor.fetchone()[0]
    finally:
        other.close()


def test_db_enqueue_task_outside_atomic_is_one_statement(backend, django_assert_num_queries):
    assert not connection.in_atomic_block
    with django_assert_num_queries(1) as captured:  # one autocommit INSERT: no BEGIN, no COMMIT
        result = on_queue(test_tasks.noop_task).enqueue(1, two=3)
    assert "INSERT" in captured.captured_queries[0]["sql"]
    assert uuid.UUID(result.id).version == 7  # the outbox's ids (django-tasks-db's are v4)
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert result.started_at is None and result.finished_at is None
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value
    assert result.attempts == 0
    assert get_task_count_in_new_connection() == 1  # committed


def test_db_get_result_is_one_query(backend, django_assert_num_queries):
    result = backend.enqueue(on_queue(test_tasks.noop_task), [], {})
    with django_assert_num_queries(1):
        assert backend.get_result(result.id) == result


def test_db_invalid_uuid(backend):
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("123")
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(str(uuid.uuid4()))


def test_db_check(backend):
    assert list(backend.check()) == []


def test_db_doesnt_wait_until_transaction_commit(backend):
    with transaction.atomic():
        result = on_queue(test_tasks.noop_task).enqueue()
        assert result.enqueued_at is not None
        assert get_task_count_in_new_connection() == 0
    assert get_task_count_in_new_connection() == 1


def test_db_run_enqueued_task_and_failing_task(backend, work):
    ok = on_queue(test_tasks.noop_task).enqueue()
    bad = on_queue(test_tasks.failing_task_value_error).enqueue()
    work()
    assert ok.status == TaskResultStatus.READY and ok.attempts == 0  # a result is a snapshot until refreshed
    ok.refresh()
    bad.refresh()
    assert ok.status == TaskResultStatus.SUCCESSFUL and ok.attempts == 1
    assert bad.status == TaskResultStatus.FAILED
    assert bad.errors[0].exception_class is ValueError
    assert bad.errors[0].traceback.endswith("ValueError: This task failed due to ValueError\n")


def test_db_run_after(backend, work):
    result = on_queue(test_tasks.noop_task).using(run_after=timezone.now() + dt.timedelta(hours=10)).enqueue()
    work()
    result.refresh()
    assert result.status == TaskResultStatus.READY
    with connection.cursor() as cursor:
        cursor.execute("UPDATE platformkit_outbox SET not_before = now() WHERE id = %s", [uuid.UUID(result.id)])
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
