"""Where a trickle's CPU goes (issue 29: why 50/s costs more per handling
than 200/s): the topology worker (bench/instrumented_worker.py) idle, at
50/s and at 200/s, CPU per second of each of its threads, of nats-server
and of PostgreSQL, with the relay's passes, the consumer's units and the
NATS messages per event; optionally py-spy and strace per phase.

    python -m bench.profile_trickle                      # the installed tree, 2 reps, 10 s phases
    python -m bench.profile_trickle --tree /tmp/base --tree .   # A/B: trees alternate within each rep
    python -m bench.profile_trickle --py-spy DIR --strace DIR   # per phase: py-spy --gil raw, strace -c -f

A tree is a folder holding a ``django_platformkit`` package: the worker is
started with it first on ``PYTHONPATH`` (``git archive BASE django_platformkit
| tar -x -C /tmp/base`` makes one). Throwaway PostgreSQL and NATS as
``python -m bench``; ``DATABASE_URL``/``NATS_URL`` win.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import ROOT, log

#: (label, events per second, events per transaction): "50/s pairs" publishes the
#: same 50 events/s as 25 transactions of two, so the relay passes and units
#: carry two events as they do at 200/s, at the same event rate as "50/s".
PHASES = (("idle", 0.0, 1), ("50/s", 50.0, 1), ("50/s pairs", 50.0, 2), ("200/s", 200.0, 1))


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed) of ``pid``, from /proc/<pid>/task;
    and, under ``"switches <name>"``, each name's context switches (voluntary + involuntary)."""
    from .measure_trickle import CLK_TCK

    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name.startswith("consumer-"):
            name = "consumer-*"
        elif name.startswith("relay-lane"):
            name = "relay-lane-*"
        elif name == "python" and tid != str(pid):
            name = "python (unnamed)"
        elif tid == str(pid):
            name = "main"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
        out[f"stime {name}"] = out.get(f"stime {name}", 0.0) + int(fields[12]) / CLK_TCK
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:
            continue
        out[f"switches {name}"] = out.get(f"switches {name}", 0) + switches
    return out


class Worker:
    def __init__(self, tree: Path | None, stats_file: Path) -> None:
        from .harness import child_env
        from .measure_topology import TopologyWorker

        env = child_env(BENCH_TOPOLOGY="1", BENCH_STATS_FILE=str(stats_file))
        if tree is not None:
            env["PYTHONPATH"] = f"{tree}:{ROOT}"
        self.stats_file = stats_file
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "instrumented_worker.py"), "runworker", "-v", "0"], env=env, cwd=ROOT
        )
        self.topology = TopologyWorker.__new__(TopologyWorker)
        self.topology.process = self.process
        from .benchapp.platformkit import topo_idle_subscriptions

        self.topology.idle = topo_idle_subscriptions()

    def stats(self) -> dict:
        self.stats_file.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not self.stats_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the instrumented worker wrote no stats")
            time.sleep(0.02)
        time.sleep(0.02)
        return json.loads(self.stats_file.read_text())

    def stop(self) -> None:
        self.topology.stop()


PERF_EVENTS = (
    "syscalls:sys_enter_futex",
    "syscalls:sys_enter_sendto",
    "syscalls:sys_enter_write",
    "syscalls:sys_enter_writev",
    "syscalls:sys_enter_epoll_pwait",
    "syscalls:sys_enter_poll",
    "context-switches",
)


def _phase(
    worker: Worker,
    rate: float,
    seconds: float,
    meter,
    spy: Path | None,
    trace: Path | None,
    tag: str,
    perf: bool = False,
    per_tx: int = 1,
) -> dict:
    from django.db import transaction

    from django_platformkit import publish, publish_many

    from .benchapp.platformkit import TOPO_HOT
    from .harness import scalar, sql
    from .measure_topology import HOT_KINDS

    sql("DELETE FROM bench_sink")
    helpers = []
    if spy is not None:
        helpers.append(
            subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "--gil",
                    "-r",
                    "200",
                    "-d",
                    str(int(seconds)),
                    "-f",
                    "raw",
                    "-p",
                    str(worker.process.pid),
                    "-o",
                    str(spy / f"{tag}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    if trace is not None:
        helpers.append(
            subprocess.Popen(
                [
                    "timeout",
                    "-s",
                    "INT",
                    str(seconds),
                    "strace",
                    "-c",
                    "-f",
                    "-p",
                    str(worker.process.pid),
                    "-o",
                    str(trace / f"{tag}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    perf_out = Path(tempfile.mkdtemp(prefix="bench-perf-")) / "perf.csv"
    if perf:
        helpers.append(
            subprocess.Popen(
                [
                    "perf",
                    "stat",
                    "-x",
                    ",",
                    "-e",
                    ",".join(PERF_EVENTS),
                    "-p",
                    str(worker.process.pid),
                    "-o",
                    str(perf_out),
                    "--",
                    "sleep",
                    str(seconds),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    if helpers:
        time.sleep(0.2 if perf and not (spy or trace) else 1.0)  # attached before the window
    stats0, threads0, servers0, t0 = worker.stats(), _thread_cpu(worker.process.pid), meter(), time.monotonic()
    count = int(rate * seconds) // per_tx * per_tx
    started = time.perf_counter()
    for n in range(0, count, per_tx):
        wait = started + n / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with transaction.atomic():
            if per_tx == 1:
                publish(TOPO_HOT, {"n": n, "sku": f"sku-{n}"})
            else:
                publish_many(TOPO_HOT, [{"n": n + i, "sku": f"sku-{n + i}"} for i in range(per_tx)])
    if count:
        deadline = time.monotonic() + 60
        while scalar("SELECT count(*) FROM bench_sink WHERE kind = ANY(%s)", [list(HOT_KINDS)]) < 2 * count:
            if time.monotonic() > deadline:
                raise RuntimeError("not every event was handled within 60 s")
            time.sleep(0.05)
    else:
        time.sleep(max(0.0, seconds - (time.perf_counter() - started)))
    elapsed = time.monotonic() - t0
    stats1, threads1, servers1 = worker.stats(), _thread_cpu(worker.process.pid), meter()
    for helper in helpers:
        helper.wait(seconds + 30)
    perf_counts = {}
    if perf and perf_out.exists():
        for line in perf_out.read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[0].strip().isdigit():
                perf_counts["perf " + parts[2].removeprefix("syscalls:sys_enter_")] = int(parts[0])
    return {
        "perf": perf_counts,
        "rate": rate,
        "events": count,
        "seconds": elapsed,
        "threads": {
            k: threads1[k] - threads0.get(k, 0.0) for k in threads1 if not k.startswith(("switches ", "stime "))
        },
        "stime": {k[6:]: threads1[k] - threads0.get(k, 0.0) for k in threads1 if k.startswith("stime ")},
        "switches": {k[9:]: threads1[k] - threads0.get(k, 0) for k in threads1 if k.startswith("switches ")},
        "servers": {k: servers1[k] - servers0[k] for k in servers1},
        "counts": {k: stats1[k] - stats0[k] for k in stats1 if isinstance(stats1[k], int)},
    }


def _floor(rates: tuple[float, ...], seconds: float, reps: int) -> list[str]:
    """The machine's own price of a trickle: the handler alone (one ORM create
    per ``atomic()``) paced at each rate in this process, CPU per insert of
    this process (``time.process_time``) and of its PostgreSQL backend."""
    from django.db import connection, transaction

    from .benchapp.models import Sink
    from .measure_trickle import CLK_TCK, _stat

    connection.ensure_connection()
    backend = connection.connection.info.backend_pid
    samples: dict[float, list[tuple[float, float]]] = {r: [] for r in rates}
    for _ in range(reps):
        for rate in rates:
            count = int(rate * seconds)
            pg0, cpu0 = sum(int(x) for x in _stat(backend)[11:13]) / CLK_TCK, time.process_time()
            started = time.perf_counter()
            for n in range(count):
                wait = started + n / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                with transaction.atomic():
                    Sink.objects.create(kind="floor", event_id=str(n), occurred_at=None)
            cpu = time.process_time() - cpu0
            pg = sum(int(x) for x in _stat(backend)[11:13]) / CLK_TCK - pg0
            samples[rate].append((1000 * cpu / count, 1000 * pg / count))
    lines = ["the handler alone, paced in one thread (medians): CPU per insert, this process / its PostgreSQL backend"]
    for rate, values in samples.items():
        lines.append(
            f"  {rate:g}/s: {statistics.median(v[0] for v in values):.3f} ms / {statistics.median(v[1] for v in values):.3f} ms"
            f" (samples {', '.join(f'{a:.3f}/{b:.3f}' for a, b in values)})"
        )
    return lines


def _report(label: str, phases: dict[str, list[dict]]) -> list[str]:
    lines = [f"{label}: medians over reps; CPU in % of one core (ms of CPU per second), per event in ms"]
    names = sorted({n for runs in phases.values() for r in runs for n in r["threads"]})
    header = ["phase", "worker total", *names, "nats-server", "postgres", "worker ms/handling", "nats ms/event"]
    header += ["relay passes/s", "rows/pass", "units/s", "deliveries/unit", "nats msgs in/s", "nats msgs out/s"]
    rows = []
    totals = {}
    for phase, runs in phases.items():

        def med(f) -> float:
            return statistics.median(f(r) for r in runs)

        total = med(lambda r: sum(r["threads"].values()) / r["seconds"])
        totals[phase] = (runs[0]["rate"], total)
        row = [phase, f"{100 * total:.1f}"]
        row += [f"{100 * med(lambda r, n=n: r['threads'].get(n, 0.0) / r['seconds']):.1f}" for n in names]
        row += [f"{100 * med(lambda r, k=k: r['servers'][k] / r['seconds']):.1f}" for k in ("nats", "postgres")]
        rate = runs[0]["rate"]
        row.append(f"{1000 * total / (2 * rate):.2f}" if rate else "-")
        row.append(f"{1000 * med(lambda r: r['servers']['nats'] / r['seconds']) / rate:.2f}" if rate else "-")
        c = lambda key: med(lambda r, key=key: r["counts"].get(key, 0) / r["seconds"])  # noqa: E731
        row += [f"{c('relay_passes'):.1f}", f"{c('relay_rows') / max(1e-9, c('relay_passes')):.2f}"]
        row += [f"{c('units'):.1f}", f"{c('deliveries') / max(1e-9, c('units')):.2f}"]
        row += [f"{c('nats_in_msgs'):.0f}", f"{c('nats_out_msgs'):.0f}"]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    for phase, runs in phases.items():
        rate = runs[0]["rate"]
        per = lambda v, r: v / (r["events"] or r["seconds"])  # noqa: E731
        unit = "per event" if rate else "per second"
        sw = {n: statistics.median(per(r["switches"].get(n, 0), r) for r in runs) for n in runs[0]["switches"]}
        if rate:
            st = {
                n: statistics.median(r["stime"].get(n, 0.0) / max(1e-9, r["threads"].get(n, 0.0)) for r in runs)
                for n in runs[0]["stime"]
                if runs[0]["threads"].get(n)
            }
            lines.append(
                f"  {phase}: system (kernel) share of each thread's CPU "
                + ", ".join(f"{n} {100 * v:.0f}%" for n, v in sorted(st.items()) if v)
            )
        pf = {n: statistics.median(per(r.get("perf", {}).get(n, 0), r) for r in runs) for n in runs[0].get("perf", {})}
        lines.append(
            f"  {phase} {unit}: context switches "
            + ", ".join(f"{n} {v:.1f}" for n, v in sorted(sw.items()) if v)
            + ("; perf: " + ", ".join(f"{n} {v:.1f}" for n, v in pf.items()) if pf else "")
        )
    if "idle" in totals:
        fixed = totals["idle"][1]
        for phase, (rate, total) in totals.items():
            if rate:
                lines.append(
                    f"  {phase}: fixed {1000 * fixed:.1f} ms/s = {1000 * fixed / (2 * rate):.3f} ms per handling; "
                    f"marginal {1000 * (total - fixed) / (2 * rate):.3f} ms per handling above idle"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_trickle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tree", action="append", type=Path, help="A folder holding django_platformkit/ (repeatable: A/B)"
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0, help="Each phase's window (default 10)")
    parser.add_argument("--py-spy", type=Path, metavar="DIR", help="py-spy record --gil -f raw per phase into DIR")
    parser.add_argument("--strace", type=Path, metavar="DIR", help="strace -c -f per phase into DIR")
    parser.add_argument(
        "--perf",
        action="store_true",
        help="perf stat: syscalls and context switches per phase (perf's own window: the phase's first N seconds)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="Also the handler alone paced at 50/s and 200/s (the machine's price of a trickle)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "profile_trickle.json")
    args = parser.parse_args(argv)
    trees: list[Path | None] = [t.resolve() for t in args.tree] if args.tree else [None]
    for d in (args.py_spy, args.strace):
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)

    from . import services as services_module

    services = services_module.start(machine=False)
    os.environ.update(services.env())
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    results: dict[str, dict[str, list[dict]]] = {str(t): {p: [] for p, _, _ in PHASES} for t in trees}
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django_platformkit.broker.transport import Transport

        from .measure_topology import _reset
        from .measure_trickle import Meter, _find, _monitor, _stat

        transport = Transport(name="bench")
        transport.connect()
        transport.ensure_stream()
        from urllib.parse import urlsplit

        from django_platformkit import conf

        nats_pid = _find("nats-server", urlsplit(conf.settings.NATS_URL).port or 4222)
        mon = _monitor()
        backend = mon.execute("SELECT pg_backend_pid()").fetchone()[0]
        meter = Meter(postmaster=int(_stat(backend)[1]), monitor_backend=backend, nats=nats_pid, redis=None)

        def servers() -> dict[str, float]:
            return meter.sample([])

        floor = _floor((50.0, 200.0), args.seconds, args.reps) if args.floor else []
        stats_file = Path(tempfile.mkdtemp(prefix="bench-profile-")) / "stats.json"
        for rep in range(args.reps):
            for tree in trees:
                _reset(transport)
                worker = Worker(tree, stats_file)
                try:
                    worker.topology.warm_up()
                    time.sleep(2.0)
                    order = PHASES if rep % 2 == 0 else PHASES[::-1]
                    for phase, rate, per_tx in order:
                        log(
                            f"profile rep {rep + 1}/{args.reps} tree {tree or 'installed'}: {phase} for {args.seconds:g}s"
                        )
                        tag = f"{(tree.name if tree else 'installed')}-{phase.replace('/', '').replace(' ', '-')}-{rep}"
                        result = _phase(
                            worker, rate, args.seconds, servers, args.py_spy, args.strace, tag, args.perf, per_tx
                        )
                        results[str(tree)][phase].append(result)
                        log(
                            f"  worker {100 * sum(result['threads'].values()) / result['seconds']:.1f}% "
                            + " ".join(
                                f"{k}={100 * v / result['seconds']:.1f}"
                                for k, v in sorted(result["threads"].items())
                                if v
                            )
                            + f" | nats {100 * result['servers']['nats'] / result['seconds']:.1f}% pg {100 * result['servers']['postgres'] / result['seconds']:.1f}%"
                            + f" | {result['counts']}"
                        )
                finally:
                    worker.stop()
        mon.close()
        transport.close()
    finally:
        services.cleanup()
    print()
    if floor:
        print("\n".join(floor) + "\n")
    for tree, phases in results.items():
        print("\n".join(_report(f"tree {tree if tree != 'None' else 'installed'}", phases)))
        print()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
