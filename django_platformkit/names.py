"""The name grammar events, tenants, subscriptions and jobs share, and the
sentence for a name that isn't there (with the closest that is).

An event name and a tenant are NATS subject tokens, and a subscription name
becomes a durable consumer's name (``.`` -> ``-``), so each is checked here,
once, before it can reach the broker: a bad name raises with the fix.
"""

from __future__ import annotations

import difflib
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from django.apps import apps

from django_platformkit.exceptions import ConfigurationError, InvalidEventName

#: ``<module>.<event>``, each part ``[a-z][a-z0-9_]*``.
EVENT_NAME = re.compile(r"^[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*$")
#: A tenant token: a NATS subject token, so no dots, spaces or wildcards (a UUID fits).
TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Tenant tokens that mean something else on the subject: ``_`` stands for "no
#: tenant" (``wire.NO_TENANT``, the scheme shared with the Go
#: platformkit), so a tenant named ``_`` would arrive as no tenant at all.
RESERVED_TENANTS = frozenset({"_"})
#: Event module reserved for the package's own events (``platformkit.event_replayed``).
RESERVED_MODULE = "platformkit"


def check_event_name(name: Any) -> str:
    """Return ``name`` if it follows ``<module>.<event>`` (each part
    ``[a-z][a-z0-9_]*``), else raise ``InvalidEventName`` saying so."""
    # fullmatch: with match(), '$' also matches before a final newline, and
    # 'shop.order\n' would reach the NATS protocol line as a subject.
    if not isinstance(name, str) or not EVENT_NAME.fullmatch(name):
        raise InvalidEventName(
            f"{name!r} is not an event name: use '<module>.<event>', lower case, "
            "each part [a-z][a-z0-9_]*, exactly one dot (e.g. 'shop.order_placed')."
        )
    return name


def check_tenant(tenant: Any) -> str | None:
    """Return ``tenant`` if it is ``None`` or a token ``[A-Za-z0-9_-]{1,64}``
    (a UUID fits) other than the reserved ``_`` (``RESERVED_TENANTS``: "no
    tenant" on the subject); else raise ``InvalidEventName`` saying so. The
    tenant is a NATS subject token, so dots, spaces and wildcards can't be
    allowed."""
    if tenant is None:
        return None
    if isinstance(tenant, uuid.UUID):
        tenant = str(tenant)
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise InvalidEventName(
            f"tenant {tenant!r} is not a tenant token: use 1 to 64 characters of "
            "[A-Za-z0-9_-] (a UUID fits), or None for no tenant."
        )
    if tenant in RESERVED_TENANTS:
        raise InvalidEventName(
            f"tenant {tenant!r} is reserved: on the subject it means 'no tenant', so the event would "
            "arrive without one. Pass tenant=None for no tenant, or choose another token."
        )
    return tenant


#: One part of a subscription or job name (names are parts joined by ``.``;
#: no ``-``, so ``.`` -> ``-`` gives a one-to-one durable name).
SUBSCRIPTION_NAME_PART = r"[A-Za-z_][A-Za-z0-9_]*"
_NAME = re.compile(rf"{SUBSCRIPTION_NAME_PART}(\.{SUBSCRIPTION_NAME_PART})*")


def default_name(func: Callable[..., Any]) -> str:
    """``"<app_label>.<function name>"``: the name ``subscribe()`` and ``job()`` give a function by default."""
    module = getattr(func, "__module__", "") or ""
    label = None
    if apps.apps_ready:
        config = apps.get_containing_app_config(module)
        if config is not None:
            label = config.label
    if label is None:
        label = module.split(".")[0] or "app"
    return f"{label}.{func.__name__}"


def check_subscription_name(name: Any, where: str = "") -> str:
    """Return ``name`` if it is dot-separated identifiers without ``-`` (at most 200 characters), else raise ``ConfigurationError`` mentioning ``where``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > 200:
        raise ConfigurationError(
            f"subscription name {name!r}{where} is invalid: use dot-separated identifiers "
            "([A-Za-z_][A-Za-z0-9_]*, no '-'), e.g. 'shop.send_confirmation'."
        )
    return name


def closest_name(name: str, known: Iterable[str]) -> str | None:
    """The name of ``known`` that ``name`` most likely misspells, or None
    (difflib's ratio of at least 0.75): one did-you-mean for the checks and
    for ``publish()`` at run time alike."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return close[0] if close else None


#: How many near names an "unknown name" error suggests.
_SUGGESTIONS = 3


def unknown_name(kind: str, name: str, known: Iterable[str]) -> str:
    """The sentence for a ``kind`` (``"subscription"``, ``"job"``...) called
    ``name`` that isn't among ``known``: the closest known names
    (``difflib``, as Django's own ``Unknown command`` does), else the known
    ones, so a typo is one look away from its fix."""
    choices = sorted(set(known))
    close = difflib.get_close_matches(name, choices, n=_SUGGESTIONS, cutoff=0.6)
    if close:
        return f"unknown {kind} {name!r}; did you mean {' or '.join(repr(c) for c in close)}?"
    listed = ", ".join(choices[:20]) + (", …" if len(choices) > 20 else "")
    return f"unknown {kind} {name!r}; known: {listed or '(none)'}."
