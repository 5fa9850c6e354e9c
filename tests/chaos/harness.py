"""The fault-injection rig: real writer, relay and worker processes over a
database and NATS servers of the scenario's own, so a scenario can SIGKILL
any of them, and a tally that counts every subscription's committed handler
runs per event id.

``lost`` counts (event, subscription) pairs without an effect - a pending
row, a message the broker dropped, a healthy event dead-lettered - and
``duplicated`` the effects beyond the first. Both must be 0.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent
EVENT = "testapp.order_placed"
SUBSCRIPTIONS = ("testapp.record_order", "testapp.count_order")
STREAM = "CHAOS"
PREFIX = "chaos"
#: Short, so a killed worker's messages come back quickly.
ACK_WAIT_SECONDS = 2.5
HANDLER_TIMEOUT_SECONDS = 2.0
#: The attempt limit of every scenario: the default (``MAX_ATTEMPTS`` 5)
#: unless ``PLATFORMKIT_CHAOS_MAX_ATTEMPTS`` says otherwise. It used to be 50,
#: which hid the bug the default exposes: a worker killed or stopped with
#: fetched, unstarted messages had each hand-back counted as an attempt,
#: dead-lettering healthy events that never ran (issue 11).
MAX_ATTEMPTS = os.environ.get("PLATFORMKIT_CHAOS_MAX_ATTEMPTS")

#: Lines printed by the scenarios, repeated in pytest's terminal summary.
REPORTED: list[str] = []


def scaled(count: int) -> int:
    """``count`` times ``PLATFORMKIT_CHAOS_SCALE`` (default 1): a quicker run
    while developing, the issue's numbers in CI."""
    return max(10, int(count * float(os.environ.get("PLATFORMKIT_CHAOS_SCALE", "1"))))


@dataclass
class Tally:
    events: int
    lost: int
    duplicated: int
    pending: int
    dead_letters: int
    stray: int  # effects for ids the outbox never had
    handled: dict[str, int] = field(default_factory=dict)  # distinct events with an effect, per subscription

    def complete(self, expected: int) -> bool:
        return self.events >= expected and self.pending == 0 and all(n >= expected for n in self.handled.values())


class Process:
    """One child process started by the rig; its output goes to a log file."""

    def __init__(self, rig: Rig, role: str, argv: list[str], env: dict[str, str]) -> None:
        self.rig, self.role, self.argv, self.env = rig, role, argv, env
        self.generation = 0
        self.popen: subprocess.Popen | None = None
        self.start()

    @property
    def log_path(self) -> Path:
        return self.rig.workdir / f"{self.role}.log"

    def start(self) -> Process:
        self.generation += 1
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        log.write(f"--- start #{self.generation}: {' '.join(self.argv[1:])}\n".encode())
        log.flush()
        self.popen = subprocess.Popen(
            self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        return self

    def wait_for_log(self, text: str, timeout: float = 120.0) -> None:
        """Block until this run of the process has logged ``text`` (e.g.
        "worker started": a fault before that would hit start-up, not work)."""

        def logged() -> bool:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                return text.encode() in log.read()

        wait_for(lambda: logged() or not self.running, timeout=timeout, what=f"{self.role} to log {text!r}")
        assert self.running, f"{self.role} exited {self.popen.returncode} before logging {text!r}:\n{self.tail()}"

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.running:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(30)

    def terminate(self, timeout: float = 30.0) -> tuple[int | None, float]:
        """SIGTERM and wait; ``(exit status or None if still running, seconds)``."""
        started = time.monotonic()
        if not self.running:
            return self.popen.returncode if self.popen else None, 0.0
        self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Rig:
    """One scenario's processes over its own database (``database_url``) and
    NATS (``nats_urls``, comma-separated for a cluster)."""

    def __init__(
        self,
        name: str,
        *,
        database_url: str,
        nats_urls: str,
        workdir: Path,
        subscriptions: Sequence[str] = SUBSCRIPTIONS,
        **settings_env: str,
    ) -> None:
        self.name = name
        #: The subscriptions whose effects the tally counts (and the workers consume by default).
        self.subscriptions = tuple(subscriptions)
        self.database_url = database_url
        self.nats_urls = nats_urls
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[Process] = []
        self.settings_env = settings_env
        #: The stream this rig's processes use (a scenario may give a project its own).
        self.stream = settings_env.get("PLATFORMKIT_TEST_STREAM", STREAM)
        self.started = time.monotonic()
        self.faults = 0

    # -- processes --
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PLATFORMKIT_TEST_DB_NAME"}
        env.update(
            DATABASE_URL=self.database_url,
            NATS_URL=self.nats_urls,
            DJANGO_SETTINGS_MODULE="tests.settings",
            PYTHONPATH=str(ROOT),
            PLATFORMKIT_TEST_STREAM=STREAM,
            PLATFORMKIT_TEST_PREFIX=PREFIX,
            PLATFORMKIT_TEST_ACK_WAIT=str(ACK_WAIT_SECONDS),
            PLATFORMKIT_TEST_HANDLER_TIMEOUT=str(HANDLER_TIMEOUT_SECONDS),
            PLATFORMKIT_LOG_LEVEL="INFO",
        )
        # Not inherited from this process either: tests/settings.py's default is the library's.
        env.pop("PLATFORMKIT_TEST_MAX_ATTEMPTS", None)
        if MAX_ATTEMPTS:
            env["PLATFORMKIT_TEST_MAX_ATTEMPTS"] = MAX_ATTEMPTS
        env.update(self.settings_env)
        env.update(extra)
        return env

    def manage(self, role: str, *args: str) -> Process:
        process = Process(self, role, [sys.executable, str(ROOT / "tests" / "manage.py"), *args], self.env())
        self.processes.append(process)
        return process

    def relay(self, number: int = 1) -> Process:
        return self.manage(f"relay{number}", "runrelay")

    def worker(
        self,
        number: int = 1,
        *,
        subscriptions: Sequence[str] | None = None,
        relay: bool = False,
        jobs: Sequence[str] = (),
    ) -> Process:
        args = ["runworker"]
        if not relay:
            args.append("--no-relay")
        if jobs:
            for job in jobs:
                args += ["--job", job]
        else:
            args.append("--no-jobs")
        for sub in self.subscriptions if subscriptions is None else subscriptions:
            args += ["--subscription", sub]
        return self.manage(f"worker{number}", *args)

    def writers(self, count: int, events: int, *, seconds: float) -> list[Process]:
        """``count`` writer processes sharing ``events`` between them."""
        share = [events // count + (1 if i < events % count else 0) for i in range(count)]
        out = []
        for i, n in enumerate(share):
            argv = [
                sys.executable,
                "-m",
                "tests.chaos.writer",
                "--writer",
                str(i),
                "--count",
                str(n),
                "--seconds",
                str(seconds),
            ]
            process = Process(self, f"writer{i}", argv, self.env())
            self.processes.append(process)
            out.append(process)
        return out

    def faults_while_handling(self, events: int, *, rounds: int, seed: int, inject: Callable[[Process], None]) -> None:
        """Start a relay and two workers, let two writers publish ``events``
        over 20 s - a fixed window, so a fast machine can't finish before
        the faults land - and meanwhile, ``rounds`` times 1.5 to 2.5 s apart,
        call ``inject`` on each worker in turn once it is at work."""
        rng = random.Random(seed)
        self.relay()
        workers = [self.worker(1), self.worker(2)]
        for worker in workers:
            worker.wait_for_log("worker started")
        writers = self.writers(2, events, seconds=20)
        for round_ in range(rounds):
            time.sleep(rng.uniform(1.5, 2.5))
            _, _, effects = self.progress()
            if not any(w.running for w in writers) and all(effects.get(s, 0) >= events for s in self.subscriptions):
                break  # nothing left to handle: a fault now would prove nothing
            victim = workers[round_ % 2]
            victim.wait_for_log("worker started")  # at work, not mid start-up
            inject(victim)
        self.wait_for_writers(writers)

    def wait_for_writers(self, writers: Sequence[Process], timeout: float = 300.0) -> None:
        wait_for(lambda: all(not w.running for w in writers), timeout=timeout, what="the writers")
        codes = [w.popen.returncode for w in writers]
        assert codes == [0] * len(writers), f"writers exited {codes}\n{self.logs()}"

    def stop_all(self) -> None:
        for process in self.processes:
            if process.running:
                process.popen.send_signal(signal.SIGTERM)
        for process in self.processes:
            if process.popen is not None:
                try:
                    process.popen.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()

    def logs(self) -> str:
        return "\n".join(
            f"===== {p.role} (exit {p.popen.returncode if p.popen else '-'}) =====\n{p.tail()}" for p in self.processes
        )

    # -- faults --
    def fault(self, what: str) -> None:
        self.faults += 1
        with open(self.workdir / "faults.log", "a") as log:
            log.write(f"{time.monotonic() - self.started:8.2f}s fault #{self.faults}: {what}\n")

    def terminate_database_sessions(self) -> int:
        """``pg_terminate_backend`` every client session of the scenario's
        database but ours: the connections die mid-query, mid-transaction."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            killed = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            ).fetchone()[0]
        self.fault(f"pg_terminate_backend x{killed}")
        return killed

    # -- counting --
    def tally(self) -> Tally:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            events, pending = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM platformkit_outbox WHERE name = %s",
                [EVENT],
            ).fetchone()
            lost, duplicated = conn.execute(
                "SELECT count(*) FILTER (WHERE n = 0), coalesce(sum(n - 1) FILTER (WHERE n > 1), 0) FROM ("
                " SELECT o.id, s.name, count(e.id) AS n FROM platformkit_outbox o"
                " CROSS JOIN unnest(%s::text[]) AS s(name)"
                " LEFT JOIN testapp_effect e ON e.event_id = o.id AND e.subscription = s.name"
                " WHERE o.name = %s GROUP BY o.id, s.name) per_pair",
                [list(self.subscriptions), EVENT],
            ).fetchone()
            stray = conn.execute(
                "SELECT count(*) FROM testapp_effect e WHERE NOT EXISTS (SELECT 1 FROM platformkit_outbox o WHERE o.id = e.event_id)"
            ).fetchone()[0]
            handled = dict(
                conn.execute(
                    "SELECT subscription, count(DISTINCT event_id) FROM testapp_effect WHERE subscription = ANY(%s) GROUP BY 1",
                    [list(self.subscriptions)],
                ).fetchall()
            )
            dead = conn.execute("SELECT count(*) FROM platformkit_dead_letters").fetchone()[0]
        return Tally(
            events=events,
            lost=lost,
            duplicated=int(duplicated),
            pending=pending,
            dead_letters=dead,
            stray=stray,
            handled={s: handled.get(s, 0) for s in self.subscriptions},
        )

    def assert_exactly_once(self, tally: Tally, events: int | None = None) -> None:
        """Every event (``events`` of them, if given) reached every
        subscription once: nothing lost, doubled, stray, pending or dead-lettered."""
        if events is not None:
            assert tally.events == events
        assert (tally.lost, tally.duplicated, tally.stray, tally.pending) == (0, 0, 0, 0), (
            tally,
            self.dead_letter_errors(),
            self.logs(),
        )
        assert tally.dead_letters == 0, self.dead_letter_errors()

    def dead_letter_errors(self, limit: int = 5) -> list[str]:
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            return [
                r[0]
                for r in conn.execute(
                    "SELECT subscription || ': ' || error FROM platformkit_dead_letters LIMIT %s", [limit]
                )
            ]

    def progress(self) -> tuple[int, int, dict[str, int]]:
        """``(events, pending, effect rows per subscription)``: cheap enough
        to poll every second without slowing the scenario it watches."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            events, pending = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM platformkit_outbox WHERE name = %s",
                [EVENT],
            ).fetchone()
            effects = dict(conn.execute("SELECT subscription, count(*) FROM testapp_effect GROUP BY 1").fetchall())
        return events, pending, effects

    def wait_until_settled(self, expected: int, *, timeout: float) -> Tally:
        """Poll until every one of ``expected`` events has an effect in every
        subscription, nothing is pending in the outbox and no durable has a
        message pending or awaiting its ack; then wait one ack wait more, so
        a redelivery that would double an effect has time to show."""
        deadline = time.monotonic() + timeout
        tally = None
        while time.monotonic() < deadline:
            events, pending, effects = self.progress()
            with open(self.workdir / "progress.log", "a") as log:
                log.write(
                    f"{time.monotonic() - self.started:8.2f}s events={events} pending={pending} effects={effects}\n"
                )
            if events >= expected and not pending and all(effects.get(s, 0) >= expected for s in self.subscriptions):
                tally = self.tally()
                if tally.complete(expected) and consumers_idle(self.nats_urls, self.stream, self.subscriptions):
                    time.sleep(ACK_WAIT_SECONDS + 1)
                    return self.tally()
            time.sleep(1.0)
        tally = tally or self.tally()
        raise AssertionError(f"scenario {self.name} did not settle within {timeout:.0f} s: {tally}\n{self.logs()}")

    def finish(self, expected: int, *, timeout: float) -> Tally:
        """Wait until settled, print the scenario's line, and assert every
        one of ``expected`` events reached every subscription exactly once."""
        tally = self.wait_until_settled(expected, timeout=timeout)
        self.report(tally)
        self.assert_exactly_once(tally, expected)
        return tally

    def report(self, tally: Tally, *, extra_duplicates: int = 0) -> str:
        """Print the scenario's one line and return it. ``extra_duplicates``:
        doubles counted elsewhere (a job run twice for one slot)."""
        seconds = time.monotonic() - self.started
        line = (
            f"scenario={self.name} events={tally.events} faults={self.faults} "
            f"lost={tally.lost} duplicated={tally.duplicated + tally.stray + extra_duplicates} seconds={seconds:.1f}"
        )
        REPORTED.append(line)
        print(line, flush=True)
        return line


# --- NATS, read directly (the rig's own view, not the library's) --------------


def nats_call(urls: str, coro_factory, timeout: float = 10.0):
    import nats

    async def run():
        nc = await nats.connect(
            servers=urls.split(","), connect_timeout=2, max_reconnect_attempts=2, allow_reconnect=True
        )
        try:
            return await coro_factory(nc.jetstream(timeout=5))
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(run(), timeout))


def consumers_idle(urls: str, stream: str = STREAM, subscriptions: Sequence[str] = SUBSCRIPTIONS) -> bool:
    """True when every subscription's durable has nothing pending and
    nothing awaiting an ack (False, too, when NATS can't answer)."""

    async def check(js):
        for sub in subscriptions:
            info = await js.consumer_info(stream, sub.replace(".", "-"))
            if info.num_pending or info.num_ack_pending:
                return False
        return True

    try:
        return nats_call(urls, check)
    except Exception:
        return False


def stream_leader(urls: str) -> str | None:
    """The server name of the stream's current leader, or None."""

    async def leader(js):
        info = await js.stream_info(STREAM)
        return info.cluster.leader if info.cluster else None

    try:
        return nats_call(urls, leader)
    except Exception:
        return None
