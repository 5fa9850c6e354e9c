"""8: the realistic topology (issue 11): one ``runworker`` serving 24
subscriptions - two on the hot event, one kept busy by a backlog of slow
events, 21 idle - and two periodic jobs, every handler one ORM insert.

Rows (``--only topology`` for all, or one part: ``topology-latency``,
``topology-drain``, ``topology-processes``, ``topology-isolation``,
``topology-rss``, ``topology-idle``):

- commit -> handler start on the hot event at a steady 200/s and 1,000/s
  (database clock at both ends: the outbox row's ``created_at`` and the sink
  row's ``clock_timestamp()``), and the worker's CPU per handling at 200/s
  (``/proc/<pid>/stat`` of the worker and its children) against the handler
  alone (the same ORM insert, one per ``atomic()``, in this process); and,
  for information, the 1,000/s rate again with ``runworker --processes 2``;
- draining 10,000 events x 2 subscriptions against (a) the handler alone,
  100 per transaction, and (b) the naive exactly-once loop: nats-py pull of
  256, per message one psycopg transaction with the claim and the insert,
  one ack each - both in the same run;
- ``runworker --processes auto`` (one consumer process per usable core)
  against one process over the same drain, and against pgqueuer with two
  worker processes (batch size 100, the same ORM handler, two jobs per
  event) draining the same number of events;
- a 30 x 1 s backlog on one subscription: the delay of pings to every other;
- worker RSS over a 1,000,000-row backlog, idle CPU with 100 idle subscriptions.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

from django.db import transaction

from django_platformkit import publish, publish_many
from django_platformkit.wire import durable_name, filter_subject_for

from .benchapp.platformkit import (
    TOPO_HOT,
    TOPO_HOT_SUBSCRIPTIONS,
    TOPO_PING,
    TOPO_SLOW,
    TOPO_SLOW_SUBSCRIPTION,
    topo_idle_subscriptions,
)
from .harness import (
    ROOT,
    Result,
    Sizes,
    child_env,
    fill_outbox,
    log,
    manage,
    reset_broker,
    reset_tables,
    rss_kib,
    scalar,
    sql,
)

PARTS = ("latency", "drain", "processes", "isolation", "rss", "idle")
HOT_KINDS = tuple(s.rsplit(".", 1)[1] for s in TOPO_HOT_SUBSCRIPTIONS)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], q: float) -> float:
    index = max(0, min(len(values) - 1, int(round(q / 100 * len(values) + 0.5)) - 1))
    return sorted(values)[index]


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# --- processes -------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its descendants (all threads), seconds."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        except OSError:
            continue
        stack += _children(p)
    return total


def tree_rss_kib(pid: int) -> tuple[int, int]:
    """(sum of VmRSS, sum of VmHWM) over ``pid`` and its descendants, KiB."""
    rss = hwm = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            r, h = rss_kib(p)
        except OSError:
            continue
        rss, hwm = rss + r, hwm + h
        stack += _children(p)
    return rss, hwm


class TopologyWorker:
    """``runworker`` with the topology declared (all 24 subscriptions, both jobs, the relay)."""

    def __init__(self, *args: str, idle: int | None = None) -> None:
        env = {"BENCH_TOPOLOGY": "1"}
        if idle is not None:
            env["BENCH_IDLE_SUBSCRIPTIONS"] = str(idle)
        self.idle = topo_idle_subscriptions(idle) if idle is not None else topo_idle_subscriptions()
        self.process = manage("runworker", "-v", "0", *args, env=env)

    def warm_up(self, timeout: float = 120.0) -> None:
        """Until one hot event and one ping went all the way through every
        subscription (durables created, connections open)."""
        kinds = [*HOT_KINDS, *(s.rsplit(".", 1)[1] for s in self.idle)]
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the topology worker exited {self.process.returncode} during warm-up")
            with transaction.atomic():
                publish(TOPO_HOT, {"warm": True})
                publish(TOPO_PING, {"warm": True})
            time.sleep(0.5)
            seen = scalar("SELECT count(DISTINCT kind) FROM bench_sink WHERE kind = ANY(%s)", [kinds])
            if seen == len(kinds):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"warm-up: {seen} of {len(kinds)} subscriptions handled an event within {timeout:g}s"
                )
        time.sleep(1.0)
        sql("DELETE FROM bench_sink")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _reset(transport, idle: int | None = None) -> None:
    subs = [*TOPO_HOT_SUBSCRIPTIONS, TOPO_SLOW_SUBSCRIPTION, *topo_idle_subscriptions(idle or 100)]
    reset_tables()
    reset_broker(transport, *(durable_name(s) for s in subs), "naive_a", "naive_b")


# --- the parts -------------------------------------------------------------------


def _paced_publish(rate: float, seconds: float, per_transaction: int) -> float:
    """Publish ``rate`` hot events/s for ``seconds``, ``per_transaction`` per
    ``atomic()``; the rate achieved."""
    count = int(rate * seconds) // per_transaction
    interval = per_transaction / rate
    started = time.perf_counter()
    for n in range(count):
        wait = started + n * interval - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        with transaction.atomic():
            if per_transaction == 1:
                publish(TOPO_HOT, {"n": n, "sku": f"sku-{n}"})
            else:  # one INSERT: a single publisher process can't write 1,000 transactions/s beside the worker on 2 cores
                publish_many(
                    TOPO_HOT, [{"n": n * per_transaction + i, "sku": f"sku-{n}"} for i in range(per_transaction)]
                )
    return count * per_transaction / (time.perf_counter() - started)


def _relay_share(since) -> str:
    """Where the p50 went: created -> stamped by the relay (after the
    broker's ack) and stamped -> handler start, each a median in ms."""
    relay, after = sql(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM o.published_at - o.created_at) * 1000), "
        "percentile_cont(0.5) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM s.at - o.published_at) * 1000) "
        "FROM bench_sink s JOIN platformkit_outbox o ON o.id::text = s.event_id "
        "WHERE s.kind = ANY(%s) AND s.occurred_at >= %s",
        [list(HOT_KINDS), since],
        fetch=True,
    )[0]
    return f"medians: commit -> relay stamp {float(relay):.1f} ms, stamp -> handler start {float(after):.1f} ms"


def _latencies(since) -> list[float]:
    rows = sql(
        "SELECT EXTRACT(EPOCH FROM at - occurred_at) * 1000 FROM bench_sink WHERE kind = ANY(%s) AND occurred_at >= %s",
        [list(HOT_KINDS), since],
        fetch=True,
    )
    return [float(r[0]) for r in rows]


def _handler_alone_cpu_per_handling(n: int = 2000) -> float:
    """CPU seconds of one ``Sink.objects.create`` in an ``atomic()`` of its own, in this process."""
    from .benchapp.models import Sink

    started = time.process_time()
    for i in range(n):
        with transaction.atomic():
            Sink.objects.create(kind="alone_cpu", event_id=str(i), occurred_at=None)
    return (time.process_time() - started) / n


def _steady(
    worker: TopologyWorker, sizes: Sizes, rate: float, per_tx: int, what: str
) -> tuple[list[float], float, float]:
    """Publish the hot event at ``rate``/s for the window and wait for every
    handling: (latencies in ms, publish rate achieved, worker tree CPU seconds)."""
    since = scalar("SELECT clock_timestamp()")
    cpu_before = tree_cpu_seconds(worker.process.pid)
    log(
        f"topology latency: hot event at {rate:g}/s for {sizes.topo_window_seconds:g}s ({per_tx} per transaction), 24 subscriptions + 2 jobs in {what}"
    )
    achieved = _paced_publish(rate, sizes.topo_window_seconds, per_tx)
    expected = 2 * int(rate * sizes.topo_window_seconds) // per_tx * per_tx
    _wait_for(lambda: len(_latencies(since)) >= expected, 180, f"{expected} hot handlings")
    cpu = tree_cpu_seconds(worker.process.pid) - cpu_before
    log(f"topology latency at {rate:g}/s, {what}: {_relay_share(since)}")
    return _latencies(since), achieved, cpu


def _latency_with_processes(sizes: Sizes, transport) -> list[Result]:
    """The 1,000/s row again with ``runworker --processes 2`` (info: the lever for a rate one process can't carry)."""
    if not _processes_supported():
        return []
    _reset(transport)
    worker = TopologyWorker("--processes", "2")
    try:
        worker.warm_up()
        values, achieved, _ = _steady(worker, sizes, 1000.0, 10, "runworker --processes 2")
    finally:
        worker.stop()
    return [
        Result(
            f"topo_latency_1000_{q}_processes2",
            f"(info) topology: commit -> handler start {q} at 1,000/s, --processes 2",
            _percentile(values, int(q[1:])),
            "ms",
            target="info",
            note=f"{len(values)} handlings, publish rate achieved {achieved:.0f}/s",
        )
        for q in ("p50", "p99")
    ]


def part_latency(sizes: Sizes, transport) -> list[Result]:
    _reset(transport)
    worker = TopologyWorker()
    results: list[Result] = []
    try:
        worker.warm_up()
        for rate, per_tx, p50_target, p99_target in ((200.0, 1, 10.0, 50.0), (1000.0, 10, 50.0, None)):
            values, achieved, cpu = _steady(worker, sizes, rate, per_tx, "one worker")
            p50, p99 = _percentile(values, 50), _percentile(values, 99)
            label = f"{rate:,.0f}/s"
            note = f"PostgreSQL fsync={scalar('SHOW fsync')} synchronous_commit={scalar('SHOW synchronous_commit')} (as every row of this bench); {len(values)} handlings, publish rate achieved {achieved:.0f}/s ({per_tx} per transaction), max {max(values):.1f} ms"
            results.append(
                Result(
                    f"topo_latency_{int(rate)}_p50",
                    f"topology: commit -> handler start p50 at {label}",
                    p50,
                    "ms",
                    target=f"< {p50_target:g} ms",
                    met=p50 < p50_target,
                    note=note,
                    detail={"samples": len(values), "achieved": achieved},
                )
            )
            results.append(
                Result(
                    f"topo_latency_{int(rate)}_p99",
                    f"topology: commit -> handler start p99 at {label}",
                    p99,
                    "ms",
                    target=f"< {p99_target:g} ms" if p99_target else "info",
                    met=(p99 < p99_target) if p99_target else None,
                )
            )
            if rate == 200.0:
                per_handling = cpu / len(values)
                alone = _handler_alone_cpu_per_handling()
                ratio = per_handling / alone
                results.append(
                    Result(
                        "topo_cpu_per_handling",
                        "topology: worker CPU per handling at 200/s",
                        per_handling * 1000,
                        "ms",
                        floor=alone * 1000,
                        floor_what="the handler alone: ORM create in its own atomic()",
                        ratio=ratio,
                        target="<= 2x",
                        met=ratio <= 2.0,
                        note=f"worker tree CPU {cpu:.2f}s over {len(values)} handlings (relay, scheduler, 22 idle pulls included)",
                    )
                )
                sql("DELETE FROM bench_sink WHERE kind = 'alone_cpu'")
    finally:
        worker.stop()
    return results + _latency_with_processes(sizes, transport)


def _drain_rate(kinds: list[str], expected: int, timeout: float = 600) -> tuple[float, float]:
    """(handlings/s over first-to-last handler run on the database clock, wall seconds waited)."""
    started = time.monotonic()
    _wait_for(
        lambda: scalar("SELECT count(*) FROM bench_sink WHERE kind = ANY(%s)", [kinds]) >= expected,
        timeout,
        f"{expected} handlings",
        interval=0.25,
    )
    count, span = sql(
        "SELECT count(*), EXTRACT(EPOCH FROM max(at) - min(at)) FROM bench_sink WHERE kind = ANY(%s)",
        [kinds],
        fetch=True,
    )[0]
    return (count - 1) / float(span), time.monotonic() - started


def _ours_drain(sizes: Sizes, transport, *args: str, seen: dict | None = None) -> float:
    """Handlings/s; ``seen`` gets ``children``: the worker's child processes after warm-up."""
    _reset(transport)
    worker = TopologyWorker(*args)
    try:
        worker.warm_up()
        if seen is not None:
            seen["children"] = len(_children(worker.process.pid))
        log(
            f"topology drain: {sizes.topo_drain_events:,} hot events x 2 subscriptions, runworker {' '.join(args) or '(defaults)'}"
        )
        fill_outbox(TOPO_HOT.name, sizes.topo_drain_events)
        sql("SELECT pg_notify('platformkit_outbox', '')")
        rate, _ = _drain_rate(list(HOT_KINDS), 2 * sizes.topo_drain_events)
    finally:
        worker.stop()
    return rate


def _handler_alone_rate(events: int) -> float:
    from .benchapp.models import Sink

    sql("DELETE FROM bench_sink WHERE kind = 'alone'")
    for start in range(0, events, 100):
        with transaction.atomic():
            for i in range(start, min(events, start + 100)):
                Sink.objects.create(kind="alone", event_id=str(i), occurred_at=None)
    count, span = sql(
        "SELECT count(*), EXTRACT(EPOCH FROM max(at) - min(at)) FROM bench_sink WHERE kind = 'alone'", fetch=True
    )[0]
    return (count - 1) / float(span)


def _naive_rate(events: int) -> float:
    """The naive exactly-once loop over the hot events already in the stream:
    two durables (one per subscription), each a nats-py pull of 256 and, per
    message, one psycopg transaction with the claim and the insert, then one ack."""
    import nats
    import psycopg
    from django.db import connection
    from nats.js import api

    from django_platformkit import conf

    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    stream = conf.settings.STREAM

    async def consume(js, durable: str, kind: str) -> None:
        sub = await js.pull_subscribe(
            filter_subject_for(TOPO_HOT.name),
            durable=durable,
            stream=stream,
            config=api.ConsumerConfig(
                ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL, max_ack_pending=10_000
            ),
        )
        async with await psycopg.AsyncConnection.connect(**params, autocommit=True) as conn:
            handled = 0
            while handled < events:
                try:
                    msgs = await sub.fetch(256, timeout=2)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    body = json.loads(msg.data)
                    async with conn.transaction():
                        claimed = await (
                            await conn.execute(
                                "INSERT INTO platformkit_handled (subscription, event_id, handled_at) VALUES (%s, %s, now()) ON CONFLICT DO NOTHING RETURNING 1",
                                [durable, body["id"]],
                            )
                        ).fetchone()
                        if claimed:
                            await conn.execute(
                                "INSERT INTO bench_sink (kind, event_id, occurred_at, at) VALUES (%s, %s, NULL, clock_timestamp())",
                                [kind, body["id"]],
                            )
                    await msg.ack()
                    if "warm" not in body["data"]:
                        handled += 1

    async def main() -> None:
        nc = await nats.connect(conf.settings.NATS_URL)
        try:
            js = nc.jetstream()
            await asyncio.gather(consume(js, "naive_a", "naive_a"), consume(js, "naive_b", "naive_b"))
        finally:
            await nc.close()

    asyncio.run(main())
    count, span = sql(
        "SELECT count(*), EXTRACT(EPOCH FROM max(at) - min(at)) FROM bench_sink WHERE kind IN ('naive_a', 'naive_b')",
        fetch=True,
    )[0]
    return (count - 1) / float(span)


def part_drain(sizes: Sizes, transport) -> tuple[list[Result], float]:
    ours = _ours_drain(sizes, transport)
    # The stream now holds the drain's events (and the warm-up's): the naive loop reads the same messages.
    log("topology drain: the naive exactly-once loop (nats-py + psycopg) over the same messages")
    naive = _naive_rate(sizes.topo_drain_events)
    log("topology drain: the handler alone, 100 ORM creates per transaction")
    alone = _handler_alone_rate(2 * sizes.topo_drain_events)
    events = f"{sizes.topo_drain_events:,} x 2"
    return [
        Result(
            "topo_drain_vs_alone",
            f"topology: drain {events}, default settings",
            ours,
            "events/s",
            floor=alone,
            floor_what="the handler alone, 100 ORM creates per atomic()",
            ratio=ours / alone,
            target=">= 0.75x",
            met=ours / alone >= 0.75,
        ),
        Result(
            "topo_drain_vs_naive",
            f"topology: drain {events}, default settings",
            ours,
            "events/s",
            floor=naive,
            floor_what="naive loop: fetch 256, claim+insert per tx, ack each",
            ratio=ours / naive,
            target=">= 1.2x",
            met=ours / naive >= 1.2,
        ),
    ], ours


def _processes_supported(auto: bool = False) -> bool:
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "manage.py"), "runworker", "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
    ).stdout
    return "--processes" in help_text and (not auto or "N|auto" in help_text)


#: The peer of the processes part: pgqueuer, two worker processes, dequeues of 100.
PEER_PROCESSES = 2
PEER_BATCH_SIZE = 100


def _pgqueuer_drain(events: int) -> tuple[float, str] | None:
    """pgqueuer with ``PEER_PROCESSES`` worker processes (bench/peers/pgqueuer_app.py,
    ``--batch-size 100``) draining ``events`` x 2 jobs, each the same ORM insert as
    our subscriptions: (handlings/s over first-to-last handler run, note), None
    without pgqueuer. The backlog is enqueued in one transaction after warm-up,
    as ours is written to the outbox in one statement after warm-up."""
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return None
    import tempfile
    from pathlib import Path

    from .peers import handler, pgqueuer_app
    from .systems import Pgqueuer

    logs = Path(tempfile.mkdtemp(prefix="bench-topo-pgqueuer-"))
    system = Pgqueuer(logs, processes=PEER_PROCESSES, batch_size=PEER_BATCH_SIZE)
    system.reset()
    system.start()
    try:
        system.warm_up()
        log(
            f"topology processes: pgqueuer, {PEER_PROCESSES} worker processes, batch size {PEER_BATCH_SIZE}, "
            f"drains {events:,} events x 2 jobs"
        )
        pgqueuer_app.prepare()
        with transaction.atomic():
            for start in range(0, events, 1000):
                pgqueuer_app.enqueue_many([str(n) for n in range(start, min(events, start + 1000))])
        rate, _ = _drain_rate(list(handler.HOT_KINDS), 2 * events)
        system._check_alive()
        distinct = scalar(
            "SELECT count(DISTINCT (kind, event_id)) FROM bench_sink WHERE kind = ANY(%s)", [list(handler.HOT_KINDS)]
        )
        rows = scalar("SELECT count(*) FROM bench_sink WHERE kind = ANY(%s)", [list(handler.HOT_KINDS)])
    finally:
        system.stop()
    reset_tables("pgqueuer", "pgqueuer_log", "pgqueuer_statistics", "pgqueuer_schedules")
    return rate, f"pgqueuer: {rows:,} handler rows, {distinct:,} distinct (kind, event); logs {logs}"


def part_processes(sizes: Sizes, transport, one_process: float | None) -> list[Result]:
    events = sizes.topo_drain_events
    if not _processes_supported(auto=True):
        log("topology processes: runworker has no --processes auto in this build: skipped")
        return [
            Result(
                key,
                f"topology: runworker --processes auto{what}",
                None,
                "handlings/s",
                floor_what="skipped: runworker has no --processes auto in this build",
                target=target,
            )
            for key, what, target in (
                ("topo_processes", "", ">= 1.6x"),
                ("topo_processes_vs_peer", " vs pgqueuer, 2 processes", ">= 1.5x"),
            )
        ]
    from django_platformkit.runtime.supervisor import usable_cores

    if one_process is None:
        one_process = _ours_drain(sizes, transport)
    seen: dict = {}
    auto = _ours_drain(sizes, transport, "--processes", "auto", seen=seen)
    cores = usable_cores()
    started = (
        f"--processes auto started {cores} consumer process{'es' if cores != 1 else ''} "
        f"(usable cores: os.process_cpu_count() or the affinity mask; os.cpu_count() {os.cpu_count()}) "
        f"+ the relay/scheduler child; the worker had {seen.get('children', '?')} child processes after warm-up"
    )
    rows = [
        Result(
            "topo_processes",
            f"topology: drain {events:,} x 2, --processes auto",
            auto,
            "handlings/s",
            floor=one_process,
            floor_what="the same, one process",
            ratio=auto / one_process,
            target=">= 1.6x",
            met=auto / one_process >= 1.6,
            note=started,
            detail={"consumer_processes": cores, "children": seen.get("children")},
        )
    ]
    peer = _pgqueuer_drain(events)
    what = f"topology: drain {events:,} x 2, --processes auto vs pgqueuer, {PEER_PROCESSES} processes"
    if peer is None:
        log("topology processes: pgqueuer is not installed: the peer row is skipped")
        rows.append(
            Result(
                "topo_processes_vs_peer",
                what,
                auto,
                "handlings/s",
                floor_what="skipped: pgqueuer is not installed (pip install -e '.[bench]')",
                target=">= 1.5x",
            )
        )
        return rows
    pgq, pgq_note = peer
    rows.append(
        Result(
            "topo_processes_vs_peer",
            what,
            auto,
            "handlings/s",
            floor=pgq,
            floor_what=f"pgqueuer, {PEER_PROCESSES} worker processes, batch size {PEER_BATCH_SIZE}, same ORM handler",
            ratio=auto / pgq,
            target=">= 1.5x",
            met=auto / pgq >= 1.5,
            note=(
                f"events/s: ours {auto / 2:,.0f}, pgqueuer {pgq / 2:,.0f} (2 handlings per event: two subscriptions, "
                f"two jobs enqueued per event); {pgq_note}"
            ),
        )
    )
    return rows


def part_isolation(sizes: Sizes, transport) -> list[Result]:
    _reset(transport)
    worker = TopologyWorker()
    delays: list[tuple[str, float]] = []
    try:
        worker.warm_up()
        log("topology isolation: 30 x 1 s events on one subscription, pings to the 23 others meanwhile")
        with transaction.atomic():
            for n in range(30):
                publish(TOPO_SLOW, {"n": n, "sleep": 1.0})
        _wait_for(
            lambda: scalar("SELECT count(*) FROM bench_sink WHERE kind = 'topo_slow'") >= 2,
            60,
            "the slow backlog to start",
        )
        others = [*HOT_KINDS, *(s.rsplit(".", 1)[1] for s in worker.idle)]
        for round_ in range(sizes.topo_pings):
            since = scalar("SELECT clock_timestamp()")
            with transaction.atomic():
                publish(TOPO_PING, {"ping": round_})
            with transaction.atomic():
                publish(TOPO_HOT, {"ping": round_})
            _wait_for(
                lambda: (
                    scalar(
                        "SELECT count(*) FROM bench_sink WHERE kind = ANY(%s) AND occurred_at >= %s", [others, since]
                    )
                    >= len(others)
                ),
                60,
                "every subscription's ping",
            )
            delays += [
                (k, float(ms))
                for k, ms in sql(
                    "SELECT kind, EXTRACT(EPOCH FROM at - occurred_at) * 1000 FROM bench_sink WHERE kind = ANY(%s) AND occurred_at >= %s",
                    [others, since],
                    fetch=True,
                )
            ]
            time.sleep(1.5)
        slow_left = scalar("SELECT 30 - count(*) FROM bench_sink WHERE kind = 'topo_slow'")
    finally:
        worker.stop()
    worst = max(delays, key=lambda kv: kv[1])
    values = [ms for _, ms in delays]
    return [
        Result(
            "topo_isolation",
            "topology: ping delay beside a 30 x 1 s backlog (worst)",
            worst[1],
            "ms",
            target="< 100 ms",
            met=worst[1] < 100,
            note=f"{len(values)} pings to 23 subscriptions over {sizes.topo_pings} rounds, median {statistics.median(values):.1f} ms, worst {worst[0]}; slow events left at the end: {slow_left}",
        )
    ]


def part_rss(sizes: Sizes, transport) -> list[Result]:
    _reset(transport)
    log(f"topology rss: {sizes.topo_rss_rows:,} pending hot rows, then the worker for {sizes.topo_rss_seconds:g}s")
    fill_outbox(TOPO_HOT.name, sizes.topo_rss_rows)
    worker = TopologyWorker()
    peak = 0
    try:
        deadline = time.monotonic() + sizes.topo_rss_seconds
        while time.monotonic() < deadline and worker.process.poll() is None:
            rss, hwm = tree_rss_kib(worker.process.pid)
            peak = max(peak, rss, hwm)
            time.sleep(0.5)
        handled = scalar("SELECT count(*) FROM bench_sink")
    finally:
        worker.stop()
    mib = peak / 1024
    return [
        Result(
            "topo_rss",
            f"topology: worker peak RSS, {sizes.topo_rss_rows:,}-row backlog",
            mib,
            "MiB",
            target="< 150 MiB",
            met=mib < 150,
            note=f"{handled:,} handlings in the {sizes.topo_rss_seconds:g}s window",
        )
    ]


def part_idle(sizes: Sizes, transport) -> list[Result]:
    _reset(transport, 100)
    worker = TopologyWorker(idle=100)
    try:
        worker.warm_up(timeout=240)
        time.sleep(5)
        log(f"topology idle: 100 idle subscriptions (+3), worker CPU over {sizes.topo_idle_seconds:g}s")
        before, t0 = tree_cpu_seconds(worker.process.pid), time.monotonic()
        time.sleep(sizes.topo_idle_seconds)
        percent = 100 * (tree_cpu_seconds(worker.process.pid) - before) / (time.monotonic() - t0)
    finally:
        worker.stop()
    return [
        Result(
            "topo_idle_cpu",
            "topology: idle worker CPU, 100 idle subscriptions",
            percent,
            "% of a core",
            target="< 2 %",
            met=percent < 2,
        )
    ]


def run_topology(sizes: Sizes, transport, parts: tuple[str, ...] = PARTS) -> list[Result]:
    results: list[Result] = []
    one_process = None
    if "latency" in parts:
        results += part_latency(sizes, transport)
    if "drain" in parts:
        rows, one_process = part_drain(sizes, transport)
        results += rows
    if "processes" in parts:
        results += part_processes(sizes, transport, one_process)
    if "isolation" in parts:
        results += part_isolation(sizes, transport)
    if "rss" in parts:
        results += part_rss(sizes, transport)
    if "idle" in parts:
        results += part_idle(sizes, transport)
    reset_tables()
    reset_broker(transport)
    return results
