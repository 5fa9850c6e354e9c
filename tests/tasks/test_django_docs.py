"""Every example of Django's own documentation of ``django.tasks``
(``docs/topics/tasks.txt``, Django 6.0/6.1), run as
written against OutboxBackend in this project - a worker in between where
Django's ImmediateBackend would have run the task inside ``enqueue()``.
Numbered in the order the page shows them (24: the "Errors" section's
two snippets). Example 25 (``run_after`` given a ``timedelta``, as
Django's own ``tests/tasks`` and the django-tasks docs use it) is Django's
own bug: ``Task.using()`` keeps the timedelta
and ``validate_task()`` calls ``timezone.is_aware()`` on it, so every
backend, Django's own included, raises ``AttributeError``; the test holds
ours to exactly that and shows the aware-datetime form working. Real
PostgreSQL, NATS and worker."""

from __future__ import annotations

import datetime as dt
import logging
from functools import partial

import pytest
from django.core import mail
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

pytest.importorskip("django.tasks")

from django.tasks import TaskResultStatus, default_task_backend, task, task_backends

from django_platformkit.models import OutboxEvent
from django_platformkit.tasks.backend import OutboxBackend
from tests.conftest import tasks_registered, wait_for
from tests.testapp import docs_tasks
from tests.testapp.models import Effect, Order

pytestmark = pytest.mark.django_db(transaction=True)

OURS = "django_platformkit.tasks.OutboxBackend"
# Example 5, "Third-party backends": our path as BACKEND. One attempt per
# task on "default", as Django's backends have no retries (a failing
# example's result reads FAILED after one run, as the docs show).
TASKS = {
    "default": {
        "BACKEND": OURS,
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"QUEUES": {"default": {"MAX_ATTEMPTS": 1}}},
    },
    "reserve": {"BACKEND": OURS, "QUEUES": ["default"]},
}


@pytest.fixture
def ours(broker, settings):
    # Django 6.1 warns (an error here) when mail is sent without MAILERS; 6.0 ignores it.
    settings.MAILERS = {"default": {"BACKEND": "django.core.mail.backends.locmem.EmailBackend"}}

    with tasks_registered(TASKS) as backend:
        yield backend


@pytest.fixture
def work(run_worker):
    """What the docs' worker does: run what is enqueued (a burst worker over every queue's bands)."""
    from django_platformkit.tasks.registry import queue_subscriptions

    return lambda: run_worker(subscriptions=queue_subscriptions(["default", "emails"]))


def in_a_loop(coroutine):
    import asyncio

    from asgiref.sync import sync_to_async
    from django.db import connections

    async def run():
        try:
            return await coroutine
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(run())


# --- Configuring a Task backend --------------------------------------------------


@pytest.mark.parametrize("backend", ["immediate.ImmediateBackend", "dummy.DummyBackend"])
def test_01_02_djangos_own_backends_configured_beside_the_app_register_no_queue(backend):
    """Examples 1 and 2 configure Django's own backends: the app stays out of their way."""
    from django_platformkit.tasks.registry import register_task_queues

    with override_settings(TASKS={"default": {"BACKEND": f"django.tasks.backends.{backend}"}}):
        assert register_task_queues() == []


def test_03_04_the_dummy_backends_results_and_clear():
    with override_settings(TASKS={"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}):
        docs_tasks.the_answer.enqueue()
        assert len(default_task_backend.results) == 1
        default_task_backend.clear()
        assert len(default_task_backend.results) == 0


def test_05_06_07_our_backend_by_path_retrieved_by_alias_and_as_the_default(ours):
    assert isinstance(task_backends["default"], OutboxBackend)
    assert isinstance(task_backends["reserve"], OutboxBackend)
    assert task_backends["reserve"] is not task_backends["default"]
    assert default_task_backend.alias == "default"


# --- Defining Tasks ----------------------------------------------------------------


def test_08_the_decorated_function_is_a_task_that_sends_the_email(ours, work):
    result = docs_tasks.email_users.enqueue(["ada@example.com"], "Hi", "Hello")
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 1
    assert [m.to for m in mail.outbox] == [["ada@example.com"]]


def test_09_priority_and_queue_name_on_the_decorator(ours, work):
    """The docs' second example: refused at import before priority was supported."""
    email_users = task(priority=2, queue_name="emails")(docs_tasks.email_users.func)
    assert (email_users.priority, email_users.queue_name) == (2, "emails")
    result = email_users.enqueue(emails=["bob@example.com"], subject="Hi", message="Hello")
    assert OutboxEvent.objects.get(pk=result.id).name == "platformkit.task_emails__high"
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.task.priority == 2
    assert [m.to for m in mail.outbox] == [["bob@example.com"]]


def test_10_a_task_that_takes_its_context(ours, work, caplog):
    with caplog.at_level(logging.DEBUG, logger=docs_tasks.__name__):
        result = docs_tasks.email_users_with_context.enqueue(["cy@example.com"], "Hi", "Hello")
        work()
    assert f"Attempt 1 to send user email. Task result id: {result.id}." in caplog.text
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_11_using_gives_a_new_task_with_a_higher_priority(ours):
    email_users = docs_tasks.email_users.using(backend="default")
    assert email_users.priority == 0
    assert email_users.using(priority=10).priority == 10
    assert email_users.priority == 0


# --- Enqueueing Tasks ----------------------------------------------------------------


def test_12_enqueue_with_keyword_arguments_returns_a_result(ours, work):
    result = docs_tasks.email_users.enqueue(
        emails=["user@example.com"],
        subject="You have a message",
        message="Hello there!",
    )
    assert result.status == TaskResultStatus.READY
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert mail.outbox[0].subject == "You have a message"


def test_13_aenqueue_in_an_async_context(ours, work):
    result = in_a_loop(docs_tasks.email_users.aenqueue(["dee@example.com"], "Hi", "Hello"))
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_14_an_argument_json_cant_carry_is_a_type_error_and_nothing_is_enqueued(ours):
    with pytest.raises(TypeError):
        docs_tasks.process_data.enqueue(dt.datetime.now())
    assert not OutboxEvent.objects.exists()


def test_15_a_tuple_comes_back_a_list_and_the_task_fails_as_the_docs_say(ours, work):
    result = docs_tasks.double_dictionary.enqueue((1, 2, 3))
    work()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert "TypeError: unhashable type: 'list'" in result.errors[0].traceback


def test_16_a_task_enqueued_in_the_transaction_runs_after_it_commits_and_finds_the_thing(ours, work):
    """The docs' warning does not apply: the task is a row of the same
    transaction, so no worker can see it before the Thing."""
    with transaction.atomic():
        Order.objects.create(total=1)
        result = docs_tasks.my_task.enqueue(thing_num=1)
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_17_the_docs_on_commit_form_works_too(ours, work):
    with transaction.atomic():
        Order.objects.create(total=2)
        transaction.on_commit(partial(docs_tasks.my_task.enqueue, thing_num=2))
    assert OutboxEvent.objects.count() == 1
    work()
    (row,) = OutboxEvent.objects.all()
    assert default_task_backend.get_result(str(row.pk)).status == TaskResultStatus.SUCCESSFUL


# --- Task results ------------------------------------------------------------------


def test_18_19_20_a_result_by_id_from_the_task_the_backend_and_async(ours, work):
    result_id = docs_tasks.the_answer.enqueue().id
    work()
    assert docs_tasks.the_answer.get_result(result_id).return_value == 42
    assert default_task_backend.get_result(result_id).return_value == 42
    assert in_a_loop(docs_tasks.the_answer.aget_result(result_id)).return_value == 42
    assert in_a_loop(default_task_backend.aget_result(result_id)).status == TaskResultStatus.SUCCESSFUL


def test_21_23_a_running_results_return_value_is_a_value_error_then_refresh_shows_it_succeeded(ours, background_worker):
    from django_platformkit.tasks.registry import queue_subscriptions

    background_worker(subscriptions=queue_subscriptions(["default"]))
    result = docs_tasks.answers_when_released.enqueue("docs_running")
    wait_for(lambda: result.refresh() or result.status == TaskResultStatus.RUNNING, what="RUNNING")
    assert result.status == TaskResultStatus.RUNNING  # example 21's first line
    with pytest.raises(ValueError, match="Task has not finished yet"):  # example 23
        result.return_value
    Effect.objects.create(subscription="docs_running.release", event_id=result.id, payload={})
    wait_for(lambda: result.refresh() or result.status == TaskResultStatus.SUCCESSFUL, what="SUCCESSFUL")
    assert result.return_value == 42  # example 21's end


def test_22_the_return_value(ours, work):
    result = docs_tasks.the_answer.enqueue()
    work()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


def test_24a_an_errors_exception_class(ours, work):
    result = docs_tasks.raises_value_error.enqueue()
    work()
    result.refresh()
    assert result.errors[0].exception_class is ValueError


def test_24b_an_errors_traceback(ours, work):
    result = docs_tasks.returns_now.enqueue()
    work()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].traceback.startswith("Traceback (most recent call last):")
    assert "TypeError" in result.errors[0].traceback and "datetime" in result.errors[0].traceback


def test_25_run_after_given_a_timedelta_fails_in_django_itself_and_the_aware_datetime_works(ours, work):
    """Django's bug, not ours: ``using(run_after=timedelta(...))`` raises
    the same AttributeError on Django's own DummyBackend as here (Django's
    ``tests/tasks`` expects a datetime from it). Pass an aware datetime."""
    with pytest.raises(AttributeError, match="utcoffset") as ours_raised:
        docs_tasks.the_answer.using(run_after=dt.timedelta(minutes=5))
    with override_settings(TASKS={"default": {"BACKEND": "django.tasks.backends.dummy.DummyBackend"}}):
        with pytest.raises(AttributeError) as django_raised:
            docs_tasks.the_answer.using(run_after=dt.timedelta(minutes=5))
    assert str(ours_raised.value) == str(django_raised.value)
    later = timezone.now() + dt.timedelta(minutes=5)
    result = docs_tasks.the_answer.using(run_after=later).enqueue()
    work()
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.task.run_after == later
