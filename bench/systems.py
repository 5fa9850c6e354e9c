"""The systems the bench runs side by side as their users run them (the
base class, and pgqueuer's runner, which the trickle (measure_trickle.py)
and the topology's two-process drain (measure_topology.py) both start)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.db import transaction

from .harness import ROOT, child_env, reset_tables, sql


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


class System:
    """One queue as a user runs it: its processes, its enqueue, its tables."""

    name = ""
    kinds: tuple[str, ...] = ("trickle_a", "trickle_b")
    settings = ""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.processes: list[subprocess.Popen] = []

    def _log(self, what: str) -> Any:
        return open(self.logs / f"{self.name}-{what}.log", "ab")

    def _spawn(self, argv: list[str], what: str = "worker", **env: str) -> subprocess.Popen:
        out = self._log(what)
        process = subprocess.Popen(argv, env=child_env(**env), cwd=ROOT, stdout=out, stderr=out)
        self.processes.append(process)
        return process

    def reset(self) -> None:
        reset_tables()

    def start(self) -> None:
        raise NotImplementedError

    def prepare(self) -> None:
        """Called outside ``atomic()`` before a series of enqueues."""

    def enqueue(self, n: int) -> str:
        """Enqueue event ``n`` (inside the caller's ``atomic()``); its key in ``bench_sink.event_id``."""
        raise NotImplementedError

    def warm_up(self, timeout: float = 120.0) -> None:
        """Until each hot kind ran once (processes up, connections open)."""
        deadline, n = time.monotonic() + timeout, -1
        while True:
            self._check_alive()
            self.prepare()
            with transaction.atomic():
                self.enqueue(n)
            n -= 1
            time.sleep(0.5)
            seen = sql(
                "SELECT count(DISTINCT kind) FROM bench_sink WHERE kind = ANY(%s)", [list(self.kinds)], fetch=True
            )
            if seen[0][0] == len(self.kinds):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no warm-up handling within {timeout:g}s (see {self.logs})")
        time.sleep(1.0)
        sql("DELETE FROM bench_sink")

    def _check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(f"{self.name}: {process.args} exited {process.returncode} (see {self.logs})")

    def roots(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)
        self.processes = []


class Pgqueuer(System):
    name = "pgqueuer"
    settings = "pgq run's supervisor (asyncpg, uvloop), CLI defaults: batch size 10, dequeue timeout 30 s; schedules every minute"

    def reset(self) -> None:
        from .peers import pgqueuer_app

        pgqueuer_app.install()
        reset_tables("pgqueuer", "pgqueuer_log", "pgqueuer_statistics", "pgqueuer_schedules")

    def __init__(self, logs: Path, processes: int = 1, batch_size: int | None = None) -> None:
        super().__init__(logs)
        self.processes_wanted = processes
        self.batch_size = batch_size

    def start(self) -> None:
        extra = ["--batch-size", str(self.batch_size)] if self.batch_size else []
        for n in range(self.processes_wanted):
            self._spawn([sys.executable, "-m", "bench.peers.pgqueuer_app", *extra], what=f"worker{n or ''}")

    def prepare(self) -> None:
        from .peers import pgqueuer_app

        pgqueuer_app.prepare()

    def enqueue(self, n: int) -> str:
        from .peers import pgqueuer_app

        pgqueuer_app.enqueue(str(n))
        return str(n)
