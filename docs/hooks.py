"""MkDocs hook: the reference tables that come from the code, not from prose.

A page holds a marker such as ``<!-- platformkit:settings -->``; this hook
replaces it with a table built from ``conf.DEFAULTS`` (settings),
``checks.MESSAGES`` (check ids), the ``management/commands`` package
(commands and their help) or the metrics module (when there is one). It
sets Django up with ``tests.settings``, which starts no server and opens no
connection, so ``mkdocs build`` needs neither PostgreSQL nor NATS.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_READY = False


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
    return " ".join(str(text).split()).replace("|", "\\|")


def _settings_table() -> str:
    from django_platformkit import conf

    rows = ["| Setting | Default | Checked by |", "| --- | --- | --- |"]
    for key, (default, validate) in conf.DEFAULTS.items():
        rows.append(f"| `{key}` | `{_cell(repr(default))}` | `{validate.__name__.lstrip('_')}` |")
    return "\n".join(rows)


def _checks_table() -> str:
    from django_platformkit.checks import messages as checks

    rows = ["| Id | Message | Hint |", "| --- | --- | --- |"]
    for code, (message, hint) in sorted(checks.MESSAGES.items()):
        rows.append(f"| `{checks.TAG}.{code}` | {_cell(message)} | {_cell(hint)} |")
    return "\n".join(rows)


def _commands_table() -> str:
    from django_platformkit.management import commands

    rows = ["| Command | What it does |", "| --- | --- |"]
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        help_text = getattr(getattr(module, "Command", None), "help", "") or (module.__doc__ or "").strip()
        rows.append(f"| `manage.py {info.name}` | {_cell(help_text)} |")
    return "\n".join(rows)


def _metrics_table() -> str:
    try:
        module = importlib.import_module("django_platformkit.metrics")
    except ImportError:
        return "_No metrics module in this build yet._"
    # prometheus-client metric objects carry their name, help and type.
    found = []
    for value in vars(module).values():
        name, documentation, kind = (getattr(value, attr, None) for attr in ("_name", "_documentation", "_type"))
        if isinstance(name, str) and isinstance(documentation, str) and isinstance(kind, str):
            found.append(f"| `{name}` | {kind} | {_cell(documentation)} |")
    if not found:
        return "_No metrics defined._"
    return "\n".join(["| Metric | Type | Help |", "| --- | --- | --- |", *sorted(found)])


_MARKERS = {
    "<!-- platformkit:settings -->": _settings_table,
    "<!-- platformkit:checks -->": _checks_table,
    "<!-- platformkit:commands -->": _commands_table,
    "<!-- platformkit:metrics -->": _metrics_table,
}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    for marker, build in _MARKERS.items():
        if marker in markdown:
            _setup()
            markdown = markdown.replace(marker, build())
    return markdown
