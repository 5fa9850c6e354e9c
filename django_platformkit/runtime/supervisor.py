"""``runworker --processes N``: one command, several worker processes.

One Python process uses one core (the GIL), and a relay draining a backlog
in the same process as the consumers slows them to a crawl. The supervisor
owns only child processes: one runs the relay and the scheduler, N run the
consumers (each its own ``Worker`` with its pulls, pool and connections; the
durables are shared, so the broker spreads each subscription's messages
over the N processes). It forks them (no re-import, no argv to rebuild),
forwards one SIGTERM/SIGINT to every child and waits for them to finish
their in-flight handlers, and restarts a child that dies, with backoff:
1 s, doubling to 30 s; a child that died ``GIVE_UP_AFTER_DEATHS`` times
within ``GIVE_UP_WINDOW_SECONDS`` makes the supervisor stop the others and
exit 1, so its own supervisor (systemd, Kubernetes) sees the failure. A
child refused by its configuration (a connection pool too small for it, a
durable that drifted, a stream another project owns) is not restarted: no
restart can fix it, so the supervisor stops the others and exits 1 at once.
A consumer child that recycled itself (``recycle.py``: ``EXIT_RECYCLE``,
after finishing and acking what it held) is replaced at once - unless it
lived less than ``RECYCLE_STEADY_SECONDS``: then after a back-off doubling
from ``RESTART_FIRST_SECONDS`` to ``RESTART_MAX_SECONDS``, so a limit it
meets at once never starts children in a storm (34-49 children in 10 s,
each with new connections, were seen). A ``--max-memory-per-process`` below
what a fresh child already uses is refused before any child starts.
With ``burst`` each consumer child drains and exits 0 (not restarted) while
the relay child keeps relaying - a handler may publish more - until every
consumer child finished; a consumer child that fails ends the run with its
code. With ``metrics`` (``treemetrics.py``) the supervisor serves one
``/metrics`` for the whole tree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from django.db import connections

from django_platformkit._retry import Backoff
from django_platformkit.exceptions import ConfigurationError, ConsumerDrift
from django_platformkit.runtime.cpus import usable_cpus
from django_platformkit.runtime.health import HealthFile
from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.recycle import EXIT_RECYCLE, memory_limit_text, resident_mib
from django_platformkit.runtime.treemetrics import TreeMetrics

logger = logging.getLogger(__name__)

#: Restart backoff for a child that died: first delay and cap, in seconds.
RESTART_FIRST_SECONDS = 1.0
RESTART_MAX_SECONDS = 30.0
#: A child that lived this long is healthy again: its backoff starts over.
STABLE_AFTER_SECONDS = 60.0
#: A child that recycled after living less than this is replaced after the
#: back-off (doubling per quick recycle), not at once; a longer life resets it.
RECYCLE_STEADY_SECONDS = 10.0
#: What stops a supervisor (and, passed on, its children).
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}

#: This many deaths of one child within the window: stop everything, exit 1.
GIVE_UP_AFTER_DEATHS = 5
GIVE_UP_WINDOW_SECONDS = 120.0
#: Exit status of the supervisor when it gave up on a child.
EXIT_GAVE_UP = 1
#: Exit status of a child its configuration refused (sysexits.h's EX_CONFIG):
#: restarting it would only repeat the refusal, with a traceback each time.
EXIT_CONFIGURATION = 78


def usable_cores() -> int:
    """The CPUs this process may really use (``runworker --processes auto``):
    its affinity mask and a cgroup CPU quota, rounded up, at least 1 (``cpus.usable_cpus``)."""
    return usable_cpus()


class _Child:
    def __init__(self, role: str, options: WorkerOptions) -> None:
        self.role = role
        self.options = options
        self.pid: int | None = None
        self.started = 0.0
        self.deaths: list[float] = []
        self.restart_at: float | None = None
        self.exit_code: int | None = None
        self.recycles = 0  # exits with EXIT_RECYCLE: restarted at once, never counted as deaths
        self.backoff = Backoff(RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS)
        self.recycle_backoff = Backoff(RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS)

    def recycled(self, now: float) -> float:
        """Record a recycle at ``now`` (monotonic seconds); return the restart
        delay in seconds: 0 after a steady life, else the doubling back-off."""
        self.recycles += 1
        if now - self.started >= RECYCLE_STEADY_SECONDS:
            self.recycle_backoff.reset()
            return 0.0
        return self.recycle_backoff.next()

    def died(self, now: float) -> float:
        """Record a death at ``now`` (monotonic seconds); return the restart delay in seconds."""
        if now - self.started > STABLE_AFTER_SECONDS:
            self.deaths.clear()
        self.deaths = [t for t in self.deaths if now - t < GIVE_UP_WINDOW_SECONDS] + [now]
        if len(self.deaths) == 1:
            # Healthy until now (it lived long enough, or its earlier deaths are
            # out of the window): a restart is not part of a crash loop.
            self.backoff.reset()
        return self.backoff.next()


class Supervisor:
    """Run the relay + scheduler child and ``processes`` consumer children.

    Args:
        options: What the command was asked to run. ``relay``/``scheduler``:
            whether the first child runs them (neither: no such child,
            ``WorkerOptions.relay_child``); the consumer children run the
            rest (``WorkerOptions.consumer_child``). ``health_file``: each
            child writes ``<health_file>.<role>``; the supervisor writes
            ``health_file`` every second (healthy when every child is up and
            says healthy) and a final ``{"healthy": false, "stopped": true}``.
            ``burst``: the consumer children drain and exit, then the relay
            child is stopped. ``recycle``: when a consumer child replaces itself.
        processes: How many consumer children.
        metrics: Counted by every child, served by the supervisor, or None.

    ``run()`` returns the exit code: 0 after a clean stop (or a drained
    burst), 1 when it gave up on a child, else the first non-zero code a
    child stopped with.
    """

    def __init__(self, options: WorkerOptions, *, processes: int, metrics: TreeMetrics | None = None) -> None:
        self.health_file = Path(options.health_file) if options.health_file else None
        self.burst = options.burst
        self.metrics = metrics
        self.children: list[_Child] = []
        if options.relay or options.runs_scheduler:
            # Never a burst itself: it relays until every consumer child drained (a handler may publish).
            self.children.append(_Child("relay", options.relay_child()))
        for number in range(processes):
            self.children.append(_Child(f"consumer{number}", options.consumer_child()))
        self.recycle = options.recycle
        self.stopping = False
        self.exit_code = 0
        self._signals = 0

    def install_signal_handlers(self) -> None:
        supervisor_pid = os.getpid()

        def handle(signum: int, frame: Any) -> None:
            if os.getpid() != supervisor_pid:
                # A child forked a moment ago, before its worker took the signals
                # over: it stops before starting (nothing in flight), and never
                # signals the supervisor's other children from its copy of the list.
                raise SystemExit(0)
            self._signals += 1
            name = signal.Signals(signum).name
            if self._signals == 1:
                logger.info(
                    "supervisor stopping signal=%s: stopping children=%s",
                    name,
                    ",".join(c.role for c in self.children if c.pid),
                )
            else:
                logger.warning("supervisor stopping now signal=%s (second request): children stop at once", name)
            self.stopping = True
            self._signal_children(signal.SIGTERM)

        for signum in _STOP_SIGNALS:
            signal.signal(signum, handle)

    def _signal_children(self, signum: int) -> None:
        for child in self.children:
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    def refuse_what_no_child_could_run(self) -> None:
        """Raise ``ConfigurationError`` for what every start of a child would
        refuse and the parent can tell without the broker: a connection pool
        smaller than a child keeps (each child checks it again), and a memory
        limit a fresh child is already above (a child is a fork of this
        process: it starts at this size and grows; one that meets its limit
        before handling anything refuses to run too). Call before ``run()``,
        so the refusal is one message, not children dying."""
        from django_platformkit.runtime.worker import Worker

        for child in self.children:
            Worker(child.options).refuse_a_small_connection_pool()
        limit = self.recycle.max_memory_mib if self.recycle is not None else None
        if limit is not None:
            size = resident_mib()
            if size >= limit:
                raise ConfigurationError(memory_limit_text(limit, size))

    def run(self) -> int:
        # Nothing of ours may be shared with the children: no connection, no loop thread.
        connections.close_all()
        logger.info("supervisor started pid=%s children=%s", os.getpid(), ",".join(c.role for c in self.children))
        for child in self.children:
            if not self.stopping:
                self._start(child)
        last_health = 0.0
        while any(c.pid is not None for c in self.children) or not self.stopping:
            self._reap()
            now = time.monotonic()
            if self.burst and not self.stopping and self._drained():
                logger.info("supervisor burst drained: every consumer child finished; stopping the rest")
                self.stopping = True
                self._signal_children(signal.SIGTERM)
            if not self.stopping:
                for child in self.children:
                    if child.pid is None and child.restart_at is not None and now >= child.restart_at:
                        self._start(child)
            if now - last_health >= 1.0:
                self._write_health()
                last_health = now
            time.sleep(0.1)
        self._write_health(final=True)
        if self.metrics is not None:
            self.metrics.close()
        logger.info("supervisor stopped exit=%s", self.exit_code)
        return self.exit_code

    def _drained(self) -> bool:
        consumers = [c for c in self.children if c.role.startswith("consumer")]
        return all(c.pid is None and c.restart_at is None and c.exit_code == 0 for c in consumers)

    def _start(self, child: _Child) -> None:
        # A stop signal between the fork and ``child.pid`` would find no pid to
        # pass on: the new child would run on and the supervisor wait for it
        # forever. Held until the pid is recorded, it is handled after, and
        # reaches the child as any other's.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            if self.stopping:
                return
            self._fork(child, held)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def _fork(self, child: _Child, mask: set[int | signal.Signals]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        with self.metrics.forking() if self.metrics is not None else contextlib.nullcontext():
            pid = os.fork()
        if pid == 0:  # the child
            # Signals held in the parent arrive only to the parent; the child's
            # own start under the supervisor's handler is ``install_signal_handlers``'s.
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            code = 1
            try:
                code = _child_main(child, self.health_file, self.metrics)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except (ConfigurationError, ConsumerDrift) as exc:
                # What the single-process command prints as its CommandError: no traceback.
                logger.critical("worker child refused to run role=%s: %s", child.role, exc)
                code = EXIT_CONFIGURATION
            except BaseException:
                logger.exception("worker child crashed role=%s", child.role)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        child.pid, child.started, child.restart_at = pid, time.monotonic(), None
        logger.info("child started role=%s pid=%s", child.role, pid)

    def _reap(self) -> None:
        for child in self.children:
            if child.pid is None:
                continue
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = child.pid, 0
            if pid == 0:
                continue
            code = os.waitstatus_to_exitcode(status)
            child.pid, child.exit_code = None, code
            if self.metrics is not None:
                self.metrics.child_exited(pid)
            if self.stopping:
                logger.info("child stopped role=%s pid=%s exit=%s", child.role, pid, code)
                # A child that recycled itself as the stop came finished and acked what it held: a clean exit.
                if code and code != EXIT_RECYCLE and not self.exit_code:
                    self.exit_code = code if code > 0 else 1
                continue
            now = time.monotonic()
            if self.burst and child.role != "relay" and code != EXIT_RECYCLE:
                if code == 0:
                    logger.info("child drained role=%s pid=%s", child.role, pid)
                    continue
                logger.error(
                    "child failed its burst role=%s pid=%s exit=%s: stopping every child", child.role, pid, code
                )
                self.exit_code = code if code > 0 else 1
                self.stopping = True
                self._signal_children(signal.SIGTERM)
                continue
            if code == EXIT_RECYCLE:
                # Not a death: it finished and acked what it held. A fresh one now, unless it recycles quickly.
                delay = child.recycled(now)
                child.restart_at = now + delay
                if delay:
                    logger.warning(
                        "child recycled role=%s pid=%s after %.1fs: starting a fresh one in %.0fs (a child that "
                        "recycles within %.0fs of its start costs more than it saves: raise "
                        "--max-handlings-per-process or --max-memory-per-process)",
                        child.role,
                        pid,
                        now - child.started,
                        delay,
                        RECYCLE_STEADY_SECONDS,
                    )
                else:
                    logger.info("child recycled role=%s pid=%s; starting a fresh one", child.role, pid)
                continue
            delay = child.died(now)
            if code == EXIT_CONFIGURATION:
                logger.critical(
                    "child refused to run role=%s (see above): a restart can't fix its configuration; "
                    "stopping every child, supervisor exit=%s",
                    child.role,
                    EXIT_GAVE_UP,
                )
                self.exit_code = EXIT_GAVE_UP
                self.stopping = True
                self._signal_children(signal.SIGTERM)
                continue
            if len(child.deaths) >= GIVE_UP_AFTER_DEATHS:
                logger.critical(
                    "child keeps dying role=%s exit=%s deaths=%s within=%.0fs: stopping every child, supervisor exit=%s",
                    child.role,
                    code,
                    len(child.deaths),
                    GIVE_UP_WINDOW_SECONDS,
                    EXIT_GAVE_UP,
                )
                self.exit_code = EXIT_GAVE_UP
                self.stopping = True
                self._signal_children(signal.SIGTERM)
                continue
            child.restart_at = now + delay
            logger.error("child died role=%s pid=%s exit=%s; restarting in %.0fs", child.role, pid, code, delay)

    def health(self) -> dict[str, Any]:
        children = {}
        healthy = not self.stopping
        for child in self.children:
            state: dict[str, Any] = {
                "pid": child.pid,
                "up": child.pid is not None,
                "restarts": len(child.deaths),
                "recycles": child.recycles,
            }
            if self.health_file is not None and child.pid is not None:
                try:
                    reported = json.loads(Path(f"{self.health_file}.{child.role}").read_text())
                    state["healthy"] = (
                        bool(reported.get("healthy")) and time.time() - float(reported.get("time", 0)) < 10
                    )
                except (OSError, ValueError):
                    state["healthy"] = False
            else:
                state["healthy"] = child.pid is not None
            healthy = healthy and state["healthy"]
            children[child.role] = state
        return {
            "pid": os.getpid(),
            "healthy": healthy,
            "stopped": self.stopping,
            "children": children,
            "time": time.time(),
        }

    def _write_health(self, final: bool = False) -> None:
        if self.health_file is None:
            return
        state = self.health()
        if final:
            state.update(healthy=False, stopped=True, exit_code=self.exit_code)
        HealthFile(self.health_file).write(state)


def _child_main(child: _Child, health_file: Path | None, metrics: TreeMetrics | None = None) -> int:
    # A terminal's Ctrl-C goes to the whole process group: in a group of its
    # own, a child hears only the supervisor's one SIGTERM (two would abandon
    # its in-flight handlers).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent()
    # Until the worker takes the signals over, the supervisor's handler stops
    # this child before it starts (see ``install_signal_handlers``).
    if metrics is not None:
        metrics.in_child(child.options.subscriptions or ())
    from django_platformkit.runtime.worker import Worker

    worker = Worker(child.options.with_health_file(f"{health_file}.{child.role}" if health_file else None))
    worker.install_signal_handlers()
    return worker.run()


def _die_with_parent() -> None:
    """Linux: SIGTERM this child when the supervisor dies (even by SIGKILL), so no orphan keeps consuming."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass
