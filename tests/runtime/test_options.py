"""``WorkerOptions``: the one value ``runworker``, the supervisor and the
worker share. What each ``--processes`` child runs is derived from it here."""

from __future__ import annotations

import pytest

from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.recycle import RecyclePolicy

pytestmark = pytest.mark.unit


def test_the_options_are_frozen_and_keep_no_callers_list():
    jobs = ["nightly"]
    options = WorkerOptions(jobs=jobs)
    jobs.append("hourly")
    assert options.jobs == ("nightly",)
    with pytest.raises(AttributeError):
        options.burst = True  # type: ignore[misc]


def test_a_burst_runs_no_jobs_and_waits_for_the_outbox_when_it_relays():
    assert not WorkerOptions(burst=True).runs_scheduler
    assert WorkerOptions(burst=True).drain_waits_for_outbox
    assert not WorkerOptions(burst=True, relay=False).drain_waits_for_outbox
    assert WorkerOptions(burst=True, relay=False, burst_waits_for_relay=True).drain_waits_for_outbox


def test_the_relay_child_relays_and_schedules_and_is_never_a_burst_nor_recycled():
    policy = RecyclePolicy(max_handlings=10)
    child = WorkerOptions(burst=True, jobs=["nightly"], recycle=policy, health_file="/tmp/h").relay_child()
    assert (child.relay, child.consumers, child.scheduler, child.burst) == (True, False, False, False)
    assert child.recycle is None and child.health_file is None and child.subscriptions is None
    assert WorkerOptions(jobs=["nightly"]).relay_child().scheduler
    assert WorkerOptions(jobs=["nightly"]).relay_child().jobs == ("nightly",)


def test_a_consumer_child_consumes_alone_and_drains_behind_the_relay_child():
    policy = RecyclePolicy(max_memory_mib=512)
    options = WorkerOptions(burst=True, burst_timeout_seconds=5, connect_timeout_seconds=3, recycle=policy)
    child = options.consumer_child()
    assert (child.relay, child.consumers, child.scheduler) == (False, True, False)
    assert child.burst and child.burst_timeout_seconds == 5 and child.connect_timeout_seconds == 3
    assert child.recycle is policy and child.drain_waits_for_outbox
    assert not WorkerOptions(burst=True, relay=False).consumer_child().drain_waits_for_outbox
    assert not WorkerOptions().consumer_child().burst
