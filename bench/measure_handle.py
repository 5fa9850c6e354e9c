"""4: handled events/s for a trivial handler (one INSERT into bench_sink):
our worker per message and in batch mode, and procrastinate and pgqueuer
draining equivalent jobs (no-op plus the same INSERT) in the same run.

Every side is timed the same way: sink rows over the span from the first to
the last handler run (database clock), so start-up and the drained-check at
the end are not counted; the wall-clock rate is kept in the JSON too.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from datetime import timedelta

from django.db import connection

from django_platformkit.broker.transport import Transport
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.outbox.relay import Relay
from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.worker import Worker
from django_platformkit.wire import durable_name

from .benchapp.platformkit import (
    BATCH_SUPPORTED,
    CONCURRENCY,
    CONCURRENCY_SUPPORTED,
    HANDLE,
    HANDLE_BATCH,
    HANDLE_BATCH_CONCURRENT,
)
from .harness import (
    Result,
    Sizes,
    conn_max_age,
    fill_outbox,
    log,
    ratio_result,
    reset_broker,
    reset_tables,
    scalar,
    sink_rate,
    sql,
)

PROCRASTINATE_CONCURRENCY = 10
PROCRASTINATE_POOL_SIZE = 12
PGQUEUER_BATCH_SIZE = 100
PGQUEUER_POOL_SIZE = 4


def _database_url() -> str:
    s = connection.settings_dict
    return (
        f"postgresql://{s['USER']}@{s['HOST']}:{s['PORT']}/{s['NAME']}"
        if not s["PASSWORD"]
        else (f"postgresql://{s['USER']}:{s['PASSWORD']}@{s['HOST']}:{s['PORT']}/{s['NAME']}")
    )


def _check(kind: str, n: int, wall: float) -> dict:
    count, steady = sink_rate(kind)
    if count != n:
        raise RuntimeError(f"{kind}: the handler ran {count} times for {n} events")
    return {"steady": steady, "wall": n / wall}


def ours_rate(transport: Transport, subscription_name: str, event: str, kind: str, n: int) -> dict:
    sub = next(s for s in subscriptions() if s.name == subscription_name)
    reset_tables()
    reset_broker(transport, durable_name(subscription_name))
    fill_outbox(event, n)
    stats = Relay(transport).drain()
    assert stats.stored == n, stats
    worker = Worker(
        WorkerOptions(relay=False, scheduler=False, burst=True, subscriptions=[sub], burst_timeout_seconds=600),
        transport=Transport(),
    )
    started = time.perf_counter()
    code = worker.run()
    wall = time.perf_counter() - started
    if code:
        raise RuntimeError(f"burst worker exited {code}")
    handled = scalar("SELECT count(*) FROM platformkit_handled WHERE subscription = %s", [subscription_name])
    if handled != n:
        raise RuntimeError(f"{subscription_name}: {handled} claims for {n} events")
    return _check(kind, n, wall)


# --- procrastinate ---------------------------------------------------------------


def procrastinate_rate(n: int) -> dict:
    """procrastinate 3 with its async psycopg connector (no Django), one
    async task doing the INSERT through the app's pool, a worker at
    concurrency 10 with ``wait=False`` (exits once the queue is empty)."""
    import procrastinate

    url = _database_url()
    reset_tables()
    installed = scalar("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
    if installed:
        sql("TRUNCATE procrastinate_jobs CASCADE")

    async def go() -> float:
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(
                conninfo=url, min_size=PROCRASTINATE_POOL_SIZE, max_size=PROCRASTINATE_POOL_SIZE
            )
        )

        @app.task(name="bench_sink")
        async def bench_sink(i: int) -> None:
            await app.connector.execute_query_async(
                "INSERT INTO bench_sink (kind, event_id, at) VALUES ('procrastinate', %(i)s, clock_timestamp())",
                i=str(i),
            )

        async with app.open_async():
            if not installed:
                await app.schema_manager.apply_schema_async()
            for start in range(0, n, 1000):
                await bench_sink.batch_defer_async(*({"i": i} for i in range(start, min(n, start + 1000))))
            started = time.perf_counter()
            await app.run_worker_async(concurrency=PROCRASTINATE_CONCURRENCY, wait=False, install_signal_handlers=False)
            return time.perf_counter() - started

    wall = asyncio.run(go())
    return _check("procrastinate", n, wall)


# --- pgqueuer --------------------------------------------------------------------


def pgqueuer_rate(n: int, *, noop: bool = False) -> dict:
    """pgqueuer with its asyncpg driver under uvloop (as its CLI runs),
    ``batch_size=100`` dequeues (completions are batched too), drain mode;
    the entrypoint does the INSERT through an asyncpg pool of 4.

    ``noop``: the entrypoint does nothing (the tasks bench's no-op task);
    the rate is then from pgqueuer's own log (first ``picked`` to last
    ``successful``), its count of successful jobs checked against ``n``."""
    import asyncpg
    import uvloop
    from pgqueuer import AsyncpgDriver, Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    url = _database_url()
    reset_tables()

    async def go() -> tuple[float, int, float | None]:
        conn = await asyncpg.connect(url)
        pool = await asyncpg.create_pool(url, min_size=PGQUEUER_POOL_SIZE, max_size=PGQUEUER_POOL_SIZE)
        try:
            queries = Queries(AsyncpgDriver(conn))
            if not await queries.schema_is_installed():
                await queries.install()
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
            for start in range(0, n, 1000):
                ids = range(start, min(n, start + 1000))
                await queries.enqueue(["bench_sink"] * len(ids), [str(i).encode() for i in ids], [0] * len(ids))
            qm = QueueManager(queries)

            @qm.entrypoint("bench_sink")
            async def bench_sink(job) -> None:
                if noop:
                    return
                await pool.execute(
                    "INSERT INTO bench_sink (kind, event_id, at) VALUES ('pgqueuer', $1, clock_timestamp())",
                    job.payload.decode(),
                )

            started = time.perf_counter()
            await qm.run(
                batch_size=PGQUEUER_BATCH_SIZE, mode=QueueExecutionMode.drain, dequeue_timeout=timedelta(seconds=1)
            )
            wall = time.perf_counter() - started
            done, span = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE status = 'successful'), "
                "EXTRACT(EPOCH FROM max(created) FILTER (WHERE status = 'successful') "
                "- min(created) FILTER (WHERE status = 'picked')) FROM pgqueuer_log"
            )
            return wall, done, None if span is None else float(span)
        finally:
            await pool.close()
            await conn.close()

    wall, done, span = uvloop.run(go())
    if not noop:
        return _check("pgqueuer", n, wall)
    if done != n or not span:
        raise RuntimeError(f"pgqueuer (no-op): {done} of {n} jobs successful")
    return {"steady": (n - 1) / span, "wall": n / wall}


def batch_mode_in_consumer() -> bool:
    """Whether the Consumer reads ``Subscription.batch`` at all (the attribute
    can exist before the batch code path does)."""
    return ".batch" in inspect.getsource(Consumer)


def run_handle(sizes: Sizes, transport: Transport) -> list[Result]:
    """Ours with persistent connections (CONN_MAX_AGE=None, as the
    competitors' pools) against procrastinate and pgqueuer; then ours again
    at Django's default CONN_MAX_AGE=0, which must cost nothing more."""
    slow, fast = sizes.handle_events_slow, sizes.handle_events
    kinds = ("tx", "batch", "batch_concurrent", "procrastinate", "pgqueuer", "tx_default", "batch_default")
    samples: dict[str, list[dict]] = {k: [] for k in kinds}
    reconnecting = max(500, slow // 3)  # fewer: at CONN_MAX_AGE=0 each message may reconnect
    batch_note = ""
    if not BATCH_SUPPORTED:
        batch_note = "subscribe() takes no batch=True in this build: batch rows skipped"
    elif not batch_mode_in_consumer():
        batch_note = "Subscription.batch exists but Consumer never reads it: 'batch' ran per message"
    for rep in range(sizes.reps):
        step = f"handle rep {rep + 1}/{sizes.reps}:"
        with conn_max_age(None):
            log(f"{step} ours per message ({slow})")
            samples["tx"].append(ours_rate(transport, "bench.sink_tx", HANDLE.name, "tx", slow))
            if BATCH_SUPPORTED:
                log(f"{step} ours batch=True ({fast})")
                samples["batch"].append(ours_rate(transport, "bench.sink_batch", HANDLE_BATCH.name, "batch", fast))
            if CONCURRENCY_SUPPORTED:
                log(f"{step} ours batch=True, concurrency={CONCURRENCY} ({fast})")
                samples["batch_concurrent"].append(
                    ours_rate(
                        transport, "bench.sink_batch_concurrent", HANDLE_BATCH_CONCURRENT.name, "batch_concurrent", fast
                    )
                )
        log(f"{step} procrastinate ({slow})")
        samples["procrastinate"].append(procrastinate_rate(slow))
        log(f"{step} pgqueuer ({fast})")
        samples["pgqueuer"].append(pgqueuer_rate(fast))
        with conn_max_age(0):
            log(f"{step} ours per message, CONN_MAX_AGE=0 ({reconnecting})")
            samples["tx_default"].append(ours_rate(transport, "bench.sink_tx", HANDLE.name, "tx", reconnecting))
            if BATCH_SUPPORTED:
                log(f"{step} ours batch=True, CONN_MAX_AGE=0 ({fast // 2})")
                samples["batch_default"].append(
                    ours_rate(transport, "bench.sink_batch", HANDLE_BATCH.name, "batch", fast // 2)
                )
    steady = {k: [s["steady"] for s in v] for k, v in samples.items()}
    detail = {"wall_rates": {k: [s["wall"] for s in v] for k, v in samples.items()}, "steady_rates": steady}
    results = []
    if BATCH_SUPPORTED:
        results += [
            ratio_result(
                "handle_batch_vs_procrastinate",
                "handled/s, batch=True",
                steady["batch"],
                steady["procrastinate"],
                unit="events/s",
                floor_what=f"procrastinate, concurrency {PROCRASTINATE_CONCURRENCY}",
                at_least=3.0,
                note=batch_note,
                detail=detail,
            ),
            ratio_result(
                "handle_batch_vs_pgqueuer",
                "handled/s, batch=True",
                steady["batch"],
                steady["pgqueuer"],
                unit="events/s",
                floor_what=f"pgqueuer, batch_size {PGQUEUER_BATCH_SIZE}",
                at_least=1.0,
                note=f"one consumer thread; pgqueuer runs on a pool of {PGQUEUER_POOL_SIZE} connections",
            ),
            ratio_result(
                "handle_batch_vs_tx",
                "handled/s, batch=True",
                steady["batch"],
                steady["tx"],
                unit="events/s",
                floor_what="ours, one transaction per message",
                at_least=2.5,
            ),
        ]
        if CONCURRENCY_SUPPORTED:
            results.append(
                ratio_result(
                    "handle_batch_concurrent_vs_pgqueuer",
                    f"handled/s, batch=True, concurrency={CONCURRENCY}",
                    steady["batch_concurrent"],
                    steady["pgqueuer"],
                    unit="events/s",
                    floor_what=f"pgqueuer, batch_size {PGQUEUER_BATCH_SIZE}, pool {PGQUEUER_POOL_SIZE}",
                    at_least=1.0,
                    note="added row: as many consumer threads (connections) as pgqueuer's pool",
                )
            )
    else:
        results.append(
            Result("handle_batch", "handled/s, batch=True", None, "events/s", target="skipped", note=batch_note)
        )
    for key, what in (("procrastinate", "procrastinate"), ("pgqueuer", "pgqueuer")):
        r = ratio_result(
            f"handle_tx_vs_{key}",
            "(info) handled/s, per message",
            steady["tx"],
            steady[key],
            unit="events/s",
            floor_what=what,
            at_least=1.0,
        )
        r.target, r.met = "info", None
        results.append(r)
    results.append(
        ratio_result(
            "handle_tx_default_conn",
            "handled/s, per message, CONN_MAX_AGE=0",
            steady["tx_default"],
            steady["tx"],
            unit="events/s",
            floor_what="the same, CONN_MAX_AGE=None",
            at_least=0.9,
            note="added target: Django's default CONN_MAX_AGE=0 must not cost the worker a reconnect per message",
        )
    )
    if BATCH_SUPPORTED:
        results.append(
            ratio_result(
                "handle_batch_default_conn",
                "handled/s, batch=True, CONN_MAX_AGE=0",
                steady["batch_default"],
                steady["batch"],
                unit="events/s",
                floor_what="the same, CONN_MAX_AGE=None",
                at_least=0.9,
                note="added target, as above",
            )
        )
    reset_tables()
    reset_broker(transport)
    return results
