"""The supervisor's restart delays: a child that keeps dying waits longer
each time (1 s doubling to 30 s), one that lived a while starts over."""

from __future__ import annotations

import pytest

from django_platformkit.runtime.supervisor import (
    GIVE_UP_AFTER_DEATHS,
    RESTART_MAX_SECONDS,
    STABLE_AFTER_SECONDS,
    _Child,
    usable_cores,
)

pytestmark = pytest.mark.unit


def _crash_loop(child: _Child, start: float, times: int, lived_seconds: float = 0.5) -> list[float]:
    delays, now = [], start
    for _ in range(times):
        child.started = now
        now += lived_seconds
        delay = child.died(now)
        delays.append(delay)
        now += delay
    return delays


def test_a_child_dying_at_once_waits_twice_as_long_each_time_up_to_the_cap():
    child = _Child("consumer0", {})
    assert _crash_loop(child, 1000.0, 7) == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, RESTART_MAX_SECONDS]


def test_a_child_that_lived_past_the_stable_time_restarts_after_the_first_delay_again():
    child = _Child("consumer0", {})
    _crash_loop(child, 1000.0, 3)
    child.started = 2000.0
    assert child.died(2000.0 + STABLE_AFTER_SECONDS + 1) == 1.0
    assert child.deaths == [2000.0 + STABLE_AFTER_SECONDS + 1]


def test_deaths_within_the_window_are_counted_for_giving_up():
    child = _Child("relay", {})
    _crash_loop(child, 1000.0, GIVE_UP_AFTER_DEATHS)
    assert len(child.deaths) == GIVE_UP_AFTER_DEATHS


def test_processes_auto_counts_the_cores_this_process_may_use_not_every_core():
    """``--processes auto`` under ``taskset`` or a container's CPU set: the
    affinity mask, not ``os.cpu_count()``. Linux (``sched_setaffinity`` sets
    the calling thread's mask, which this test restores)."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    mask = os.sched_getaffinity(0)
    assert usable_cores() == len(mask)
    os.sched_setaffinity(0, {min(mask)})
    try:
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, mask)
