"""How a worker process shows it is alive, and when it stops pretending.

Owns the health file (JSON a probe reads, replaced atomically, so a probe
never reads half a state; the last state a stopped process leaves says
``healthy: false``) and the watchdog: once a second it logs progress, writes
the health file and the heartbeat, and ends the process with
``EXIT_STUCK_HANDLER`` when a handler runs past ``HANDLER_TIMEOUT_SECONDS``
plus ``HANDLER_STUCK_GRACE_SECONDS`` - a supervisor restarts a process that
exits, never one that is alive and consumes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from django_platformkit.runtime.runstate import RunState

logger = logging.getLogger(__name__)

#: Exit status when a handler is stuck past HANDLER_TIMEOUT_SECONDS + grace.
EXIT_STUCK_HANDLER = 3
#: How often the watchdog logs the worker's counts at INFO when they changed.
PROGRESS_LOG_SECONDS = 10.0


class HealthFile:
    """A JSON file rewritten whole: written to a temporary file of this
    writer's own (process and thread: the children of ``--processes`` share
    a folder) and renamed over ``path``. A write that fails (a full disk)
    is logged at WARNING and never raised: the probe notices a stale file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def write(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_text(json.dumps(state))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("health file not written path=%s error=%s", self.path, exc)


class _Watched(Protocol):
    """What the watchdog reads of a consumer: when its running handler
    started (monotonic seconds, None when idle) and its subscription."""

    @property
    def handler_started(self) -> float | None: ...

    @property
    def subscription(self) -> Any: ...

    def record_stuck_runs(self, started_before: float, error: str) -> int: ...


class _Worker(Protocol):
    """What the watchdog watches of a worker (``parts.WorkerParts``)."""

    @property
    def consumers(self) -> Sequence[_Watched]: ...

    @property
    def heartbeat(self) -> Any: ...

    def counts(self) -> dict[str, int]: ...

    def check_alive(self) -> None: ...

    def write_health(self, stuck: str | None, exit_code: int | None) -> None: ...


class Watchdog:
    """The loop of a worker's watchdog thread, once a second until ``done``
    is set (after the worker's other threads ended, so a handler stuck in
    the shutdown still ends the process).

    Of ``worker``: its ``consumers`` are watched for stuck handlers
    (``timeout_seconds``: logged at ERROR once; past ``timeout_seconds +
    grace_seconds``: the process exits ``EXIT_STUCK_HANDLER`` after
    ``write_health(stuck_subscription, EXIT_STUCK_HANDLER)``, the final
    state: stopped, with that exit code); its ``counts()`` are logged at
    INFO every ``PROGRESS_LOG_SECONDS`` when they changed. While
    ``stopping`` is not set: ``check_alive()`` (raises nothing; it stops the
    worker itself when a part of it died) and ``write_health(None, None)``.
    Its ``heartbeat``: ``beat()`` every loop, ``stopped()`` at the end.
    """

    def __init__(
        self,
        worker: _Worker,
        *,
        stopping: threading.Event,
        done: threading.Event,
        timeout_seconds: float,
        grace_seconds: float,
    ) -> None:
        self.consumers = worker.consumers
        self.counts = worker.counts
        self.check_alive = worker.check_alive
        self.write_health = worker.write_health
        self.heartbeat = worker.heartbeat
        self.stopping = stopping
        self.done = done
        self.timeout_seconds = timeout_seconds
        self.grace_seconds = grace_seconds
        self._warned: set[int] = set()

    def run(self) -> None:
        last_counts, last_logged = self.counts(), time.monotonic()
        while not self.done.wait(1.0):
            now = time.monotonic()
            if now - last_logged >= PROGRESS_LOG_SECONDS:
                counts = self.counts()
                if counts != last_counts:
                    logger.info(
                        "progress interval=%.0fs %s",
                        now - last_logged,
                        " ".join(f"{k}={counts[k] - last_counts.get(k, 0)}" for k in counts),
                    )
                last_counts, last_logged = counts, now
            if not self.stopping.is_set():
                self.check_alive()
            self._check_stuck(now)
            if not self.stopping.is_set():
                self.write_health(None, None)
            self.heartbeat.beat()  # writes only every few seconds
        self.heartbeat.stopped()

    def _check_stuck(self, now: float) -> None:
        timeout, grace = self.timeout_seconds, self.grace_seconds
        for consumer in self.consumers:
            started = consumer.handler_started
            if started is None:
                self._warned.discard(id(consumer))
                continue
            running = now - started
            if running > timeout and id(consumer) not in self._warned:
                self._warned.add(id(consumer))
                logger.error(
                    "handler stuck subscription=%s running=%.0fs timeout=%ss: its ack is no longer extended; "
                    "the worker exits in %.0fs unless it returns",
                    consumer.subscription.name,
                    running,
                    timeout,
                    timeout + grace - running,
                )
            if running > timeout + grace:
                logger.critical(
                    "handler stuck subscription=%s running=%.0fs: exiting status=%s so the supervisor restarts the worker",
                    consumer.subscription.name,
                    running,
                    EXIT_STUCK_HANDLER,
                )
                # The run ends here: its retries and dead letter say so, and where it hung.
                consumer.record_stuck_runs(
                    now - timeout - grace,
                    f"HandlerTimeout: the handler ran {running:.0f}s without returning, past HANDLER_TIMEOUT_SECONDS "
                    f"({timeout:g}s) and HANDLER_STUCK_GRACE_SECONDS ({grace:g}s): the worker exited "
                    f"(status {EXIT_STUCK_HANDLER}) so its supervisor restarts it",
                )
                self.write_health(consumer.subscription.name, EXIT_STUCK_HANDLER)
                logging.shutdown()
                os._exit(EXIT_STUCK_HANDLER)


class HealthReport:
    """A worker's health file, if it has one: written every second while
    the worker starts (``while_starting``: a broker or database it waits for
    can take long, and a probe reads the file's age), then by the watchdog,
    and a final state that says ``healthy: false, stopped: true`` with the
    exit code, so a probe never reads "healthy" from a worker that has exited.

    Args:
        path: The file (None: no health file; every call does nothing).
        snapshot: What the file says now, given a stuck subscription or None.
        run: Where the worker's run stands (starting; its exit code, for the final state).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        snapshot: Callable[[str | None], dict[str, Any]],
        run: RunState,
    ) -> None:
        self.file = HealthFile(path) if path else None
        self.snapshot = snapshot
        self.run = run
        # Re-entrant: the final write may come from a signal handler on a thread that holds it.
        self.lock = threading.RLock()

    def while_starting(self) -> None:
        """Write the file every second from a thread of its own while the
        worker starts and does not stop: a worker waiting for its broker or
        database says so (``"starting": true``, not healthy), since a probe
        reads the file's age. Each write holds ``lock``, as the final write
        does, so a start-up state can't land after the final one."""
        if self.file is None:
            return
        run = self.run

        def beat() -> None:
            while True:
                with self.lock:
                    if not run.starting or run.stop.is_set():
                        return
                    with contextlib.suppress(Exception):
                        self.write()
                run.stop.wait(1.0)

        threading.Thread(target=beat, name="platformkit-start-up-health", daemon=True).start()

    def write(self, stuck: str | None = None, final: bool = False) -> None:
        if self.file is None:
            return
        state = self.snapshot(stuck)
        if final:
            state.update(healthy=False, stopped=True, exit_code=self.run.exit_code)
        self.file.write(state)

    def final(self) -> None:
        with self.lock, contextlib.suppress(Exception):
            self.write(final=True)
