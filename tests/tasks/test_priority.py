"""Django's task priority through OutboxBackend: each queue is five priority
bands (``tasks.queues.PRIORITY_BANDS``), a worker starts the highest band
with work first and a band's tasks in enqueue order; the whole -100..100
range is accepted, anything else is Django's own ``InvalidTask``. Real
PostgreSQL, NATS and worker; the order is read from the rows the tasks
wrote (a sequence: the order they started in)."""

from __future__ import annotations

import random

import pytest
from django.db import transaction

pytest.importorskip("django.tasks")

from django.tasks import TaskResultStatus
from django.tasks.exceptions import InvalidTask

from django_platformkit.models import OutboxEvent
from django_platformkit.outbox.relay import Relay
from django_platformkit.tasks.queues import PRIORITY_BANDS, band_of, event_name, queue_of
from tests.conftest import tasks_registered, wait_for
from tests.testapp import tasks
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

#: One unit at a time: the order tasks start in is the order they ran.
TASKS = {
    "default": {
        "BACKEND": "django_platformkit.tasks.OutboxBackend",
        "QUEUES": ["default"],
        "OPTIONS": {"CONCURRENCY": 1},
    }
}


@pytest.fixture
def one_slot(broker):
    with tasks_registered(TASKS) as backend:
        yield backend


def queue_subscriptions():
    from django_platformkit.tasks.registry import queue_subscriptions

    return queue_subscriptions(["default"])


def started(label):
    """The ``n`` of each ``record(label, n)`` run, in the order the runs wrote their rows."""
    return [e.payload["n"] for e in Effect.objects.filter(subscription=label).order_by("id")]


def rank(priority):
    return PRIORITY_BANDS.index(band_of(priority))


def test_the_bands_cover_djangos_range_once_highest_first():
    covered = [p for band in PRIORITY_BANDS for p in range(band.highest, band.lowest - 1, -1)]
    assert covered == list(range(100, -101, -1))
    assert band_of(0).suffix == "" and event_name("emails", 0) == "platformkit.task_emails"
    assert event_name("emails", 7) == "platformkit.task_emails__high"
    assert event_name("emails", -100) == "platformkit.task_emails__lowest"
    assert {queue_of(event_name("a_b", band.highest)) for band in PRIORITY_BANDS} == {"a_b"}


def test_a_backlog_runs_band_by_band_and_in_enqueue_order_within_each(one_slot, transport, run_worker):
    """40 tasks over the whole range, enqueued in a shuffled order and in the
    stream before the worker starts: each band's tasks start before every
    lower band's, and a band's tasks in the order they were enqueued (two
    priorities of one band keep enqueue order: the band is the unit of
    priority)."""
    priorities = [100, 51, 50, 30, 1, 0, -1, -50, -51, -100] * 4
    random.Random(34).shuffle(priorities)
    with transaction.atomic():
        for n, priority in enumerate(priorities):
            tasks.record.using(priority=priority).enqueue("backlog", n=n)
    Relay(transport).drain()
    assert OutboxEvent.objects.filter(published_at__isnull=True).count() == 0
    run_worker(subscriptions=queue_subscriptions(), relay=False, transport=transport)
    expected = sorted(range(len(priorities)), key=lambda n: (rank(priorities[n]), n))
    assert started("backlog") == expected


def test_higher_priority_tasks_enqueued_while_the_worker_is_busy_start_before_the_lower_ones_waiting(
    one_slot, background_worker
):
    """The one slot runs a task until released; meanwhile 5 low-priority
    tasks and then 5 high-priority ones are enqueued. Released, the worker
    starts the 5 high ones first, though the low ones were enqueued (and
    fetched: the low band's long-poll was open) before them."""
    background_worker(subscriptions=queue_subscriptions())
    blocker = tasks.waits_for_release.enqueue("blocker")
    wait_for(
        lambda: one_slot.get_result(blocker.id).status == TaskResultStatus.RUNNING,
        what="the blocker to run",
        timeout=30,
    )
    for n in range(5):
        tasks.record.using(priority=-10).enqueue("busy", n=n)
    for n in range(5, 10):
        tasks.record.using(priority=10).enqueue("busy", n=n)
    wait_for(lambda: not OutboxEvent.objects.filter(published_at__isnull=True).exists(), what="the relay")
    Effect.objects.create(subscription="blocker.release", event_id=blocker.id, payload={})
    wait_for(lambda: len(started("busy")) == 10, what="the ten tasks", timeout=60)
    assert started("busy") == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("priority", [-100, -51, -1, 0, 1, 50, 100])
def test_every_priority_in_djangos_range_is_accepted_and_kept_on_the_result(one_slot, priority):
    result = tasks.record.using(priority=priority).enqueue("range")
    row = OutboxEvent.objects.get(pk=result.id)
    assert row.name == event_name("default", priority)
    assert one_slot.get_result(result.id).task.priority == priority


@pytest.mark.parametrize("priority", [-101, 101, 1.5])
def test_a_priority_outside_djangos_range_is_djangos_invalid_task_and_writes_nothing(one_slot, priority):
    with pytest.raises(InvalidTask, match="priority"):
        tasks.record.using(priority=priority).enqueue("outside")
    assert not OutboxEvent.objects.exists()
