"""The task queues ``TASKS`` configures, named for the outbox: queue ``Q``
is the event and the subscription ``platformkit.task_Q`` (durable
``platformkit-task_Q``), and its ``OPTIONS`` (``BATCH``, ``CONCURRENCY``,
and per queue ``QUEUES[Q]``: ``MAX_ATTEMPTS``, ``BACKOFF_SECONDS``,
``RATE_LIMIT``) become that subscription's. Reads settings only: no backend
is made here.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from django.conf import settings as django_settings
from django.utils.module_loading import import_string

from django_platformkit.wire import TASK_EVENT_PREFIX

try:  # Django 6.0+
    import django.tasks  # noqa: F401 - only whether it is there

    HAVE_DJANGO_TASKS = True
except ImportError:  # Django 5.2
    HAVE_DJANGO_TASKS = False

#: The dotted path users put in ``TASKS[alias]["BACKEND"]``.
BACKEND_PATH = "django_platformkit.tasks.OutboxBackend"
#: Where the backend class is defined (a subclass of it is ours too).
_BACKEND_CLASS = "django_platformkit.tasks.backend.OutboxBackend"


#: Queue names our event grammar can carry after ``task_``.
QUEUE_NAME = re.compile(r"^[a-z0-9_]{1,150}$")


#: The keys OutboxBackend reads from a TASKS entry's OPTIONS.
OPTIONS_KEYS = ("BATCH", "CONCURRENCY", "QUEUES")
#: The keys of one queue's entry in ``OPTIONS["QUEUES"]``, as the
#: ``subscribe()`` options they set (the same meaning and validation).
QUEUE_OPTIONS = {"MAX_ATTEMPTS": "max_attempts", "BACKOFF_SECONDS": "backoff_seconds", "RATE_LIMIT": "rate_limit"}


def event_name(queue: str) -> str:
    """The event (and subscription) name of ``queue``: ``platformkit.task_<queue>``."""
    return TASK_EVENT_PREFIX + queue


def queue_of(name: str) -> str | None:
    """The queue of a task event or subscription name, or None for any other name."""
    return name[len(TASK_EVENT_PREFIX) :] if name.startswith(TASK_EVENT_PREFIX) else None


def configured_queues() -> dict[str, list[str]]:
    """``{queue: [backend aliases]}`` for every ``TASKS`` entry using ``OutboxBackend``
    (read from settings: no backend is instantiated)."""
    queues: dict[str, list[str]] = {}
    if not HAVE_DJANGO_TASKS:  # Django 5.2: TASKS means nothing; configuring us raises on use
        return queues
    for alias, params in (getattr(django_settings, "TASKS", None) or {}).items():
        if not isinstance(params, dict) or not _is_ours(params.get("BACKEND")):
            continue
        names = params.get("QUEUES", ["default"])
        if not is_queue_list(names):  # a str would be its letters: check E107
            continue
        for queue in names:
            queues.setdefault(queue, []).append(alias)
    return queues


def is_queue_list(names: Any) -> bool:
    """Whether a TASKS entry's ``QUEUES`` is a collection of names (not a str, which Django's set() splits)."""
    return isinstance(names, list | tuple | set | frozenset)


def _is_ours(path: Any) -> bool:
    """Whether a TASKS entry's ``BACKEND`` is ``OutboxBackend`` or a subclass of it."""
    if path == BACKEND_PATH:
        return True
    if not isinstance(path, str) or not HAVE_DJANGO_TASKS:
        return False
    try:
        backend = import_string(path)
    except ImportError:
        return False
    # By name along its MRO: this module can't import the backend, which reads the queues from here.
    return isinstance(backend, type) and any(
        f"{c.__module__}.{c.__qualname__}" == _BACKEND_CLASS for c in backend.__mro__
    )


#: ``OPTIONS["BATCH"]`` when a backend doesn't say: on, as for ``@subscribe``.
#: Measured (bench/README.md, "Django Tasks"): a task in a transaction of
#: its own pays BEGIN, the claim, COMMIT and an ack alone (236 no-op tasks/s),
#: a unit shares them (627/s); the worker sizes units to ~0.1 s of measured
#: run time (``consume.pool.UNIT_TARGET_SECONDS``), so a slow task gets a unit of its
#: own and short ones don't wait long behind each other.
DEFAULT_BATCH = True


def _options(queue: str) -> list[dict[str, Any]]:
    """The ``OPTIONS`` of every backend serving ``queue``."""
    tasks_setting = getattr(django_settings, "TASKS", None) or {}
    return [options_of(tasks_setting[alias]) for alias in configured_queues().get(queue, [])]


def options_of(params: dict[str, Any]) -> dict[str, Any]:
    """A TASKS entry's ``OPTIONS``; one that isn't a dict counts as none (check E108)."""
    options = params.get("OPTIONS") or {}
    return options if isinstance(options, dict) else {}


def batch_of(queue: str) -> bool:
    """``OPTIONS["BATCH"]`` of the backends serving ``queue`` (default
    ``DEFAULT_BATCH``; any of them True: batch)."""
    return any(bool(options.get("BATCH", DEFAULT_BATCH)) for options in _options(queue))


#: ``OPTIONS["CONCURRENCY"]`` when a backend doesn't say: a worker runs two
#: units of a queue at once (``subscribe(concurrency=2)``), so one slow task
#: doesn't hold up the queue's other tasks in that worker, and one unit's
#: round trips to the database overlap the other's Python. Django promises
#: no order between tasks, so a queue gives up none it had. Measured (bench
#: ``tasks``, no-op tasks, one worker): ~2,340/s against ~1,500-2,100/s with 1.
DEFAULT_CONCURRENCY = 2


def concurrency_of(queue: str) -> int:
    """``OPTIONS["CONCURRENCY"]`` of the backends serving ``queue`` (default
    ``DEFAULT_CONCURRENCY``; the largest of them). A value the check
    ``platformkit.E106`` refuses counts as the default here."""
    values = [options.get("CONCURRENCY", DEFAULT_CONCURRENCY) for options in _options(queue)]
    valid = [v for v in values if is_positive_int(v)]
    return max(valid, default=DEFAULT_CONCURRENCY)


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def event_id_of(result_id: object) -> uuid.UUID | None:
    """The outbox event id a task result id names, or None when it names none."""
    try:
        return uuid.UUID(str(result_id))
    except ValueError:
        return None


def queue_options_of(options: dict[str, Any], queue: str) -> dict[str, Any]:
    """``OPTIONS["QUEUES"][queue]`` of one backend's options, or {} (missing,
    or not a dict: checks E110 and E112 say so)."""
    queues = options.get("QUEUES") or {}
    entry = queues.get(queue) if isinstance(queues, dict) else None
    return entry if isinstance(entry, dict) else {}


def subscribe_options(queue: str) -> dict[str, Any]:
    """The ``subscribe()`` keyword arguments ``OPTIONS["QUEUES"][queue]`` sets
    (``max_attempts``, ``backoff_seconds``, ``rate_limit``), from the first
    backend serving ``queue`` that sets each (check E109 makes them agree).
    A value the checks refuse is left out here (the setting's default holds)."""
    from django_platformkit import conf
    from django_platformkit.exceptions import ConfigurationError

    validators = {"MAX_ATTEMPTS": conf.positive_int, "BACKOFF_SECONDS": conf.backoff_seconds, "RATE_LIMIT": conf.rate}
    found: dict[str, Any] = {}
    for options in _options(queue):
        for key, value in queue_options_of(options, queue).items():
            if key not in QUEUE_OPTIONS or QUEUE_OPTIONS[key] in found:
                continue
            try:
                validators[key](key, value)
            except ConfigurationError:
                continue
            found[QUEUE_OPTIONS[key]] = value
    return found
