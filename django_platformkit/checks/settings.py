"""System checks of configuration: the PLATFORMKIT dict and INSTALLED_APPS.

A bad value is reported under its key (``E005``-``E008``, ``E010``, ``W001``) rather
than raised, so one mistake doesn't hide the others; a second ``runworker``
is a warning (``W003``/``W004``). Reads settings only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from django.apps import AppConfig, apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from django_platformkit import conf
from django_platformkit.checks.messages import FIXES, TAG, check_error, check_warning, setting_or_none
from django_platformkit.names import closest_name


@checks.register(TAG)
def check_settings(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E005`` PLATFORMKIT is not a dict, ``E006`` unknown keys, ``E007``
    invalid values, ``E008`` handler timeout vs ack wait, ``E010`` a duplicate
    window longer than the retention (NATS refuses the stream), ``W001`` a backoff
    list longer than ``MAX_ATTEMPTS`` has retries.

    Backoff decision: ``MAX_ATTEMPTS`` = n needs n-1 delays. Fewer is fine
    (documented: the last delay repeats, so ``[5]`` means "every 5 s"); more
    is a warning, since the extra delays never run - reported only when the
    list was set explicitly, not for the default list cut short."""
    from django.conf import settings as django_settings
    from django.utils.module_loading import import_string

    raw = getattr(django_settings, "PLATFORMKIT", {})
    if not isinstance(raw, Mapping):
        return [check_error("E005", "settings.PLATFORMKIT", type=type(raw).__name__)]
    errors: list[checks.CheckMessage] = []
    for key in conf.settings.unknown_keys():
        suggestion = closest_name(key, conf.DEFAULTS)
        fix = FIXES["unknown_key_near"].format(suggestion=suggestion) if suggestion else FIXES["unknown_key"]
        errors.append(check_error("E006", "settings.PLATFORMKIT", key=key, fix=fix))
    for key in conf.DEFAULTS:
        try:
            value = getattr(conf.settings, key)
            if key == "TENANT_CONTEXT" and value is not None:
                import_string(value)
        except ImproperlyConfigured as exc:
            error = " ".join(str(exc).split())  # one line
            errors.append(check_error("E007", "settings.PLATFORMKIT", key=key, error=error))
        except ImportError as exc:
            error = FIXES["not_importable"].format(value=value, error=" ".join(str(exc).split()))
            errors.append(check_error("E007", "settings.PLATFORMKIT", key=key, error=error))
    timeout, ack_wait = setting_or_none("HANDLER_TIMEOUT_SECONDS"), setting_or_none("ACK_WAIT_SECONDS")
    if timeout is not None and ack_wait is not None and timeout >= ack_wait:
        errors.append(check_error("E008", "settings.PLATFORMKIT", timeout=timeout, ack_wait=ack_wait))
    window, retention = setting_or_none("DUPLICATE_WINDOW_SECONDS"), setting_or_none("RETENTION_DAYS")
    if window is not None and retention is not None and window > float(retention) * 86400:
        errors.append(check_error("E010", "settings.PLATFORMKIT", window=window, max_age=float(retention) * 86400))
    attempts, delays = setting_or_none("MAX_ATTEMPTS"), setting_or_none("BACKOFF_SECONDS")
    if "BACKOFF_SECONDS" in raw and attempts is not None and delays is not None and len(delays) > attempts - 1:
        errors.append(
            check_warning("W001", "settings.PLATFORMKIT", delays=len(delays), attempts=attempts, retries=attempts - 1)
        )
    return errors


@checks.register(TAG)
def check_runworker(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``W003``/``W004``: another installed app also provides ``runworker``
    (Django Channels does). Django runs the one of the app listed first."""
    from django.core.management import find_commands

    providers = [
        config.name
        for config in apps.get_app_configs()
        if "runworker" in find_commands(os.path.join(config.path, "management"))
    ]
    if len(providers) < 2 or "django_platformkit" not in providers:
        return []
    warnings: list[checks.CheckMessage] = []
    if providers[0] != "django_platformkit":
        warnings.append(check_warning("W003", "settings.INSTALLED_APPS", other=providers[0]))
    for other in providers[providers.index("django_platformkit") + 1 :]:
        warnings.append(check_warning("W004", "settings.INSTALLED_APPS", other=other))
    return warnings
