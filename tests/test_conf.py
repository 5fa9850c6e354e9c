"""The typed settings object: one attribute per PLATFORMKIT key with its
validator's type, read lazily, re-read when the setting changes."""

from __future__ import annotations

import typing

import pytest

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError

pytestmark = pytest.mark.unit


def test_every_setting_is_a_typed_attribute_whose_default_is_valid():
    assert list(conf.DEFAULTS) == [
        name for name, value in vars(conf.Settings).items() if isinstance(value, conf._Setting)
    ]
    for key, (default, validate) in conf.DEFAULTS.items():
        declared = vars(conf.Settings)[key]
        assert (declared.key, declared.default, declared.validate) == (key, default, validate)
        # What the checker sees for conf.settings.<KEY>: the validator's return type, never Any.
        returns = typing.get_type_hints(validate, vars(conf))["return"]
        assert returns is not typing.Any, key
        validate(key, default)


def test_a_read_is_validated_cached_and_re_read_when_the_setting_changes(settings):
    settings.PLATFORMKIT = {"MAX_ATTEMPTS": 3, "BACKOFF_SECONDS": [2, 4.5]}
    assert conf.settings.MAX_ATTEMPTS == 3
    assert conf.settings.BACKOFF_SECONDS == (2, 4.5)
    assert conf.settings.RELAY_BATCH_SIZE == 1000  # the default
    assert vars(conf.settings)["MAX_ATTEMPTS"] == 3  # cached where attribute lookup finds it first

    settings.PLATFORMKIT = {"MAX_ATTEMPTS": 7}  # setting_changed -> Settings.clear()
    assert "MAX_ATTEMPTS" not in vars(conf.settings)
    assert conf.settings.MAX_ATTEMPTS == 7
    assert conf.settings.BACKOFF_SECONDS == (1, 5, 15, 30)

    settings.PLATFORMKIT = {"MAX_ATTEMPTS": 0}
    with pytest.raises(ConfigurationError, match=r"PLATFORMKIT\['MAX_ATTEMPTS'\] must be an integer >= 1, got 0"):
        conf.settings.MAX_ATTEMPTS  # the read is what raises
    assert "MAX_ATTEMPTS" not in vars(conf.settings)  # a bad value is never cached


def test_a_name_that_is_not_a_setting_is_an_attribute_error():
    with pytest.raises(AttributeError, match="'MAX_ATTEMPTZ' is not a PLATFORMKIT setting"):
        getattr(conf.settings, "MAX_ATTEMPTZ")  # noqa: B009 - mypy rejects the attribute spelt out


def test_validators_return_what_their_type_says(settings):
    settings.PLATFORMKIT = {"BACKOFF_SECONDS": (d for d in [0, 1]), "NATS_OPTIONS": {"user": "u"}, "RELAY_LANES": 3}
    assert conf.settings.BACKOFF_SECONDS == (0, 1)
    options = conf.settings.NATS_OPTIONS
    assert options == {"user": "u"} and options is not settings.PLATFORMKIT["NATS_OPTIONS"]
    assert conf.settings.RELAY_LANES == 3
    for key, value, error in [
        ("BACKOFF_SECONDS", "15", "must be a list of seconds"),
        ("BACKOFF_SECONDS", [], "at least one delay"),
        ("BACKOFF_SECONDS", [1, -1], "delays must be finite numbers >= 0, got -1"),
        ("RELAY_LANES", 17, "must be 1 to 16"),
        ("STREAM_REPLICAS", True, "must be an integer >= 1"),
        ("NATS_URL", "http://x", "must start with nats://"),
    ]:
        settings.PLATFORMKIT = {key: value}
        with pytest.raises(ConfigurationError, match=error):
            getattr(conf.settings, key)


def test_event_loop_auto_takes_uvloop_when_installed_and_asyncio_when_asked(settings, monkeypatch):
    import asyncio
    import builtins
    import sys

    import uvloop

    from django_platformkit.broker.connection import event_loop_kind, new_event_loop

    assert conf.settings.EVENT_LOOP == "auto"
    loop = new_event_loop()
    try:
        assert (event_loop_kind(), isinstance(loop, uvloop.Loop)) == ("uvloop", True)
    finally:
        loop.close()

    settings.PLATFORMKIT = {"EVENT_LOOP": "asyncio"}
    loop = new_event_loop()
    try:
        assert event_loop_kind() == "asyncio"
        assert isinstance(loop, asyncio.BaseEventLoop) and not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()

    settings.PLATFORMKIT = {"EVENT_LOOP": "trio"}
    with pytest.raises(
        ConfigurationError, match=r"PLATFORMKIT\['EVENT_LOOP'\] must be one of 'auto', 'uvloop', 'asyncio', got 'trio'"
    ):
        conf.settings.EVENT_LOOP

    # Without uvloop installed: "auto" falls back to asyncio, "uvloop" says what to install.
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "uvloop")
    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    settings.PLATFORMKIT = {}
    assert event_loop_kind() == "asyncio"
    settings.PLATFORMKIT = {"EVENT_LOOP": "uvloop"}
    with pytest.raises(ConfigurationError, match=r"uvloop is not installed: pip install 'django-platformkit\[speed\]'"):
        conf.settings.EVENT_LOOP


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        # NaN and infinity passed "> 0" / ">= 0": NaN compares False both ways.
        ("BACKOFF_SECONDS", [1, float("nan")], r"delays must be finite numbers >= 0, got nan"),
        ("BACKOFF_SECONDS", [float("inf")], r"delays must be finite numbers >= 0, got inf"),
        ("ACK_WAIT_SECONDS", float("inf"), r"must be a finite number > 0, got inf"),
        ("RELAY_INTERVAL_SECONDS", float("inf"), r"must be a finite number > 0, got inf"),
        ("HANDLER_STUCK_GRACE_SECONDS", float("inf"), r"must be a finite number > 0, got inf"),
        ("RETENTION_DAYS", float("nan"), r"must be a finite number > 0, got nan"),
        # JetStream takes durations as int64 nanoseconds (about 292 years).
        ("ACK_WAIT_SECONDS", 10**10, r"at most 9,223,372,036 \(JetStream"),
        ("DUPLICATE_WINDOW_SECONDS", 10**10, r"at most 9,223,372,036 \(JetStream"),
        ("RETENTION_DAYS", 10**9, r"at most 106,751 \(JetStream"),
        ("BACKOFF_SECONDS", [1, 10**10], r"at most 9,223,372,036 seconds \(JetStream"),
        # PostgreSQL's statement_timeout is int32 milliseconds (about 24.8 days).
        ("HANDLER_TIMEOUT_SECONDS", 3 * 10**6, r"at most 2,147,483 \(PostgreSQL's statement_timeout"),
    ],
)
def test_a_number_the_broker_or_the_database_can_not_take_is_refused_when_read(settings, key, value, error):
    """Each of these passed validation and `manage.py check`, then: every
    retry's NAK failed ("cannot convert float NaN to integer", so a failing
    event waited out the ack wait instead of its backoff), the worker died at
    start-up in an OverflowError traceback (ACK_WAIT_SECONDS inf), NATS
    refused the stream as "invalid JSON" with advice about account limits
    (RETENTION_DAYS past int64 nanoseconds), or PostgreSQL refused the
    handler's statement_timeout, so every event was dead-lettered
    (HANDLER_TIMEOUT_SECONDS past int32 milliseconds)."""
    settings.PLATFORMKIT = {key: value}
    with pytest.raises(ConfigurationError, match=rf"PLATFORMKIT\['{key}'\].*{error}"):
        getattr(conf.settings, key)


def test_the_largest_numbers_the_broker_and_the_database_take_are_accepted(settings):
    settings.PLATFORMKIT = {
        "ACK_WAIT_SECONDS": 9_223_372_036,
        "DUPLICATE_WINDOW_SECONDS": 9_223_372_036,
        "RETENTION_DAYS": 106_751,
        "BACKOFF_SECONDS": [0, 9_223_372_036],
        "HANDLER_TIMEOUT_SECONDS": 2_147_483,
    }
    assert conf.settings.ACK_WAIT_SECONDS == 9_223_372_036
    assert conf.settings.DUPLICATE_WINDOW_SECONDS == 9_223_372_036
    assert conf.settings.RETENTION_DAYS == 106_751
    assert conf.settings.BACKOFF_SECONDS == (0, 9_223_372_036)
    assert conf.settings.HANDLER_TIMEOUT_SECONDS == 2_147_483


def test_subscribe_refuses_a_backoff_the_broker_can_not_take():
    from django_platformkit import subscribe

    with pytest.raises(ConfigurationError, match=r"finite numbers >= 0, got nan"):
        subscribe("testapp.order_placed", name="testapp.nan_backoff", backoff_seconds=[float("nan")])(lambda e: None)
