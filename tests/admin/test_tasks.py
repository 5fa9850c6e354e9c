"""The tasks list (django_platformkit.admin.tasks): each django.tasks task by
its function path - filtered by it, not by the queue's event - with its
status in Django's words, when it finished and how long its last run took."""

from __future__ import annotations

import datetime

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from django_platformkit.models import DeadLetter, OutboxEvent, TaskResultRecord
from django_platformkit.outbox.deadletters import record_dead_letter

pytestmark = pytest.mark.django_db

TASKS = "admin:django_platformkit_outboxtask_changelist"


def _task(path: str, *, ran_for: float | None = None, failed: bool = False, queue: str = "default") -> OutboxEvent:
    """A task row; ``ran_for`` seconds: its last run, which succeeded (or, ``failed``, ended in a dead letter)."""
    row = OutboxEvent.objects.create(
        name=f"platformkit.task_{queue}",
        payload={"task": path, "args": [1], "kwargs": {"to": "a@example.com"}, "backend": "default"},
        published_at=timezone.now(),
    )
    if ran_for is None:
        return row
    started = timezone.now() - datetime.timedelta(minutes=2)
    finished = started + datetime.timedelta(seconds=ran_for)
    TaskResultRecord.objects.create(
        event_id=row.pk,
        status="" if failed else "SUCCESSFUL",
        started_at=started - datetime.timedelta(minutes=1),  # an earlier attempt's start: not the duration's
        last_attempted_at=started,
        finished_at=None if failed else finished,
    )
    if failed:
        record_dead_letter(
            subscription=row.name,
            event_id=row.pk,
            name=row.name,
            tenant=None,
            attempts=3,
            error="RuntimeError: boom",
            traceback="",
        )
        DeadLetter.objects.filter(event_id=row.pk).update(failed_at=finished)
    return row


@pytest.fixture
def viewer() -> User:
    return User.objects.create_superuser("tilda", password=None)


def test_the_tasks_list_shows_each_task_by_path_with_status_finished_at_and_duration(client, viewer):
    done = _task("shop.tasks.send_receipt", ran_for=0.42)
    slow = _task("shop.tasks.rebuild_index", ran_for=75)
    failed = _task("shop.tasks.send_receipt", ran_for=2.5, failed=True)
    waiting = _task("shop.tasks.send_receipt")
    client.force_login(viewer)
    response = client.get(reverse(TASKS))
    html = response.content.decode()
    for column in ("column-created", "column-task_path", "column-status", "column-finished", "column-duration"):
        assert column in html, column
    assert "column-name" not in html  # the queue's event is not how tasks are told apart
    admin = response.context["cl"].model_admin
    rows = {row.pk: row for row in response.context["cl"].result_list}
    assert [admin.duration(rows[t.pk]) for t in (done, slow, failed, waiting)] == ["420 ms", "1 min 15 s", "2 s", "—"]
    assert [admin.status(rows[t.pk]) for t in (done, failed)] == ["Successful", "Failed"]
    finished = TaskResultRecord.objects.get(event_id=done.pk).finished_at
    assert f"{finished:%Y-%m-%d %H:%M:%S} UTC" in str(admin.finished(rows[done.pk]))
    dead = DeadLetter.objects.get(event_id=failed.pk).failed_at
    assert f"{dead:%Y-%m-%d %H:%M:%S} UTC" in str(admin.finished(rows[failed.pk]))  # a failure ends at its dead letter
    assert admin.finished(rows[waiting.pk]) == "—"


def test_tasks_are_filtered_by_their_function_path(client, viewer):
    receipts = [_task("shop.tasks.send_receipt", ran_for=1), _task("shop.tasks.send_receipt", queue="emails")]
    index = _task("shop.tasks.rebuild_index", ran_for=1)
    client.force_login(viewer)
    response = client.get(reverse(TASKS))
    task_filter = next(f for f in response.context["cl"].filter_specs if f.parameter_name == "task")
    assert [choice["display"] for choice in task_filter.choices(response.context["cl"])][1:] == [
        "shop.tasks.rebuild_index",
        "shop.tasks.send_receipt",
    ]
    chosen = client.get(reverse(TASKS), {"task": "shop.tasks.send_receipt"}).context["cl"].result_list
    assert {row.pk for row in chosen} == {r.pk for r in receipts}
    chosen = client.get(reverse(TASKS), {"task": "shop.tasks.rebuild_index"}).context["cl"].result_list
    assert [row.pk for row in chosen] == [index.pk]


def test_a_deferred_task_says_until_when_it_waits(client, viewer):
    row = _task("shop.tasks.send_reminder")
    later = timezone.now() + datetime.timedelta(hours=2)
    OutboxEvent.objects.filter(pk=row.pk).update(not_before=later, published_at=None)
    client.force_login(viewer)
    html = client.get(reverse(TASKS)).content.decode()
    assert f'run after <time datetime="{later.isoformat()}">{later:%Y-%m-%d %H:%M:%S} UTC</time>' in html
