"""Whether a stream may be used, judged without a broker: the limits that
could discard events nobody handled, each named with its fix."""

from __future__ import annotations

import pytest

from django_platformkit.broker.standing import StreamLimits, judge_stream
from django_platformkit.identity import Tenure

pytestmark = pytest.mark.unit

SAFE = {"retention": "limits", "max_msgs": -1, "max_bytes": -1, "max_msgs_per_subject": -1}


def limit_problems(**limits):
    return StreamLimits(**limits).problems()


def test_a_stream_with_limits_retention_and_no_numeric_limit_is_safe():
    assert limit_problems(**SAFE) == []
    assert limit_problems(retention="limits", max_msgs=None, max_bytes=0, max_msgs_per_subject=None) == []


def test_a_max_age_of_retention_days_or_longer_or_none_is_safe_and_a_shorter_one_is_not(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "RETENTION_DAYS": 14}
    week, fortnight = 7 * 86400.0, 14 * 86400.0
    assert limit_problems(**SAFE, max_age_seconds=fortnight) == []
    assert limit_problems(**SAFE, max_age_seconds=fortnight + 3600) == []  # longer: drift, not a loss
    assert limit_problems(**SAFE, max_age_seconds=None) == [] == limit_problems(**SAFE, max_age_seconds=0)
    (problem,) = limit_problems(**SAFE, max_age_seconds=week)  # RETENTION_DAYS raised after the stream was made
    assert problem.value == "604800" and "RETENTION_DAYS (1209600 s)" in problem.effect


#: Each stream setting that could discard unhandled events, a value that does, and the fix its refusal names.
UNSAFE_LIMITS = [
    ("max_msgs", 300, "manage.py stream update"),
    ("max_bytes", 200_000, "manage.py stream update"),
    ("max_msgs_per_subject", 1, "manage.py stream update"),
    ("max_age", 15, "manage.py stream update"),
    ("retention", "interest", "manage.py stream reset --yes --discard-unhandled"),
    ("retention", "workqueue", "manage.py stream reset --yes --discard-unhandled"),
]


@pytest.mark.parametrize(
    ("setting", "value", "fix"),
    UNSAFE_LIMITS,
)
def test_each_limit_that_could_discard_unhandled_events_is_named_with_its_fix(setting, value, fix):
    setting_name = "max_age_seconds" if setting == "max_age" else setting
    (problem,) = limit_problems(**{**SAFE, setting_name: value})
    assert (problem.setting, problem.value) == (setting, str(value))
    assert fix in problem.fix
    assert str(problem).startswith(f"{setting}={value}: ")


def test_the_judgement_of_a_stream_names_every_problem_and_refuses_it():
    standing = judge_stream(
        StreamLimits(retention="workqueue", max_msgs=10, max_age_seconds=3600),
        name="S",
        url="nats://user:secret@host:4222",
        recorded=Tenure.read(None, None),
        owner=None,
        instance=None,
        now=0.0,
    )
    assert standing.refused and [p.setting for p in standing.problems] == ["max_msgs", "max_age", "retention"]
    assert standing.max_age_seconds == 3600
    assert "max_msgs=10" in standing.text and "retention=workqueue" in standing.text
    assert "max_age=3600: messages older than 3600 s are discarded" in standing.text
    assert "secret" not in standing.text
