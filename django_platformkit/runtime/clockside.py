"""A worker's clock side: its heartbeat, its scheduler and its look at the
operators' controls (``controlwatch``), which need only PostgreSQL. They
start before the worker reaches NATS and never wait for it - a worker
started while NATS is down runs its jobs and is listed on the overview as
waiting for the broker - and the heartbeat row says what the worker does
(``models.WorkerState``, told from the run's ``RunState``) at every beat.
The controls are read first, so a pause or a disable holds from a worker's
first unit and first slot. Its reconciliation (``reconciling.py``) starts
with them and makes its first pass as soon as the worker has started (it
needs the broker), then one per interval.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from django_platformkit import conf
from django_platformkit.broker.port import Broker
from django_platformkit.consume.pool import ConsumerPool
from django_platformkit.jobs.controls import JobSwitches
from django_platformkit.models import WorkerState
from django_platformkit.runtime.controlwatch import ControlWatch
from django_platformkit.runtime.heartbeat import Heartbeat, StateReport
from django_platformkit.runtime.reconciling import ReconcileLoop
from django_platformkit.runtime.runstate import RunState
from django_platformkit.runtime.startup import StartUp


class _Contest(Protocol):
    """The stream watch's word on a contest over the stream (``StreamWatch``)."""

    @property
    def contest(self) -> str: ...


class ClockSide:
    """The heartbeat and the scheduler of one worker.

    Args:
        subscriptions: The names the worker consumes, for its heartbeat row.
        broker: The worker's broker (connected or not).
        start_up: What the worker's start-up waits for (``StartUp.waiting``).
        run: Where the worker's run stands (still starting; stopping).
        watch: The contest over the stream now (``StreamWatch.contest``, "" when none).
        spawn: Starts a named thread that crashes the worker if it raises.
        scheduler: Run the periodic jobs (``jobs``: which; None: all).
        pool: The worker's consumer pool, or None (it consumes nothing): its
            control watch reads the pauses for it as well as the job switches.
        using: The database alias of the ledger and the heartbeat.
    """

    def __init__(
        self,
        subscriptions: Sequence[str],
        *,
        broker: Broker,
        start_up: StartUp,
        run: RunState,
        watch: _Contest,
        spawn: Callable[[str, Callable[[], object]], threading.Thread],
        scheduler: bool,
        jobs: Sequence[str] | None,
        pool: ConsumerPool | None = None,
        using: str,
    ) -> None:
        #: The worker's heartbeat row, saying ``state()`` at each beat. The
        #: overview's "workers seen", from before the broker is reached.
        self.heartbeat = Heartbeat(subscriptions, using=using, state=self.state)
        self.broker = broker
        self.start_up = start_up
        self.run_state = run
        self.watch = watch
        self.stop = run.stop
        self.spawn = spawn
        self.want_scheduler = scheduler
        self.jobs = jobs
        self.using = using
        #: The operators' controls this worker obeys: pauses for its pool, job switches for its scheduler.
        self.controls = ControlWatch(
            using=using,
            stop=run.stop,
            pool=pool,
            switches=JobSwitches() if scheduler else None,
        )
        #: The scheduler once started (None: none, or not yet).
        self.scheduler: Any = None
        self._beating: threading.Thread | None = None

    def start(self, *, give_up: bool = False) -> None:
        """Read the controls (waiting out a database that can't answer yet;
        ``give_up``: a run-once mode's bound, ``StartUp.wait_for``) and keep
        reading them, beat (from a thread of its own while the worker
        starts; the watchdog beats after), start the scheduler and the reconciliation."""
        if self.controls.wanted:
            self.start_up.wait_for(self.controls.first_look, "database", give_up=give_up)
            self.spawn("platformkit-controls", self.controls.run)
        self._beating = self.heartbeat.beat_while(self.run_state)
        loop = ReconcileLoop(self.broker, start_up=self.start_up, run=self.run_state, using=self.using)
        self.spawn("platformkit-reconcile", loop.run)
        if self.want_scheduler:
            from django_platformkit.jobs.scheduler import Scheduler

            self.scheduler = Scheduler(using=self.using, jobs=self.jobs, switches=self.controls.switches)
            self.spawn("platformkit-scheduler", functools.partial(self.scheduler.run, self.stop))

    def join_heartbeat(self, timeout: float | None = None) -> None:
        """Wait for the start-up heartbeat thread (it writes the stopped row once ``stop`` is set)."""
        if self._beating is not None:
            self._beating.join(timeout)

    def state(self) -> StateReport:
        """What the heartbeat row says the worker does now."""
        if self.run_state.starting:
            waiting = self.start_up.waiting
            return (WorkerState.WAITING_FOR_BROKER, waiting) if waiting else (WorkerState.STARTING, "")
        if not self.broker.connected.is_set():
            return WorkerState.WAITING_FOR_BROKER, f"NATS at {conf.redact_url(self.broker.url)}: reconnecting"
        contest = self.watch.contest
        return (WorkerState.CONTESTED, contest) if contest else (WorkerState.RUNNING, "")
