"""10: the peers at a trickle (issue 29): worker CPU per handling, CPU of
every process per event and commit -> handler latency at a steady 200/s
and 50/s, ours against pgqueuer, procrastinate, django-tasks-db and Celery
(when ``redis-server`` is installed), in interleaved repetitions.

Every system runs the realistic topology as far as it has the parts: the
hot event handled twice (ours: two subscriptions; the peers: two jobs or
tasks enqueued per event, in the publisher's transaction), idle task types
beside them (ours: 21 idle subscriptions and a slow one, each a durable
with its waiting pull; the peers: 22 registered task types) and the
periodic jobs (bench/peers/ says how each peer runs them). Every handling
is the same ORM insert (bench/peers/handler.py). One system runs at a
time, started fresh for each (system, rate, repetition) and warmed up
(every hot handler ran once) before the window.

- Publisher: this process, one ``transaction.atomic()`` per event on
  Django's connection, on a fixed schedule; the commit time is
  ``time.time()`` in the first ``on_commit`` callback (before Celery's
  ``delay``, which is an ``on_commit`` callback too).
- Latency: commit -> the handler's row (``clock_timestamp()`` of its
  INSERT); both ends read the machine's realtime clock.
- Worker CPU: user + system of every process of the system (the worker
  and its children, Celery's beat; reaped children through their
  parent's cutime/cstime), from /proc/<pid>/stat, over the window from the
  first publish to the moment every handling was seen, divided by the
  handlings.
- All processes: the worker CPU plus nats-server, this run's redis-server
  and every PostgreSQL process (the postmaster, its reaped children and
  every live child: the workers' and the publisher's backends,
  checkpointer, walwriter, autovacuum) except the backend of the bench's
  own monitoring connection; divided by the events. The publisher's
  Python (this process) is not counted for anyone.
- Exactly once: each hot kind has one row per published event (counted
  and distinct); a run that lost or doubled any is reported as such.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection, transaction

from .harness import ROOT, Result, Sizes, log, reset_tables
from .systems import Pgqueuer, System

SYSTEMS = ("ours", "pgqueuer", "procrastinate", "django-tasks-db", "celery")
RATES = (200.0, 50.0)
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: How long after the window a system may take to catch up before the run
#: counts what is missing as not handled (a peer that can't keep up).
CATCH_UP_SECONDS = 60.0
#: The report lines (the peer tables) run.py prints under its table.
REPORT: list[str] = []


# --- CPU from /proc ---------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def _own_and_reaped(fields: list[str]) -> float:
    """utime + stime + cutime + cstime (the last two: children it waited for), seconds."""
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def tree_cpu(roots: list[int], kids: dict[int, list[int]], exclude: frozenset[int] = frozenset()) -> float:
    """CPU seconds of ``roots`` and every descendant, alive or reaped, but not ``exclude``."""
    total, stack, seen = 0.0, list(roots), set()
    while stack:
        pid = stack.pop()
        if pid in seen or pid in exclude:
            continue
        seen.add(pid)
        fields = _stat(pid)
        if fields is None:
            continue
        total += _own_and_reaped(fields)
        stack += kids.get(pid, [])
    return total


def _find(binary: str, port: int) -> int | None:
    """The pid of a running ``binary`` whose command line names ``port``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode(errors="replace")).name == binary and str(port).encode() in b" ".join(argv):
            return int(entry)
    return None


@dataclass
class Meter:
    """Samples the CPU of one run's parts: the system's processes, PostgreSQL, NATS, Redis."""

    postmaster: int
    monitor_backend: int
    nats: int | None
    redis: int | None

    def sample(self, system_roots: list[int]) -> dict[str, float]:
        kids = _children_map()
        return {
            "worker": tree_cpu(system_roots, kids),
            "postgres": tree_cpu([self.postmaster], kids, exclude=frozenset({self.monitor_backend})),
            "nats": tree_cpu([self.nats], kids) if self.nats else 0.0,
            "redis": tree_cpu([self.redis], kids) if self.redis else 0.0,
        }


# --- Redis for Celery ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """``REDIS_URL`` when set, else a throwaway ``redis-server`` (no persistence) on a free port."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.url = os.environ.get("REDIS_URL", "")
        self.pid: int | None = None
        self.origin = "REDIS_URL"
        if self.url:
            return
        binary = shutil.which("redis-server")
        if binary is None:
            self.origin = "not installed"
            return
        port = _free_port()
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        self.pid = self.process.pid
        self.origin = f"throwaway redis-server on 127.0.0.1:{port}, no persistence"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushdb()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


# --- the systems --------------------------------------------------------------------


class Ours(System):
    name = "ours"
    settings = "runworker, defaults (relay in-process with LISTEN, one consumer process, uvloop)"

    def __init__(self, logs: Path, transport: Any) -> None:
        super().__init__(logs)
        from .measure_topology import HOT_KINDS

        self.transport = transport
        self.kinds = HOT_KINDS
        self.worker: Any = None

    def reset(self) -> None:
        from .measure_topology import _reset

        _reset(self.transport)

    def start(self) -> None:
        from .measure_topology import TopologyWorker

        self.worker = TopologyWorker()
        self.processes = [self.worker.process]

    def warm_up(self, timeout: float = 120.0) -> None:
        self.worker.warm_up(timeout)  # a hot event and a ping through all 23 subscriptions

    def enqueue(self, n: int) -> str:
        from django_platformkit import publish

        from .benchapp.platformkit import TOPO_HOT

        return str(publish(TOPO_HOT, {"n": n, "sku": f"sku-{n}"}))


class Procrastinate(System):
    name = "procrastinate"
    settings = (
        "manage.py procrastinate worker, defaults: concurrency 1, LISTEN/NOTIFY + 5 s poll; periodic 5 s and 1 min"
    )

    def reset(self) -> None:
        reset_tables("procrastinate_jobs", "procrastinate_periodic_defers", "procrastinate_events")

    def start(self) -> None:
        self._spawn([sys.executable, str(ROOT / "bench" / "manage.py"), "procrastinate", "worker"])

    def enqueue(self, n: int) -> str:
        from .peers import procrastinate_tasks

        procrastinate_tasks.enqueue(str(n))
        return str(n)


class DjangoTasksDb(System):
    name = "django-tasks-db"
    settings = "manage.py db_worker --backend db, defaults: one task at a time, 1 s poll when empty; no periodic jobs"

    def reset(self) -> None:
        from django_tasks_db.models import DBTaskResult

        reset_tables(DBTaskResult._meta.db_table)

    def start(self) -> None:
        self._spawn([sys.executable, str(ROOT / "bench" / "manage.py"), "db_worker", "--backend", "db"])

    def enqueue(self, n: int) -> str:
        from .peers import tasks_db

        tasks_db.enqueue(str(n))
        return str(n)


class Celery(System):
    name = "celery"
    settings = "celery worker (prefork, 2 children = CPUs, prefetch 4, acks early, no result backend, DB_REUSE_MAX: connections kept) + celery beat (5 s, 1 min), Redis broker"

    def __init__(self, logs: Path, redis: Redis) -> None:
        super().__init__(logs)
        self.redis = redis
        from .peers.celery_app import app

        app.conf.broker_url = redis.url  # this process read the settings before the URL was known

    def reset(self) -> None:
        reset_tables()
        self.redis.flush()

    def start(self) -> None:
        env = {"BENCH_REDIS_URL": self.redis.url}
        celery = [sys.executable, "-m", "celery", "-A", "bench.peers.celery_app"]
        self._spawn([*celery, "worker", "--loglevel", "WARNING"], **env)
        schedule = self.logs / f"celerybeat-{time.monotonic_ns()}"
        self._spawn([*celery, "beat", "--loglevel", "WARNING", "-s", str(schedule)], "beat", **env)

    def enqueue(self, n: int) -> str:
        from .peers import celery_app

        celery_app.enqueue(str(n))
        return str(n)


# --- one run --------------------------------------------------------------------------


@dataclass
class Run:
    system: str
    rate: float
    rep: int
    events: int = 0
    achieved: float = 0.0
    handled: int = 0
    duplicates: int = 0
    missing: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")

    @property
    def worker_ms_per_handling(self) -> float:
        return 1000 * self.cpu["worker"] / max(1, self.handled)

    @property
    def all_ms_per_event(self) -> float:
        return 1000 * sum(self.cpu.values()) / max(1, self.events)

    @property
    def exactly_once(self) -> bool:
        return not self.duplicates and not self.missing


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, int(round(q / 100 * len(values) + 0.5)) - 1))]


def _monitor():
    """A connection of the bench's own for polling and reading results: its backend is left out of the CPU."""
    import psycopg

    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    return psycopg.connect(**params, autocommit=True)


def _one(system: System, rate: float, seconds: float, rep: int, meter_for) -> Run:
    run = Run(system.name, rate, rep)
    system.reset()
    system.start()
    try:
        system.warm_up()
        with _monitor() as mon:
            meter = meter_for(mon)
            count = int(rate * seconds)
            commits: dict[int, float] = {}
            keys: dict[str, int] = {}
            kinds = list(system.kinds)
            before, t0 = meter.sample(system.roots()), time.monotonic()
            system.prepare()
            started = time.perf_counter()
            for n in range(count):
                wait = started + n / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                with transaction.atomic():
                    transaction.on_commit(lambda n=n: commits.__setitem__(n, time.time()))
                    keys[system.enqueue(n)] = n
            run.events, run.achieved = count, count / (time.perf_counter() - started)
            deadline = time.monotonic() + CATCH_UP_SECONDS
            while True:
                done = mon.execute("SELECT count(*) FROM bench_sink WHERE kind = ANY(%s)", [kinds]).fetchone()[0]
                if done >= 2 * count or time.monotonic() > deadline:
                    break
                system._check_alive()
                time.sleep(0.05)
            after, run.seconds = meter.sample(system.roots()), time.monotonic() - t0
            run.cpu = {k: after[k] - before[k] for k in after}
            rows = mon.execute(
                "SELECT kind, event_id, EXTRACT(EPOCH FROM at)::float8 FROM bench_sink WHERE kind = ANY(%s)", [kinds]
            ).fetchall()
    finally:
        system.stop()
    per_kind: dict[str, set[str]] = {k: set() for k in kinds}
    latencies = []
    for kind, key, at in rows:
        if key in per_kind[kind]:
            run.duplicates += 1
            continue
        per_kind[kind].add(key)
        if key in keys:
            latencies.append(1000 * (at - commits[keys[key]]))
    run.handled = len(rows)
    run.missing = sum(count - len(seen & keys.keys()) for seen in per_kind.values())
    # What never ran within the catch-up counts as slower than anything that did.
    latencies += [float("inf")] * run.missing
    if latencies:
        run.p50_ms, run.p99_ms = _percentile(latencies, 50), _percentile(latencies, 99)
        run.max_ms = max(latencies)
    return run


# --- the report -------------------------------------------------------------------------


def _ms(value: float) -> str:
    if value != value:
        return "-"
    if value == float("inf"):
        return f"> {CATCH_UP_SECONDS:g} s"
    return f"{value:,.1f} ms" if value < 10_000 else f"{value / 1000:,.1f} s"


def _table(rate: float, runs: list[Run]) -> tuple[str, dict[str, dict[str, float]]]:
    med: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r.system for r in runs):
        mine = [r for r in runs if r.system == name]
        med[name] = {
            "worker": statistics.median(r.worker_ms_per_handling for r in mine),
            "all": statistics.median(r.all_ms_per_event for r in mine),
            "p50": statistics.median(r.p50_ms for r in mine),
            "p99": statistics.median(r.p99_ms for r in mine),
            "pg": statistics.median(1000 * r.cpu["postgres"] / max(1, r.events) for r in mine),
            "broker": statistics.median(1000 * (r.cpu["nats"] + r.cpu["redis"]) / max(1, r.events) for r in mine),
            "reps": len(mine),
            "exact": all(r.exactly_once for r in mine),
            "missing": sum(r.missing for r in mine),
            "duplicates": sum(r.duplicates for r in mine),
        }
    peers = {k: v for k, v in med.items() if k != "ours"}

    def best(key: str) -> float | None:
        values = [v[key] for v in peers.values() if v[key] == v[key]]
        return min(values) if values else None

    header = [
        "system",
        "worker CPU / handling",
        "x best peer",
        "all CPU / event",
        "x best peer",
        "of which PG / broker",
        "p50",
        "p99",
        "x best peer",
        "exactly once",
    ]
    rows = []
    for name, v in med.items():
        cells = [name]
        for key, fmt in (("worker", "{:.2f} ms"), ("all", "{:.2f} ms")):
            b = best(key)
            cells += [fmt.format(v[key]), f"{v[key] / b:.2f}x" if b else "-"]
        cells.append(f"{v['pg']:.2f} / {v['broker']:.2f} ms")
        b = best("p99")
        p99_ratio = "-" if not b or v["p99"] == float("inf") or b == float("inf") else f"{v['p99'] / b:.2f}x"
        cells += [_ms(v["p50"]), _ms(v["p99"]), p99_ratio]
        cells.append(
            "yes"
            if v["exact"]
            else f"NO: {int(v['missing'])} missing, {int(v['duplicates'])} doubled over {int(v['reps'])} runs"
        )
        rows.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [
        f"trickle at {rate:g} events/s x 2 handlings, medians of {max(int(v['reps']) for v in med.values())} interleaved runs:",
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines), med


def _targets(rate: float, med: dict[str, dict[str, float]]) -> list[Result]:
    ours = med.get("ours")
    peers = {k: v for k, v in med.items() if k != "ours"}
    if ours is None or not peers:
        return []
    label = f"{rate:g}/s"
    out: list[Result] = []
    pgq = peers.get("pgqueuer")
    if pgq:
        ratio = ours["worker"] / pgq["worker"]
        out.append(
            Result(
                f"trickle_{int(rate)}_worker_cpu",
                f"trickle {label}: worker CPU per handling",
                ours["worker"],
                "ms",
                floor=pgq["worker"],
                floor_what="pgqueuer",
                ratio=ratio,
                target="<= 1.0x",
                met=ratio <= 1.0,
            )
        )
    best_all = min(peers.items(), key=lambda kv: kv[1]["all"])
    ratio = ours["all"] / best_all[1]["all"]
    out.append(
        Result(
            f"trickle_{int(rate)}_all_cpu",
            f"trickle {label}: all-processes CPU per event",
            ours["all"],
            "ms",
            floor=best_all[1]["all"],
            floor_what=f"best peer: {best_all[0]}",
            ratio=ratio,
            target="<= 1.0x",
            met=ratio <= 1.0,
        )
    )
    best_p99 = min(peers.items(), key=lambda kv: kv[1]["p99"])
    p99_ratio = ours["p99"] / best_p99[1]["p99"] if best_p99[1]["p99"] not in (0, float("inf")) else None
    out.append(
        Result(
            f"trickle_{int(rate)}_p99_vs_peer",
            f"trickle {label}: commit -> handler row p99",
            ours["p99"],
            "ms",
            floor=best_p99[1]["p99"],
            floor_what=f"best peer: {best_p99[0]}",
            ratio=p99_ratio,
            target="<= 1.0x",
            met=None if p99_ratio is None else p99_ratio <= 1.0,
        )
    )
    if rate == 200.0:
        out += [
            Result(
                "trickle_200_p50",
                "trickle 200/s: commit -> handler row p50",
                ours["p50"],
                "ms",
                target="< 10 ms",
                met=ours["p50"] < 10,
            ),
            Result(
                "trickle_200_p99",
                "trickle 200/s: commit -> handler row p99",
                ours["p99"],
                "ms",
                target="< 50 ms",
                met=ours["p99"] < 50,
            ),
        ]
    return out


# --- entry point ------------------------------------------------------------------------


def available_systems(redis: Redis) -> tuple[list[str], list[str]]:
    """(systems to run, lines saying what was skipped and why)."""
    chosen, skipped = [], []
    wanted = [s.strip() for s in os.environ.get("BENCH_TRICKLE_SYSTEMS", ",".join(SYSTEMS)).split(",") if s.strip()]
    for name in wanted:
        module = {"pgqueuer": "pgqueuer", "procrastinate": "procrastinate", "django-tasks-db": "django_tasks_db"}.get(
            name
        )
        if name == "celery":
            try:
                import celery  # noqa: F401
                import redis as _redis  # noqa: F401
            except ImportError:
                skipped.append("celery: celery[redis] not installed (pip install -e '.[bench]')")
                continue
            if not redis.url:
                skipped.append(
                    "celery: no redis-server on PATH and no REDIS_URL (Debian: apt-get install redis-server)"
                )
                continue
        elif module:
            try:
                __import__(module)
            except ImportError:
                skipped.append(f"{name}: not installed (pip install -e '.[bench]')")
                continue
        chosen.append(name)
    return chosen, skipped


def run_trickle(sizes: Sizes, transport: Any) -> list[Result]:
    from urllib.parse import urlsplit

    from django_platformkit import conf

    logs = Path(tempfile.mkdtemp(prefix="bench-trickle-"))
    redis = Redis()
    results: list[Result] = []
    try:
        names, skipped = available_systems(redis)
        for line in skipped:
            log(f"trickle: skipped {line}")
        if redis.url:
            os.environ["BENCH_REDIS_URL"] = redis.url
        nats_port = urlsplit(conf.settings.NATS_URL.split(",")[0]).port or 4222
        nats_pid = _find("nats-server", nats_port)

        def meter_for(mon) -> Meter:
            backend = mon.execute("SELECT pg_backend_pid()").fetchone()[0]
            postmaster = int(_stat(backend)[1])
            return Meter(postmaster=postmaster, monitor_backend=backend, nats=nats_pid, redis=redis.pid)

        factories = {
            "ours": lambda: Ours(logs, transport),
            "pgqueuer": lambda: Pgqueuer(logs),
            "procrastinate": lambda: Procrastinate(logs),
            "django-tasks-db": lambda: DjangoTasksDb(logs),
            "celery": lambda: Celery(logs, redis),
        }
        systems = [factories[n]() for n in names]
        seconds = sizes.trickle_seconds
        runs: list[Run] = []
        for rep in range(sizes.reps):
            for rate in RATES:
                for system in systems:
                    log(f"trickle rep {rep + 1}/{sizes.reps}: {system.name} at {rate:g}/s for {seconds:g}s")
                    run = _one(system, rate, seconds, rep, meter_for)
                    runs.append(run)
                    log(
                        f"  {system.name} {rate:g}/s: worker {run.worker_ms_per_handling:.2f} ms/handling, "
                        f"all {run.all_ms_per_event:.2f} ms/event ({', '.join(f'{k} {v:.2f}s' for k, v in run.cpu.items())}), "
                        f"p50 {_ms(run.p50_ms)} p99 {_ms(run.p99_ms)}, {run.handled}/{2 * run.events} handlings"
                        + ("" if run.exactly_once else f", {run.missing} missing, {run.duplicates} doubled")
                    )
        REPORT.append(
            f"Trickle peers (load average {os.getloadavg()[0]:.1f} at the end; worker = every process of the system; "
            "all = worker + every PostgreSQL process but the bench's monitor + nats-server + redis-server; "
            "latency = commit -> the handler's row):"
        )
        for rate in RATES:
            mine = [r for r in runs if r.rate == rate]
            text, med = _table(rate, mine)
            REPORT.append(text)
            REPORT.append(
                "per run, in the order run (worker CPU per handling, p99): "
                + "; ".join(
                    f"{name} "
                    + ", ".join(f"{r.worker_ms_per_handling:.2f} ms/{_ms(r.p99_ms)}" for r in mine if r.system == name)
                    for name in med
                )
            )
            targets = _targets(rate, med)
            REPORT.append(
                f"issue 29 targets at {rate:g}/s: "
                + "; ".join(
                    f"{t.what.split(': ', 1)[1]} {_ms(t.ours) if t.unit == 'ms' and t.ratio is None else f'{t.ratio:.2f}x' if t.ratio is not None else '-'}"
                    f" (target {t.target}) {'-' if t.met is None else 'met' if t.met else 'MISSED'}"
                    for t in targets
                )
            )
            results += targets
        REPORT.append("settings: " + "; ".join(f"{s.name}: {s.settings}" for s in systems))
        if nats_pid is None:
            REPORT.append(f"nats-server (port {nats_port}) is not a process of this machine: its CPU is not counted")
        if skipped:
            REPORT.append("skipped: " + "; ".join(skipped))
        if results:
            results[0].detail = {
                "runs": [{**r.__dict__, "cpu": r.cpu} for r in runs],
                "redis": redis.origin,
                "logs": str(logs),
            }
    finally:
        redis.stop()
        reset_tables()
    return results
