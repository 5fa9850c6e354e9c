"""System checks of the declarations: subscriptions, ``publish()`` calls, jobs.

Keeps "an undeclared event can't be published, and ``check`` says where one
would be": ``E002`` reads the project's own source for literal event names.
Reads the registries and source files only: never a query or a connection.
"""

from __future__ import annotations

import ast
import os
import site
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.apps import AppConfig, apps
from django.core import checks

from django_platformkit.checks.messages import TAG, check_error, check_warning, in_apps, setting_or_none, undeclared_fix

_PUBLISH_FUNCTIONS = {
    "django_platformkit.publish": "publish",
    "django_platformkit.outbox.events.publish": "publish",
    "django_platformkit.publish_many": "publish_many",
    "django_platformkit.outbox.events.publish_many": "publish_many",
}
_SKIPPED_DIRS = {"__pycache__", "node_modules", "site-packages", "dist-packages"}
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # django_platformkit itself


@checks.register(TAG)
def check_subscriptions(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E001``: a subscription to an event nobody declared. ``E011``: a
    ``rate_limit`` that is no rate. ``W002``: a subscription's own backoff
    list longer than its retries."""
    from django_platformkit.consume.subscriptions import subscriptions
    from django_platformkit.outbox.events import catalogue

    declared = catalogue()
    errors: list[checks.CheckMessage] = []
    for sub in subscriptions():
        if not in_apps(sub.declared_in, app_configs):
            continue
        if sub.event not in declared:
            errors.append(
                check_error(
                    "E001",
                    sub.declared_in,
                    subscription=sub.name,
                    event=sub.event,
                    fix=undeclared_fix(sub.event, declared),
                )
            )
        if sub.rate_limit_error:
            errors.append(check_error("E011", sub.declared_in, subscription=sub.name, value=sub.rate_limit_given))
        if sub.backoff_seconds_override is not None:
            attempts = sub.max_attempts_override or setting_or_none("MAX_ATTEMPTS")
            if attempts is not None and len(sub.backoff_seconds_override) > attempts - 1:
                errors.append(
                    check_warning(
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
            and node.module in ("django_platformkit", "django_platformkit.outbox.events")
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
        if call is not None:
            literal = _literal(_argument(node, "event"))  # publish() and publish_many() both name it first
            if literal:
                found.append(PublishCall(path, literal[1], call, literal[0]))
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
    from django_platformkit.outbox.events import catalogue

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
                    check_error(
                        "E002", where, call=call.call, event=call.event, fix=undeclared_fix(call.event, declared)
                    )
                )
    return errors


# --- settings ----------------------------------------------------------------


@checks.register(TAG)
def check_jobs(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``E009``: a job whose schedule can't run (a cron expression that never
    fires, an unknown time zone), as ``jobs.specs.validate_schedule`` finds it."""
    from django_platformkit.jobs import specs as jobs

    list_jobs = getattr(jobs, "jobs", None)
    validate = getattr(jobs, "validate_schedule", None)
    if list_jobs is None or validate is None:
        return []
    errors: list[checks.CheckMessage] = []
    for spec in list_jobs():
        if not in_apps(spec.declared_in, app_configs):
            continue
        for problem in validate(every=spec.every, cron=spec.cron, timezone=spec.timezone):
            errors.append(
                check_error(
                    "E009", spec.declared_in or spec.name, job=spec.name, problem=" ".join(str(problem).split())
                )
            )
    return errors
