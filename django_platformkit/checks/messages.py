"""System check texts and helpers: every id's message and hint in one place.

``MESSAGES`` is the contract a test pins per id; the check functions live in
``checks.declarations`` (events, subscriptions, jobs), ``checks.settings``
(the PLATFORMKIT dict, installed apps) and ``checks.services`` (database and
broker), and importing ``checks`` registers them all. Nothing here queries or connects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from django_platformkit import conf
from django_platformkit.names import closest_name

TAG = "platformkit"

#: id -> (message, hint). Messages stay under 80 characters for names of
#: ordinary length; hints are one line. ``{fix}`` is one of ``FIXES``.
MESSAGES: dict[str, tuple[str, str]] = {
    "E001": ("subscription {subscription!r}: event {event!r} is not declared", "{fix}"),
    "E002": ("{call}() of undeclared event {event!r}", "{fix}"),
    "E003": (
        "database {alias!r} behind the outbox is {vendor}, not PostgreSQL",
        "Point PLATFORMKIT['DATABASE_ALIAS'] at a PostgreSQL database (SKIP LOCKED, advisory locks).",
    ),
    "E004": ("PLATFORMKIT['DATABASE_ALIAS'] = {alias!r} is not in DATABASES", "Set it to one of {aliases}."),
    "E005": (
        "settings.PLATFORMKIT is a {type}, not a dict",
        "Make PLATFORMKIT a dict of settings, e.g. {{'NATS_URL': 'nats://...'}}.",
    ),
    "E006": ("unknown PLATFORMKIT key {key!r}", "{fix}"),
    "E007": ("PLATFORMKIT[{key!r}] is invalid", "{error}"),
    "E008": (
        "HANDLER_TIMEOUT_SECONDS ({timeout:g}) is not below ACK_WAIT_SECONDS ({ack_wait:g})",
        "Lower HANDLER_TIMEOUT_SECONDS or raise ACK_WAIT_SECONDS: the broker redelivers after the ack wait.",
    ),
    "E009": ("job {job!r} has a schedule that can't run", "{problem}"),
    "E010": (
        "DUPLICATE_WINDOW_SECONDS ({window:g}) exceeds RETENTION_DAYS ({max_age:g} s)",
        "RETENTION_DAYS is the stream's max age and NATS refuses a longer duplicate window, so no relay or worker could start: "
        "lower DUPLICATE_WINDOW_SECONDS or raise RETENTION_DAYS.",
    ),
    "E011": (
        "subscription {subscription!r}: rate_limit={value!r} is not a rate",
        "Write it as handler starts per second, minute or hour, every worker together: '100/s', '30/m' or "
        "'1000/h' (a whole number from 1 to 999999999), or leave rate_limit out for no limit.",
    ),
    "W001": (
        "BACKOFF_SECONDS has {delays} delays; MAX_ATTEMPTS={attempts} uses {retries}",
        "One delay per retry, so the extra delays never run: drop them or raise MAX_ATTEMPTS.",
    ),
    "W002": (
        "subscription {subscription!r}: {delays} delays; max_attempts={attempts} uses {retries}",
        "One delay per retry, so the extra delays never run: drop them or raise max_attempts.",
    ),
    "W003": (
        "runworker of {other!r} hides django_platformkit's runworker",
        "List 'django_platformkit' before {other!r} in INSTALLED_APPS: the first app listed wins.",
    ),
    "W004": (
        "runworker of {other!r} is hidden by django_platformkit's",
        "List {other!r} first if you need its worker (ours is then hidden), or silence platformkit.W004.",
    ),
    "W005": (
        "subscription {subscription!r}: max_ack_pending={value} leaves room for {room} events parked for retry",
        "The broker stops delivering at max_ack_pending, and events NAKed for a retry count until they come back: "
        "{value} is below CONSUMER_BATCH_SIZE x concurrency x 2 ({credit}: a running unit and the one fetched early) + {headroom}. Raise MAX_ACK_PENDING "
        "(or the subscription's max_ack_pending), or leave it unset for the derived default.",
    ),
    "W006": (
        "PLATFORMKIT[{key!r}] is left at its default {value!r}",
        "Set PLATFORMKIT['STREAM'] and ['SUBJECT_PREFIX'] to this project's own names: projects sharing a NATS must not share them.",
    ),
}

FIXES = {
    "declare": "Add declare({event!r}) to an app's platformkit.py.",
    "did_you_mean": "Did you mean {suggestion!r}? Else add declare({event!r}) to an app's platformkit.py.",
    "unknown_key": "Remove it; the known keys are in django_platformkit.conf.DEFAULTS.",
    "unknown_key_near": "Did you mean {suggestion!r}? Else remove it.",
    "not_importable": "{value!r} can't be imported ({error}): give the dotted path of a callable.",
}


def _texts(check_id: str, values: Mapping[str, Any]) -> tuple[str, str]:
    message, hint = MESSAGES[check_id]
    return message.format(**values), hint.format(**values)


def check_error(check_id: str, obj: Any = None, **values: Any) -> checks.Error:
    """The error ``check_id`` (``"E005"``) with its texts from ``MESSAGES`` filled in from ``values``."""
    message, hint = _texts(check_id, values)
    return checks.Error(message, hint=hint, obj=obj, id=f"{TAG}.{check_id}")


def check_warning(check_id: str, obj: Any = None, **values: Any) -> checks.Warning:
    """The warning ``check_id`` (``"W001"``) with its texts from ``MESSAGES`` filled in from ``values``."""
    message, hint = _texts(check_id, values)
    return checks.Warning(message, hint=hint, obj=obj, id=f"{TAG}.{check_id}")


def undeclared_fix(event: str, known: Iterable[str]) -> str:
    """The hint for an undeclared ``event``: the closest of ``known``, else to declare it."""
    suggestion = closest_name(event, known)
    if suggestion is None:
        return FIXES["declare"].format(event=event)
    return FIXES["did_you_mean"].format(event=event, suggestion=suggestion)


def setting_or_none(key: str) -> Any:
    """The validated value, or None when it is invalid (``E005``/``E007``
    report that): one bad setting must not crash the other checks."""
    try:
        return getattr(conf.settings, key)
    except ImproperlyConfigured:
        return None


def in_apps(module: str, app_configs: Sequence[AppConfig] | None) -> bool:
    """Whether ``module`` belongs to one of ``app_configs`` (None: every app, as Django's checks mean it)."""
    if app_configs is None:
        return True
    return any(module == c.name or module.startswith(c.name + ".") for c in app_configs)
