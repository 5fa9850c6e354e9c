"""The task queues ``TASKS`` configures, named for the outbox: queue ``Q``
is one event and subscription per priority band (``PRIORITY_BANDS``):
``platformkit.task_Q`` for the default priority 0 (durable
``platformkit-task_Q``), ``platformkit.task_Q__high`` and so on for the
others, and its ``OPTIONS`` (``BATCH``, ``CONCURRENCY``, and per queue
``QUEUES[Q]``: ``MAX_ATTEMPTS``, ``BACKOFF_SECONDS``, ``RATE_LIMIT``)
become each band's. Reads settings only: no backend is made here.
"""

from __future__ import annotations

import re
import uuid
from typing import Any, NamedTuple

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


#: Queue names our event grammar can carry after ``task_``; no ``__``,
#: which separates a queue from its priority band (``emails__high``).
QUEUE_NAME = re.compile(r"^(?!.*__)[a-z0-9_]{1,150}$")


class PriorityBand(NamedTuple):
    """A range of Django's task priorities that shares one subject and one
    durable per queue: within a queue, a band's tasks start before any of a
    lower band's that a worker has seen waiting; within a band, in enqueue
    order (``docs/tasks.md``, "Priority")."""

    #: The event name's suffix after ``__`` ("" for the default band: the queue's name as it always was).
    suffix: str
    lowest: int
    highest: int


#: Highest first. Django's range is -100..100 (``django.tasks.base.TASK_MIN_PRIORITY``
#: / ``TASK_MAX_PRIORITY``), default 0. Five bands, as kombu's Redis transport
#: keeps a list per priority step (4 by default) and River has 4 levels: every
#: band is a durable each worker pulls, so a few, not 201. 0 has a band of its
#: own, so any priority above the default starts before every default task.
PRIORITY_BANDS = (
    PriorityBand("highest", 51, 100),
    PriorityBand("high", 1, 50),
    PriorityBand("", 0, 0),
    PriorityBand("low", -50, -1),
    PriorityBand("lowest", -100, -51),
)
#: Between a queue's name and its band's suffix in the event name.
BAND_SEPARATOR = "__"
_BAND_SUFFIXES = frozenset(band.suffix for band in PRIORITY_BANDS if band.suffix)
#: The band of priority 0, Django's default: the queue's own name.
DEFAULT_BAND = next(band for band in PRIORITY_BANDS if not band.suffix)


#: The keys OutboxBackend reads from a TASKS entry's OPTIONS.
OPTIONS_KEYS = ("BATCH", "CONCURRENCY", "QUEUES")
#: The keys of one queue's entry in ``OPTIONS["QUEUES"]``, as the
#: ``subscribe()`` options they set (the same meaning and validation).
QUEUE_OPTIONS = {"MAX_ATTEMPTS": "max_attempts", "BACKOFF_SECONDS": "backoff_seconds", "RATE_LIMIT": "rate_limit"}


def band_of(priority: int) -> PriorityBand:
    """The band of a priority in Django's -100..100 (validated by Django before it gets here)."""
    for band in PRIORITY_BANDS:
        if priority >= band.lowest:
            return band
    return PRIORITY_BANDS[-1]


def event_name(queue: str, priority: int = 0) -> str:
    """The event (and subscription) name of ``queue``'s band for ``priority``:
    ``platformkit.task_<queue>`` for the default band, else
    ``platformkit.task_<queue>__<band>`` (``platformkit.task_emails__high``)."""
    suffix = band_of(priority).suffix
    return TASK_EVENT_PREFIX + queue + (BAND_SEPARATOR + suffix if suffix else "")


def band_event_names(queue: str) -> list[str]:
    """Every band's event name of ``queue``, highest band first."""
    return [event_name(queue, band.highest) for band in PRIORITY_BANDS]


def split_task_name(name: str) -> tuple[str, PriorityBand] | None:
    """``(queue, band)`` of a task event or subscription name, or None for any other name."""
    if not name.startswith(TASK_EVENT_PREFIX):
        return None
    rest = name[len(TASK_EVENT_PREFIX) :]
    queue, separator, suffix = rest.rpartition(BAND_SEPARATOR)
    if separator and queue and suffix in _BAND_SUFFIXES:
        return queue, next(band for band in PRIORITY_BANDS if band.suffix == suffix)
    return rest, DEFAULT_BAND


def queue_of(name: str) -> str | None:
    """The queue of a task event or subscription name (any band), or None for any other name."""
    split = split_task_name(name)
    return split[0] if split is not None else None


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
