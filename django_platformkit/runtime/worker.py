"""The worker process: relay + the consumer pool + the scheduler, sharing
one broker connection.

The worker takes its ``WorkerOptions`` (``options.py``), has its parts
assembled once (``parts.py``) and owns their lifecycle: ``StartUp``
(``startup.py``: the broker, the stream and the durables made ready), the
``ConsumerPool`` (``consume/pool.py``: how deliveries reach handlers), the
relay and the scheduler, the ``StreamWatch`` (``streamwatch.py``: the
stream's standing while it runs), and the watchdog, heartbeat and health
file (``health.py``, ``heartbeat.py``); the parts read the run's
``RunState`` (``runstate.py``). The heartbeat and the scheduler
start first and never wait for the broker: jobs need only PostgreSQL, and a
worker waiting for NATS says so on its heartbeat row.

Stopping is cooperative: SIGTERM or SIGINT stops pulling, NAKs at once what
was fetched and not started, lets in-flight units finish and ack, and exits
0. A handler stuck past its timeout plus a grace period makes the process
exit 3 (the watchdog), and a crash of any worker thread or of the event
loop makes it exit 1, so its supervisor restarts it (never a live process
that no longer consumes). ``supervisor.py`` runs the relay and scheduler in
one process and N consumer processes under one parent (``runworker
--processes N``); ``runrelay`` is this worker with the relay alone.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from django.db import connections

from django_platformkit import conf
from django_platformkit.broker.connection import event_loop_kind
from django_platformkit.broker.port import Broker
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.pool import ConsumerPool, pool_thread_count
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.outbox.relay import Relay, RelayStats
from django_platformkit.runtime import burst
from django_platformkit.runtime.health import Watchdog
from django_platformkit.runtime.heartbeat import Heartbeat
from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.parts import WorkerParts
from django_platformkit.runtime.recycle import EXIT_RECYCLE
from django_platformkit.runtime.threads import Threads

logger = logging.getLogger(__name__)

#: The GIL switch interval while the relay shares the process with
#: consumers (Python's default is 5 ms): a relay draining a backlog is
#: CPU-bound, and every time a consumer thread's database or NATS answer
#: arrives it would wait up to one interval for the GIL (the convoy effect
#: that dropped consumers to 30-70 handlings/s). ``--processes`` avoids it.
SHARED_SWITCH_INTERVAL_SECONDS = 0.001


class Worker:
    """Compose relay, consumer pool and scheduler over one broker.

    Args:
        options: What it runs (default: ``WorkerOptions()``: relay, every
            registered subscription and every job, until stopped).
        transport: The broker (default: a ``Transport`` to ``NATS_URL``).

    Raises:
        ConfigurationError: A subscription's ``rate_limit`` can't be read.
    """

    def __init__(self, options: WorkerOptions | None = None, *, transport: Broker | None = None) -> None:
        if transport is None:
            from django_platformkit.broker.transport import Transport

            transport = Transport()
        self.options = options or WorkerOptions()
        self.transport: Broker = transport
        self.parts = WorkerParts(self.options, transport)
        self.run_state = self.parts.run
        self.stop_event = self.run_state.stop
        self.using = self.parts.using
        self._watchdog_thread: threading.Thread | None = None
        self._threads_done = threading.Event()

    # -- the parts, by the names callers use --
    @property
    def pool(self) -> ConsumerPool:
        return self.parts.pool

    @property
    def consumers(self) -> list[Consumer]:
        """Every consumer of the pool (one per subscription and ``concurrency`` slot)."""
        return self.parts.consumers

    @property
    def subscriptions(self) -> list[Subscription]:
        """The subscriptions this worker consumes (``options.subscriptions``, or every one registered)."""
        return self.parts.subscriptions

    @property
    def heartbeat(self) -> Heartbeat:
        return self.parts.heartbeat

    @property
    def threads(self) -> Threads:
        return self.parts.threads

    @property
    def relay(self) -> Relay | None:
        return self.parts.relay

    @property
    def exit_code(self) -> int:
        return self.run_state.exit_code

    def counts(self) -> dict[str, int]:
        """Totals of this process: relayed rows, and each handling outcome."""
        return self.parts.counts()

    # -- lifecycle --
    def install_signal_handlers(self) -> None:
        signals: list[str] = []  # a stop a recycle began is no first request: a SIGTERM then is no second
        parts = self.parts

        def handle(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            signals.append(name)
            if self.run_state.starting:
                self.stop_event.set()
                if parts.clock_side.scheduler is not None:
                    # Jobs may be running: start-up's waits end at once, the jobs get their grace.
                    logger.info("worker stopping signal=%s during start-up: letting running jobs finish", name)
                    return
                # Nothing fetched or running yet: leave now, not after a connect or durable check
                # that may take long (the heartbeat's thread writes the stopped row first, briefly).
                logger.info("worker stopping signal=%s during start-up: nothing in flight; exit=0", name)
                parts.clock_side.join_heartbeat(2.0)
                parts.health_file.final()
                logging.shutdown()
                os._exit(0)
            if len(signals) > 1:
                # Asked twice: the operator means it. In-flight transactions roll back; their messages are redelivered.
                logger.warning("worker stopping now signal=%s (second request): in-flight handlers are abandoned", name)
                parts.health_file.final()
                logging.shutdown()
                os._exit(1)
            logger.info("worker stopping signal=%s: finishing in-flight handlers (send it again to stop at once)", name)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        """Run until stopped (or drained, with ``burst``).

        Returns:
            The exit code: 0, ``runstate.EXIT_CRASHED``, or 1 for a burst not drained in time.
        """
        parts, options = self.parts, self.options
        parts.health_file.while_starting()
        try:
            self.refuse_a_small_connection_pool()
            parts.clock_side.start(give_up=options.burst)  # jobs, controls, heartbeat: only PostgreSQL, never NATS
            # A burst is a script's step: fail it rather than wait forever for a broker.
            if not parts.start_up.connect_and_ensure_stream(give_up=options.burst):
                return self._stopped_in_start_up()
            parts.heartbeat.instance = parts.start_up.instance or ""
            if options.consumers:
                parts.start_up.ensure_durables(parts.subscriptions)
            if self.stop_event.is_set():
                return self._stopped_in_start_up()
        except ConfigurationError as exc:
            self._end_start_up(refused=str(exc))
            raise
        except BaseException:
            self._end_start_up()
            raise
        logger.info(
            "worker started pid=%s relay=%s subscriptions=%s threads=%s batch_size=%s scheduler=%s burst=%s loop=%s",
            os.getpid(),
            options.relay,
            len(self.pool.lanes) if options.consumers else "-",
            pool_thread_count([lane.subscription for lane in self.pool.lanes]),
            conf.settings.CONSUMER_BATCH_SIZE,
            options.runs_scheduler,
            options.burst,
            event_loop_kind(),
        )
        try:
            if options.burst:
                self._run_burst()
            else:
                self._run_forever()
        finally:
            self.stop_event.set()
            self._shutdown()
        return self.exit_code

    def refuse_a_small_connection_pool(self) -> None:
        """``StartUp.refuse_a_small_connection_pool`` (``ConfigurationError``) with this worker's threads."""
        self.parts.refuse_a_small_connection_pool()

    def relay_once(self) -> RelayStats | None:
        """One relay pass on this worker's start-up path (``runrelay --once``):
        connect and ensure the stream as ``run()`` does (``BrokerUnavailable``
        after ``connect_timeout_seconds``), relay what is due now, close.
        Returns the pass's ``RelayStats`` (``deferred``: pending rows not due
        yet), or None when stopped during start-up. An unreachable database
        raises ``DatabaseUnavailable`` after one attempt; a database error of
        the pass propagates; the rows it concerns stay pending."""
        start_up = self.parts.start_up
        try:
            start_up.reach_the_database_once()
            if not start_up.connect_and_ensure_stream(give_up=True):
                self._stopped_in_start_up()
                return None
            self.run_state.started()  # from here a signal lets the pass stop after its current batch
            relay = self.relay or Relay(self.transport, using=self.using)
            stats = relay.drain(self.stop_event)
            stats.deferred = relay.deferred_count()
            return stats
        finally:
            self.transport.close()
            connections.close_all()

    def _stopped_in_start_up(self) -> int:
        logger.info("worker stopped during start-up exit=%s", self.exit_code)
        self._end_start_up()
        return self.exit_code

    def _end_start_up(self, refused: str = "") -> None:
        """Start-up ends without running: stop the clock side (jobs get
        their grace), write the heartbeat's stopped row (``refused``: why the
        stream was refused, and the fix) and the final health state."""
        self.heartbeat.refusal = refused
        self.stop_event.set()
        self.threads.join()
        self.parts.clock_side.join_heartbeat()
        self.parts.health_file.final()
        self.transport.close()

    def _shutdown(self) -> None:
        self.run_state.started()
        self.parts.watch.wake()  # it waits for the next look or a stream change: it sees the stop now
        self.pool.stop_pulling()
        # Nothing is fetched any more: hand back what waits now, not after the
        # in-flight units (early fetch queues a unit behind a running one).
        self.pool.hand_back_queued()
        # The watchdog keeps watching until the others are done: a handler
        # stuck past its timeout + grace still ends the process (status 3)
        # instead of hanging the shutdown forever.
        self.threads.join(but=self._watchdog_thread)
        self.pool.hand_back_queued()  # again: a puller whose stop timed out may have delivered since
        self._threads_done.set()
        if self._watchdog_thread is not None:
            self._watchdog_thread.join()
        self.transport.close()
        connections.close_all()
        self.parts.health_file.final()
        logger.info(
            "worker stopped exit=%s uptime=%.0fs totals %s",
            self.exit_code,
            time.monotonic() - self.parts.started_at,
            " ".join(f"{k}={v}" for k, v in self.counts().items()),
        )

    def _start_watchdog(self) -> None:
        watchdog = Watchdog(
            self.parts,
            stopping=self.stop_event,
            done=self._threads_done,
            timeout_seconds=float(conf.settings.HANDLER_TIMEOUT_SECONDS),
            grace_seconds=float(conf.settings.HANDLER_STUCK_GRACE_SECONDS),
        )
        self._watchdog_thread = self.threads.spawn("platformkit-watchdog", watchdog.run)

    def _run_forever(self) -> None:
        self.run_state.started()  # from here a signal stops gracefully: units may be in flight
        if self.relay is not None and self.pool.lanes:
            sys.setswitchinterval(min(sys.getswitchinterval(), SHARED_SWITCH_INTERVAL_SECONDS))
        if self.relay is not None:
            self.threads.spawn("platformkit-relay", functools.partial(self.relay.run, self.stop_event))
        self.pool.start()
        self.threads.spawn("platformkit-stream-watch", self.parts.watch.run)
        self._start_watchdog()
        recycle = self.options.recycle
        if recycle is None:
            while not self.stop_event.wait(0.5):
                pass
        elif recycle.wait(self.stop_event, lambda: sum(sum(c.counts.values()) for c in self.consumers)):
            # As SIGTERM stops: nothing more is fetched, what was fetched and not
            # started is handed back uncounted, in-flight units finish and ack.
            self.run_state.exit_code = EXIT_RECYCLE
            self.stop_event.set()

    # -- burst --
    def _run_burst(self) -> None:
        """Drain everything, then stop (``burst.drain``)."""
        self.run_state.started()
        self.pool.start()
        self._start_watchdog()
        not_drained = burst.drain(
            relay=self.relay,
            pool=self.pool,
            broker=self.transport,
            using=self.using,
            stop_event=self.stop_event,
            timeout_seconds=self.options.burst_timeout_seconds,
            wait_for_outbox=self.options.drain_waits_for_outbox,
        )
        if not_drained:  # a crash meanwhile keeps its own exit code
            self.run_state.exit_code = not_drained
