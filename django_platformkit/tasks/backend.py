"""Django's own Tasks API (``django.tasks``, Django 6.0+) over the outbox.

A task is an event. ``enqueue()`` writes one outbox row in the caller's
transaction (outside ``atomic()`` it commits on its own: the one place we
don't require ``atomic``), so a task commits or rolls back with the write that
asked for it: no ``transaction.on_commit()`` needed, nothing lost if the
process dies after the commit. Each queue is one built-in subscription whose
handler calls the task inside the claim's transaction, so the task's database
writes happen exactly once; retries, ``MAX_ATTEMPTS``, backoff, dead letters,
replay and the tenant context are the subscription machinery's.

Naming: queue ``Q`` is the event ``platformkit.task_Q`` and the subscription
of the same name (durable ``platformkit-task_Q``). Our event grammar allows
``[a-z0-9_]`` after ``task_``; any other queue name is refused by the
system check ``platformkit.E102`` (rename the queue), never mapped lossily.
Results: see ``django_platformkit.tasks.results``.

On Django < 6.0 (no ``django.tasks``) this module still imports;
``OutboxBackend`` then raises ``ImproperlyConfigured`` saying Django 6 is
needed. We don't support the ``django-tasks`` backport: one contract, Django's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import re
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings as django_settings
from django.core import checks
from django.db import ProgrammingError, connections, transaction
from django.utils.module_loading import import_string

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError, InvalidPayload

try:  # Django 6.0+
    from django.tasks import TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.exceptions import InvalidTask
    from django.tasks.signals import task_enqueued

    HAVE_DJANGO_TASKS = True
except ImportError:  # Django 5.2
    HAVE_DJANGO_TASKS = False
    BaseTaskBackend = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from datetime import datetime

    from django.tasks import Task

    from django_platformkit.consume.subscriptions import Subscription

logger = logging.getLogger(__name__)

#: The dotted path users put in ``TASKS[alias]["BACKEND"]``.
BACKEND_PATH = "django_platformkit.tasks.OutboxBackend"
#: ``platformkit.task_<queue>``: the event and the subscription of a queue.
TASK_EVENT_PREFIX = "platformkit.task_"
#: Queue names our event grammar can carry after ``task_``.
QUEUE_NAME = re.compile(r"^[a-z0-9_]{1,150}$")

NEEDS_DJANGO_6 = (
    "django_platformkit.tasks.OutboxBackend implements django.tasks, which is new in Django 6.0; "
    "this project runs Django {version}. Upgrade to Django 6.0+ or remove the backend from TASKS "
    "(publish() + @subscribe work on Django 5.2)."
)

# System checks of the backend (ids in a range of their own, 1xx, so they
# can't collide with checks.py's): message, hint.
CHECKS = {
    "E101": (
        "TASKS[{alias!r}] uses {backend} but 'django_platformkit' is not in INSTALLED_APPS",
        "Add 'django_platformkit' to INSTALLED_APPS and run migrate: tasks are outbox rows and need its tables.",
    ),
    "E102": (
        "TASKS[{alias!r}]: queue {queue!r} can't be an event name",
        "Rename the queue to lowercase letters, digits and underscores (at most 150), e.g. {suggestion!r}.",
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
        "Remove it: the options are BATCH (True or False) and CONCURRENCY (a positive int).",
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
        "A worker runs a queue as one subscription, with one BATCH and one CONCURRENCY: give the backends "
        "serving {queue!r} the same OPTIONS, or each its own queues.",
    ),
}
#: The keys OutboxBackend reads from a TASKS entry's OPTIONS.
OPTIONS_KEYS = ("BATCH", "CONCURRENCY")


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
        if not _is_queue_list(names):  # a str would be its letters: check E107
            continue
        for queue in names:
            queues.setdefault(queue, []).append(alias)
    return queues


def _is_queue_list(names: Any) -> bool:
    """Whether a TASKS entry's ``QUEUES`` is a collection of names (not a str, which Django's set() splits)."""
    return isinstance(names, list | tuple | set | frozenset)


def _is_ours(path: Any) -> bool:
    if path == BACKEND_PATH:
        return True
    if not isinstance(path, str) or not HAVE_DJANGO_TASKS:
        return False
    try:
        return isinstance(import_string(path), type) and issubclass(import_string(path), OutboxBackend)
    except ImportError:
        return False


#: ``OPTIONS["BATCH"]`` when a backend doesn't say: on, as for ``@subscribe``.
#: Measured (README "Django Tasks", performance): a task in a transaction of
#: its own pays BEGIN, the claim, COMMIT and an ack alone (236 no-op tasks/s),
#: a unit shares them (627/s); the worker sizes units to ~0.1 s of measured
#: run time (``worker.UNIT_TARGET_SECONDS``), so a slow task gets a unit of its
#: own and short ones don't wait long behind each other.
DEFAULT_BATCH = True


def _options(queue: str) -> list[dict[str, Any]]:
    """The ``OPTIONS`` of every backend serving ``queue``."""
    tasks_setting = getattr(django_settings, "TASKS", None) or {}
    return [_options_of(tasks_setting[alias]) for alias in configured_queues().get(queue, [])]


def _options_of(params: dict[str, Any]) -> dict[str, Any]:
    """A TASKS entry's ``OPTIONS``; one that isn't a dict counts as none (check E108)."""
    options = params.get("OPTIONS") or {}
    return options if isinstance(options, dict) else {}


def _batch(queue: str) -> bool:
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


def _concurrency(queue: str) -> int:
    """``OPTIONS["CONCURRENCY"]`` of the backends serving ``queue`` (default
    ``DEFAULT_CONCURRENCY``; the largest of them). A value the check
    ``platformkit.E106`` refuses counts as the default here."""
    values = [options.get("CONCURRENCY", DEFAULT_CONCURRENCY) for options in _options(queue)]
    valid = [v for v in values if _is_positive_int(v)]
    return max(valid, default=DEFAULT_CONCURRENCY)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _refuse_atomic_elsewhere(alias: str) -> None:
    """Raise ``TransactionRequired`` if ``enqueue()`` runs inside an atomic
    block of another database than the outbox's (``alias``): committing on
    its own there, the task would run whatever became of those writes."""
    from django_platformkit.exceptions import TransactionRequired

    others = [c.alias for c in connections.all(initialized_only=True) if c.in_atomic_block and c.alias != alias]
    if others:
        raise TransactionRequired(
            f"enqueue() inside transaction.atomic() on {others[0]!r}, but the outbox is on {alias!r} "
            "(PLATFORMKIT['DATABASE_ALIAS']): the task can only commit or roll back with writes on "
            f"{alias!r}. Point DATABASE_ALIAS at the database your writes use, enqueue inside "
            f"transaction.atomic(using={alias!r}) around writes there, or enqueue after the block commits."
        )


def register_task_queues() -> list[str]:
    """Declare the event and subscribe the built-in handler of every queue in
    ``TASKS`` (called by ``AppConfig.ready()``; safe to call again after the
    setting changed). Invalid queue names are skipped here and reported by
    the check ``platformkit.E102``. Returns the subscription names."""
    from django_platformkit.consume.subscriptions import get_subscription, subscribe
    from django_platformkit.outbox.events import declare
    from django_platformkit.tasks.results import RUNNING_LOCK_NAMESPACE, run_task

    names = []
    for queue in configured_queues():
        if not QUEUE_NAME.match(str(queue)):
            continue
        name = event_name(queue)
        declare(
            name,
            description=f"A django.tasks task on queue {queue!r} (payload: task path, args, kwargs, backend alias).",
        )
        subscribe(name, name=name, batch=_batch(queue), concurrency=_concurrency(queue))(run_task)
        # The claim takes each task's RUNNING lock: no statement of its own per task.
        subscription = get_subscription(name)
        assert subscription is not None  # registered by the line above
        subscription.claim_lock_namespace = RUNNING_LOCK_NAMESPACE
        names.append(name)
    return names


def queue_subscriptions(queues: Sequence[str]) -> list[Subscription]:
    """The subscriptions that run ``queues`` (``runworker --queue``). Raises
    ``ConfigurationError`` naming the queues no ``TASKS`` backend of ours has."""
    from django_platformkit.consume.subscriptions import subscriptions

    known = {queue: s for s in subscriptions() if (queue := queue_of(s.name)) is not None}
    missing = sorted(set(queues) - set(known))
    if missing:
        raise ConfigurationError(
            f"unknown queue(s) {', '.join(missing)}; the TASKS queues of {BACKEND_PATH} are: {', '.join(sorted(known)) or '(none)'}"
        )
    return [known[q] for q in dict.fromkeys(queues)]


# --- the backend ---------------------------------------------------------------

_INSERT = (
    "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at, not_before) "
    "VALUES (%s, %s, %s, %s::jsonb, %s::jsonb, clock_timestamp(), %s) RETURNING created_at"
)
_INSERT_NOTIFY = f"WITH e AS ({_INSERT}) SELECT e.created_at, pg_notify('platformkit_outbox', '') FROM e"


def django_json_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` under Django's own rule for task arguments
    (``django.utils.json.normalize_json``, which ``TaskResult`` applies:
    str, int, float, bool, None, lists, dicts; tuples become lists, UTF-8
    ``bytes`` become str), so a task that runs on Django's built-in backends
    takes the same arguments here - no datetime or Decimal quietly turned
    into a string. Raises ``InvalidPayload`` (a ``ValueError``) naming the
    path of the first value Django refuses (``$.args[1]``) and what to do.
    """
    from django.utils.json import normalize_json

    try:
        # A list normalizes to a list and a dict to a dict (the stubs return the union of every JSON type).
        return cast(list[Any], normalize_json(list(args))), cast(dict[str, Any], normalize_json(dict(kwargs)))
    except (TypeError, ValueError):
        path, value = (
            _refused_by_django(list(args), "$.args") or _refused_by_django(dict(kwargs), "$.kwargs") or ("$", None)
        )
    raise InvalidPayload(
        f"{type(value).__name__} at {path} is not a task argument Django's task backends accept "
        "(str, int, float, bool, None, list, dict; bytes only as UTF-8): convert it before enqueue(), "
        "e.g. a datetime with .isoformat(), a Decimal with str(), a model instance by its pk.",
        path=path,
    )


def _refused_by_django(value: Any, path: str) -> tuple[str, Any] | None:
    """Where ``normalize_json`` would raise inside ``value``: ``(path, value)``, or None."""
    from django_platformkit.outbox.payload import _path

    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _refused_by_django(key, f"{path} (a key)") or _refused_by_django(item, _path(path, key))
            if found:
                return found
        return None
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return path, value
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return None
    if isinstance(value, Sequence):
        for index, item in enumerate(value):
            found = _refused_by_django(item, _path(path, index))
            if found:
                return found
        return None
    return path, value


# Python 3.14 evaluates annotations when it reads a signature: a name imported
# only under TYPE_CHECKING would raise NameError at enqueue(). Binding needs
# no annotations, so read them as forward references (as django.utils.inspect does).
_SIGNATURE_OPTIONS: dict[str, Any] = {}
if sys.version_info >= (3, 14):
    import annotationlib

    _SIGNATURE_OPTIONS["annotation_format"] = annotationlib.Format.FORWARDREF

#: Binds in the place of the ``TaskContext`` Django passes a
#: ``takes_context`` task first: the caller of ``enqueue()`` doesn't give it.
_CONTEXT = object()


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature, read once per function (``enqueue()`` is
    benchmarked against a bare ORM insert: reading it costs ~8 µs, binding
    ~1.5 µs), or None when it has none (a builtin or C function: nothing to
    check). ``func``'s own, not its ``__wrapped__``'s: a decorator that fills
    an argument in would otherwise have every correct call refused."""
    try:
        return inspect.signature(func, follow_wrapped=False, **_SIGNATURE_OPTIONS)
    except (TypeError, ValueError):
        return None


def _refuse_arguments_it_cant_take(task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` when ``task``'s function can't be called with
    ``args`` and ``kwargs`` (after the ``TaskContext`` of a ``takes_context``
    task), as calling it would, naming the task and ``inspect``'s reason
    (``missing a required argument: 'label'``). Celery checks the same at the
    call (``Task.typing``): enqueued, such a task would fail on the worker on
    every attempt and become a dead letter ``MAX_ATTEMPTS`` backoffs later.
    Only here, never on the worker: there a function a rolling deploy changed
    since the enqueue fails that attempt and is retried (a newer worker may
    take the arguments), see ``tasks_results.run_task``."""
    signature = _signature(task.func)
    if signature is None:
        return
    try:
        if task.takes_context:
            signature.bind(_CONTEXT, *args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        context = " after the context (Django passes the TaskContext)" if task.takes_context else ""
        raise TypeError(
            f"task {task.module_path}{shown} can't be called with these arguments: {exc}. Nothing was "
            f"enqueued: pass enqueue() the arguments the function takes{context}, or change the function "
            "(a task enqueued like this would fail on every attempt)."
        ) from None


class OutboxBackend(BaseTaskBackend):
    """``django.tasks`` backend: a task is an outbox row run by ``runworker``.

    ``TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend",
    "QUEUES": ["default", "emails"], "OPTIONS": {}}}``. The outbox lives on
    ``PLATFORMKIT["DATABASE_ALIAS"]``. ``OPTIONS``: ``"BATCH"`` (default
    True, as ``@subscribe``) runs its queues as batch subscriptions: a unit
    of tasks (sized by measured run time to ~0.1 s, so a slow task runs
    alone) in one transaction, a savepoint per task after a failure; each
    task's writes still happen exactly once. ``{"BATCH": False}``: every
    task commits in a transaction of its own. ``supports_defer`` (``run_after``, honoured
    by the relay), ``supports_get_result``; no async task functions (they'd
    run outside the claim's transaction) and no priority (JetStream delivers
    a subscription's messages in stream order; a priority we can't keep
    would be a lie).
    """

    supports_defer = True
    supports_get_result = True
    supports_async_task = False
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        if not HAVE_DJANGO_TASKS:
            import django

            raise ConfigurationError(NEEDS_DJANGO_6.format(version=django.get_version()))
        super().__init__(alias, params)
        # As written: Django's set() of a str is its letters (check E107).
        self._queues_setting = params.get("QUEUES", ["default"])
        self._app_installed: bool | None = None  # looked up at the first enqueue()

    def validate_task(self, task: Task[..., Any]) -> None:
        refusal = self._queues_refusal()
        if refusal is not None:
            # Check E107's words, here too: a @task is validated when its
            # module is imported, usually before the checks could say it,
            # and Django's own refusal ("Queue 'emails' is not valid")
            # hides that QUEUES was read as letters.
            raise InvalidTask(f"{refusal.msg}: {refusal.hint} ({refusal.id})")
        super().validate_task(task)
        if not QUEUE_NAME.match(task.queue_name):
            raise InvalidTask(
                f"Queue {task.queue_name!r} can't be an event name: rename it (lowercase letters, digits, '_')."
            )

    # -- enqueue --
    def enqueue[**P, R](self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        """Write the task as one outbox row and return its ``TaskResult``
        (id = the event id, status READY, ``enqueued_at`` = the row's
        ``created_at``). Inside ``transaction.atomic()`` the row commits or
        rolls back with the caller's writes; outside, it commits at once.

        Raises, before any SQL (the caller's transaction stays usable):
        ``InvalidTask`` (Django's validation: queue not in ``QUEUES``,
        ``run_after`` naive, ...), ``TypeError`` when the task's function
        can't take ``args`` and ``kwargs`` (a missing or unknown argument, too
        many; a ``takes_context`` task's context excepted: Django passes it),
        naming the task and why, ``InvalidPayload`` (a ``ValueError``) when
        an argument doesn't survive a JSON round trip, naming its path
        (``$.args[0]``, ``$.kwargs.when``) or exceeding ``MAX_PAYLOAD_BYTES``.
        ``ConfigurationError`` when ``django_platformkit`` is not in
        ``INSTALLED_APPS``. ``TransactionRequired`` when called inside an atomic block of another
        database than the outbox's. ``ProgrammingError`` saying to migrate if
        the outbox table is missing.
        """
        from django_platformkit._ids import uuid7
        from django_platformkit.names import check_tenant
        from django_platformkit.outbox.events import (
            _published,
            _trace_headers,
            announce,
            current_event,
            explain_unmigrated,
            get_event_type,
        )
        from django_platformkit.outbox.payload import encode_payload

        if not self._app_installed:
            self._refuse_unless_installed()
        self.validate_task(task)
        # The arguments' shape before their values: a call the function can't
        # take is the mistake Python itself would report first, whatever the values.
        _refuse_arguments_it_cant_take(task, args, kwargs)
        args, kwargs = django_json_arguments(args, kwargs)
        payload = {"task": task.module_path, "args": args, "kwargs": kwargs, "backend": self.alias}
        text, data = encode_payload(payload)
        handled = current_event.get()
        tenant = check_tenant(handled.tenant if handled is not None else None)
        event_id = uuid7()
        name = event_name(task.queue_name)
        alias = conf.settings.DATABASE_ALIAS
        connection = connections[alias]
        sql = _INSERT_NOTIFY if conf.settings.RELAY_LISTEN else _INSERT
        params: list[uuid.UUID | str | datetime | None] = [
            event_id,
            name,
            tenant,
            text,
            _trace_headers(),
            task.run_after,
        ]
        try:
            if connection.in_atomic_block:
                with connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    enqueued_at = cursor.fetchone()[0]
            else:
                # The one place we don't require atomic(): plain code may enqueue
                # anywhere, and then the row is its own transaction.
                _refuse_atomic_elsewhere(alias)
                with transaction.atomic(using=alias), connection.cursor() as cursor:
                    cursor.execute(sql, params)
                    enqueued_at = cursor.fetchone()[0]
        except ProgrammingError as exc:
            explain_unmigrated(exc, alias)
            raise
        if _published.receivers:  # as publish() does: testing.capture_events(), metrics
            announce(get_event_type(name), event_id, tenant, text, alias)
        result: TaskResult[P, R] = TaskResult(
            task=task,
            id=str(event_id),
            status=TaskResultStatus.READY,
            enqueued_at=enqueued_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=data["args"],
            kwargs=data["kwargs"],
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # As Django's database backend does: enqueued means committed, so a
        # rollback sends nothing (and outside atomic() it is sent at once).
        transaction.on_commit(
            lambda: task_enqueued.send_robust(type(self), task_result=result), using=alias, robust=True
        )
        return result

    def _refuse_unless_installed(self) -> None:
        """Raise ``ConfigurationError`` (check E101's text) when
        ``django_platformkit`` isn't installed: nothing would ever run the
        row. The check alone can't say it: Django registers its task checks
        only once something imports ``django.tasks``."""
        from django.apps import apps

        self._app_installed = apps.is_installed("django_platformkit")
        if not self._app_installed:
            message, hint = CHECKS["E101"]
            raise ConfigurationError(
                f"{message.format(alias=self.alias, backend=BACKEND_PATH)}: no worker would run this task. {hint}"
            )

    # -- results --
    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """The ``TaskResult`` of ``result_id`` as the database has it now.
        Raises ``TaskResultDoesNotExist`` when no task row has that id (never
        enqueued, rolled back, or purged). See ``tasks_results.load_result``."""
        from django_platformkit.tasks.results import load_result

        return load_result(self, result_id)

    # -- checks --
    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """``platformkit.E101`` app not installed, ``E102`` a queue name our
        event grammar can't carry, ``E103`` no queues, ``E104`` a ``BATCH``
        option that isn't a bool, ``E105`` an option we don't know, ``E106`` a
        ``CONCURRENCY`` that isn't a positive int, ``E107`` ``QUEUES`` not a
        list, ``E108`` ``OPTIONS`` not a dict, ``E109`` a queue shared with
        another of our backends under different options. No queries."""
        from django.apps import apps

        errors = list(super().check(**kwargs))
        where = "settings.TASKS"
        if not apps.is_installed("django_platformkit"):
            errors.append(_check("E101", where, alias=self.alias, backend=BACKEND_PATH))
        refusal = self._queues_refusal(where)
        if refusal is not None:
            errors.append(refusal)
        elif not self.queues:
            errors.append(_check("E103", where, alias=self.alias))
        else:
            for queue in sorted(self.queues):
                if not QUEUE_NAME.match(str(queue)):
                    suggestion = re.sub(r"[^a-z0-9_]", "_", str(queue).lower())[:150] or "default"
                    errors.append(_check("E102", where, alias=self.alias, queue=queue, suggestion=suggestion))
            errors.extend(self._check_shared_queues(where))
        options: Any = self.options or {}  # as written in the setting: anything
        if not isinstance(options, dict):
            errors.append(_check("E108", where, alias=self.alias, value=options))
            return errors
        if "BATCH" in options and not isinstance(options["BATCH"], bool):
            errors.append(_check("E104", where, alias=self.alias, value=options["BATCH"]))
        if "CONCURRENCY" in options and not _is_positive_int(options["CONCURRENCY"]):
            errors.append(_check("E106", where, alias=self.alias, value=options["CONCURRENCY"]))
        for key in sorted(set(options) - set(OPTIONS_KEYS), key=str):
            close = difflib.get_close_matches(str(key), OPTIONS_KEYS, n=1)
            did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(_check("E105", where, alias=self.alias, key=key, did_you_mean=did_you_mean))
        return errors

    def _queues_refusal(self, where: str = "settings.TASKS") -> checks.Error | None:
        """Check ``E107`` when ``QUEUES`` as written isn't a list of names
        (a string, read by Django as its letters), else None."""
        names = self._queues_setting
        if _is_queue_list(names):
            return None
        example = names if isinstance(names, str) and QUEUE_NAME.match(names) else "default"
        return _check("E107", where, alias=self.alias, value=names, example=example)

    def _check_shared_queues(self, where: str) -> list[checks.CheckMessage]:
        """``E109`` for each queue this backend shares with a later one (by
        alias, so a pair is reported once) whose BATCH or CONCURRENCY differ."""
        tasks_setting = getattr(django_settings, "TASKS", None) or {}
        mine: dict[str, Any] = self.options if isinstance(self.options, dict) else {}  # not a dict: E108
        errors: list[checks.CheckMessage] = []
        for queue, aliases in sorted(configured_queues().items(), key=lambda item: str(item[0])):
            if self.alias not in aliases:
                continue
            for other in sorted(a for a in set(aliases) if a > self.alias):
                theirs = _options_of(tasks_setting[other])
                differences = [
                    f"{key} {mine.get(key, default)!r} vs {theirs.get(key, default)!r}"
                    for key, default in (("BATCH", DEFAULT_BATCH), ("CONCURRENCY", DEFAULT_CONCURRENCY))
                    if mine.get(key, default) != theirs.get(key, default)
                ]
                if differences:
                    errors.append(
                        _check(
                            "E109",
                            where,
                            queue=queue,
                            alias=self.alias,
                            other=other,
                            differences=", ".join(differences),
                        )
                    )
        return errors


def _check(code: str, obj: str, **values: Any) -> checks.Error:
    message, hint = CHECKS[code]
    return checks.Error(message.format(**values), hint=hint.format(**values), obj=obj, id=f"platformkit.{code}")


def _event_id(result_id: object) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(result_id))
    except ValueError:
        return None
