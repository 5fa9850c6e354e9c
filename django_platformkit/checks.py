"""System checks: ``manage.py check`` says where the contract is broken.

Keeps "an undeclared event can't be published, and ``check`` says where one
would be". Every text is in ``MESSAGES`` below, under a stable id. Checks
read settings, the registries and the project's own source files only: never
a query, never a network call, so ``check`` and ``migrate`` work on an empty
database with the broker down.
"""

from __future__ import annotations

import ast
import difflib
import os
import site
import sysconfig
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.apps import AppConfig, apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from . import conf

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
        "{value} is below CONSUMER_BATCH_SIZE x concurrency ({credit}) + {headroom}. Raise MAX_ACK_PENDING "
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

_PUBLISH_FUNCTIONS = {
    "django_platformkit.publish": "publish",
    "django_platformkit.events.publish": "publish",
    "django_platformkit.publish_many": "publish_many",
    "django_platformkit.events.publish_many": "publish_many",
}
_SKIPPED_DIRS = {"__pycache__", "node_modules", "site-packages", "dist-packages"}
_PACKAGE_DIR = Path(__file__).resolve().parent


def _texts(check_id: str, values: Mapping[str, Any]) -> tuple[str, str]:
    message, hint = MESSAGES[check_id]
    return message.format(**values), hint.format(**values)


def _error(check_id: str, obj: Any = None, **values: Any) -> checks.Error:
    message, hint = _texts(check_id, values)
    return checks.Error(message, hint=hint, obj=obj, id=f"{TAG}.{check_id}")


def _warning(check_id: str, obj: Any = None, **values: Any) -> checks.Warning:
    message, hint = _texts(check_id, values)
    return checks.Warning(message, hint=hint, obj=obj, id=f"{TAG}.{check_id}")


def _suggestion(name: str, known: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return close[0] if close else None


def _undeclared_fix(event: str, known: Iterable[str]) -> str:
    suggestion = _suggestion(event, known)
    if suggestion is None:
        return FIXES["declare"].format(event=event)
    return FIXES["did_you_mean"].format(event=event, suggestion=suggestion)


def _setting(key: str) -> Any:
    """The validated value, or None when it is invalid (``E005``/``E007``
    report that): one bad setting must not crash the other checks."""
    try:
        return getattr(conf.settings, key)
    except ImproperlyConfigured:
        return None


def _in_apps(module: str, app_configs: Sequence[AppConfig] | None) -> bool:
    if app_configs is None:
        return True
    return any(module == c.name or module.startswith(c.name + ".") for c in app_configs)


# --- the catalogue -----------------------------------------------------------


@checks.register(TAG)
def check_subscriptions(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E001``: a subscription to an event nobody declared. ``W002``: a
    subscription's own backoff list longer than its retries."""
    from .events import catalogue
    from .subscriptions import subscriptions

    declared = catalogue()
    errors: list[checks.CheckMessage] = []
    for sub in subscriptions():
        if not _in_apps(sub.declared_in, app_configs):
            continue
        if sub.event not in declared:
            errors.append(
                _error(
                    "E001",
                    sub.declared_in,
                    subscription=sub.name,
                    event=sub.event,
                    fix=_undeclared_fix(sub.event, declared),
                )
            )
        if sub.backoff_seconds_override is not None:
            attempts = sub.max_attempts_override or _setting("MAX_ATTEMPTS")
            if attempts is not None and len(sub.backoff_seconds_override) > attempts - 1:
                errors.append(
                    _warning(
                        "W002",
                        sub.declared_in,
                        subscription=sub.name,
                        delays=len(sub.backoff_seconds_override),
                        attempts=attempts,
                        retries=attempts - 1,
                    )
                )
    return errors


@dataclass(frozen=True)
class PublishCall:
    """A literal event name passed to ``publish()``/``publish_many()``."""

    path: Path
    line: int
    call: str  # "publish" or "publish_many"
    event: str


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it refers to, for imports of django_platformkit:
    only calls of *our* publish count (``redis.publish("a.b")`` does not)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "django_platformkit" or alias.name.startswith("django_platformkit."):
                    if alias.asname:
                        names[alias.asname] = alias.name
                    else:
                        names["django_platformkit"] = "django_platformkit"
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module in ("django_platformkit", "django_platformkit.events")
        ):
            for alias in node.names:
                if alias.name == "*":
                    names.update({n: f"{node.module}.{n}" for n in ("publish", "publish_many")})
                else:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _literal(node: ast.AST | None) -> tuple[str, int] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, node.lineno
    return None


def _argument(call: ast.Call, keyword: str) -> ast.expr | None:
    if call.args:
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _many_literals(node: ast.expr | None) -> Iterator[tuple[str, int]]:
    """Event names from ``publish_many([("a.b", {...}), ...])`` and from a
    comprehension whose element is such a tuple."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items: list[ast.expr] = list(node.elts)
    elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        items = [node.elt]
    else:
        return
    for item in items:
        if isinstance(item, ast.Tuple) and item.elts:
            found = _literal(item.elts[0])
            if found:
                yield found


def publish_calls(source: str, path: Path) -> list[PublishCall]:
    """Every literal event name ``source`` passes to django_platformkit's
    ``publish``/``publish_many``, with its line. Names built at run time are
    left to ``publish()`` to refuse. A file that doesn't parse yields none."""
    try:
        tree = ast.parse(source, filename=str(path))
    except (SyntaxError, ValueError):
        return []
    names = _imported_names(tree)
    if not names:
        return []
    found: list[PublishCall] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if head not in names:
            continue
        call = _PUBLISH_FUNCTIONS.get(names[head] + ("." + rest if rest else ""))
        if call == "publish":
            literal = _literal(_argument(node, "event"))
            if literal:
                found.append(PublishCall(path, literal[1], call, literal[0]))
        elif call == "publish_many":
            found.extend(
                PublishCall(path, line, call, name) for name, line in _many_literals(_argument(node, "events"))
            )
    return sorted(found, key=lambda c: (c.line, c.event))


def _outside_project() -> list[Path]:
    paths = {*site.getsitepackages(), site.getusersitepackages()}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with_key = sysconfig.get_paths().get(key)
        if with_key:
            paths.add(with_key)
    return [Path(p).resolve() for p in paths if p]


def _is_within(path: Path, parents: Iterable[Path]) -> bool:
    return any(path == parent or parent in path.parents for parent in parents)


def project_sources(app_configs: Iterable[AppConfig]) -> Iterator[tuple[Path, Path]]:
    """``(file, display root)`` for every ``.py`` file of the project's own
    apps: not site-packages or the standard library, not this package, no
    hidden or virtualenv directories. The display root is the directory that
    holds the app's top-level package, so files show as ``shop/views.py``."""
    outside = _outside_project()
    seen: set[Path] = set()
    for config in app_configs:
        app_dir = Path(config.path).resolve()
        if _is_within(app_dir, outside) or any(part in _SKIPPED_DIRS for part in app_dir.parts):
            continue
        if app_dir == _PACKAGE_DIR or _PACKAGE_DIR in app_dir.parents:
            continue
        root = app_dir.parents[config.name.count(".")] if config.name.count(".") < len(app_dir.parents) else app_dir
        for dirpath, dirnames, filenames in os.walk(app_dir):
            # Prune in place: a virtualenv or node_modules inside an app is not the app.
            dirnames[:] = sorted(
                d
                for d in dirnames
                if not d.startswith(".") and d not in _SKIPPED_DIRS and not (Path(dirpath) / d / "pyvenv.cfg").exists()
            )
            for filename in sorted(filenames):
                if filename.endswith(".py"):
                    path = Path(dirpath, filename).resolve()
                    if path not in seen and path.parent != _PACKAGE_DIR and _PACKAGE_DIR not in path.parents:
                        seen.add(path)
                        yield path, root


def _display(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


@checks.register(TAG)
def check_publish_calls(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E002``: ``publish("…")`` with a literal name nobody declared, found
    by reading the project's own apps' source. Reported as ``file:line``."""
    from .events import catalogue

    declared = catalogue()
    errors: list[checks.CheckMessage] = []
    for path, root in project_sources(app_configs if app_configs is not None else apps.get_app_configs()):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "publish" not in source:  # most files: skip the parse
            continue
        for call in publish_calls(source, path):
            if call.event not in declared:
                where = f"{_display(call.path, root)}:{call.line}"
                errors.append(
                    _error("E002", where, call=call.call, event=call.event, fix=_undeclared_fix(call.event, declared))
                )
    return errors


# --- settings ----------------------------------------------------------------


@checks.register(TAG)
def check_settings(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E005`` PLATFORMKIT is not a dict, ``E006`` unknown keys, ``E007``
    invalid values, ``E008`` handler timeout vs ack wait, ``W001`` a backoff
    list longer than ``MAX_ATTEMPTS`` has retries.

    Backoff decision: ``MAX_ATTEMPTS`` = n needs n-1 delays. Fewer is fine
    (documented: the last delay repeats, so ``[5]`` means "every 5 s"); more
    is a warning, since the extra delays never run - reported only when the
    list was set explicitly, not for the default list cut short."""
    from django.conf import settings as django_settings
    from django.utils.module_loading import import_string

    raw = getattr(django_settings, "PLATFORMKIT", {})
    if not isinstance(raw, Mapping):
        return [_error("E005", "settings.PLATFORMKIT", type=type(raw).__name__)]
    errors: list[checks.CheckMessage] = []
    for key in conf.settings.unknown_keys():
        suggestion = _suggestion(key, conf.DEFAULTS)
        fix = FIXES["unknown_key_near"].format(suggestion=suggestion) if suggestion else FIXES["unknown_key"]
        errors.append(_error("E006", "settings.PLATFORMKIT", key=key, fix=fix))
    for key in conf.DEFAULTS:
        try:
            value = getattr(conf.settings, key)
            if key == "TENANT_CONTEXT":
                import_string(value)
        except ImproperlyConfigured as exc:
            error = " ".join(str(exc).split())  # one line
            errors.append(_error("E007", "settings.PLATFORMKIT", key=key, error=error))
        except ImportError as exc:
            error = FIXES["not_importable"].format(value=value, error=" ".join(str(exc).split()))
            errors.append(_error("E007", "settings.PLATFORMKIT", key=key, error=error))
    timeout, ack_wait = _setting("HANDLER_TIMEOUT_SECONDS"), _setting("ACK_WAIT_SECONDS")
    if timeout is not None and ack_wait is not None and timeout >= ack_wait:
        errors.append(_error("E008", "settings.PLATFORMKIT", timeout=timeout, ack_wait=ack_wait))
    attempts, delays = _setting("MAX_ATTEMPTS"), _setting("BACKOFF_SECONDS")
    if "BACKOFF_SECONDS" in raw and attempts is not None and delays is not None and len(delays) > attempts - 1:
        errors.append(
            _warning("W001", "settings.PLATFORMKIT", delays=len(delays), attempts=attempts, retries=attempts - 1)
        )
    return errors


@checks.register(TAG)
def check_database(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E004`` DATABASE_ALIAS names no database; ``E003`` it is not
    PostgreSQL. Reads the backend's vendor: no connection is opened."""
    from django.conf import settings as django_settings
    from django.db.utils import load_backend

    alias = _setting("DATABASE_ALIAS")
    if alias is None:
        return []
    if alias not in django_settings.DATABASES:
        return [_error("E004", "settings.PLATFORMKIT", alias=alias, aliases=sorted(django_settings.DATABASES))]
    try:
        # The backend class's vendor: importing it opens no connection.
        vendor = load_backend(django_settings.DATABASES[alias].get("ENGINE", "")).DatabaseWrapper.vendor
    except ImproperlyConfigured:
        return []  # Django's own checks and connection say what is wrong with ENGINE
    if vendor != "postgresql":
        return [_error("E003", "settings.DATABASES", alias=alias, vendor=vendor)]
    return []


# --- jobs and commands -------------------------------------------------------


@checks.register(TAG)
def check_jobs(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E009``: a job whose schedule can't run (a cron expression that never
    fires, an unknown time zone), as ``jobs.validate_schedule`` finds it."""
    from . import jobs

    list_jobs = getattr(jobs, "jobs", None)
    validate = getattr(jobs, "validate_schedule", None)
    if list_jobs is None or validate is None:
        return []
    errors: list[checks.CheckMessage] = []
    for spec in list_jobs():
        if not _in_apps(spec.declared_in, app_configs):
            continue
        for problem in validate(every=spec.every, cron=spec.cron, timezone=spec.timezone):
            errors.append(
                _error("E009", spec.declared_in or spec.name, job=spec.name, problem=" ".join(str(problem).split()))
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
        warnings.append(_warning("W003", "settings.INSTALLED_APPS", other=providers[0]))
    for other in providers[providers.index("django_platformkit") + 1 :]:
        warnings.append(_warning("W004", "settings.INSTALLED_APPS", other=other))
    return warnings


#: Parked retries a durable must carry beyond its in-flight credit before W005 stays quiet.
MIN_RETRY_ROOM = 1000


@checks.register(TAG)
def check_max_ack_pending(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``W005``: a durable's ``max_ack_pending`` can't carry the credit the
    runtime fetches (``CONSUMER_BATCH_SIZE x concurrency``) plus
    ``MIN_RETRY_ROOM`` parked retries: healthy events would wait behind them."""
    from .subscriptions import subscriptions
    from .transport import max_ack_pending_for

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
        credit = batch * sub.concurrency
        if value < credit + MIN_RETRY_ROOM:
            messages.append(
                _warning(
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
        _warning("W006", "settings.PLATFORMKIT", key=key, value=conf.DEFAULTS[key][0])
        for key in ("STREAM", "SUBJECT_PREFIX")
        if raw.get(key, conf.DEFAULTS[key][0]) == conf.DEFAULTS[key][0]
    ]
