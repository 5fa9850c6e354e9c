"""``async def`` task functions through OutboxBackend (``supports_async_task``):
the worker runs them through Django's ``Task.call`` (asgiref's
``async_to_sync``), so their ORM calls (``acreate``, ``aexists``, ...) come
back to the pool thread and run on the claim's connection, inside the
unit's transaction: their writes commit with the claim exactly once, and
roll back with a failed attempt, which is retried and dead-lettered as any
task's. Real PostgreSQL, NATS and worker."""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("django.tasks")

from django.tasks import TaskResultStatus

from django_platformkit.models import DeadLetter
from tests.tasks.test_backend import effects, outbox_tasks, task_subscriptions  # noqa: F401 - the fixture
from tests.testapp import tasks
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_backend_says_it_runs_async_tasks(outbox_tasks):  # noqa: F811
    assert outbox_tasks.supports_async_task is True


def test_an_async_tasks_orm_write_commits_once_with_its_result(outbox_tasks, run_worker):  # noqa: F811
    result = tasks.arecord.enqueue("async_once", n=2)
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"label": "async_once", "n": 2}
    assert effects("async_once") == 1
    run_worker(subscriptions=task_subscriptions())  # nothing runs it again
    assert effects("async_once") == 1


def test_an_async_tasks_orm_calls_run_inside_the_claims_transaction(outbox_tasks, run_worker):  # noqa: F811
    """The claim row is uncommitted while the task runs: only the claim's own
    connection, inside its transaction, can see it."""
    result = tasks.asees_its_claim.enqueue("async_claim")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value is True
    assert Effect.objects.get(subscription="async_claim").payload == {"claim_seen": True}


def test_an_async_tasks_write_rolls_back_with_a_failed_attempt_then_retries_and_dead_letters(
    outbox_tasks,  # noqa: F811
    run_worker,
    settings,
):
    from django_platformkit import replay

    max_attempts = settings.PLATFORMKIT["MAX_ATTEMPTS"]
    result = tasks.afails_until_fixed.enqueue("async_flaky")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == max_attempts
    assert {e.exception_class_path for e in result.errors} == {"builtins.RuntimeError"}
    assert effects("async_flaky") == 0  # each failed run's acreate rolled back with it
    assert DeadLetter.objects.get().event_id == uuid.UUID(result.id)

    Effect.objects.create(subscription="async_flaky.fixed", event_id=uuid.uuid4())
    replay(result.id, actor="ops", reason="fixed")
    run_worker(subscriptions=task_subscriptions())
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == "fixed"
    assert effects("async_flaky") == 1


def test_async_tasks_in_one_unit_keep_a_failing_neighbours_write_out(outbox_tasks, run_worker):  # noqa: F811
    """A unit of async tasks (BATCH: one transaction) with one failing: the
    unit is redone with a savepoint per task; the others' writes commit
    once, the failing one's never."""
    ok = [tasks.arecord.enqueue("async_unit", n=n) for n in range(5)]
    bad = tasks.afails_until_fixed.enqueue("async_unit_bad")
    run_worker(subscriptions=task_subscriptions())
    for result in ok:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
    assert effects("async_unit") == 5
    assert effects("async_unit_bad") == 0
    bad.refresh()
    assert bad.status == TaskResultStatus.FAILED
