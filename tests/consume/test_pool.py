"""When a lane lends its running unit's credit to the next fetch (pool.py's
early fetch): never before its handlers were measured, never for slow ones,
and earlier the longer a fetch takes."""

from __future__ import annotations

import pytest

from django_platformkit.consume.pool import EARLY_FETCH_MAX_PER_MESSAGE_SECONDS, UNIT_TARGET_SECONDS, Lane

pytestmark = pytest.mark.unit


class _Subscription:
    name = "orders.record"
    rate_limit = None
    rate_limit_error = ""


def _lane() -> Lane:
    return Lane(_Subscription(), [object()])  # type: ignore[arg-type, list-item]


def test_a_lane_not_measured_yet_fetches_when_its_unit_ends():
    assert _lane().early_fetch_in(100) is None


def test_a_lane_of_slow_handlers_fetches_when_its_unit_ends():
    lane = _lane()
    lane.measured(1, 2 * EARLY_FETCH_MAX_PER_MESSAGE_SECONDS, batch_size=100)
    assert lane.early_fetch_in(1) is None


def test_a_lane_of_fast_handlers_fetches_before_its_unit_ends_and_sooner_when_fetches_are_slow():
    lane = _lane()
    lane.measured(100, 0.08, batch_size=100)  # 0.8 ms per delivery
    lane.fetch_seconds = 0.004
    quick = lane.early_fetch_in(100)
    lane.fetch_seconds = 0.02
    slow = lane.early_fetch_in(100)
    assert quick is not None and slow is not None
    assert 0 < slow < quick < 0.08  # inside the unit's expected 80 ms, earlier for the slower fetch
    lane.fetch_seconds = UNIT_TARGET_SECONDS
    assert lane.early_fetch_in(100) == 0.0  # a fetch longer than the unit: at once, never negative
