"""Which task? The admin names a django.tasks task by its dotted path
wherever a task queue's row appears: on the overview, each task under its
queue's subscription (handled, dead letters, newest error) with the quiet
priority bands folded away; on the dead-letter and attempt lists, under the
subscription, filterable by it. Real PostgreSQL, NATS and worker."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

pytest.importorskip("django.tasks")


from django_platformkit.models import Attempt, DeadLetter
from tests.conftest import tasks_registered
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)

TASKS = {
    "default": {
        "BACKEND": "django_platformkit.tasks.OutboxBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"QUEUES": {"default": {"MAX_ATTEMPTS": 2, "BACKOFF_SECONDS": [0.1]}}},
    }
}


@pytest.fixture
def ran(broker, run_worker):
    """Two record() runs and one fails_until_fixed() that ends as a dead letter, by a real worker."""
    from django_platformkit.tasks.registry import queue_subscriptions

    with tasks_registered(TASKS) as backend:
        tasks.record.enqueue("named", n=1)
        tasks.record.enqueue("named", n=2)
        tasks.fails_until_fixed.enqueue("named_failing")
        run_worker(subscriptions=queue_subscriptions(["default"]))
        yield backend


@pytest.fixture
def admin_client(client):
    client.force_login(User.objects.create_superuser("ops", password=None))
    return client


def test_the_overview_names_each_task_under_its_queue_and_folds_the_quiet_bands(ran, admin_client):
    page = admin_client.get(reverse("admin:django_platformkit_overview")).content.decode()
    assert 'data-subscription="platformkit.task_default"' in page
    for band in ("highest", "high", "low", "lowest"):  # nothing at those priorities: no rows
        assert f'data-subscription="platformkit.task_default__{band}"' not in page
    assert 'data-task="tests.testapp.tasks.record" data-task-of="platformkit.task_default"' in page
    assert 'data-task="tests.testapp.tasks.fails_until_fixed"' in page
    record_row = page.split('data-task="tests.testapp.tasks.record"')[1].split("</tr>")[0]
    assert "2 handled in the last hour" in record_row
    failing_row = page.split('data-task="tests.testapp.tasks.fails_until_fixed"')[1].split("</tr>")[0]
    assert "1 dead letter" in failing_row and "not fixed yet" in failing_row
    assert "task=tests.testapp.tasks.fails_until_fixed" in failing_row


def test_a_band_with_work_shows_on_the_overview(ran, admin_client):
    tasks.record.using(priority=70).enqueue("waiting")  # not run: the band has a row to show
    page = admin_client.get(reverse("admin:django_platformkit_overview")).content.decode()
    assert 'data-subscription="platformkit.task_default__highest"' in page


def test_dead_letters_and_attempts_name_the_task_and_filter_by_it(ran, admin_client):
    dead = DeadLetter.objects.get()
    url = reverse("admin:django_platformkit_deadletter_changelist")
    page = admin_client.get(url).content.decode()
    assert "tests.testapp.tasks.fails_until_fixed" in page
    assert admin_client.get(url, {"task": "tests.testapp.tasks.fails_until_fixed"}).context["cl"].result_count == 1
    assert admin_client.get(url, {"task": "tests.testapp.tasks.record"}).context["cl"].result_count == 0
    detail = admin_client.get(reverse("admin:django_platformkit_deadletter_change", args=[dead.pk]))
    assert "tests.testapp.tasks.fails_until_fixed" in detail.content.decode()

    url = reverse("admin:django_platformkit_attempt_changelist")
    page = admin_client.get(url).content.decode()
    assert "tests.testapp.tasks.fails_until_fixed" in page
    failed = admin_client.get(url, {"task": "tests.testapp.tasks.fails_until_fixed"}).context["cl"].result_count
    assert failed == Attempt.objects.filter(event_id=dead.event_id).count() >= 1


def test_the_task_list_shows_the_priority_it_was_enqueued_with(ran, admin_client):
    result = tasks.record.using(priority=-30).enqueue("prio")
    page = admin_client.get(reverse("admin:django_platformkit_outboxtask_changelist")).content.decode()
    assert '<span class="platformkit-source pk-priority">priority -30</span>' in page
    detail = admin_client.get(reverse("admin:django_platformkit_outboxtask_change", args=[result.id]))
    assert "-30" in detail.content.decode()
