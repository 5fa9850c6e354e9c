"""The ``PLATFORMKIT`` settings dict, read lazily through one object.

Defaults live here and nowhere else; values are validated on read and never
written back. A bad value raises ``ImproperlyConfigured`` naming the key.
Units are in the names: a number without one is a count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from django.conf import settings as django_settings
from django.core.signals import setting_changed

from django_platformkit.exceptions import ConfigurationError

# Used with fullmatch only: ``re.match`` with ``$`` accepts a trailing
# newline, which passes ``check`` and then fails at run time on the broker.
_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_STREAM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _positive_number(key: str, value: object) -> float:
    # NaN passed "> 0" checks written the other way round, and infinity
    # passed this one: neither is a duration a server or a sleep can take.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a finite number > 0, got {value!r}.")
    return value


#: JetStream takes its durations (ack wait, duplicate window, max age, a
#: NAK's delay) as int64 nanoseconds: past this many seconds (about 292
#: years) nats-py can't encode one, or the server refuses the request as
#: "invalid JSON".
NATS_MAX_SECONDS = (2**63 - 1) // 10**9
#: PostgreSQL's statement_timeout and idle_in_transaction_session_timeout
#: (the handler's transaction gets both) are int32 milliseconds: at most
#: this many seconds (about 24.8 days), or PostgreSQL refuses the SET and
#: every handler run fails.
POSTGRES_MAX_TIMEOUT_SECONDS = (2**31 - 1) // 1000


def _at_most(key: str, value: object, limit: int, why: str) -> float:
    """``value`` as ``_positive_number`` validates it, refused above ``limit`` saying ``why``."""
    number = _positive_number(key, value)
    if number > limit:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be at most {limit:,} ({why}), got {value!r}.")
    return number


def _nats_seconds(key: str, value: object) -> float:
    return _at_most(key, value, NATS_MAX_SECONDS, "JetStream's limit: int64 nanoseconds")


def _nats_days(key: str, value: object) -> float:
    return _at_most(
        key, value, NATS_MAX_SECONDS // 86400, "JetStream's limit on the stream's max age: int64 nanoseconds"
    )


def _handler_timeout(key: str, value: object) -> float:
    return _at_most(key, value, POSTGRES_MAX_TIMEOUT_SECONDS, "PostgreSQL's statement_timeout: int32 milliseconds")


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be an integer >= 1, got {value!r}.")
    return value


def _string(key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a non-empty string, got {value!r}.")
    return value


_NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def redact_url(url: str) -> str:
    """``url`` (one URL or a comma-separated list) with any user info replaced
    by ``***``: ``nats://worker:s3cret@host:4222`` -> ``nats://***@host:4222``.
    Use it for every URL that reaches a log line, an error or a page.
    Everything up to the last ``@`` goes: a password may hold an ``@`` or a
    ``/`` (the client takes the user info up to the last ``@``), and a host
    hidden by mistake is better than a password shown."""
    return ",".join(re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://).*@", r"\1***@", part.strip()) for part in url.split(","))


def _nats_url(key: str, value: object) -> str:
    text = _string(key, value)
    for url in (u.strip() for u in text.split(",")):
        if not url.startswith(_NATS_SCHEMES):
            raise ConfigurationError(
                f"PLATFORMKIT[{key!r}] holds {redact_url(url)!r}: each comma-separated URL must start with "
                "nats://, tls://, ws:// or wss:// (e.g. 'nats://127.0.0.1:4222')."
            )
    return text


def _subject_prefix(key: str, value: object) -> str:
    text = _string(key, value)
    if not all(_SUBJECT_TOKEN.fullmatch(part) for part in text.split(".")):
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be dot-separated NATS subject tokens "
            f"without wildcards or spaces, got {value!r}."
        )
    return text


def _stream(key: str, value: object) -> str:
    if not isinstance(value, str) or not _STREAM_NAME.fullmatch(value):
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be a JetStream stream name ([A-Za-z0-9_-], at most 64), got {value!r}."
        )
    return value


def _backoff(key: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be a list of seconds, got {value!r}.")
    delays: list[float] = []
    for delay in value:
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay) or delay < 0:
            # NaN and infinity: every retry's NAK failed to encode, so the event waited out the ack wait.
            raise ConfigurationError(f"PLATFORMKIT[{key!r}] delays must be finite numbers >= 0, got {delay!r}.")
        if delay > NATS_MAX_SECONDS:
            raise ConfigurationError(
                f"PLATFORMKIT[{key!r}] delays must be at most {NATS_MAX_SECONDS:,} seconds "
                f"(JetStream's limit on a NAK's delay: int64 nanoseconds), got {delay!r}."
            )
        delays.append(delay)
    if not delays:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must hold at least one delay in seconds.")
    return tuple(delays)


def _replicas(key: str, value: object) -> int:
    count = _positive_int(key, value)
    if count > 5:
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be 1 to 5 (JetStream's limit), got {value!r}.")
    return count


def _lanes(key: str, value: object) -> int:
    count = _positive_int(key, value)
    if count > 16:
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be 1 to 16, got {value!r}: each lane holds a database connection while a "
            "backlog drains, and past a few lanes the relay is bound by NATS, not by waiting. Run more runrelay processes instead."
        )
    return count


def _optional_string(key: str, value: object) -> str | None:
    return None if value is None else _string(key, value)


def _optional_positive_int(key: str, value: object) -> int | None:
    return None if value is None else _positive_int(key, value)


def _boolean(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"PLATFORMKIT[{key!r}] must be True or False, got {value!r}.")
    return value


#: ``rate_limit`` periods: the unit letter -> seconds.
RATE_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"\s*([1-9][0-9]{0,8})\s*/\s*([smh])\s*")


@dataclass(frozen=True)
class Rate:
    """A parsed rate limit: at most ``count`` handler starts in any window of
    ``period_seconds`` (``"100/s"`` -> ``Rate(100, 1.0)``)."""

    count: int
    period_seconds: float

    @property
    def spacing_seconds(self) -> float:
        """The least time between two starts: ``period_seconds / count``."""
        return self.period_seconds / self.count

    def __str__(self) -> str:
        unit = next(k for k, v in RATE_PERIODS.items() if v == self.period_seconds)
        return f"{self.count}/{unit}"


def _rate(key: str, value: object) -> Rate:
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be a rate like '100/s', '30/m' or '1000/h' (a whole number of handler "
            f"starts from 1 to 999999999, '/', then s, m or h: per second, minute or hour), got {value!r}."
        )
    return Rate(int(match.group(1)), RATE_PERIODS[match.group(2)])


#: The validators an option that overrides a setting uses too (``subscribe()``):
#: ``(key, value) -> value``, raising ``ConfigurationError`` that names ``PLATFORMKIT[key]``.
positive_int = _positive_int
boolean = _boolean
backoff_seconds = _backoff
rate = _rate


#: ``EVENT_LOOP`` values: the transport's event loop (see ``event_loop_kind``).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def _event_loop(key: str, value: object) -> str:
    if value not in EVENT_LOOPS:
        raise ConfigurationError(
            f"PLATFORMKIT[{key!r}] must be one of {', '.join(repr(v) for v in EVENT_LOOPS)}, got {value!r}."
        )
    if value == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                f"PLATFORMKIT[{key!r}] is 'uvloop', but uvloop is not installed: "
                "pip install 'django-platformkit[speed]' (Linux and macOS), or set 'auto'."
            ) from None
    return str(value)


def _nats_options(key: str, value: object) -> dict[str, Any]:
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


class _Setting[SettingT]:
    """One ``PLATFORMKIT`` key declared on ``Settings``: its default and the
    validator that checks a value and returns it as ``SettingT``.

    A non-data descriptor: the first read validates and stores the value in
    the instance's ``__dict__``, so later reads are plain attribute lookups
    until ``Settings.clear()`` forgets them. The checker sees ``SettingT``
    (the validator's return type) for ``conf.settings.<KEY>``."""

    def __init__(self, default: object, validate: Callable[[str, Any], SettingT]) -> None:
        self.default = default
        self.validate = validate
        self.key = ""

    def __set_name__(self, owner: type[object], name: str) -> None:
        self.key = name

    @overload
    def __get__(self, instance: None, owner: type[object]) -> _Setting[SettingT]: ...

    @overload
    def __get__(self, instance: Settings, owner: type[object]) -> SettingT: ...

    def __get__(self, instance: Settings | None, owner: type[object]) -> _Setting[SettingT] | SettingT:
        if instance is None:
            return self
        value = self.validate(self.key, instance.user_settings.get(self.key, self.default))
        # Cached where attribute lookup finds it first; clear() removes it.
        instance.__dict__[self.key] = value
        return value


class Settings:
    """Attribute access to ``settings.PLATFORMKIT`` with defaults, one typed
    attribute per setting.

    ``conf.settings.MAX_ATTEMPTS`` -> the configured value or the default,
    validated on first read (an ``int`` here; each attribute has its
    validator's type). Raises ``ImproperlyConfigured`` (``ConfigurationError``)
    naming the key for a bad value, and ``AttributeError`` for a name that is
    not a setting. Unknown keys in the dict are reported by ``manage.py check``.
    """

    # The one place defaults live (``DEFAULTS`` below is derived from these).
    NATS_URL = _Setting("nats://127.0.0.1:4222", _nats_url)
    NATS_OPTIONS = _Setting({}, _nats_options)
    STREAM = _Setting("PLATFORMKIT", _stream)
    SUBJECT_PREFIX = _Setting("platformkit", _subject_prefix)
    DATABASE_ALIAS = _Setting("default", _string)
    RELAY_INTERVAL_SECONDS = _Setting(1.0, _positive_number)
    RELAY_BATCH_SIZE = _Setting(1000, _positive_int)
    RELAY_LANES = _Setting(2, _lanes)
    RELAY_LISTEN = _Setting(True, _boolean)
    MAX_ATTEMPTS = _Setting(5, _positive_int)
    BACKOFF_SECONDS = _Setting((1, 5, 15, 30), _backoff)
    ACK_WAIT_SECONDS = _Setting(30, _nats_seconds)
    HANDLER_TIMEOUT_SECONDS = _Setting(25, _handler_timeout)
    HANDLER_STUCK_GRACE_SECONDS = _Setting(60, _positive_number)
    CONSUMER_BATCH_SIZE = _Setting(100, _positive_int)
    CONSUMER_THREADS = _Setting(4, _positive_int)
    # None: derived per subscription (transport.max_ack_pending_for): in-flight
    # credit twice over plus room for 20,000 events parked for retry.
    MAX_ACK_PENDING = _Setting(None, _optional_positive_int)
    MAX_PAYLOAD_BYTES = _Setting(512 * 1024, _positive_int)
    RETENTION_DAYS = _Setting(7, _nats_days)
    DUPLICATE_WINDOW_SECONDS = _Setting(120, _nats_seconds)
    STREAM_REPLICAS = _Setting(1, _replicas)
    RECONCILE_INTERVAL_SECONDS = _Setting(60.0, _positive_number)
    #: None: the built-in context, ``set_config('platformkit.tenant', tenant, true)``.
    TENANT_CONTEXT = _Setting(None, _optional_string)
    EVENT_LOOP = _Setting("auto", _event_loop)

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

    if not TYPE_CHECKING:
        # Only reached for a name that is not a setting (settings are class
        # attributes). Hidden from the checker, so a misspelt setting is a
        # type error rather than ``Any``.
        def __getattr__(self, key: str) -> Any:
            raise AttributeError(f"{key!r} is not a PLATFORMKIT setting")

    def clear(self) -> None:
        """Forget validated values; the next read re-reads ``settings.PLATFORMKIT`` (on ``setting_changed``)."""
        for key in DEFAULTS:
            self.__dict__.pop(key, None)


#: key -> (default, validator), in declaration order: derived from ``Settings``
#: (for ``manage.py check``, the docs' settings table and suggestions).
DEFAULTS: dict[str, tuple[Any, Callable[[str, Any], Any]]] = {
    name: (attribute.default, attribute.validate)
    for name, attribute in vars(Settings).items()
    if isinstance(attribute, _Setting)
}


settings = Settings()


def _reload(*, setting: str, **kwargs: Any) -> None:
    if setting == "PLATFORMKIT":
        settings.clear()


setting_changed.connect(_reload)
