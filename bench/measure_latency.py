"""5: end-to-end latency from commit to handler start at a steady rate.

A worker process (relay + one consumer, LISTEN wake-up) runs as it would in
production; this process publishes one event per transaction on a fixed
schedule. The handler stamps ``clock_timestamp()``; the event's
``occurred_at`` is the outbox row's ``created_at``, also ``clock_timestamp()``
taken a moment before the commit - so both ends read the database's clock.
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from pathlib import Path

from django.db import transaction

from django_platformkit import publish
from django_platformkit.wire import durable_name

from .benchapp.platformkit import LATENCY
from .harness import Result, Sizes, log, manage, reset_broker, reset_tables, scalar, sql

SUBSCRIPTION = "bench.sink_latency"


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    index = max(0, min(len(sorted_values) - 1, int(round(q / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[index]


def _publish_one(i: int) -> None:
    with transaction.atomic():
        publish(LATENCY, {"n": i, "sku": f"sku-{i}"})


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def run_latency(sizes: Sizes, transport) -> list[Result]:
    """With persistent connections, then at Django's default CONN_MAX_AGE=0
    (the same targets: a worker should not need to be told)."""
    results = _latency(sizes, transport, {"BENCH_CONN_MAX_AGE": "none"}, "")
    for r in _latency(sizes, transport, {"BENCH_CONN_MAX_AGE": "0"}, "CONN_MAX_AGE=0"):
        r.key += "_default_conn"
        results.append(r)
    return results


def _latency(sizes: Sizes, transport, env: dict[str, str], label: str) -> list[Result]:
    reset_tables()
    reset_broker(transport, durable_name(SUBSCRIPTION))
    health = Path(tempfile.mkdtemp(prefix="bench-")) / "health.json"
    worker = manage(
        "runworker", "--no-jobs", "--subscription", SUBSCRIPTION, "--health-file", str(health), "-v", "0", env=env
    )
    try:
        _wait_for(health.exists, 60, "the worker's health file")
        # Warm up: the durable exists and one event went all the way through.
        i = 0
        while not scalar("SELECT count(*) FROM bench_sink"):
            _publish_one(i)
            i += 1
            time.sleep(0.1)
            if i > 600:
                raise RuntimeError("no warm-up event was handled within a minute")
        time.sleep(1.0)
        since = scalar("SELECT clock_timestamp()")
        rate, seconds = sizes.latency_rate_per_second, sizes.latency_seconds
        count = int(rate * seconds)
        log(
            f"latency{f' ({label})' if label else ''}: {count} events at {rate:g}/s for {seconds:g}s, one per transaction, worker process running"
        )
        started = time.perf_counter()
        late = 0
        for n in range(count):
            due = started + n / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            elif wait < -0.005:
                late += 1
            _publish_one(n)
        achieved = count / (time.perf_counter() - started)
        _wait_for(
            lambda: scalar("SELECT count(*) FROM bench_sink WHERE occurred_at >= %s", [since]) >= count,
            120,
            "every event to be handled",
        )
        rows = sql(
            "SELECT EXTRACT(EPOCH FROM at - occurred_at) * 1000 FROM bench_sink WHERE occurred_at >= %s ORDER BY 1",
            [since],
            fetch=True,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except Exception:
            worker.kill()
    values = [float(r[0]) for r in rows]
    p50, p95, p99 = (_percentile(values, q) for q in (50, 95, 99))
    detail = {
        "events": len(values),
        "achieved_rate": achieved,
        "late_publishes": late,
        "max_ms": values[-1],
        "mean_ms": statistics.fmean(values),
    }
    note = f"{label or 'CONN_MAX_AGE=None'}: {len(values)} events at {achieved:.0f}/s achieved; max {values[-1]:.1f} ms"
    results = [
        Result(
            "latency_p50",
            "commit -> handler start, p50" + (f" ({label})" if label else ""),
            p50,
            "ms",
            target="< 15 ms",
            met=p50 < 15,
            note=note,
            detail=detail,
        ),
        Result(
            "latency_p95", "commit -> handler start, p95" + (f" ({label})" if label else ""), p95, "ms", target="info"
        ),
        Result(
            "latency_p99",
            "commit -> handler start, p99" + (f" ({label})" if label else ""),
            p99,
            "ms",
            target="< 100 ms",
            met=p99 < 100,
        ),
    ]
    reset_tables()
    reset_broker(transport)
    return results
