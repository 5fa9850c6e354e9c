"""6-7: a large backlog. The relay's rate with 10k vs 1M pending rows (the
pending-rows partial index keeps its query independent of table size; the
EXPLAIN is printed), then the peak RSS of a worker process relaying and
handling over what is left of the 1M rows."""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from pathlib import Path

from django.db import connection, transaction

from django_platformkit.outbox.relay import _PLAN_SQL, _SELECT_SQL, Relay
from django_platformkit.wire import durable_name

from .benchapp.platformkit import BACKLOG
from .harness import Result, Sizes, fill_outbox, log, manage, pending, reset_broker, reset_tables, rss_kib, scalar

SUBSCRIPTION = "bench.sink_backlog"
#: How long the worker gets to exit after SIGTERM before it is killed.
STOP_WAIT_SECONDS = 30.0


def explain(batch_size: int) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the relay's SELECT, planned as the relay
    plans it, rolled back (it locks rows)."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_PLAN_SQL)
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + _SELECT_SQL, [batch_size])
            plan = "\n".join(r[0] for r in cursor.fetchall())
        transaction.set_rollback(True)
    return plan


def relay_rows(transport, rows: int) -> float:
    """Relay ``rows`` of the oldest pending rows, batch by batch; events/s."""
    relay = Relay(transport)
    done = 0
    started = time.perf_counter()
    while done < rows:
        stats = relay.relay_batch()
        if not stats.stored:
            raise RuntimeError(f"relay stopped after {done} rows: {stats}")
        done += stats.stored
    return done / (time.perf_counter() - started)


def _at_small(transport, small: int, n: int) -> tuple[float, str]:
    reset_tables()
    reset_broker(transport, durable_name(SUBSCRIPTION))
    fill_outbox(BACKLOG.name, small)  # no ANALYZE: the statistics are as stale as after a real burst
    plan = explain(Relay(transport).batch_size)
    return relay_rows(transport, n), plan


def run_backlog(sizes: Sizes, transport) -> list[Result]:
    """10k pending before and after the 1M backlog (the machine's load
    drifts; the floor is the median of both), 1M pending in between."""
    small, big, n = 10_000, sizes.backlog_rows, sizes.backlog_relay_rows
    n = min(n, small)
    log(f"relay at {small} pending: relay {n} rows (x{sizes.reps})")
    at_small = []
    for _ in range(sizes.reps):
        rate, plan_small = _at_small(transport, small, n)
        at_small.append(rate)
    reset_tables()
    reset_broker(transport, durable_name(SUBSCRIPTION))
    log(f"filling the outbox with {big:,} pending rows (one INSERT ... SELECT generate_series)")
    started = time.perf_counter()
    fill_outbox(BACKLOG.name, big)  # no ANALYZE, as above
    log(f"  filled in {time.perf_counter() - started:.1f}s; relay at {big:,} pending: relay {n} rows (x{sizes.reps})")
    plan_big = explain(Relay(transport).batch_size)
    at_big = [relay_rows(transport, n) for _ in range(sizes.reps)]
    print(f"\nEXPLAIN of the relay's SELECT at {small:,} pending rows:\n{plan_small}\n")
    print(
        f"EXPLAIN of the relay's SELECT at {pending():,} pending rows (of {big:,} in the table):\n{plan_big}\n",
        flush=True,
    )
    results = _rss(sizes, big)
    log(f"relay at {small} pending again: relay {n} rows (x{sizes.reps})")
    for _ in range(sizes.reps):
        at_small.append(_at_small(transport, small, n)[0])
    reset_tables()
    reset_broker(transport, durable_name(SUBSCRIPTION))
    flat = Result(
        "relay_flat",
        f"relay rate at {big:,} pending",
        statistics.median(at_big),
        "events/s",
        floor=statistics.median(at_small),
        floor_what=f"relay rate at {small:,} pending",
        target=">= 0.8x",
        samples={"ours": at_big, "floor": at_small},
        detail={"explain_small": plan_small, "explain_big": plan_big},
    )
    flat.ratio = flat.ours / flat.floor
    flat.met = flat.ratio >= 0.8
    flat.note = (
        "uses platformkit_outbox_pending" if "platformkit_outbox_pending" in plan_big else "NOT using the pending index"
    )
    return [flat, *results]


def _rss(sizes: Sizes, big: int) -> list[Result]:
    window = sizes.rss_window_seconds
    before = pending()
    health = Path(tempfile.mkdtemp(prefix="bench-")) / "health.json"
    log(f"worker RSS: runworker (relay + consumer) over {before:,} pending rows for {window:g}s")
    worker = manage("runworker", "--no-jobs", "--subscription", SUBSCRIPTION, "--health-file", str(health), "-v", "0")
    peak_sampled = 0
    try:
        deadline = time.monotonic() + 60
        while not health.exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
            time.sleep(0.05)
        start_rss, _ = rss_kib(worker.pid)
        t0 = time.monotonic()
        end = t0 + window
        timeline: list[tuple[float, int]] = [(0.0, before)]  # (seconds, pending rows)
        next_count = t0 + 2.0
        while time.monotonic() < end and worker.poll() is None:
            current, _ = rss_kib(worker.pid)
            peak_sampled = max(peak_sampled, current)
            if time.monotonic() >= next_count:
                timeline.append((time.monotonic() - t0, pending()))
                next_count += 2.0
            time.sleep(0.25)
        _, hwm = rss_kib(worker.pid)
        timeline.append((time.monotonic() - t0, pending()))
    finally:
        stopping = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        killed = False
        try:
            worker.wait(STOP_WAIT_SECONDS)
        except Exception:
            killed = True
            worker.kill()
            worker.wait(10)
        stop_seconds = time.monotonic() - stopping
    after = pending()
    handled = scalar("SELECT count(*) FROM bench_sink WHERE kind = 'backlog'")
    peak_mib = max(hwm, peak_sampled) / 1024
    relayed_after_window = (timeline[-1][1] if timeline else before) - after
    stop = Result(
        "worker_stop",
        "(info) worker exit after SIGTERM, mid-backlog",
        stop_seconds,
        "s",
        target="info",
        note=(f"killed after {STOP_WAIT_SECONDS:g}s; " if killed else "")
        + f"it relayed {relayed_after_window:,} more rows after the SIGTERM",
        detail={"killed": killed, "relayed_after_sigterm": relayed_after_window},
    )
    rss = Result(
        "worker_rss",
        f"worker peak RSS, {big:,}-row backlog",
        peak_mib,
        "MiB",
        target="< 150 MiB",
        met=peak_mib < 150,
        note=f"relayed {before - (timeline[-1][1] if timeline else after):,} and handled {handled:,} in {window:g}s; RSS at start {start_rss / 1024:.0f} MiB",
        detail={
            "pending_before": before,
            "pending_after": after,
            "handled": handled,
            "start_rss_mib": start_rss / 1024,
            "hwm_mib": hwm / 1024,
            "sampled_peak_mib": peak_sampled / 1024,
            "pending_timeline": timeline,
        },
    )
    return [rss, *_drain_curve(timeline), stop]


def _drain_curve(timeline: list[tuple[float, int]]) -> list[Result]:
    """The worker's relay rate early vs late in the drain: dead index entries
    of stamped rows pile up in front of the pending ones until VACUUM."""
    rates = [((p0 - p1) / (t1 - t0), p0) for (t0, p0), (t1, p1) in zip(timeline, timeline[1:]) if t1 > t0]
    busy = [(rate, p) for rate, p in rates if p > 0]
    if len(busy) < 4:
        return []
    quarter = max(1, len(busy) // 4)
    early = [r for r, _ in busy[:quarter]]
    late = [r for r, _ in busy[-quarter:]]
    if busy[-1][0] == 0:
        late = [r for r, _ in busy[-quarter - 1 : -1]]
    result = Result(
        "relay_drain_curve",
        "(info) worker relay rate, last quarter of the window",
        statistics.median(late),
        "events/s",
        floor=statistics.median(early),
        floor_what="first quarter",
        target="info",
        note=f"relayed {timeline[0][1] - timeline[-1][1]:,} rows in {timeline[-1][0]:.0f}s (pending sampled every 2s)",
        samples={"ours": late, "floor": early},
    )
    result.ratio = result.ours / result.floor if result.floor else None
    return [result]
