"""3: relay events/s against a raw pipelined JetStream publish loop in the
same run, and two relay processes against one (SKIP LOCKED: neither waits
on the other's rows)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

from django_platformkit import conf
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import envelope

from .benchapp.platformkit import RELAY
from .harness import ROOT, Result, Sizes, child_env, fill_outbox, log, pending, ratio_result, reset_broker, reset_tables

PAYLOAD_TEXT = '{"n": 1, "qty": 1, "sku": "sku-1"}'  # jsonb's text form, as the relay reads it


def raw_floor_rate(rows: int) -> float:
    """nats-py alone: ``publish_async`` of ``rows`` relay-shaped messages,
    each with its own ``Nats-Msg-Id``, pipelined (nats-py bounds in-flight
    acks at 4000), then wait for every ack. No database."""
    import nats

    now = datetime.now(UTC)
    messages = [envelope(uuid.uuid4(), RELAY.name, None, PAYLOAD_TEXT, {}, now) for _ in range(rows)]

    async def go() -> float:
        nc = await nats.connect(conf.settings.NATS_URL)
        js = nc.jetstream()
        try:
            await (await js.publish_async(messages[0].subject, b"{}", headers={"Nats-Msg-Id": str(uuid.uuid4())}))
            futures = []
            started = time.perf_counter()
            for m in messages:
                futures.append(await js.publish_async(m.subject, m.body, headers={"Nats-Msg-Id": m.msg_id}))
            await js.publish_async_completed()
            elapsed = time.perf_counter() - started
            failed = sum(1 for f in futures if f.exception() is not None)
            if failed:
                raise RuntimeError(f"raw floor: {failed} publishes failed")
            return rows / elapsed
        finally:
            await nc.close()

    return asyncio.run(go())


def relay_rate(transport, rows: int) -> float:
    reset_tables()
    fill_outbox(RELAY.name, rows)
    relay = Relay(transport)
    started = time.perf_counter()
    stats = relay.drain()
    elapsed = time.perf_counter() - started
    if stats.stored != rows or pending():
        raise RuntimeError(f"relay stored {stats.stored} of {rows}, {pending()} left pending")
    return rows / elapsed


def processes_rate(transport, rows: int, processes: int, cpu_share: dict[int, list]) -> float:
    """``processes`` relay processes drain ``rows`` together; rate over the
    span from the first start to the last finish."""
    reset_tables()
    reset_broker(transport)
    fill_outbox(RELAY.name, rows)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.relayproc"],
            env=child_env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"relay process said {line!r}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in procs]
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    stored = sum(r["stored"] for r in reports)
    if stored != rows or pending():
        raise RuntimeError(f"{processes} relays stored {stored} of {rows}, {pending()} left pending")
    span = max(r["finished"] for r in reports) - min(r["started"] for r in reports)
    # CPU each relay process used per second of the span: near 1.0 means
    # the relay is bound by its own Python, not by PostgreSQL or NATS.
    cpu_share.setdefault(processes, []).append([round(r["cpu_seconds"] / span, 2) for r in reports])
    return rows / span


def run_relay(sizes: Sizes, transport) -> list[Result]:
    rows = sizes.relay_rows
    raw_floor_rate(2000)  # warm up the server's store
    log(f"relay: drain {rows} rows in-process vs raw publish_async loop of {rows} (x{sizes.reps})")
    ours, floor = [], []
    for _ in range(sizes.reps):
        reset_broker(transport)
        floor.append(raw_floor_rate(rows))
        reset_broker(transport)
        ours.append(relay_rate(transport, rows))
    results = [
        ratio_result(
            "relay",
            "relay drain, 1 process",
            ours,
            floor,
            unit="events/s",
            floor_what="raw nats-py publish_async loop, Nats-Msg-Id",
            at_least=0.6,
            note=f"RELAY_BATCH_SIZE={conf.settings.RELAY_BATCH_SIZE}",
        )
    ]
    log(f"relay: 2 processes vs 1 over {rows} rows (x{sizes.reps})")
    one, two = [], []
    cpu_share: dict[int, list] = {}
    for _ in range(sizes.reps):
        one.append(processes_rate(transport, rows, 1, cpu_share))
        two.append(processes_rate(transport, rows, 2, cpu_share))
    results.append(
        ratio_result(
            "relay_2proc",
            "relay drain, 2 processes",
            two,
            one,
            unit="events/s",
            floor_what="the same, 1 process",
            at_least=1.3,
            note=f"CPU per relay process (s/s): 1 process {cpu_share[1]}, 2 processes {cpu_share[2]}",
            detail={"cpu_share": cpu_share},
        )
    )
    reset_tables()
    reset_broker(transport)
    return results
