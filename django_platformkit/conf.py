"""The ``PLATFORMKIT`` settings dict, read lazily through one object.

Defaults live here and nowhere else; values are validated on read and never
written back. A bad value raises ``ImproperlyConfigured`` naming the key.
Units are in the names: a number without one is a count.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed

from .exceptions import ConfigurationError

# Used with fullmatch only: ``re.match`` with ``$`` accepts a trailing
# newline, which passes ``check`` and then fails at run time on the broker.
_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_STREAM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _positive_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a number > 0, got {value!r}.")
    return value


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be an integer >= 1, got {value!r}.")
    return value


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a non-empty string, got {value!r}.")
    return value


_NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def redact_url(url: str) -> str:
    """``url`` (one URL or a comma-separated list) with any user info replaced
    by ``***``: ``nats://worker:s3cret@host:4222`` -> ``nats://***@host:4222``.
    Use it for every URL that reaches a log line, an error or a page."""
    return ",".join(re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^@/]*@", r"\1***@", part.strip()) for part in url.split(","))


def _nats_url(key: str, value: Any) -> str:
    _string(key, value)
    for url in (u.strip() for u in value.split(",")):
        if not url.startswith(_NATS_SCHEMES):
            raise ConfigurationError(
                f"PLATFORMKIT[{key!r}] holds {redact_url(url)!r}: each comma-separated URL must start with "
                "nats://, tls://, ws:// or wss:// (e.g. 'nats://127.0.0.1:4222')."
            )
    return value


def _subject_prefix(key: str, value: Any) -> str:
    _string(key, value)
    if not all(_SUBJECT_TOKEN.fullmatch(part) for part in value.split(".")):
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be dot-separated NATS subject tokens "
            f"without wildcards or spaces, got {value!r}."
        )
    return value


def _stream(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _STREAM_NAME.fullmatch(value):
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be a JetStream stream name ([A-Za-z0-9_-], at most 64), got {value!r}."
        )
    return value


def _backoff(key: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a list of seconds, got {value!r}.")
    delays = tuple(value)
    if not delays:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must hold at least one delay in seconds.")
    for delay in delays:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
            raise ConfigurationError(f"PLATFORMKIT[{key!r}] delays must be numbers >= 0, got {delay!r}.")
    return delays


def _replicas(key: str, value: Any) -> int:
    _positive_int(key, value)
    if value > 5:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be 1 to 5 (JetStream's limit), got {value!r}.")
    return value


def _lanes(key: str, value: Any) -> int:
    _positive_int(key, value)
    if value > 16:
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be 1 to 16, got {value!r}: each lane holds a database connection while a "
            "backlog drains, and past a few lanes the relay is bound by NATS, not by waiting. Run more runrelay processes instead."
        )
    return value


def _optional_positive_int(key: str, value: Any) -> int | None:
    return None if value is None else _positive_int(key, value)


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be True or False, got {value!r}.")
    return value


#: The validators an option that overrides a setting uses too (``subscribe()``):
#: ``(key, value) -> value``, raising ``ConfigurationError`` that names ``PLATFORMKIT[key]``.
positive_int = _positive_int
boolean = _boolean
backoff_seconds = _backoff


def _nats_options(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a dict, got {value!r}.")
    unknown = set(value) - NATS_OPTION_KEYS
    if unknown:
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] has unknown keys {sorted(unknown)}; supported: {sorted(NATS_OPTION_KEYS)}."
        )
    return dict(value)


#: Connection options passed on to nats-py: credentials and TLS.
NATS_OPTION_KEYS = frozenset(
    {
        "user",
        "password",
        "token",
        "user_credentials",
        "nkeys_seed",
        "tls_ca_file",
        "tls_cert_file",
        "tls_key_file",
        "tls_hostname",
        "name",
    }
)

# key -> (default, validator). The one place defaults live.
DEFAULTS: dict[str, tuple[Any, Callable[[str, Any], Any]]] = {
    "NATS_URL": ("nats://127.0.0.1:4222", _nats_url),
    "NATS_OPTIONS": ({}, _nats_options),
    "STREAM": ("PLATFORMKIT", _stream),
    "SUBJECT_PREFIX": ("platformkit", _subject_prefix),
    "DATABASE_ALIAS": ("default", _string),
    "RELAY_INTERVAL_SECONDS": (1.0, _positive_number),
    "RELAY_BATCH_SIZE": (1000, _positive_int),
    "RELAY_LANES": (2, _lanes),
    "RELAY_LISTEN": (True, _boolean),
    "MAX_ATTEMPTS": (5, _positive_int),
    "BACKOFF_SECONDS": ((1, 5, 15, 30), _backoff),
    "ACK_WAIT_SECONDS": (30, _positive_number),
    "HANDLER_TIMEOUT_SECONDS": (25, _positive_number),
    "HANDLER_STUCK_GRACE_SECONDS": (60, _positive_number),
    "CONSUMER_BATCH_SIZE": (100, _positive_int),
    "CONSUMER_THREADS": (4, _positive_int),
    # None: derived per subscription (transport.max_ack_pending_for): in-flight
    # credit twice over plus room for 20,000 events parked for retry.
    "MAX_ACK_PENDING": (None, _optional_positive_int),
    "MAX_PAYLOAD_BYTES": (512 * 1024, _positive_int),
    "RETENTION_DAYS": (7, _positive_number),
    "DUPLICATE_WINDOW_SECONDS": (120, _positive_number),
    "STREAM_REPLICAS": (1, _replicas),
    "TENANT_CONTEXT": ("django_platformkit.subscriptions.set_config_tenant", _string),
}


class Settings:
    """Attribute access to ``settings.PLATFORMKIT`` with defaults.

    ``conf.settings.MAX_ATTEMPTS`` -> the configured value or the default,
    validated. Raises ``ImproperlyConfigured`` (``ConfigurationError``) naming
    the key for a bad value, and ``AttributeError`` for a name that is not a
    setting. Unknown keys in the dict are reported by ``manage.py check``.
    """

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    @property
    def user_settings(self) -> Mapping[str, Any]:
        """The raw ``settings.PLATFORMKIT`` dict ({} when unset). Raises ``ConfigurationError`` if it is not a dict."""
        value = getattr(django_settings, "PLATFORMKIT", {})
        if not isinstance(value, Mapping):
            raise ConfigurationError(f"settings.PLATFORMKIT must be a dict, got {type(value).__name__}.")
        return value

    def unknown_keys(self) -> list[str]:
        """Sorted keys of ``PLATFORMKIT`` that are not settings (reported by ``manage.py check``)."""
        return sorted(set(self.user_settings) - set(DEFAULTS))

    def __getattr__(self, key: str) -> Any:
        if key not in DEFAULTS:
            raise AttributeError(f"{key!r} is not a PLATFORMKIT setting")
        try:
            return self._cache[key]
        except KeyError:
            pass
        default, validate = DEFAULTS[key]
        value = validate(key, self.user_settings.get(key, default))
        self._cache[key] = value
        return value

    def clear(self) -> None:
        """Forget validated values; the next read re-reads ``settings.PLATFORMKIT`` (on ``setting_changed``)."""
        self._cache.clear()


settings = Settings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting == "PLATFORMKIT":
        settings.clear()


setting_changed.connect(_reload)
