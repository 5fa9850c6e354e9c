"""System checks of what the outbox and the broker need: a PostgreSQL database
(``E003``/``E004``), durables with room for parked retries (``W005``), a
stream and subject prefix of this project's own (``W006``). Reads settings
and backend classes only: the broker may be down, the database empty.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from django_platformkit import conf
from django_platformkit.checks.messages import TAG, check_error, check_warning, setting_or_none


@checks.register(TAG)
def check_database(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E004`` DATABASE_ALIAS names no database; ``E003`` it is not
    PostgreSQL. Reads the backend's vendor: no connection is opened."""
    from django.conf import settings as django_settings
    from django.db.utils import load_backend

    alias = setting_or_none("DATABASE_ALIAS")
    if alias is None:
        return []
    if alias not in django_settings.DATABASES:
        return [check_error("E004", "settings.PLATFORMKIT", alias=alias, aliases=sorted(django_settings.DATABASES))]
    try:
        # The backend class's vendor: importing it opens no connection.
        vendor = load_backend(django_settings.DATABASES[alias].get("ENGINE", "")).DatabaseWrapper.vendor
    except ImproperlyConfigured:
        return []  # Django's own checks and connection say what is wrong with ENGINE
    if vendor != "postgresql":
        return [check_error("E003", "settings.DATABASES", alias=alias, vendor=vendor)]
    return []


# --- jobs and commands -------------------------------------------------------


#: Parked retries a durable must carry beyond its in-flight credit before W005 stays quiet.
MIN_RETRY_ROOM = 1000


@checks.register(TAG)
def check_max_ack_pending(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``W005``: a durable's ``max_ack_pending`` can't carry the credit the
    runtime fetches (``CONSUMER_BATCH_SIZE x concurrency x 2``: a slot
    running fast handlers fetches its next unit early) plus
    ``MIN_RETRY_ROOM`` parked retries: healthy events would wait behind them."""
    from django_platformkit.broker.streams import max_ack_pending_for
    from django_platformkit.consume.subscriptions import subscriptions

    try:
        batch = int(conf.settings.CONSUMER_BATCH_SIZE)
    except Exception:
        return []
    messages: list[checks.CheckMessage] = []
    for sub in subscriptions():
        try:
            value = max_ack_pending_for(sub.concurrency, getattr(sub, "max_ack_pending_override", None))
        except Exception:
            return []
        credit = 2 * batch * sub.concurrency  # a running unit and the one fetched early, per slot
        if value < credit + MIN_RETRY_ROOM:
            messages.append(
                check_warning(
                    "W005",
                    sub.declared_in or sub.name,
                    subscription=sub.name,
                    value=value,
                    room=max(0, value - credit),
                    credit=credit,
                    headroom=MIN_RETRY_ROOM,
                )
            )
    return messages


@checks.register(TAG)
def check_broker_namespace(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``W006`` ``STREAM`` or ``SUBJECT_PREFIX`` left at its default in a
    project with ``DEBUG = False``: a second project on the same NATS with
    the defaults would meet this one's stream (the worker then refuses to
    start, ``identity.py``); naming them up front avoids the surprise. Reads
    settings only."""
    from django.conf import settings as django_settings

    if getattr(django_settings, "DEBUG", False):
        return []
    raw = getattr(django_settings, "PLATFORMKIT", {})
    if not isinstance(raw, Mapping):
        return []  # E005 says so
    return [
        check_warning("W006", "settings.PLATFORMKIT", key=key, value=conf.DEFAULTS[key][0])
        for key in ("STREAM", "SUBJECT_PREFIX")
        if raw.get(key, conf.DEFAULTS[key][0]) == conf.DEFAULTS[key][0]
    ]
