"""What a ``django.tasks`` task's runs leave behind, read back as its ``TaskResult``.

The return value is written with the claim, in the task's own transaction
(``runner``). A failed attempt's error is written after its rollback (from the
``event_failed`` signal), so the history survives the rollback that undid the
attempt. The rest is derived when read, from rows that are the truth anyway:
READY/enqueued_at/args from the outbox row, FAILED/finished_at from the dead
letter (so a replay makes the task READY again) or from a claim whose
outcome is ``cancelled`` (``cancel()``: the error class ``Cancelled``), RUNNING from a
transaction-scoped advisory lock the claim takes on every task of its unit
(released by the commit, the rollback or the worker's death: never stale) and
the transaction's start time. Borrowed: django-tasks-db keeps one result row
per task; we keep one only once there is something to say.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import traceback as traceback_module
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django.db import connections
from django.utils import timezone
from django.utils.module_loading import import_string

from django_platformkit import conf, signals
from django_platformkit._process import worker_id
from django_platformkit._tables import DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE, TASK_RESULTS_TABLE
from django_platformkit.exceptions import Cancelled
from django_platformkit.tasks.queues import event_id_of, queue_of
from django_platformkit.wire import TASK_EVENT_PREFIX, HandlingOutcome

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
    "r.last_attempted_at, r.finished_at, r.errors::text, r.worker_ids::text, d.failed_at, h.handled_at, "
    "(SELECT a.xact_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid::int8 = %s "
    " AND l.objid::int8 = (hashtext(o.id::text)::int8 & 4294967295) LIMIT 1) "
    f"FROM {OUTBOX_TABLE} o LEFT JOIN {TASK_RESULTS_TABLE} r ON r.event_id = o.id "
    f"LEFT JOIN LATERAL (SELECT failed_at FROM {DEAD_LETTER_TABLE} x WHERE x.event_id = o.id "
    " AND x.subscription IN (o.name, 'platformkit.relay') ORDER BY failed_at DESC LIMIT 1) d ON true "
    f"LEFT JOIN {HANDLED_TABLE} h ON h.subscription = o.name AND h.event_id = o.id AND h.outcome = '{HandlingOutcome.CANCELLED}' "
    "WHERE o.id = %s AND o.name LIKE %s"
)


def task_at(path: str, alias: str, queue: str) -> Task[..., Any]:
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


def as_enqueued(task: Task[..., Any], payload: dict[str, Any]) -> Task[..., Any]:
    """``task`` with the priority it was enqueued with (``task.using(priority=...)``,
    kept in the payload when not 0), without revalidation."""
    priority = payload.get("priority", 0)
    return task if task.priority == priority else _with_fields(task, priority=priority)


def missing_task(path: str, alias: str, queue: str, reason: str) -> Task[..., Any]:
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


signals.event_failed.connect(_record_failure, dispatch_uid="django_platformkit.tasks.record_failure")


def load_result(backend: _Backend, result_id: object) -> TaskResult[..., Any]:
    """Build the ``TaskResult`` of ``result_id`` from the database (one query;
    a second for a cancelled task's actor and reason).

    ``status``: SUCCESSFUL (a run committed), FAILED (dead-lettered, or
    cancelled: its last error's class is ``Cancelled``),
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
        cancelled_at,
        running_since,
    ) = row
    payload = json.loads(payload_text)
    alias, queue = payload.get("backend", backend.alias), queue_of(name) or "default"
    try:
        task = task_at(payload["task"], alias, queue)
    except ValueError as exc:  # renamed or removed since: the result still exists
        task = missing_task(payload["task"], alias, queue, str(exc))
    if run_after is not None and task.run_after != run_after:
        task = _with_fields(task, run_after=run_after)  # as enqueued: task.using(run_after=...)
    task = as_enqueued(task, payload)
    errors = [TaskError(**e) for e in json.loads(errors_text or "[]")]
    if status == "SUCCESSFUL":
        state = TaskResultStatus.SUCCESSFUL
    elif cancelled_at is not None:
        state, finished_at = TaskResultStatus.FAILED, cancelled_at
        errors.append(TaskError(exception_class_path=_CANCELLED_PATH, traceback=_cancelled_text(event_id)))
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


_CANCELLED_PATH = f"{Cancelled.__module__}.{Cancelled.__qualname__}"
#: The audit event ``cancel()`` published for a task: who and why.
_CANCEL_AUDIT_SQL = (
    f"SELECT payload->>'actor', payload->>'reason' FROM {OUTBOX_TABLE} "
    "WHERE name = 'platformkit.event_cancelled' AND payload->>'event_id' = %s ORDER BY created_at LIMIT 1"
)


def _cancelled_text(event_id: object) -> str:
    """The "traceback" of a cancelled task's error: who cancelled it and why."""
    with connections[conf.settings.DATABASE_ALIAS].cursor() as cursor:
        cursor.execute(_CANCEL_AUDIT_SQL, [str(event_id)])
        row = cursor.fetchone()
    said = f" by {row[0]}: {row[1]}" if row else ""
    return f"{_CANCELLED_PATH}: cancelled{said} (no run of it starts after the cancel)\n"
