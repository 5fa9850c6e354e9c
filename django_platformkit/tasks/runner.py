"""Running a ``django.tasks`` task in the worker: the task subscription's
handler. The return value is written with the claim, in the task's own
transaction, so it exists exactly when the task's writes do (a unit's
successful results are one statement just before its commit,
``units.UnitWrites``). Reading results back is ``results``' job.

Django's signals, paired per attempt: every ``task_started`` is followed by
exactly one ``task_finished`` for that run - SUCCESSFUL once its transaction
committed, FAILED inside the exception handler (so ``django.tasks``' ERROR
line carries the traceback), whether a retry follows or not. A run that a
neighbour's failure rolled back with its batch and that is redone at once is
the same attempt: its start is announced once.

An ``async def`` task runs through Django's own ``Task.call``, the one
sync/async boundary here: asgiref's ``async_to_sync`` runs the coroutine on
an event loop of its own in a helper thread for that run (never the
broker's loop, which a slow task would stall), and Django's async ORM
calls (``acreate``, ``aget``: ``sync_to_async(thread_sensitive=True)``)
come back to this pool thread, so they use the claim's connection inside
the unit's transaction and commit or roll back with the claim. Code the
task hands to ``sync_to_async(thread_sensitive=False)`` gets a connection
of its own, outside the claim (``docs/how-to/django-tasks.md``).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import traceback as traceback_module
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.utils import timezone

from django_platformkit import conf
from django_platformkit._process import worker_id
from django_platformkit._tables import TASK_RESULTS_TABLE
from django_platformkit.consume.units import unit_writes
from django_platformkit.exceptions import InvalidPayload, mark_permanent
from django_platformkit.outbox.payload import encode_json_value
from django_platformkit.tasks.arguments import refused_by_django
from django_platformkit.tasks.queues import queue_of
from django_platformkit.tasks.results import as_enqueued, missing_task, task_at

if TYPE_CHECKING:
    from django.tasks import TaskResult

    from django_platformkit.wire import ReceivedEvent


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


class _Announced(threading.local):
    """Per pool thread: the tasks whose ``task_started`` was sent and whose
    ``task_finished`` was not yet (a batch rolled back by a neighbour's
    failure runs them again at once: the same attempt, announced once)."""

    def __init__(self) -> None:
        self.ids: set[str] = set()


_announced = _Announced()
#: Bound on ``_announced``: a run abandoned without either signal (its
#: worker stopped mid-unit) must not grow it for ever.
_ANNOUNCED_LIMIT = 10_000


def run_task(event: ReceivedEvent) -> None:
    """The handler of every task subscription: run the task of ``event``
    inside the claim's transaction and write its result there too.

    Raises:
        BaseException: Whatever the task raises (the subscription retries,
            then dead-letters), after ``task_finished`` (FAILED) was sent;
            a ``TypeError`` marked permanent (no retry) for a return value
            Django's results can't store.
    """
    dj = _django_tasks()
    TaskResultStatus = dj.TaskResultStatus
    payload = event.payload
    alias = payload.get("backend", "default")
    queue = queue_of(event.name) or "default"
    try:
        task = task_at(payload["task"], alias, queue)
    except ValueError as exc:
        # Renamed or removed by a rolling deploy: a stand-in that raises, so
        # this attempt fails (and is retried) with the same signals as any other.
        task = missing_task(payload["task"], alias, queue, str(exc))
    task = as_enqueued(task, payload)
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
    announced = _announced.ids
    if result.id not in announced:
        if len(announced) >= _ANNOUNCED_LIMIT:
            announced.clear()
        announced.add(result.id)
        dj.task_started.send(type(backend), task_result=result)
    try:
        # No signature check here (enqueue() did it): arguments the function
        # can't take now - renamed or changed by a rolling deploy since - are a
        # TypeError of this attempt and retried, so a newer worker may run them.
        if task.takes_context:
            value = task.call(dj.TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = _storable(dj, value)
    except KeyboardInterrupt:
        raise  # as Django's ImmediateBackend: no finished signal for an interrupt
    except BaseException as exc:
        announced.discard(result.id)
        kind = type(exc)
        result.errors.append(
            dj.TaskError(
                exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
                traceback="".join(traceback_module.format_exception(exc)),
            )
        )
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        object.__setattr__(result, "finished_at", timezone.now())
        # Inside the exception handler, as Django's backends send it: the
        # django.tasks ERROR line (and Sentry's logging integration) gets
        # exc_info. Robust: a receiver's error must not replace the task's.
        dj.task_finished.send_robust(type(backend), task_result=result)
        raise
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

    def committed() -> None:
        announced.discard(result.id)
        task_finished.send(type(backend), task_result=result)

    transaction.on_commit(committed, using=db)


def _storable(dj: SimpleNamespace, value: Any) -> Any:
    """``value`` as Django's results store it (``normalize_json``). Raises
    the ``TypeError`` (or ``ValueError``) Django's backends record, marked
    permanent: it would fail every time, so it is not retried."""
    try:
        value = dj.normalize_json(value)
    except (TypeError, ValueError) as exc:
        path, refused = refused_by_django(value, "$") or ("$", value)
        raise mark_permanent(
            type(exc)(
                f"{exc} at {path} of the task's return value ({type(refused).__name__}), which Django's task "
                "results can't store (str, int, float, bool, None, list, dict): return JSON values, e.g. a "
                "Decimal as str(), a datetime as .isoformat(), a set as a list. Not retried: it would fail "
                "every time (its writes were rolled back)."
            )
        ) from None
    if value is not None:
        # What JSON allows and PostgreSQL's jsonb refuses (a NUL, NaN, an
        # integer past 4300 digits), found before the unit's INSERT fails.
        try:
            encode_json_value(value, max_bytes=sys.maxsize)
        except InvalidPayload as exc:
            raise mark_permanent(
                ValueError(
                    f"the task's return value can't be stored: {exc} Not retried: it would fail every time "
                    "(its writes were rolled back)."
                )
            ) from None
    return value
