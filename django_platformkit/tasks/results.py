"""Running a ``django.tasks`` task in the worker, and what its runs leave behind.

The return value is written with the claim, in the task's own transaction:
it exists exactly when the task's writes do (a unit's successful results are
one statement just before its commit, ``units.UnitWrites``, not one per
task). A failed attempt's error is written after its rollback (from the
``event_failed`` signal), so the history survives the rollback that undid the
attempt. The rest is derived when read, from rows that are the truth anyway:
READY/enqueued_at/args from the outbox row, FAILED/finished_at from the dead
letter (so a replay makes the task READY again), RUNNING from a
transaction-scoped advisory lock the claim takes on every task of its unit
(released by the commit, the rollback or the worker's death: never stale) and
the transaction's start time. Borrowed: django-tasks-db keeps one result row
per task; we keep one only once there is something to say.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import traceback as traceback_module
from datetime import timedelta
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from django.db import connections, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from django_platformkit import conf, signals
from django_platformkit._process import worker_id
from django_platformkit._tables import DEAD_LETTER_TABLE, OUTBOX_TABLE, TASK_RESULTS_TABLE
from django_platformkit.consume.units import unit_writes
from django_platformkit.exceptions import InvalidPayload, PermanentFailure
from django_platformkit.outbox.payload import encode_json_value
from django_platformkit.tasks.arguments import refused_by_django
from django_platformkit.tasks.queues import TASK_EVENT_PREFIX, event_id_of, queue_of

if TYPE_CHECKING:
    from django.tasks import Task, TaskResult

    from django_platformkit.wire import ReceivedEvent

logger = logging.getLogger(__name__)


class _Backend(Protocol):
    """What ``load_result`` reads of a backend: the alias a task row falls back to."""

    @property
    def alias(self) -> str: ...


#: First key of the two-key advisory lock a running task holds ('pkts'); the
#: second is hashtext(event id). The claim takes it on every task of its unit
#: (``Subscription.claim_lock_namespace``), so a task waiting behind earlier
#: ones of its batch reads as RUNNING too, started at the unit's transaction
#: start. A hash collision can only show another running task's id as RUNNING
#: for that moment; it never blocks anything (pg_try_advisory_xact_lock).
RUNNING_LOCK_NAMESPACE = 0x706B7473

_HISTORY_SQL = f"SELECT started_at, errors::text, worker_ids::text FROM {TASK_RESULTS_TABLE} WHERE event_id = %s"
#: The result rows of a unit's successful runs, in one statement and one
#: parameter: a JSON array of ``[event id, return value, started_at,
#: last_attempted_at, finished_at, worker id]`` (psycopg would adapt and
#: quote a parameter per value in Python; json.dumps is one C call). A
#: retry's row exists: it is updated.
_SUCCESS_SQL = (
    f"INSERT INTO {TASK_RESULTS_TABLE} AS r (event_id, status, return_value, started_at, last_attempted_at, finished_at, errors, worker_ids) "
    "SELECT (x->>0)::uuid, 'SUCCESSFUL', x->1, (x->>2)::timestamptz, (x->>3)::timestamptz, (x->>4)::timestamptz, "
    "'[]'::jsonb, jsonb_build_array(x->5) FROM jsonb_array_elements(%s::jsonb) AS x "
    "ON CONFLICT (event_id) DO UPDATE SET status = 'SUCCESSFUL', return_value = EXCLUDED.return_value, "
    "started_at = COALESCE(r.started_at, EXCLUDED.started_at), last_attempted_at = EXCLUDED.last_attempted_at, "
    "finished_at = EXCLUDED.finished_at, worker_ids = r.worker_ids || EXCLUDED.worker_ids"
)


def _write_successes(cursor: Any, rows: list[list[Any]]) -> None:
    """Write the result rows ``run_task`` left (``units.UnitWrites``), or one written at once."""
    cursor.execute(_SUCCESS_SQL, [json.dumps(rows)])


_FAILURE_SQL = (
    f"INSERT INTO {TASK_RESULTS_TABLE} AS r (event_id, status, return_value, started_at, last_attempted_at, finished_at, errors, worker_ids) "
    "VALUES (%s, '', NULL, %s, %s, NULL, %s::jsonb, %s::jsonb) "
    "ON CONFLICT (event_id) DO UPDATE SET started_at = COALESCE(r.started_at, EXCLUDED.started_at), "
    "last_attempted_at = EXCLUDED.last_attempted_at, errors = r.errors || EXCLUDED.errors, "
    "worker_ids = r.worker_ids || EXCLUDED.worker_ids"
)
# One round trip: the row, its result, its dead letter (the queue's, or the
# relay's when the broker refused it), and whether a transaction runs it now.
_LOAD_SQL = (
    "SELECT o.name, o.payload::text, o.created_at, o.not_before, r.status, r.return_value::text, r.started_at, "
    "r.last_attempted_at, r.finished_at, r.errors::text, r.worker_ids::text, d.failed_at, "
    "(SELECT a.xact_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid::int8 = %s "
    " AND l.objid::int8 = (hashtext(o.id::text)::int8 & 4294967295) LIMIT 1) "
    f"FROM {OUTBOX_TABLE} o LEFT JOIN {TASK_RESULTS_TABLE} r ON r.event_id = o.id "
    f"LEFT JOIN LATERAL (SELECT failed_at FROM {DEAD_LETTER_TABLE} x WHERE x.event_id = o.id "
    " AND x.subscription IN (o.name, 'platformkit.relay') ORDER BY failed_at DESC LIMIT 1) d ON true "
    "WHERE o.id = %s AND o.name LIKE %s"
)


def _task_at(path: str, alias: str, queue: str) -> Task[..., Any]:
    """The ``Task`` object at ``path``, bound to the backend alias and queue it was enqueued with."""
    from django.tasks import Task

    module_path, _, attribute = path.rpartition(".")
    module = sys.modules.get(module_path)
    # An imported module's attribute is what import_string would return,
    # without the import machinery per task run.
    task = getattr(module, attribute, None) if module is not None else None
    try:
        if task is None:
            task = import_string(path)
    except ImportError as exc:
        raise ValueError(
            f"task {path!r} can't be imported ({exc}): was it renamed or removed? Deploy it back, or discard the task."
        ) from exc
    if not isinstance(task, Task):
        raise ValueError(f"{path!r} is not a task (decorate it with @django.tasks.task).")
    if task.backend != alias or task.queue_name != queue:
        task = task.using(backend=alias, queue_name=queue)
    return task


def _missing_task(path: str, alias: str, queue: str, reason: str) -> Task[..., Any]:
    """A stand-in ``Task`` for a result whose function can't be imported any
    more: its ``module_path`` is ``path``, calling it raises ``ValueError``
    (``reason``), and it skips the backend's validation (its queue may be
    gone from ``QUEUES`` too), so the result can still be read and reported."""
    from django.tasks import Task

    module, _, attribute = path.rpartition(".")

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(reason)

    missing.__module__, missing.__name__, missing.__qualname__ = module, attribute, attribute
    return _with_fields(
        object.__new__(Task),
        priority=0,
        func=missing,
        backend=alias,
        queue_name=queue,
        run_after=None,
        takes_context=False,
    )


def _with_fields(task: Task[..., Any], **fields: Any) -> Task[..., Any]:
    """``task`` with ``fields`` replaced, without the backend's validation
    (``dataclasses.replace`` and ``Task.using`` revalidate: a result must
    read back whatever the settings say now)."""
    from django.tasks import Task

    copy: Task[..., Any] = object.__new__(Task)
    for field in dataclasses.fields(Task):
        object.__setattr__(copy, field.name, fields.get(field.name, getattr(task, field.name, None)))
    return copy


@functools.cache
def _django_tasks() -> SimpleNamespace:
    """Django's task names ``run_task`` uses, imported once (per task, the
    import statements were a measurable share of a no-op task's run)."""
    from django.tasks import task_backends
    from django.tasks.base import TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.signals import task_finished, task_started
    from django.utils.json import normalize_json

    return SimpleNamespace(
        task_backends=task_backends,
        TaskContext=TaskContext,
        TaskError=TaskError,
        TaskResult=TaskResult,
        TaskResultStatus=TaskResultStatus,
        task_finished=task_finished,
        task_started=task_started,
        normalize_json=normalize_json,
    )


def run_task(event: ReceivedEvent) -> None:
    """The handler of every task subscription: run the task of ``event``
    inside the claim's transaction and write its result there too. Raises
    whatever the task raises (the subscription retries, then dead-letters)."""
    dj = _django_tasks()
    TaskResultStatus = dj.TaskResultStatus
    payload = event.payload
    alias = payload.get("backend", "default")
    task = _task_at(payload["task"], alias, queue_of(event.name) or "default")
    backend = dj.task_backends[alias]
    args, kwargs = payload.get("args", []), payload.get("kwargs", {})
    db = conf.settings.DATABASE_ALIAS
    started = timezone.now()
    me = worker_id()
    earlier_started, errors, earlier_workers = None, [], []
    # RUNNING: the claim took this task's advisory lock (the queue's
    # Subscription.claim_lock_namespace), held until the unit's transaction ends.
    if event.attempt > 1:  # a retry: earlier runs left their history
        with connections[db].cursor() as cursor:
            cursor.execute(_HISTORY_SQL, [event.id])
            row = cursor.fetchone()
        if row is not None:
            earlier_started = row[0]
            errors = [dj.TaskError(**e) for e in json.loads(row[1])]
            earlier_workers = json.loads(row[2])
    # TaskContext.attempt is len(worker_ids): make it the handler-run count.
    previous = earlier_workers[-(event.attempt - 1) :] if event.attempt > 1 else []
    workers = ["(unrecorded)"] * (event.attempt - 1 - len(previous)) + previous + [me]
    result: TaskResult[..., Any] = dj.TaskResult(
        task=task,
        id=str(event.id),
        status=TaskResultStatus.RUNNING,
        enqueued_at=event.occurred_at,
        started_at=earlier_started or started,
        last_attempted_at=started,
        finished_at=None,
        args=args,
        kwargs=kwargs,
        backend=alias,
        errors=errors,
        worker_ids=workers,
    )
    dj.task_started.send(type(backend), task_result=result)
    # No signature check here (enqueue() did it): arguments the function
    # can't take now - renamed or changed by a rolling deploy since - are a
    # TypeError of this attempt and retried, so a newer worker may run them.
    if task.takes_context:
        value = task.call(dj.TaskContext(task_result=result), *args, **kwargs)
    else:
        value = task.call(*args, **kwargs)
    # A return value JSON can't carry fails the attempt, as Django's
    # backends do; it would fail every time, so it is not retried.
    try:
        value = dj.normalize_json(value)
    except (TypeError, ValueError):
        path, refused = refused_by_django(value, "$") or ("$", value)
        raise PermanentFailure(
            f"the task returned {type(refused).__name__} at {path} of its return value, which Django's task "
            "results can't store (str, int, float, bool, None, list, dict): return JSON values, e.g. a "
            "Decimal as str(), a datetime as .isoformat(), a set as a list. Not retried: it would fail "
            "every time (its writes were rolled back)."
        ) from None
    if value is not None:
        # What JSON allows and PostgreSQL's jsonb refuses (a NUL, NaN, an
        # integer past 4300 digits), found before the unit's INSERT fails.
        try:
            encode_json_value(value, max_bytes=sys.maxsize)
        except InvalidPayload as exc:
            raise PermanentFailure(
                f"the task's return value can't be stored: {exc} Not retried: it would fail every time "
                "(its writes were rolled back)."
            ) from None
    finished = timezone.now()
    row = [
        str(event.id),
        value,
        (earlier_started or started).isoformat(),
        started.isoformat(),
        finished.isoformat(),
        me,
    ]
    writes = unit_writes(db)
    if writes is not None:
        writes.add(_write_successes, row)  # with the unit's other results, before its commit
    else:
        with connections[db].cursor() as cursor:
            _write_successes(cursor, [row])
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", finished)
    object.__setattr__(result, "_return_value", value)
    # Finished means committed: a rollback after the task returned is a failed attempt.
    task_finished = dj.task_finished
    transaction.on_commit(lambda: task_finished.send(type(backend), task_result=result), using=db)


def _record_failure(
    sender: Any,
    subscription: str,
    event: ReceivedEvent,
    error: BaseException,
    duration_seconds: float = 0.0,
    **kwargs: Any,
) -> None:
    """``event_failed`` receiver: append the attempt's error (class path and
    traceback) and worker to the task's result, after the rollback."""
    if queue_of(subscription) is None:
        return
    kind = type(error)
    entry = {
        "exception_class_path": f"{kind.__module__}.{kind.__qualname__}",
        "traceback": "".join(traceback_module.format_exception(error)),
    }
    started = timezone.now() - timedelta(seconds=duration_seconds or 0.0)
    with connections[conf.settings.DATABASE_ALIAS].cursor() as cursor:
        cursor.execute(_FAILURE_SQL, [event.id, started, started, json.dumps([entry]), json.dumps([worker_id()])])


def _finished_failed(sender: Any, subscription: str, event_id: Any, **kwargs: Any) -> None:
    """``event_dead_lettered`` receiver: the task is FAILED for good; send
    Django's ``task_finished`` as its backends do."""
    if queue_of(subscription) is None:
        return
    from django.tasks import task_backends
    from django.tasks.signals import task_finished

    from django_platformkit.tasks.queues import configured_queues

    aliases = configured_queues().get(queue_of(subscription) or "", [])
    if aliases:
        backend = task_backends[aliases[0]]
        task_finished.send(type(backend), task_result=load_result(backend, event_id))


signals.event_failed.connect(_record_failure, dispatch_uid="django_platformkit.tasks.record_failure")
signals.event_dead_lettered.connect(_finished_failed, dispatch_uid="django_platformkit.tasks.finished_failed")


def load_result(backend: _Backend, result_id: object) -> TaskResult[..., Any]:
    """Build the ``TaskResult`` of ``result_id`` from the database (one query).

    ``status``: SUCCESSFUL (a run committed), FAILED (dead-lettered),
    RUNNING (a transaction runs it now), else READY (waiting for its first
    run, its ``run_after``, or a retry; ``errors`` then lists the failed
    attempts). Raises ``TaskResultDoesNotExist`` for an id no task row has.
    """
    from django.tasks.base import TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import TaskResultDoesNotExist

    event_id = event_id_of(result_id)
    if event_id is None:
        raise TaskResultDoesNotExist(f"{result_id!r} is not a task result id (a UUID).")
    with connections[conf.settings.DATABASE_ALIAS].cursor() as cursor:
        cursor.execute(_LOAD_SQL, [RUNNING_LOCK_NAMESPACE, event_id, TASK_EVENT_PREFIX.replace("_", "\\_") + "%"])
        row = cursor.fetchone()
    if row is None:
        raise TaskResultDoesNotExist(f"no task {event_id}: never enqueued, rolled back, or purged with its outbox row.")
    (
        name,
        payload_text,
        enqueued_at,
        run_after,
        status,
        value_text,
        started_at,
        last_attempted_at,
        finished_at,
        errors_text,
        workers_text,
        failed_at,
        running_since,
    ) = row
    payload = json.loads(payload_text)
    alias, queue = payload.get("backend", backend.alias), queue_of(name) or "default"
    try:
        task = _task_at(payload["task"], alias, queue)
    except ValueError as exc:  # renamed or removed since: the result still exists
        task = _missing_task(payload["task"], alias, queue, str(exc))
    if run_after is not None and task.run_after != run_after:
        task = _with_fields(task, run_after=run_after)  # as enqueued: task.using(run_after=...)
    errors = [TaskError(**e) for e in json.loads(errors_text or "[]")]
    if status == "SUCCESSFUL":
        state = TaskResultStatus.SUCCESSFUL
    elif failed_at is not None:
        state, finished_at = TaskResultStatus.FAILED, failed_at
    elif running_since is not None:
        state, last_attempted_at = TaskResultStatus.RUNNING, running_since
        started_at = started_at or running_since
    else:
        state = TaskResultStatus.READY
    result: TaskResult[..., Any] = TaskResult(
        task=task,
        id=str(event_id),
        status=state,
        enqueued_at=enqueued_at,
        started_at=started_at,
        finished_at=finished_at,
        last_attempted_at=last_attempted_at,
        args=payload.get("args", []),
        kwargs=payload.get("kwargs", {}),
        backend=payload.get("backend", backend.alias),
        errors=errors,
        worker_ids=json.loads(workers_text or "[]"),
    )
    if state == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", json.loads(value_text) if value_text is not None else None)
    return result
