"""8: Django's Tasks API through the outbox (django_platformkit.tasks).

- ``enqueue()`` (one outbox row, its own transaction) against a bare ORM
  insert of the same columns (``bench_row``), alternating, one per transaction.
- Tasks drained per second by ``runworker --burst --queue default`` against
  django-tasks-db's ``db_worker --batch`` on the same no-op task; both rates
  from the results' own timestamps (first start -> last finish), so process
  start-up is not counted for either.
- enqueue -> task start p50 at a steady 200/s with a worker process running.
- Relaying due rows with a large number of rows deferred to tomorrow against
  with none (the deferred rows have an index of their own).

- The same drain against pgqueuer's own queue (measure_handle.pgqueuer_rate),
  its entrypoint a no-op too, its rate from its own log (pgqueuer has no
  django.tasks backend); pgqueuer with one INSERT per job beside it, as
  information.
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from django.db import transaction

from .harness import Result, Sizes, fill_outbox, log, manage, ratio_result, reset_broker, reset_tables, scalar, sql
from .measure_backlog import relay_rows

DURABLE = "platformkit-task_default"


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, int(round(q / 100 * len(values) + 0.5)) - 1))]


def _has_db_backend() -> bool:
    from django.conf import settings

    return "db" in settings.TASKS


def _enqueue_vs_orm(n: int) -> tuple[float, float]:
    from .benchapp.models import Row
    from .benchapp.tasks import noop

    ours = orm = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        with transaction.atomic():
            noop.enqueue(i)
        t1 = time.perf_counter()
        with transaction.atomic():
            Row.objects.create(
                name="platformkit.task_default",
                payload={"task": "bench.benchapp.tasks.noop", "args": [i], "kwargs": {}, "backend": "default"},
            )
        t2 = time.perf_counter()
        ours += t1 - t0
        orm += t2 - t1
    return n / ours, n / orm


def _enqueue_many(n: int, backend: str = "default") -> None:
    from .benchapp.tasks import noop

    task = noop.using(backend=backend)
    for start in range(0, n, 500):
        with transaction.atomic():
            for i in range(start, min(n, start + 500)):
                task.enqueue(i)


def _drain_ours(transport, n: int, batch: bool | None = None) -> tuple[float, float]:
    """(rate from the results' timestamps, rate by wall clock incl. start-up);
    ``batch`` None: the backend's default ``OPTIONS`` (no ``BATCH`` key)."""
    reset_tables()
    reset_broker(transport, DURABLE)
    _enqueue_many(n)
    t0 = time.perf_counter()
    env = {} if batch is None else {"BENCH_TASKS_BATCH": "1" if batch else "0"}
    proc = manage(
        "runworker", "--burst", "--no-jobs", "--queue", "default", "-v", "0", env=env, stdout=subprocess.DEVNULL
    )
    if proc.wait(600) != 0:
        raise RuntimeError(f"runworker --burst exited {proc.returncode}")
    wall = time.perf_counter() - t0
    done, span = sql(
        "SELECT count(*), EXTRACT(EPOCH FROM max(finished_at) - min(started_at)) FROM platformkit_task_results WHERE status = 'SUCCESSFUL'",
        fetch=True,
    )[0]
    if done != n:
        raise RuntimeError(f"ours: {done} of {n} tasks successful")
    return (n - 1) / float(span), n / wall


def _drain_db(n: int) -> tuple[float, float]:
    from django_tasks_db.models import DBTaskResult

    DB_RESULTS = DBTaskResult._meta.db_table
    sql(f"TRUNCATE {DB_RESULTS}")
    _enqueue_many(n, backend="db")
    t0 = time.perf_counter()
    proc = manage(
        "db_worker",
        "--backend",
        "db",
        "--batch",
        "--no-startup-delay",
        "--interval",
        "0.1",
        "-v",
        "0",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if proc.wait(900) != 0:
        raise RuntimeError(f"db_worker exited {proc.returncode}")
    wall = time.perf_counter() - t0
    done, span = sql(
        f"SELECT count(*), EXTRACT(EPOCH FROM max(finished_at) - min(started_at)) FROM {DB_RESULTS} WHERE status = 'SUCCESSFUL'",
        fetch=True,
    )[0]
    if done != n:
        raise RuntimeError(f"django-tasks-db: {done} of {n} tasks successful")
    return (n - 1) / float(span), n / wall


def _latency(transport, rate: float, seconds: float) -> tuple[float, float, int]:
    from .benchapp.tasks import noop

    reset_tables()
    reset_broker(transport, DURABLE)
    health = Path(tempfile.mkdtemp(prefix="bench-")) / "health.json"
    worker = manage("runworker", "--no-jobs", "--queue", "default", "--health-file", str(health), "-v", "0")
    try:
        deadline = time.monotonic() + 60
        while not health.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the worker wrote no health file within 60 s")
            time.sleep(0.05)
        noop.enqueue(-1)  # warm up: the durable exists and one task went through
        deadline = time.monotonic() + 60
        while not scalar("SELECT count(*) FROM platformkit_task_results"):
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up task did not run within 60 s")
            time.sleep(0.05)
        time.sleep(1.0)
        count = int(rate * seconds)
        started = time.perf_counter()
        for i in range(count):
            wait = started + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            noop.enqueue(i)  # outside atomic(): its own transaction
        achieved = count / (time.perf_counter() - started)
        deadline = time.monotonic() + 120
        while scalar("SELECT count(*) FROM platformkit_task_results") < count + 1:
            if time.monotonic() > deadline:
                raise RuntimeError("not every task ran within 120 s")
            time.sleep(0.1)
        rows = sql(
            "SELECT EXTRACT(EPOCH FROM r.started_at - o.created_at) * 1000 FROM platformkit_task_results r "
            "JOIN platformkit_outbox o ON o.id = r.event_id WHERE o.payload->'args'->>0 <> '-1'",
            fetch=True,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except Exception:
            worker.kill()
    values = [float(r[0]) for r in rows]
    return _percentile(values, 50), achieved, len(values)


def _deferred_backlog(transport, deferred: int, due: int, reps: int) -> tuple[list[float], list[float]]:
    """Relay rates of ``due`` due rows: ``reps`` times with ``deferred`` rows
    due tomorrow in the outbox, and ``reps`` times with none, half of those
    before and half after (as the backlog part measures its floor: the VM's
    speed drifts over the minute the deferred rows take to write). Between
    repetitions only the relayed rows are deleted, on both sides alike.
    Returns (behind, alone)."""
    from .benchapp.platformkit import BACKLOG

    def one() -> float:
        fill_outbox(BACKLOG.name, due)
        rate = relay_rows(transport, due)
        sql("DELETE FROM platformkit_outbox WHERE published_at IS NOT NULL")
        reset_broker(transport)
        return rate

    reset_tables()
    reset_broker(transport)
    alone = [one() for _ in range((reps + 1) // 2)]
    log(f"tasks: {deferred} rows deferred to tomorrow, then {due} due rows, {reps} times")
    sql(
        "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at, not_before) "
        "SELECT gen_random_uuid(), 'platformkit.task_default', NULL, jsonb_build_object('task', 'bench.benchapp.tasks.noop', 'args', jsonb_build_array(g), 'kwargs', '{}'::jsonb, 'backend', 'default'), "
        "'{}'::jsonb, clock_timestamp(), now() + interval '1 day' FROM generate_series(1, %s) AS g",
        [deferred],
    )
    behind = [one() for _ in range(reps)]
    reset_tables()
    alone += [one() for _ in range(reps - len(alone))]
    reset_tables()
    reset_broker(transport)
    return behind, alone


def run_tasks(sizes: Sizes, transport) -> list[Result]:
    results: list[Result] = []
    n_enqueue = sizes.publish_events
    log(f"tasks: enqueue() vs a bare ORM insert, {n_enqueue} each, one per transaction")
    reset_tables()
    pairs = [_enqueue_vs_orm(n_enqueue) for _ in range(sizes.reps)]
    results.append(
        ratio_result(
            "tasks_enqueue",
            "task.enqueue() (1 row, 1 tx) vs ORM insert",
            [p[0] for p in pairs],
            [p[1] for p in pairs],
            unit="events/s",
            floor_what="bare ORM insert",
            at_least=0.85,
        )
    )

    n = sizes.handle_events_slow
    log(f"tasks: {n} no-op tasks drained by runworker --burst --queue default (default OPTIONS)")
    ours = [_drain_ours(transport, n) for _ in range(sizes.reps)]
    log(f"tasks: {n} no-op tasks drained with OPTIONS BATCH=False (a transaction per task)")
    unbatched = [_drain_ours(transport, n, batch=False) for _ in range(sizes.reps)]
    if _has_db_backend():
        log(f"tasks: {n} no-op tasks drained by django-tasks-db's db_worker --batch")
        theirs = [_drain_db(n) for _ in range(sizes.reps)]
        results.append(
            ratio_result(
                "tasks_drain_vs_django_tasks_db",
                "no-op tasks drained/s vs django-tasks-db db_worker",
                [o[0] for o in ours],
                [t[0] for t in theirs],
                unit="events/s",
                floor_what="django-tasks-db db_worker",
                at_least=3.0,
                note=f"wall incl. start-up: ours {statistics.median(o[1] for o in ours):.0f}/s, theirs {statistics.median(t[1] for t in theirs):.0f}/s",
            )
        )
        # Not the default, so informational: what a transaction per task costs.
        per_task = ratio_result(
            "tasks_drain_no_batch_vs_django_tasks_db",
            "... with OPTIONS BATCH=False",
            [u[0] for u in unbatched],
            [t[0] for t in theirs],
            unit="events/s",
            floor_what="django-tasks-db db_worker",
            at_least=3.0,
        )
        per_task.target, per_task.met = "info", None
        results.append(per_task)
    else:
        results.append(
            Result(
                "tasks_drain",
                "no-op tasks drained/s (django-tasks-db not installed)",
                statistics.median(o[0] for o in ours),
                "events/s",
                target="info",
            )
        )

    try:
        from .measure_handle import pgqueuer_rate

        log(f"tasks: pgqueuer drains {n} no-op jobs, then {n} jobs of one INSERT each")
        pgq = [pgqueuer_rate(n, noop=True)["steady"] for _ in range(sizes.reps)]
        pgq_insert = [pgqueuer_rate(n)["steady"] for _ in range(sizes.reps)]
        results.append(
            ratio_result(
                "tasks_drain_vs_pgqueuer",
                "no-op tasks drained/s (default OPTIONS) vs pgqueuer",
                [o[0] for o in ours],
                pgq,
                unit="events/s",
                floor_what="pgqueuer no-op job, batch_size 100",
                at_least=1.0,
                note=f"BATCH=False: {statistics.median(u[0] for u in unbatched):.0f}/s",
            )
        )
        # What pgqueuer's rate is once its job does what a real one does.
        with_insert = ratio_result(
            "tasks_drain_vs_pgqueuer_insert",
            "... vs pgqueuer, its job one INSERT",
            [o[0] for o in ours],
            pgq_insert,
            unit="events/s",
            floor_what="pgqueuer, batch_size 100, pool 4",
            at_least=1.0,
        )
        with_insert.target, with_insert.met = "info", None
        results.append(with_insert)
    except ImportError as exc:
        log(f"tasks: pgqueuer not measured ({exc})")

    rate, seconds = sizes.latency_rate_per_second, sizes.latency_seconds
    log(f"tasks: enqueue -> start at {rate:g}/s for {seconds:g}s, worker process running")
    p50, achieved, count = _latency(transport, rate, seconds)
    results.append(
        Result(
            "tasks_latency_p50",
            "task enqueue -> start, p50",
            p50,
            "ms",
            target="< 15 ms",
            met=p50 < 15,
            note=f"{count} tasks at {achieved:.0f}/s achieved",
        )
    )

    deferred, due = sizes.backlog_rows, sizes.backlog_relay_rows
    behind, alone = _deferred_backlog(transport, deferred, due, sizes.reps)
    results.append(
        ratio_result(
            "tasks_deferred_backlog",
            f"relay of due rows behind {deferred:,} rows due tomorrow",
            behind,
            alone,
            unit="events/s",
            floor_what="no deferred rows",
            at_least=0.9,
        )
    )
    return results
