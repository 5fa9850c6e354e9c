"""What the overview concludes (django_platformkit.admin.states): a
subscription is failing, lagging or ok by one rule whose threshold follows
ACK_WAIT_SECONDS; a job is overdue once a slot after its last one went
unclaimed; stopped and silent workers fold away after a while."""

from __future__ import annotations

import datetime

import pytest
from django.test import override_settings

from django_platformkit.admin import states
from django_platformkit.admin.states import SubscriptionState, WorkerState
from django_platformkit.jobs.specs import JobSpec

pytestmark = pytest.mark.unit

NOW = datetime.datetime(2026, 12, 3, 9, 30, 0, tzinfo=datetime.UTC)


def _state(**figures) -> SubscriptionState:
    given = {"retrying": 0, "open_dead_letters": 0, "oldest_unhandled_age_seconds": None, "lagging_after": 30.0}
    return states.subscription_state(**{**given, **figures})


def test_a_subscription_with_events_retrying_or_dead_letters_open_is_failing_whatever_else_it_shows():
    assert _state(retrying=1) == SubscriptionState.FAILING
    assert _state(open_dead_letters=2) == SubscriptionState.FAILING
    assert _state(retrying=1, oldest_unhandled_age_seconds=3600) == SubscriptionState.FAILING


def test_a_subscription_is_lagging_once_its_oldest_unhandled_event_waited_longer_than_the_threshold():
    assert _state(oldest_unhandled_age_seconds=30.0) == SubscriptionState.OK
    assert _state(oldest_unhandled_age_seconds=30.5) == SubscriptionState.LAGGING
    assert _state(oldest_unhandled_age_seconds=None) == SubscriptionState.OK
    assert _state(oldest_unhandled_age_seconds=2.0) == SubscriptionState.OK


def test_the_lagging_threshold_is_the_ack_wait_and_follows_its_setting(settings):
    with override_settings(PLATFORMKIT=dict(settings.PLATFORMKIT, ACK_WAIT_SECONDS=90)):
        assert states.lagging_after_seconds() == 90.0
    with override_settings(PLATFORMKIT=dict(settings.PLATFORMKIT, ACK_WAIT_SECONDS=12)):
        assert states.lagging_after_seconds() == 12.0


def test_states_read_as_words_and_compare_as_their_values():
    assert SubscriptionState.FAILING == "failing" and str(SubscriptionState.LAGGING.label) == "lagging"
    assert str(WorkerState.WAITING_FOR_BROKER.label) == "waiting for the broker"


def _every(seconds: float) -> JobSpec:
    return JobSpec(name="testapp.sync_prices", func=lambda: None, every=datetime.timedelta(seconds=seconds))


def test_a_job_whose_last_slot_is_82_s_old_on_a_20_s_schedule_is_overdue_from_the_slot_after_it():
    spec = _every(20)
    last = spec.prev_slot(NOW - datetime.timedelta(seconds=82))
    missed = states.missed_slot(spec, last, NOW)
    assert missed == last + datetime.timedelta(seconds=20)


def test_a_job_is_on_time_while_its_next_slot_is_younger_than_the_grace():
    spec = _every(20)
    last = spec.prev_slot(NOW)
    assert states.missed_slot(spec, last, NOW) is None  # its next slot hasn't come
    from django_platformkit.jobs.scheduler import OUTAGE_MAX_SECONDS

    assert states.OVERDUE_AFTER_SECONDS == 2 * OUTAGE_MAX_SECONDS  # twice the scheduler's longest wait
    ran = datetime.datetime(2026, 12, 3, 9, 29, 20, tzinfo=datetime.UTC)  # the next slot: 09:29:40
    nine_late, eleven_late = (ran + datetime.timedelta(seconds=20 + s) for s in (9, 11))
    assert states.missed_slot(spec, ran, nine_late) is None  # the scheduler may still be on its way
    assert states.missed_slot(spec, ran, eleven_late) == ran + datetime.timedelta(seconds=20)


def test_a_job_that_never_ran_has_no_slot_to_count_from():
    assert states.missed_slot(_every(20), None, NOW) is None


def test_a_cron_job_is_overdue_by_its_own_calendar():
    nightly = JobSpec(name="testapp.nightly", func=lambda: None, cron="0 3 * * *", timezone="Europe/Paris")
    yesterday = datetime.datetime(2026, 12, 2, 2, 0, tzinfo=datetime.UTC)  # 03:00 in Paris
    assert states.missed_slot(nightly, yesterday, NOW) == datetime.datetime(2026, 12, 3, 2, 0, tzinfo=datetime.UTC)
    assert states.missed_slot(nightly, yesterday, datetime.datetime(2026, 12, 3, 1, 0, tzinfo=datetime.UTC)) is None


def test_a_worker_is_stopped_after_a_clean_exit_silent_without_one_and_otherwise_alive_or_waiting():
    assert states.worker_state(alive=False, stopped_at=NOW, waiting_for_broker=False) == WorkerState.STOPPED
    assert states.worker_state(alive=False, stopped_at=None, waiting_for_broker=True) == WorkerState.SILENT
    assert states.worker_state(alive=True, stopped_at=None, waiting_for_broker=True) == WorkerState.WAITING_FOR_BROKER
    assert states.worker_state(alive=True, stopped_at=None, waiting_for_broker=False) == WorkerState.ALIVE


def test_stopped_workers_fold_away_after_five_minutes_silent_ones_after_an_hour_live_ones_never():
    minutes = datetime.timedelta(minutes=1)
    assert not states.folded(WorkerState.STOPPED, NOW - 4 * minutes, NOW)
    assert states.folded(WorkerState.STOPPED, NOW - 6 * minutes, NOW)
    assert not states.folded(WorkerState.SILENT, NOW - 30 * minutes, NOW)
    assert states.folded(WorkerState.SILENT, NOW - 61 * minutes, NOW)
    assert not states.folded(WorkerState.ALIVE, NOW - 600 * minutes, NOW)
    assert not states.folded(WorkerState.WAITING_FOR_BROKER, NOW - 600 * minutes, NOW)
