"""Whether a stream may be used, judged without a broker: the limits that
could discard events nobody handled, each named with its fix."""

from __future__ import annotations

import pytest

from django_platformkit.broker.standing import judge_stream, limit_problems

pytestmark = pytest.mark.unit

SAFE = {"retention": "limits", "max_msgs": -1, "max_bytes": -1, "max_msgs_per_subject": -1}


def test_a_stream_with_limits_retention_and_no_numeric_limit_is_safe():
    assert limit_problems(**SAFE) == []
    assert limit_problems(retention="limits", max_msgs=None, max_bytes=0, max_msgs_per_subject=None) == []


#: Each stream setting that could discard unhandled events, a value that does, and the fix its refusal names.
UNSAFE_LIMITS = [
    ("max_msgs", 300, "manage.py stream update"),
    ("max_bytes", 200_000, "manage.py stream update"),
    ("max_msgs_per_subject", 1, "manage.py stream update"),
    ("retention", "interest", "manage.py stream reset --yes"),
    ("retention", "workqueue", "manage.py stream reset --yes"),
]


@pytest.mark.parametrize(
    ("setting", "value", "fix"),
    UNSAFE_LIMITS,
)
def test_each_limit_that_could_discard_unhandled_events_is_named_with_its_fix(setting, value, fix):
    (problem,) = limit_problems(**{**SAFE, setting: value})
    assert (problem.setting, problem.value) == (setting, str(value))
    assert fix in problem.fix
    assert str(problem).startswith(f"{setting}={value}: ")


def test_the_judgement_of_a_stream_names_every_problem_and_refuses_it():
    standing = judge_stream(
        name="S",
        url="nats://user:secret@host:4222",
        description=None,
        metadata=None,
        retention="workqueue",
        max_msgs=10,
        max_bytes=-1,
        max_msgs_per_subject=-1,
        max_age_seconds=3600,
        owner=None,
        instance=None,
        now=0.0,
    )
    assert standing.refused and [p.setting for p in standing.problems] == ["max_msgs", "retention"]
    assert standing.max_age_seconds == 3600
    assert "max_msgs=10" in standing.text and "retention=workqueue" in standing.text
    assert "secret" not in standing.text
