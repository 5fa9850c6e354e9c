"""What every measurement shares: the run's sizes, resetting tables and the
stream between runs, filling the outbox fast, starting worker processes,
and the result rows the table and JSON are made of."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Sizes:
    """How much work each measurement does; ``--quick`` shrinks everything."""

    reps: int = 3
    publish_events: int = 3000
    publish_many_batches: int = 100  # of 100 events each
    relay_rows: int = 50_000
    handle_events: int = 20_000
    handle_events_slow: int = 6_000  # per-message mode and procrastinate (~1-2k/s)
    latency_rate_per_second: float = 200.0
    latency_seconds: float = 10.0
    backlog_rows: int = 1_000_000
    backlog_relay_rows: int = 10_000  # relayed at 10k pending and at 1M pending
    rss_window_seconds: float = 60.0
    # the realistic topology (measure_topology.py)
    topo_window_seconds: float = 10.0  # each steady rate
    topo_drain_events: int = 10_000  # x 2 subscriptions
    topo_pings: int = 5
    topo_rss_rows: int = 1_000_000
    topo_rss_seconds: float = 30.0
    topo_idle_seconds: float = 20.0
    # the peers at a trickle (measure_trickle.py): each rate's window per run
    trickle_seconds: float = 10.0
    # reconciliation (measure_reconcile.py): the outbox, one interval's window, the lost events re-sent
    reconcile_rows: int = 1_000_000
    reconcile_window_rows: int = 10_000
    reconcile_resend_rows: int = 10_000

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            reps=1,
            publish_events=1000,
            publish_many_batches=30,
            relay_rows=10_000,
            handle_events=5_000,
            handle_events_slow=2_000,
            latency_seconds=5.0,
            backlog_rows=200_000,
            backlog_relay_rows=5_000,
            rss_window_seconds=15.0,
            topo_window_seconds=5.0,
            topo_drain_events=3_000,
            topo_pings=3,
            topo_rss_rows=200_000,
            topo_rss_seconds=10.0,
            topo_idle_seconds=10.0,
            trickle_seconds=4.0,
            reconcile_rows=200_000,
            reconcile_resend_rows=2_000,
        )


@dataclass
class Result:
    """One line of the final table."""

    key: str
    what: str
    ours: float | None
    unit: str
    floor: float | None = None
    floor_what: str = ""
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio_result(
    key: str,
    what: str,
    ours: list[float],
    floor: list[float],
    *,
    unit: str,
    floor_what: str,
    at_least: float,
    note: str = "",
    detail: dict | None = None,
) -> Result:
    """A result whose target is ``median(ours) / median(floor) >= at_least``."""
    o, f = statistics.median(ours), statistics.median(floor)
    ratio = o / f if f else None
    return Result(
        key=key,
        what=what,
        ours=o,
        unit=unit,
        floor=f,
        floor_what=floor_what,
        ratio=ratio,
        target=f">= {at_least:g}x",
        met=None if ratio is None else ratio >= at_least,
        note=note,
        samples={"ours": ours, "floor": floor},
        detail=detail or {},
    )


def median_of(reps: int, func: Callable[[], float]) -> list[float]:
    return [func() for _ in range(reps)]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- database and stream state ------------------------------------------------


def sql(statement: str, params: Any = None, *, fetch: bool = False) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchall() if fetch else None


def scalar(statement: str, params: Any = None) -> Any:
    return sql(statement, params, fetch=True)[0][0]


def reset_tables(*extra: str) -> None:
    tables = [
        "platformkit_outbox",
        "platformkit_task_results",
        "platformkit_handled",
        "platformkit_dead_letters",
        "bench_sink",
        "bench_row",
        *extra,
    ]
    sql(f"TRUNCATE {', '.join(tables)}")


def reset_broker(transport: Any, *durables: str) -> None:
    """Empty the stream and drop the named durables, so a run starts from nothing."""
    from django_platformkit import conf

    async def go() -> None:
        js = transport.connection.js
        for durable in durables:
            try:
                await js.delete_consumer(conf.settings.STREAM, durable)
            except Exception:
                pass
        await js.purge_stream(conf.settings.STREAM)

    transport.connection.call(go(), timeout=120)


def fill_outbox(event: str, rows: int, *, start: int = 0) -> None:
    """``rows`` pending outbox rows of ``event`` in one INSERT ... SELECT,
    payloads like ``{"n": 7, "sku": "sku-7", "qty": 1}``, ``created_at`` from
    the database clock in insertion order - what ``publish()`` would write,
    a hundred times faster."""
    sql(
        "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at) "
        "SELECT gen_random_uuid(), %s, NULL, jsonb_build_object('n', g, 'sku', 'sku-' || g, 'qty', 1), '{}'::jsonb, clock_timestamp() "
        "FROM generate_series(%s, %s) AS g",
        [event, start + 1, start + rows],
    )


def pending() -> int:
    return scalar("SELECT count(*) FROM platformkit_outbox WHERE published_at IS NULL")


def sink_rate(kind: str) -> tuple[int, float | None]:
    """(rows, steady rate/s) of the sink rows of ``kind``: rows over the span
    from the first to the last handler run (database clock), so process
    start-up and the burst worker's drained-check tail are not counted."""
    count, span = sql(
        "SELECT count(*), EXTRACT(EPOCH FROM max(at) - min(at)) FROM bench_sink WHERE kind = %s",
        [kind],
        fetch=True,
    )[0]
    if not count or not span:
        return count, None
    return count, (count - 1) / float(span)


# --- processes ------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DJANGO_SETTINGS_MODULE="bench.settings", PYTHONPATH=str(ROOT), **extra)
    return env


def manage(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
    """``bench/manage.py <args>`` as a real process with the bench settings
    (``env``: more environment variables, e.g. ``BENCH_CONN_MAX_AGE``)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "manage.py"), *args], env=child_env(**(env or {})), cwd=ROOT, **kwargs
    )


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB, from /proc: current and peak resident set."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values.get("VmRSS", 0), values.get("VmHWM", 0)


class conn_max_age:
    """Run a block with ``DATABASES['default']['CONN_MAX_AGE']`` set to
    ``value`` (None: keep connections open). Threads started inside it (a
    worker's consumers) build their connections from this same dict."""

    def __init__(self, value: int | None) -> None:
        self.value = value

    def __enter__(self) -> None:
        from django.db import connections

        self.settings = connections.settings["default"]
        self.before = self.settings.get("CONN_MAX_AGE", 0)
        self.settings["CONN_MAX_AGE"] = self.value
        connections.close_all()

    def __exit__(self, *exc: object) -> None:
        from django.db import connections

        self.settings["CONN_MAX_AGE"] = self.before
        connections.close_all()
