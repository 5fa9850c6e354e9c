"""The one backoff every retry loop uses (pure: starts nothing)."""

import pytest

from django_platformkit._retry import Backoff

pytestmark = pytest.mark.unit


def test_doubles_up_to_the_cap_and_resets():
    delay = Backoff(first=0.5, cap=5.0)
    assert [delay.next() for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    delay.reset()
    assert delay.next() == 0.5


def test_jitter_only_shortens_a_delay():
    delay = Backoff(first=1.0, cap=8.0, jitter=0.5)
    for expected in (1.0, 2.0, 4.0, 8.0, 8.0):
        got = delay.next()
        assert expected * 0.5 <= got <= expected


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((0,), {}), ((1.0, 0.5), {}), ((1.0, 2.0), {"jitter": 1.5}), ((1.0, 2.0), {"jitter": -0.1})],
)
def test_bad_arguments_say_what_is_wrong(args, kwargs):
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(*args, **kwargs)
