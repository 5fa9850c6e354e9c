"""``runworker --processes``: ``auto`` (one consumer process per usable
core), one ``/metrics`` for the whole tree (prometheus-client's multiprocess
mode), and ``--burst`` across processes. Real processes, PostgreSQL and NATS."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
from django.db import transaction

from django_platformkit import publish
from django_platformkit.devservices import free_port
from django_platformkit.models import HandledEvent, OutboxEvent
from django_platformkit.runtime.supervisor import usable_cores
from tests.conftest import manage, run_to_exit, wait_for, worker_env
from tests.runtime.test_metrics import handled, scrape
from tests.testapp.models import Effect

# 240 s: a supervisor's tree of children, each starting Django and its
# connections, killed and replaced, then drained on a graceful stop.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

SUB = "testapp.record_order"


def _stop(proc: subprocess.Popen, log: Path) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return log.read_text()


def start_logged(broker, log, *args: str) -> subprocess.Popen:
    """``runworker *args`` as a real process, its stdout and stderr in ``log``."""
    with open(log, "wb") as out:
        return manage("runworker", *args, env=worker_env(broker), stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.process
def test_processes_2_serve_one_metrics_endpoint_summing_every_child_recycled_ones_included(broker, tmp_path):
    """Two consumer children that recycle every 5 handlings: the supervisor's
    one /metrics counts every handling of every child, those that exited too."""
    port = free_port()
    log = tmp_path / "worker.log"
    proc = start_logged(
        broker,
        log,
        "--processes",
        "2",
        "--metrics-port",
        str(port),
        "--max-handlings-per-process",
        "5",
        "--no-jobs",
        "--subscription",
        SUB,
    )
    try:
        folder = Path(
            wait_for(
                lambda: (m := re.search(r"metrics of the process tree folder=(\S+)", log.read_text())) and m[1],
                timeout=60,
                what="the metrics folder in the log",
            )
        )
        with transaction.atomic():
            ids = [publish("testapp.order_placed", {"n": n}) for n in range(20)]

        def settled():
            try:
                samples = scrape(port)
            except OSError:
                return False
            return handled(samples, SUB, "handled") == 20 and samples

        samples = wait_for(settled, timeout=120, what="/metrics to show 20 handled")
        assert HandledEvent.objects.filter(subscription=SUB).count() == 20
        assert sorted(Effect.objects.filter(subscription=SUB).values_list("event_id", flat=True)) == sorted(ids)
        assert samples[("platformkit_relayed_total", ())] == 20  # counted by the relay child
        # The scrape-time figures are the supervisor's own: the database's and the stream's.
        assert samples[("platformkit_outbox_pending", ())] == 0
        assert samples[("platformkit_scrape_ok", (("source", "database"),))] == 1
        assert samples[("platformkit_scrape_ok", (("source", "nats"),))] == 1
        assert samples[("platformkit_consumer_pending", (("subscription", SUB),))] == 0
        assert samples[("platformkit_handler_duration_seconds_count", (("subscription", SUB), ("task", "")))] == 20
        # Every child counted into the folder (the supervisor, proc.pid, counts nothing of its own).
        pids = {int(f.stem.rsplit("_", 1)[1]) for f in folder.glob("counter_*.db")} - {proc.pid}
        assert len(pids) >= 3, sorted(pids)  # the relay child and two consumer children at least
        # A child past 5 handlings exits and a fresh one starts: its counts stay in the sum.
        wait_for(lambda: "child recycled role=consumer" in log.read_text(), timeout=60, what="a recycled child")
        assert handled(scrape(port), SUB, "handled") == 20
    finally:
        text = _stop(proc, log)
    assert proc.returncode == 0, text
    assert not folder.exists(), "the supervisor leaves its metrics folder behind"


@pytest.mark.process
def test_processes_auto_starts_one_consumer_child_per_usable_core(broker, tmp_path):
    health = tmp_path / "health.json"
    log = tmp_path / "worker.log"
    proc = start_logged(
        broker,
        log,
        "--processes",
        "auto",
        "--no-jobs",
        "--subscription",
        SUB,
        "--health-file",
        str(health),
    )
    try:
        state = wait_for(
            lambda: health.exists() and json.loads(health.read_text()), timeout=60, what="the supervisor's health file"
        )
        cores = usable_cores()
        assert set(state["children"]) == {"relay"} | {f"consumer{n}" for n in range(cores)}
        with transaction.atomic():
            ids = [publish("testapp.order_placed", {"n": n}) for n in range(10)]
        wait_for(
            lambda: Effect.objects.filter(subscription=SUB).count() >= len(ids), timeout=60, what="10 events handled"
        )
    finally:
        text = _stop(proc, log)
    assert proc.returncode == 0, text
    assert f"children=relay,{','.join(f'consumer{n}' for n in range(cores))}" in text
    assert sorted(Effect.objects.filter(subscription=SUB).values_list("event_id", flat=True)) == sorted(ids)


@pytest.mark.process
def test_processes_2_burst_drains_a_backlog_handles_each_event_once_and_exits_0(broker):
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": n}) for n in range(40)]
    code, output = run_to_exit(
        "runworker",
        "--processes",
        "2",
        "--burst",
        "--burst-timeout",
        "120",
        "--no-jobs",
        "--subscription",
        SUB,
        env=worker_env(broker),
        timeout=180,
    )
    assert code == 0, output
    assert "exit=0 processes=2" in output
    assert output.count("child drained role=consumer") == 2, output
    assert sorted(Effect.objects.filter(subscription=SUB).values_list("event_id", flat=True)) == sorted(ids)
    assert HandledEvent.objects.filter(subscription=SUB).count() == 40
    assert not OutboxEvent.objects.pending().exists()


@pytest.mark.process
def test_processes_burst_exits_non_zero_when_a_consumer_child_fails(broker):
    """A consumer child that can't drain in time (exit 1) ends the run with its code."""
    with transaction.atomic():
        publish("testapp.slow", {"sleep": 10})
    code, output = run_to_exit(
        "runworker",
        "--processes",
        "2",
        "--burst",
        "--burst-timeout",
        "3",
        "--no-jobs",
        "--subscription",
        "testapp.slow",
        env=worker_env(broker),
        timeout=180,
    )
    assert code == 1, output
    assert "child failed its burst" in output, output
