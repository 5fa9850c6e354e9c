"""``python -m bench``: start (or pick) the servers, run the measurements,
print the table and write ``bench/results/latest.json``.

    python -m bench                 # full run, throwaway PostgreSQL + NATS (~15 min on 2 cores)
    python -m bench --quick         # smaller sizes, one repetition (~2 min)
    python -m bench --only relay    # one measurement (repeatable)
    python -m bench --only ratelimit        # the rate limit's accuracy across two worker processes
    python -m bench --only reconcile        # a reconciliation pass over a 1M-row outbox
    python -m bench --only topology-drain   # one part of the realistic topology (measure_topology.PARTS)
    python -m bench --machine       # the machine's servers on 127.0.0.1:5432 / :4222
    DATABASE_URL=... NATS_URL=... python -m bench   # given servers (a database of its own is created on them)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

from .harness import Result, Sizes, log

MEASUREMENTS = (
    "publish",
    "relay",
    "handle",
    "latency",
    "backlog",
    "topology",
    "tasks",
    "trickle",
    "ratelimit",
    "reconcile",
)
#: One part of the topology alone: ``--only topology-drain`` (see measure_topology.PARTS).
TOPOLOGY_PARTS = tuple(f"topology-{p}" for p in ("latency", "drain", "processes", "isolation", "rss", "idle"))
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="Small sizes and one repetition: a smoke run of about 2 minutes."
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=MEASUREMENTS + TOPOLOGY_PARTS,
        metavar="NAME",
        help=f"Run only this measurement (repeatable): {', '.join(MEASUREMENTS + TOPOLOGY_PARTS)}.",
    )
    parser.add_argument(
        "--machine",
        action="store_true",
        help="Use the machine's PostgreSQL (127.0.0.1:5432) and NATS (127.0.0.1:4222) instead of throwaway servers; DATABASE_URL / NATS_URL win over both.",
    )
    parser.add_argument(
        "--json",
        default=str(RESULTS_DIR / "latest.json"),
        metavar="PATH",
        help="Where to write the results (default: bench/results/latest.json).",
    )
    return parser.parse_args(argv)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "events/s":
        return f"{value:,.0f}/s"
    if unit == "handlings/s":
        return f"{value:,.0f} handlings/s"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "s":
        return f"{value:.1f} s"
    if unit == "MiB":
        return f"{value:.1f} MiB"
    if unit == "starts":
        return f"{value:.0f} starts"
    return f"{value:.3g} {unit}"


def table(results: list[Result]) -> str:
    header = ["what", "ours", "floor / competitor", "ratio", "target", "met?"]
    rows = []
    for r in results:
        floor = f"{_fmt(r.floor, r.unit)} ({r.floor_what})" if r.floor is not None else (r.floor_what or "-")
        met = {True: "yes", False: "NO", None: "-"}[r.met]
        rows.append(
            [r.what, _fmt(r.ours, r.unit), floor, f"{r.ratio:.2f}x" if r.ratio is not None else "-", r.target, met]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in (
        "django",
        "psycopg",
        "nats-py",
        "procrastinate",
        "pgqueuer",
        "asyncpg",
        "django-tasks-db",
        "celery",
        "redis",
    ):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = Sizes.quick() if args.quick else Sizes()
    chosen = args.only or list(MEASUREMENTS)
    from . import services as services_module

    started = time.time()
    log("starting services")
    services = services_module.start(machine=args.machine)
    os.environ.update(services.env())
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    results: list[Result] = []
    errors: dict[str, str] = {}
    meta: dict = {}
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django_platformkit.broker.transport import Transport

        from .harness import scalar

        transport = Transport(name="bench")
        transport.connect()
        transport.ensure_stream()

        async def delete_stream() -> None:
            from django_platformkit import conf

            await transport.connection.js.delete_stream(conf.settings.STREAM)

        meta = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "quick": args.quick,
            "measurements": chosen,
            "sizes": vars(sizes),
            "services": services.origin,
            "postgres": scalar("SHOW server_version"),
            "nats": transport.connection.server_info.get("version"),
            "fsync": scalar("SHOW fsync"),
            "synchronous_commit": scalar("SHOW synchronous_commit"),
            "cpus": os.cpu_count(),
            "versions": _versions(),
        }
        log(
            f"postgres {meta['postgres']} ({services.origin['postgres']}), nats {meta['nats']} ({services.origin['nats']})"
        )
        meta["load"] = {}
        for name in chosen:
            load_before, began = os.getloadavg()[0], time.monotonic()
            try:
                results += _run(name, sizes, transport)
            except Exception:
                errors[name] = traceback.format_exc()
                log(f"{name} FAILED:\n{errors[name]}")
            # Other processes on the machine skew every figure (the ratios less):
            # say how busy it was, so a reader can tell noise from a regression.
            meta["load"][name] = {
                "loadavg_1min_before": load_before,
                "loadavg_1min_after": os.getloadavg()[0],
                "seconds": round(time.monotonic() - began, 1),
            }
        try:
            transport.connection.call(delete_stream(), timeout=60)
        finally:
            transport.close()
            from django.db import connections

            connections.close_all()
    finally:
        services.cleanup()
    meta["seconds"] = round(time.time() - started, 1)
    print()
    print(table(results))
    missed = [r for r in results if r.met is False]
    print(
        f"\n{len(results)} rows, {sum(r.met is True for r in results)} targets met, {len(missed)} missed"
        + (f", {len(errors)} measurements failed: {', '.join(errors)}" if errors else "")
    )
    for r in results:
        if r.note:
            print(f"  {r.key}: {r.note}")
    if "trickle" in chosen:
        from .measure_trickle import REPORT

        print("\n" + "\n\n".join(REPORT))
    if missed:
        print(
            "missed: "
            + ", ".join(
                f"{r.key} ({_fmt(r.ours, r.unit) if r.ratio is None else f'{r.ratio:.2f}x'} vs {r.target})"
                for r in missed
            )
        )
    busy = {name: max(v["loadavg_1min_before"], v["loadavg_1min_after"]) for name, v in meta.get("load", {}).items()}
    print(
        "load average (1 min) around each measurement: "
        + ", ".join(f"{k} {v:.1f}" for k, v in busy.items())
        + f" on {os.cpu_count()} CPUs"
    )
    if any(v > (os.cpu_count() or 1) for v in busy.values()):
        print(
            "  the machine was busy with other work during this run: absolute figures are low and noisy, latency most of all"
        )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"meta": meta, "results": [r.as_dict() for r in results], "errors": errors}, indent=2, default=str)
    )
    print(f"\nwrote {path} ({meta['seconds']}s)")
    return 1 if errors else 0


def _run(name: str, sizes: Sizes, transport) -> list[Result]:
    if name == "publish":
        from .measure_publish import run_publish

        return run_publish(sizes)
    if name == "relay":
        from .measure_relay import run_relay

        return run_relay(sizes, transport)
    if name == "handle":
        from .measure_handle import run_handle

        return run_handle(sizes, transport)
    if name == "latency":
        from .measure_latency import run_latency

        return run_latency(sizes, transport)
    if name == "backlog":
        from .measure_backlog import run_backlog

        return run_backlog(sizes, transport)
    if name == "topology" or name.startswith("topology-"):
        from .measure_topology import PARTS, run_topology

        return run_topology(sizes, transport, PARTS if name == "topology" else (name.split("-", 1)[1],))
    if name == "tasks":  # django.tasks through the outbox (bench/measure_tasks.py)
        return __import__("bench.measure_tasks", fromlist=["run_tasks"]).run_tasks(sizes, transport)
    if name == "trickle":  # the peers at 200/s and 50/s (bench/measure_trickle.py)
        from .measure_trickle import run_trickle

        return run_trickle(sizes, transport)
    if name == "ratelimit":
        from .measure_ratelimit import run_ratelimit

        return run_ratelimit(sizes, transport)
    if name == "reconcile":
        from .measure_reconcile import run_reconcile

        return run_reconcile(sizes, transport)
    raise ValueError(name)


if __name__ == "__main__":
    sys.exit(main())
