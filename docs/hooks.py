"""MkDocs hook: the reference pages that come from the code, not from prose.

A page holds a marker such as ``<!-- platformkit:settings -->``; this hook
replaces it with what the code defines: the settings and their defaults
(with their meanings from ``docs/reference/settings.yml``), every system
check id with its message and hint, every management command's ``--help``,
and every Prometheus series. A reference that would come out empty or
incomplete fails the build instead of rendering "none defined".

Django is set up with ``tests.settings``, which starts no server and opens no
connection, so ``mkdocs build`` needs neither PostgreSQL nor NATS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_TEXT = ROOT / "docs" / "reference" / "settings.yml"

# --- every internal module the docs read, in one place ----------------------------
# The package's layout may change; these are the only import paths of internal
# modules the documentation depends on (public names are imported as such).
#: ``DEFAULTS``: setting -> (default, validator), in declaration order.
SETTINGS_MODULE = "django_platformkit.conf"
#: ``MESSAGES``: the core system checks, id -> (message, hint); ``TAG``.
CHECKS_MODULE = "django_platformkit.checks.messages"
#: ``CHECKS``: the django.tasks backend's system checks, id -> (message, hint).
TASK_CHECKS_MODULE = "django_platformkit.tasks.checks"
#: ``Metrics``: builds every series of a worker's ``/metrics`` on its own registry.
METRICS_MODULE = "django_platformkit.runtime.metrics"
#: The management commands' package.
COMMANDS_PACKAGE = "django_platformkit.management.commands"
#: Where the package's source is, to find every check id it emits.
PACKAGE_DIR = ROOT / "django_platformkit"

_READY = False


class IncompleteReference(RuntimeError):
    """A generated reference would be incomplete: the build stops."""


def _setup() -> None:
    global _READY
    if _READY:
        return
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    _READY = True


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")


def _placeholders(text: str) -> str:
    """A check text's ``{alias!r}`` / ``{timeout:g}`` as the name in single guillemets."""
    text = re.sub(r"(?<!\{)\{(\w+)(?:![rsa])?(?::[^}]*)?\}(?!\})", "\u2039\\1\u203a", text)
    return text.replace("{{", "{").replace("}}", "}")


# --- checks ------------------------------------------------------------------------


def _check_texts() -> dict[str, tuple[str, str, str]]:
    """id -> (message, hint, where it is defined), core and tasks backend together."""
    core = importlib.import_module(CHECKS_MODULE)
    tasks = importlib.import_module(TASK_CHECKS_MODULE)
    texts: dict[str, tuple[str, str, str]] = {}
    for source, table in (("core", core.MESSAGES), ("django.tasks backend", tasks.CHECKS)):
        for code, (message, hint) in table.items():
            if code in texts:
                raise IncompleteReference(f"check id {code} is defined twice")
            texts[code] = (message, hint, source)
    return texts


def _emitted_check_ids() -> set[str]:
    """Every ``"E001"``-like id literal in the package's source: an id the code
    can emit must have a text (so a row in the reference)."""
    found: set[str] = set()
    for path in PACKAGE_DIR.rglob("*.py"):
        found.update(re.findall(r"""["']([EW]\d{3})["']""", path.read_text()))
    return found


def _checks_page() -> str:
    texts = _check_texts()
    missing = _emitted_check_ids() - set(texts)
    if missing:
        raise IncompleteReference(f"check ids used in the code without a message and hint: {sorted(missing)}")
    tag = importlib.import_module(CHECKS_MODULE).TAG
    out = []
    for title, source in (("Core checks", "core"), ("The django.tasks backend's checks", "django.tasks backend")):
        out += [f"## {title}", "", "| Id | Level | Message | Hint |", "| --- | --- | --- | --- |"]
        for code, (message, hint, where) in sorted(texts.items()):
            if where != source:
                continue
            level = "Error" if code.startswith("E") else "Warning"
            anchor = f'<a id="{code.lower()}"></a>'
            out.append(
                f"| {anchor}`{tag}.{code}` | {level} | {_cell(_placeholders(message))} | {_cell(_placeholders(hint))} |"
            )
        out.append("")
    return "\n".join(out)


# --- settings ----------------------------------------------------------------------


def _settings_page() -> str:
    conf = importlib.import_module(SETTINGS_MODULE)
    defaults: dict[str, Any] = {key: default for key, (default, _validate) in conf.DEFAULTS.items()}
    text: dict[str, dict[str, Any]] = yaml.safe_load(SETTINGS_TEXT.read_text())
    undocumented, unknown = sorted(set(defaults) - set(text)), sorted(set(text) - set(defaults))
    if undocumented or unknown:
        raise IncompleteReference(
            f"{SETTINGS_TEXT.relative_to(ROOT)} and {SETTINGS_MODULE}.DEFAULTS differ: "
            f"no meaning for {undocumented}, meaning of a setting the code lacks: {unknown}"
        )
    check_ids = set(_check_texts())
    out = ["| Setting | Default | Unit |", "| --- | --- | --- |"]
    for key, default in defaults.items():
        out.append(f"| [`{key}`](#{key.lower()}) | `{_cell(repr(default))}` | {text[key]['unit']} |")
    out.append("")
    for key, default in defaults.items():
        entry = text[key]
        guards = entry.get("guarded_by") or []
        unknown_ids = sorted(set(guards) - check_ids)
        if unknown_ids:
            raise IncompleteReference(f"{key}: guarded_by names check ids the code doesn't define: {unknown_ids}")
        checks = ", ".join(f"[`platformkit.{c}`](checks.md#{c.lower()})" for c in ["E007", *guards])
        out += [
            f"## `{key}`",
            "",
            f"**Default** `{default!r}` · **Unit** {entry['unit']}",
            "",
            f"**Accepted** {entry['values']} Anything else raises `ImproperlyConfigured` naming the key.",
            "",
            f"**Checked by** {checks}"
            + (f" · **Refused at start-up** {entry['refused_at']}" if entry.get("refused_at") else ""),
            "",
            entry["meaning"].strip(),
            "",
        ]
    return "\n".join(out)


# --- management commands --------------------------------------------------------------

#: Django's options every command has; listed once on the page, not under each command.
DJANGO_COMMON_OPTIONS = {
    "--version",
    "--settings",
    "--pythonpath",
    "--traceback",
    "--no-color",
    "--force-color",
    "--skip-checks",
}


def _help(parser: argparse.ArgumentParser) -> str:
    for action in parser._actions:
        if DJANGO_COMMON_OPTIONS & set(action.option_strings):
            action.help = argparse.SUPPRESS
    return parser.format_help().rstrip()


def _commands_page() -> str:
    from django.core.management import load_command_class

    commands = importlib.import_module(COMMANDS_PACKAGE)
    app = COMMANDS_PACKAGE.rsplit(".management.", 1)[0]
    names = sorted(i.name for i in pkgutil.iter_modules(commands.__path__) if not i.name.startswith("_"))
    if not names:
        raise IncompleteReference(f"no management commands found in {COMMANDS_PACKAGE}")
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same width on every machine
    try:
        out = []
        for name in names:
            command = load_command_class(app, name)
            parser = command.create_parser("manage.py", name)
            out += [f"## `{name}`", "", _cell(command.help), "", "```text", _help(parser), "```", ""]
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for sub, subparser in action.choices.items():
                        out += [f"### `{name} {sub}`", "", "```text", _help(subparser), "```", ""]
        return "\n".join(out)
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


# --- metrics -----------------------------------------------------------------------


def _series(name: str, kind: str) -> str:
    if kind == "counter":
        return f"`{name}_total`"
    if kind == "histogram":
        return f"`{name}_bucket`, `{name}_sum`, `{name}_count`"
    return f"`{name}`"


def _metrics_page() -> str:
    """Every family a worker's ``/metrics`` serves, from a ``Metrics`` built
    with no database query (describe, never collect) and no broker."""
    metrics = importlib.import_module(METRICS_MODULE).Metrics()
    rows = []
    for collector in list(metrics.registry._collector_to_names):
        families = collector.describe()
        for family in families:
            labels = getattr(collector, "_labelnames", None) or getattr(family, "_labelnames", ()) or ()
            rows.append(
                (
                    family.name,
                    f"| {_series(family.name, family.type)} | {family.type} | "
                    f"{', '.join(f'`{label}`' for label in labels) or '—'} | {_cell(family.documentation)} |",
                )
            )
    if not rows:
        raise IncompleteReference(f"{METRICS_MODULE}.Metrics defines no metric family")
    return "\n".join(
        ["| Series | Type | Labels | Meaning |", "| --- | --- | --- | --- |", *(r for _, r in sorted(rows))]
    )


_MARKERS = {
    "<!-- platformkit:settings -->": _settings_page,
    "<!-- platformkit:checks -->": _checks_page,
    "<!-- platformkit:commands -->": _commands_page,
    "<!-- platformkit:metrics -->": _metrics_page,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for marker, build in _MARKERS.items():
        if marker in markdown:
            _setup()
            markdown = markdown.replace(marker, build())
    return markdown
