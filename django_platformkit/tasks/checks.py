"""The system checks of ``OutboxBackend``: one table of texts (``CHECKS``,
ids E1xx, a range of their own beside ``checks.messages``), and the
function that runs them. Settings only: never a query or a network call.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Protocol

from django.conf import settings as django_settings
from django.core import checks

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.tasks.queues import (
    BACKEND_PATH,
    DEFAULT_BATCH,
    DEFAULT_CONCURRENCY,
    OPTIONS_KEYS,
    QUEUE_NAME,
    QUEUE_OPTIONS,
    configured_queues,
    is_positive_int,
    is_queue_list,
    options_of,
    queue_options_of,
)


class Checked(Protocol):
    """What the checks read of an ``OutboxBackend``: its settings, as written."""

    @property
    def alias(self) -> str: ...
    @property
    def queues(self) -> Any: ...
    @property
    def options(self) -> Any: ...
    @property
    def queues_setting(self) -> Any: ...


# System checks of the backend (ids in a range of their own, 1xx, so they
# can't collide with the ``checks/`` package's): message, hint.
CHECKS = {
    "E101": (
        "TASKS[{alias!r}] uses {backend} but 'django_platformkit' is not in INSTALLED_APPS",
        "Add 'django_platformkit' to INSTALLED_APPS and run migrate: tasks are outbox rows and need its tables.",
    ),
    "E102": (
        "TASKS[{alias!r}]: queue {queue!r} can't be an event name",
        "Rename the queue to lowercase letters, digits and single underscores (at most 150; '__' separates a "
        "queue from its priority band), e.g. {suggestion!r}.",
    ),
    "E103": (
        "TASKS[{alias!r}]: QUEUES is empty",
        'List the queues, e.g. "QUEUES": ["default"]: each is a subscription a worker must know before a task arrives.',
    ),
    "E104": (
        "TASKS[{alias!r}]['OPTIONS']['BATCH'] is {value!r}, not True or False",
        "Set it to True (the default: a queue's tasks run in units, one transaction each) or False "
        "(a transaction per task).",
    ),
    "E105": (
        "TASKS[{alias!r}]['OPTIONS'] has {key!r}, which OutboxBackend doesn't know{did_you_mean}",
        "Remove it: the options are BATCH (True or False), CONCURRENCY (a positive int) and QUEUES "
        "(per queue: MAX_ATTEMPTS, BACKOFF_SECONDS, RATE_LIMIT).",
    ),
    "E106": (
        "TASKS[{alias!r}]['OPTIONS']['CONCURRENCY'] is {value!r}, not a positive int",
        "Set it to how many units of a queue's tasks one worker runs at once, e.g. 2 (the default).",
    ),
    "E107": (
        "TASKS[{alias!r}]['QUEUES'] is {value!r}, not a list of queue names",
        'Write it as a list, e.g. "QUEUES": [{example!r}] (a string would be read as its letters).',
    ),
    "E108": (
        "TASKS[{alias!r}]['OPTIONS'] is {value!r}, not a dict",
        'Write it as a dict, e.g. "OPTIONS": {{"BATCH": True, "CONCURRENCY": 2}}, or leave it out.',
    ),
    "E109": (
        "TASKS: queue {queue!r} is served by {alias!r} and {other!r} with different OPTIONS ({differences})",
        "A worker runs a queue as one subscription, with one BATCH, CONCURRENCY and QUEUES entry: give the backends "
        "serving {queue!r} the same OPTIONS, or each its own queues.",
    ),
    "E110": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'] is {value!r}, not a dict of queue name -> options",
        'Write it as a dict, e.g. "QUEUES": {{"emails": {{"MAX_ATTEMPTS": 3, "RATE_LIMIT": "10/s"}}}}.',
    ),
    "E111": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'] sets options for {queue!r}, which is not in its QUEUES",
        "Add {queue!r} to TASKS[{alias!r}]['QUEUES'], or remove its entry (a misspelt queue name would "
        "leave the real queue on the defaults).",
    ),
    "E112": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'][{queue!r}] has {key!r}, which is not a queue option{did_you_mean}",
        "A queue's options are MAX_ATTEMPTS, BACKOFF_SECONDS and RATE_LIMIT (a dict of them).",
    ),
    "E113": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'][{queue!r}]['MAX_ATTEMPTS'] is {value!r}, not a positive int",
        "Set it to how many runs a failing task gets before it becomes a dead letter, e.g. 5 "
        "(PLATFORMKIT['MAX_ATTEMPTS'] when left out).",
    ),
    "E114": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'][{queue!r}]['BACKOFF_SECONDS'] is {value!r}: {why}",
        "Set it to a list of delays in seconds, one per retry, the last repeating, e.g. [1, 10, 60].",
    ),
    "E115": (
        "TASKS[{alias!r}]['OPTIONS']['QUEUES'][{queue!r}]['RATE_LIMIT'] is {value!r}, not a rate",
        "Write it as starts per second, minute or hour, e.g. '100/s', '30/m' or '1000/h' (every worker together).",
    ),
}


def check_backend(backend: Checked) -> list[checks.CheckMessage]:
    """``E101`` app not installed, ``E102`` a queue name our event grammar
    can't carry, ``E103`` no queues, ``E104`` a ``BATCH`` that isn't a bool,
    ``E105`` an option we don't know, ``E106`` a ``CONCURRENCY`` that isn't a
    positive int, ``E107`` ``QUEUES`` not a list, ``E108`` ``OPTIONS`` not a
    dict, ``E109`` a queue shared with another of our backends under
    different options, ``E110``-``E115`` the per-queue options
    (``OPTIONS["QUEUES"]``)."""
    from django.apps import apps

    alias = backend.alias
    errors: list[checks.CheckMessage] = []
    where = "settings.TASKS"
    if not apps.is_installed("django_platformkit"):
        errors.append(check("E101", where, alias=alias, backend=BACKEND_PATH))
    refusal = queues_refusal(alias, backend.queues_setting, where)
    if refusal is not None:
        errors.append(refusal)
    elif not backend.queues:
        errors.append(check("E103", where, alias=alias))
    else:
        for queue in sorted(backend.queues):
            if not QUEUE_NAME.match(str(queue)):
                suggestion = re.sub(r"_{2,}", "_", re.sub(r"[^a-z0-9_]", "_", str(queue).lower()))[:150] or "default"
                errors.append(check("E102", where, alias=alias, queue=queue, suggestion=suggestion))
        errors.extend(_check_shared_queues(backend, where))
    options: Any = backend.options or {}  # as written in the setting: anything
    if not isinstance(options, dict):
        errors.append(check("E108", where, alias=alias, value=options))
        return errors
    if "BATCH" in options and not isinstance(options["BATCH"], bool):
        errors.append(check("E104", where, alias=alias, value=options["BATCH"]))
    if "CONCURRENCY" in options and not is_positive_int(options["CONCURRENCY"]):
        errors.append(check("E106", where, alias=alias, value=options["CONCURRENCY"]))
    for key in sorted(set(options) - set(OPTIONS_KEYS), key=str):
        close = difflib.get_close_matches(str(key), OPTIONS_KEYS, n=1)
        did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
        errors.append(check("E105", where, alias=alias, key=key, did_you_mean=did_you_mean))
    if "QUEUES" in options:
        errors.extend(_check_queue_options(alias, options["QUEUES"], backend.queues, where))
    return errors


def _check_queue_options(alias: str, entries: Any, queues: Any, where: str) -> list[checks.CheckMessage]:
    """``E110``-``E115``: ``OPTIONS["QUEUES"]`` and each queue's entry, checked
    with the validators ``subscribe()`` uses for the same options."""
    if not isinstance(entries, dict):
        return [check("E110", where, alias=alias, value=entries)]
    errors: list[checks.CheckMessage] = []
    for queue, entry in sorted(entries.items(), key=lambda item: str(item[0])):
        if queue not in queues:
            errors.append(check("E111", where, alias=alias, queue=queue))
        if not isinstance(entry, dict):
            errors.append(check("E110", where, alias=alias, value=entries))
            continue
        for key in sorted(set(entry) - set(QUEUE_OPTIONS), key=str):
            close = difflib.get_close_matches(str(key), list(QUEUE_OPTIONS), n=1)
            did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(check("E112", where, alias=alias, queue=queue, key=key, did_you_mean=did_you_mean))
        if "MAX_ATTEMPTS" in entry and not is_positive_int(entry["MAX_ATTEMPTS"]):
            errors.append(check("E113", where, alias=alias, queue=queue, value=entry["MAX_ATTEMPTS"]))
        if "BACKOFF_SECONDS" in entry:
            try:
                conf.backoff_seconds("BACKOFF_SECONDS", entry["BACKOFF_SECONDS"])
            except ConfigurationError as exc:
                why = str(exc).split("] ", 1)[-1]
                errors.append(check("E114", where, alias=alias, queue=queue, value=entry["BACKOFF_SECONDS"], why=why))
        if "RATE_LIMIT" in entry:
            try:
                conf.rate("RATE_LIMIT", entry["RATE_LIMIT"])
            except ConfigurationError:
                errors.append(check("E115", where, alias=alias, queue=queue, value=entry["RATE_LIMIT"]))
    return errors


def queues_refusal(alias: str, names: Any, where: str = "settings.TASKS") -> checks.Error | None:
    """Check ``E107`` when ``QUEUES`` as written (``names``) isn't a list of
    names (a string, read by Django as its letters), else None."""
    if is_queue_list(names):
        return None
    example = names if isinstance(names, str) and QUEUE_NAME.match(names) else "default"
    return check("E107", where, alias=alias, value=names, example=example)


def _check_shared_queues(backend: Checked, where: str) -> list[checks.CheckMessage]:
    """``E109`` for each queue this backend shares with a later one (by
    alias, so a pair is reported once) whose BATCH, CONCURRENCY or per-queue
    options differ."""
    tasks_setting = getattr(django_settings, "TASKS", None) or {}
    mine: dict[str, Any] = backend.options if isinstance(backend.options, dict) else {}  # not a dict: E108
    errors: list[checks.CheckMessage] = []
    for queue, aliases in sorted(configured_queues().items(), key=lambda item: str(item[0])):
        if backend.alias not in aliases:
            continue
        for other in sorted(a for a in set(aliases) if a > backend.alias):
            theirs = options_of(tasks_setting[other])
            differences = [
                f"{key} {mine.get(key, default)!r} vs {theirs.get(key, default)!r}"
                for key, default in (("BATCH", DEFAULT_BATCH), ("CONCURRENCY", DEFAULT_CONCURRENCY))
                if mine.get(key, default) != theirs.get(key, default)
            ]
            if queue_options_of(mine, queue) != queue_options_of(theirs, queue):
                differences.append(
                    f"QUEUES[{queue!r}] {queue_options_of(mine, queue)!r} vs {queue_options_of(theirs, queue)!r}"
                )
            if differences:
                errors.append(
                    check(
                        "E109",
                        where,
                        queue=queue,
                        alias=backend.alias,
                        other=other,
                        differences=", ".join(differences),
                    )
                )
    return errors


def check(code: str, obj: str, **values: Any) -> checks.Error:
    """The ``checks.Error`` of ``code`` with its texts filled in."""
    message, hint = CHECKS[code]
    return checks.Error(message.format(**values), hint=hint.format(**values), obj=obj, id=f"platformkit.{code}")
