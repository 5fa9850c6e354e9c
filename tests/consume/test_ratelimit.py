"""``subscribe(..., rate_limit=...)``: handler starts across every worker
process together, never above the rate in a window of the period's length;
a subscription on the same event without a limit is not slowed. Real
PostgreSQL, NATS and worker processes."""

from __future__ import annotations

import signal
import subprocess
import threading

import pytest
from django.db import connection, transaction

from django_platformkit import conf, declare, publish, subscribe
from django_platformkit.consume.ratelimit import RateLimiter
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.exceptions import ConfigurationError
from tests.conftest import manage, wait_for, worker_env
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

EVENTS = 200
LIMIT = 20  # per second: tests/testapp/_features.py RATE_LIMIT
#: What a window may exceed the limit by (docs/guide/events.md, "Rate
#: limits"): the slots never do, but a start lags its slot by the time a pool
#: thread takes to wake and claim - milliseconds, up to ~0.1 s for a cold
#: process's first run - so a late start can share a window with later slots.
TOLERANCE = max(1, LIMIT // 10)


def starts(subscription: str) -> list[float]:
    return sorted(e.payload["started"] for e in Effect.objects.filter(subscription=subscription))


def most_in_any_window(times: list[float], seconds: float) -> int:
    """The most starts in any half-open window [t, t + seconds) (a window starting at a start is the worst)."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + seconds:
            j += 1
        best = max(best, j - i)
    return best


def test_two_worker_processes_share_one_limit_and_an_unlimited_twin_is_not_slowed(broker, registries):
    from tests.testapp._features import RATE_LIMIT

    assert conf.rate("RATE_LIMIT", RATE_LIMIT).count == LIMIT
    rated = declare("testapp.rated")
    with transaction.atomic():
        for n in range(EVENTS):
            publish(rated, {"n": n})
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1")
    workers = [manage("runworker", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.rated_limited").count() >= EVENTS,
            timeout=120,
            interval=0.5,
            what="the rate-limited subscription to drain",
        )
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(60)
    limited, free = starts("testapp.rated_limited"), starts("testapp.rated_free")
    assert len(limited) == EVENTS and len(free) == EVENTS  # each once
    pids = {e.payload["pid"] for e in Effect.objects.filter(subscription="testapp.rated_limited")}
    assert len(pids) == 2, "both worker processes took part"
    assert most_in_any_window(limited, 1.0) <= LIMIT + TOLERANCE
    drained = limited[-1] - limited[0]
    implied = (EVENTS - 1) / LIMIT  # evenly spaced starts: 9.95 s
    assert implied * 0.95 <= drained <= implied * 1.3, drained
    # The unlimited twin ran at its own pace: done long before the limited one.
    assert free[-1] - free[0] < implied / 2, free[-1] - free[0]


def test_the_limiter_hands_out_evenly_spaced_slots_to_every_taker():
    from django_platformkit.conf import Rate

    first = RateLimiter("testapp.spaced", Rate(10, 1.0), "default")
    second = RateLimiter("testapp.spaced", Rate(10, 1.0), "default")  # another worker's
    waits = [first.take(), second.take(), first.take(), second.take()]
    assert waits[0] == 0.0
    # Each later taker waits one more spacing (0.1 s), give or take the statements' own time.
    for n, wait in enumerate(waits[1:], start=1):
        assert n * 0.1 - 0.05 <= wait <= n * 0.1 + 0.001, waits
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM platformkit_rate_limits WHERE name = 'testapp.spaced'")
        assert cursor.fetchone()[0] == 1


def test_a_subscription_without_a_limit_has_no_limiter_and_a_bad_rate_is_refused(registries):
    from django_platformkit.consume.pool import Lane

    declare("testapp.unlimited")

    @subscribe("testapp.unlimited", name="testapp.unlimited")
    def unlimited(event):
        pass

    assert Lane(get_subscription("testapp.unlimited"), []).limiter is None  # type: ignore[arg-type]
    for bad in ("0/s", "10/d", "fast", 10):
        with pytest.raises(ConfigurationError, match="rate_limit"):
            subscribe("testapp.unlimited", name="testapp.bad", rate_limit=bad)(unlimited)


def test_a_limited_lane_fetches_one_delivery_per_free_slot_and_never_early(registries):
    from django_platformkit.consume.pool import ConsumerPool, Lane

    declare("testapp.limited")

    @subscribe("testapp.limited", name="testapp.limited", rate_limit="5/s", concurrency=2)
    def limited(event):
        pass

    lane = Lane(get_subscription("testapp.limited"), [object(), object()])  # type: ignore[list-item]
    lane.unit_size = 50
    lane.per_message = 0.0001
    pool = ConsumerPool(None, [lane], using="default", stop_event=threading.Event(), spawn=None)  # type: ignore[arg-type]
    assert pool._credit(lane, 100) == 1
    assert lane.early_fetch_in(1) is None
