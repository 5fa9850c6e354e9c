"""8: ``subscribe(rate_limit=...)`` across processes: two worker processes
share one limit (``benchapp.platformkit.RATE_LIMIT``) over a backlog; the
handler stamps ``clock_timestamp()``, so every start is on the database's
clock. Reported: the most starts in any window of the period's length
against the limit, and the drain time against the time the limit implies.
"""

from __future__ import annotations

import signal
import time

from django_platformkit import conf
from django_platformkit.wire import durable_name

from .benchapp.platformkit import RATE_LIMIT
from .harness import Result, Sizes, fill_outbox, log, manage, reset_broker, reset_tables, scalar, sql

SUBSCRIPTION = "bench.sink_rated"
#: Events in the backlog: 10 s of starts at the limit.
EVENTS = 500
PROCESSES = 2


def most_in_any_window(starts: list[float], seconds: float) -> int:
    """The most starts in a half-open window [t, t + seconds) (one starting at a start is the worst)."""
    best, j = 0, 0
    for i, t in enumerate(starts):
        while j < len(starts) and starts[j] < t + seconds:
            j += 1
        best = max(best, j - i)
    return best


def run_ratelimit(sizes: Sizes, transport) -> list[Result]:
    rate = conf.rate("RATE_LIMIT", RATE_LIMIT)
    reset_tables("platformkit_rate_limits")
    reset_broker(transport, durable_name(SUBSCRIPTION))
    fill_outbox("bench.rated", EVENTS)
    log(f"ratelimit: {EVENTS} events, limit {rate}, {PROCESSES} worker processes")
    workers = [
        manage("runworker", "--no-jobs", "--subscription", SUBSCRIPTION, "-v", "0", env={"BENCH_RATELIMIT": "1"})
        for _ in range(PROCESSES)
    ]
    try:
        deadline = time.monotonic() + 180
        while scalar("SELECT count(*) FROM bench_sink WHERE kind = 'rated'") < EVENTS:
            if time.monotonic() > deadline:
                raise RuntimeError("the rate-limited backlog was not drained within 180 s")
            time.sleep(0.2)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(30)
            except Exception:
                worker.kill()
    starts = [
        float(r[0])
        for r in sql("SELECT EXTRACT(EPOCH FROM at) FROM bench_sink WHERE kind = 'rated' ORDER BY 1", fetch=True)
    ]
    windows = {}
    for seconds in (rate.period_seconds, rate.period_seconds / 10):
        windows[seconds] = most_in_any_window(starts, seconds)
    most = windows[rate.period_seconds]
    drained = starts[-1] - starts[0]
    implied = (len(starts) - 1) * rate.spacing_seconds
    per_window = [
        sum(1 for t in starts if w <= t < w + rate.period_seconds)
        for w in [starts[0] + k * rate.period_seconds for k in range(int(drained / rate.period_seconds) + 1)]
    ]
    note = (
        f"{len(starts)} starts over {drained:.2f} s (the limit implies {implied:.2f} s); per {rate.period_seconds:g} s "
        f"window from the first start: {per_window}; most in any {rate.period_seconds / 10:g} s: {windows[rate.period_seconds / 10]}"
    )
    detail = {"limit": str(rate), "processes": PROCESSES, "per_window": per_window, "drained_seconds": drained}
    return [
        Result(
            "ratelimit_max_window",
            f"rate limit {rate} over {PROCESSES} processes: most starts in any {rate.period_seconds:g} s window",
            float(most),
            "starts",
            floor=float(rate.count),
            floor_what="the limit",
            ratio=most / rate.count,
            target=f"<= {rate.count} (+10%)",
            met=most <= rate.count * 1.1,
            note=note,
            detail=detail,
        ),
        Result(
            "ratelimit_drain",
            f"rate limit {rate} over {PROCESSES} processes: drain time vs the limit's",
            drained,
            "s",
            floor=implied,
            floor_what="implied by the limit",
            ratio=drained / implied if implied else None,
            target="within 10%",
            met=abs(drained - implied) <= implied * 0.1,
        ),
    ]
