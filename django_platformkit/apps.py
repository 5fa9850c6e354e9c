"""App config: import every installed app's ``platformkit.py`` (as the admin
imports ``admin.py``) so declarations, subscriptions and jobs are registered
before anything runs, then refuse a malformed one at boot with
``ImproperlyConfigured`` naming the app, the function and the fix: a worker
must not start with half a catalogue."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib import import_module
from typing import Any

from django.apps import AppConfig, apps
from django.utils.module_loading import module_has_submodule
from django.utils.translation import gettext_lazy as _

from django_platformkit.exceptions import ConfigurationError


class PlatformKitConfig(AppConfig):
    name = "django_platformkit"
    label = "django_platformkit"
    verbose_name = _("Platform kit")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_platformkit import checks  # noqa: F401 - registers the system checks
        from django_platformkit.operate import pause  # noqa: F401 - declares the pause's audit events
        from django_platformkit.outbox import events  # noqa: F401 - declares the built-in events

        discover()
        from django_platformkit.tasks.registry import register_task_queues

        register_task_queues()  # django.tasks: one subscription per TASKS queue
        validate_declarations()


def discover() -> None:
    """Import ``<app>.platformkit`` for every installed app that has one.
    A declaration refused there (bad event name, one event declared twice
    with different schemas, an invalid JSON Schema, two handlers with one
    subscription name...) is re-raised naming the app."""
    for config in apps.get_app_configs():
        if not module_has_submodule(config.module, "platformkit"):
            continue
        try:
            import_module(f"{config.name}.platformkit")
        except ConfigurationError as exc:
            raise ConfigurationError(f"app {config.label!r} ({config.name}.platformkit): {exc}") from exc


def _app_of(module: str) -> str:
    config = apps.get_containing_app_config(module)
    return repr(config.label) if config is not None else f"of module {module}"


def _refuse_signature(func: Callable[..., Any], args: tuple[Any, ...], what: str, fix: str) -> None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # some builtins have none: nothing to check
        return
    try:
        signature.bind(*args)
    except TypeError as exc:
        raise ConfigurationError(
            f"app {_app_of(getattr(func, '__module__', '') or '')}: {what} ({exc}). Fix: {fix}"
        ) from None


def _refuse_no_parameter(func: Callable[..., Any], declared_in: str) -> None:
    # signature.bind's own words for this case ("too many positional
    # arguments") read as if the handler took too many.
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return
    if not parameters:
        raise ConfigurationError(
            f"app {_app_of(getattr(func, '__module__', '') or '')}: handler {declared_in} takes no argument; "
            f"a handler takes one event. Fix: define it as 'def {getattr(func, '__name__', 'handler')}(event): ...' "
            "(one ReceivedEvent)."
        )


def validate_declarations() -> None:
    """What can only be seen once every ``platformkit.py`` is imported:
    handlers that can't take one event, jobs that can't be called with no
    arguments or have neither or both of ``every``/``cron``. Raises
    ``ConfigurationError`` (an ``ImproperlyConfigured``)."""
    from django_platformkit.consume.subscriptions import subscriptions
    from django_platformkit.jobs import specs as jobs

    for sub in subscriptions():
        _refuse_no_parameter(sub.handler, sub.declared_in)
        _refuse_signature(
            sub.handler,
            (object(),),
            f"handler {sub.declared_in} can't take one event",
            f"define it as 'def {getattr(sub.handler, '__name__', 'handler')}(event): ...' (one ReceivedEvent).",
        )
    for spec in getattr(jobs, "jobs", list)():
        where = spec.declared_in or spec.name
        if (spec.every is None) == (spec.cron is None):
            raise ConfigurationError(
                f"app {_app_of(where)}: job {spec.name!r} ({where}) needs exactly one of every= or cron=. "
                "Fix: @job(every=timedelta(minutes=5)) or @job(cron='*/5 * * * *')."
            )
        _refuse_signature(
            spec.func,
            (),
            f"job {where} can't be called with no arguments",
            f"define it as 'def {getattr(spec.func, '__name__', 'job')}(): ...' (no arguments).",
        )
