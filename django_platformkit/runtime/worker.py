"""The worker process: relay + the consumer pool + the scheduler, sharing
one broker connection.

The worker is given its parts and owns their lifecycle: ``StartUp``
(``startup.py``: the broker, the stream and the durables made ready), the
``ConsumerPool`` (``consume/pool.py``: how deliveries reach handlers), the
relay and the scheduler, the ``StreamWatch`` (``streamwatch.py``: the
stream's standing while it runs), and the watchdog, heartbeat and health
file (``health.py``, ``heartbeat.py``). The heartbeat and the scheduler
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
from collections import Counter
from collections.abc import Sequence
from typing import Any

from django.db import connections

from django_platformkit import conf
from django_platformkit.broker.connection import event_loop_kind
from django_platformkit.broker.port import Broker
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.pool import ConsumerPool, pool_connection_count, pool_thread_count
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.subscriptions import subscriptions as registered_subscriptions
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.outbox.relay import Relay, RelayStats
from django_platformkit.runtime import burst
from django_platformkit.runtime.clockside import ClockSide
from django_platformkit.runtime.health import HealthReport, Watchdog
from django_platformkit.runtime.heartbeat import Heartbeat
from django_platformkit.runtime.recycle import EXIT_RECYCLE, RecyclePolicy
from django_platformkit.runtime.startup import StartUp
from django_platformkit.runtime.streamwatch import StreamWatch
from django_platformkit.runtime.threads import Threads

logger = logging.getLogger(__name__)

#: Exit status when a worker thread or the event loop died.
EXIT_CRASHED = 1
#: The GIL switch interval while the relay shares the process with
#: consumers (Python's default is 5 ms): a relay draining a backlog is
#: CPU-bound, and every time a consumer thread's database or NATS answer
#: arrives it would wait up to one interval for the GIL (the convoy effect
#: that dropped consumers to 30-70 handlings/s). ``--processes`` avoids it.
SHARED_SWITCH_INTERVAL_SECONDS = 0.001


class Worker:
    """Compose relay, consumer pool and scheduler over one broker.

    Args:
        transport: The broker (default: a ``Transport`` to ``NATS_URL``).
        relay: Run the relay.
        consumers: Run the subscriptions' consumers.
        scheduler: Run the periodic jobs (never with ``burst``).
        burst: Drain the outbox and every consumer (nothing pending, nothing
            awaiting ack or retry), run no jobs, then return.
        subscriptions: Which subscriptions to consume (default: all registered).
        using: The database alias (default ``DATABASE_ALIAS``).
        health_file: A JSON file rewritten every second with liveness and
            counts, and a final ``{"healthy": false, "stopped": true}``.
        burst_timeout_seconds: With ``burst``: fail (exit 1) if not drained by then.
        jobs: Which periodic jobs the scheduler runs (default: all).
        connect_timeout_seconds: With ``burst`` (and ``relay_once``), how
            long to keep trying to reach NATS before failing (a running
            worker waits for it forever).
        recycle: When to stop and exit ``EXIT_RECYCLE`` so a supervisor
            starts a fresh process (``recycle.py``), or None.
        burst_waits_for_relay: With ``burst`` and no relay: another process
            relays, so drained also means no row due in the outbox.
    """

    def __init__(
        self,
        *,
        transport: Broker | None = None,
        relay: bool = True,
        consumers: bool = True,
        scheduler: bool = True,
        burst: bool = False,
        subscriptions: Sequence[Subscription] | None = None,
        using: str | None = None,
        health_file: str | os.PathLike[str] | None = None,
        burst_timeout_seconds: float | None = None,
        jobs: Sequence[str] | None = None,
        connect_timeout_seconds: float = 30.0,
        recycle: RecyclePolicy | None = None,
        burst_waits_for_relay: bool = False,
    ) -> None:
        if transport is None:
            from django_platformkit.broker.transport import Transport

            transport = Transport()
        self.transport: Broker = transport
        self.using = using or conf.settings.DATABASE_ALIAS
        self.want_relay = relay
        self.want_consumers = consumers
        self.want_scheduler = scheduler and not burst
        self.burst = burst
        self.burst_timeout_seconds = burst_timeout_seconds
        self.burst_waits_for_relay = burst_waits_for_relay or relay
        self.subscriptions = list(registered_subscriptions() if subscriptions is None else subscriptions)
        self.exit_code = 0
        self.threads = Threads(on_crash=self._crash)
        self.health_file = HealthReport(health_file, self.health, lambda: self.exit_code)
        self.stop_event = threading.Event()
        self.start_up = StartUp(
            self.transport,
            using=self.using,
            stop_event=self.stop_event,
            connect_timeout_seconds=connect_timeout_seconds,
        )
        self.pool = ConsumerPool(
            self.transport, [], using=self.using, stop_event=self.stop_event, spawn=self.threads.spawn
        )
        self.relay: Relay | None = None
        self._started = time.monotonic()
        self._watchdog_thread: threading.Thread | None = None
        self._threads_done = threading.Event()
        self.job_names = None if jobs is None else list(jobs)  # None: every registered job
        self._starting = True
        self._crashed: str | None = None
        self.recycle = recycle
        self.watch = StreamWatch(self.transport, start_up=self.start_up, refuse=self._refuse, stop=self.stop_event)
        # The admin overview's "workers seen", from before the broker is reached.
        self.heartbeat = Heartbeat([s.name for s in self.subscriptions] if consumers else [], using=self.using)
        self.clock_side = ClockSide(
            self.heartbeat,
            broker=self.transport,
            start_up=self.start_up,
            starting=lambda: self._starting,
            contest=lambda: self.watch.contest,
            stop=self.stop_event,
            spawn=self.threads.spawn,
            scheduler=self.want_scheduler,
            jobs=self.job_names,
            consumers=consumers,
            using=self.using,
        )

    @property
    def consumers(self) -> list[Consumer]:
        """Every consumer of the pool (one per subscription and ``concurrency`` slot)."""
        return self.pool.consumers

    # -- lifecycle --
    def install_signal_handlers(self) -> None:
        signals: list[str] = []  # a stop a recycle began is no first request: a SIGTERM then is no second

        def handle(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            signals.append(name)
            if self._starting:
                self.stop_event.set()
                if self.clock_side.scheduler is not None:
                    # Jobs may be running: start-up's waits end at once, the jobs get their grace.
                    logger.info("worker stopping signal=%s during start-up: letting running jobs finish", name)
                    return
                # Nothing fetched or running yet: leave now, not after a connect or durable check
                # that may take long (the heartbeat's thread writes the stopped row first, briefly).
                logger.info("worker stopping signal=%s during start-up: nothing in flight; exit=0", name)
                self.clock_side.join_heartbeat(2.0)
                self.health_file.final()
                logging.shutdown()
                os._exit(0)
            if len(signals) > 1:
                # Asked twice: the operator means it. In-flight transactions roll back; their messages are redelivered.
                logger.warning("worker stopping now signal=%s (second request): in-flight handlers are abandoned", name)
                self.health_file.final()
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
            The exit code: 0, ``EXIT_CRASHED``, or 1 for a burst not drained in time.
        """
        self.health_file.while_starting(lambda: self._starting, self.stop_event)
        try:
            self.refuse_a_small_connection_pool()
            self.clock_side.start(give_up=self.burst)  # jobs, controls, heartbeat: only PostgreSQL, never NATS
            # A burst is a script's step: fail it rather than wait forever for a broker.
            if not self.start_up.connect_and_ensure_stream(give_up=self.burst):
                return self._stopped_in_start_up()
            self.heartbeat.instance = self.start_up.instance or ""
            if self.want_consumers:
                controls = self.clock_side.controls
                self.pool = self.start_up.consumer_pool(
                    self.subscriptions, spawn=self.threads.spawn, contested=self.watch.contested, pauses=controls.pauses
                )
                controls.pool = self.pool  # a pause hands back what waits; a resume fetches
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
            self.want_relay,
            len(self.pool.lanes) if self.want_consumers else "-",
            pool_thread_count([lane.subscription for lane in self.pool.lanes]),
            conf.settings.CONSUMER_BATCH_SIZE,
            self.want_scheduler,
            self.burst,
            event_loop_kind(),
        )
        try:
            if self.burst:
                self._run_burst()
            else:
                self._run_forever()
        finally:
            self.stop_event.set()
            self._shutdown()
        return self.exit_code

    def refuse_a_small_connection_pool(self) -> None:
        """``StartUp.refuse_a_small_connection_pool`` (``ConfigurationError``) with this worker's threads."""
        self.start_up.refuse_a_small_connection_pool(
            threads=pool_connection_count(self.subscriptions) if self.want_consumers else 0,
            relay_lanes=int(conf.settings.RELAY_LANES) if self.want_relay else 0,
            scheduler=self.want_scheduler,
        )

    def relay_once(self) -> RelayStats | None:
        """One relay pass on this worker's start-up path (``runrelay --once``):
        connect and ensure the stream as ``run()`` does (``BrokerUnavailable``
        after ``connect_timeout_seconds``), relay what is due now, close.
        Returns the pass's ``RelayStats`` (``deferred``: pending rows not due
        yet), or None when stopped during start-up. An unreachable database
        raises ``DatabaseUnavailable`` after one attempt; a database error of
        the pass propagates; the rows it concerns stay pending."""
        try:
            self.start_up.reach_the_database_once()
            if not self.start_up.connect_and_ensure_stream(give_up=True):
                self._stopped_in_start_up()
                return None
            self._starting = False  # from here a signal lets the pass stop after its current batch
            self.relay = Relay(self.transport, using=self.using)
            stats = self.relay.drain(self.stop_event)
            stats.deferred = self.relay.deferred_count()
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
        self.clock_side.join_heartbeat()
        self.health_file.final()
        self.transport.close()

    def _refuse(self, text: str) -> None:
        """The ``StreamWatch`` found the stream refused while running: stop as start-up would have refused it."""
        logger.critical("stream refused while running: %s; stopping exit=%s", text, EXIT_CRASHED)
        self.heartbeat.refusal = text
        self.exit_code = EXIT_CRASHED
        self.stop_event.set()
        self.pool.notify_stopping()

    def _shutdown(self) -> None:
        self._starting = False
        self.watch.wake()  # it waits for the next look or a stream change: it sees the stop now
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
        self.health_file.final()
        logger.info(
            "worker stopped exit=%s uptime=%.0fs totals %s",
            self.exit_code,
            time.monotonic() - self._started,
            " ".join(f"{k}={v}" for k, v in self.counts().items()),
        )

    def counts(self) -> dict[str, int]:
        """Totals of this process: relayed rows, and each handling outcome."""
        totals: Counter[str] = Counter({"relayed": self.relay.totals.stored if self.relay else 0})
        for consumer in self.consumers:
            totals.update(consumer.counts)
        return {str(key): value for key, value in totals.items()}

    # -- threads --
    def _crash(self, name: str, exc: BaseException) -> None:
        # Never a live process that no longer consumes: stop everything and
        # exit non-zero so the supervisor starts a fresh one.
        logger.critical(
            "worker thread crashed thread=%s error=%r; stopping the worker exit=%s",
            name,
            exc,
            EXIT_CRASHED,
            exc_info=exc,
        )
        self._crashed = name
        self.exit_code = EXIT_CRASHED
        self.stop_event.set()
        self.pool.notify_stopping()

    # -- watchdog, progress, health (health.py) --
    def _watchdog(self) -> None:
        Watchdog(
            consumers=self.consumers,
            counts=self.counts,
            check_alive=self._check_alive,
            write_health=self._write_watchdog_health,
            heartbeat=self.heartbeat,
            stopping=self.stop_event,
            done=self._threads_done,
            timeout_seconds=float(conf.settings.HANDLER_TIMEOUT_SECONDS),
            grace_seconds=float(conf.settings.HANDLER_STUCK_GRACE_SECONDS),
        ).run()

    def _check_alive(self) -> None:
        """A dead event loop or a crashed lane means nothing is fetched any more: end the process."""
        if not self.transport.loop_alive():
            self._crash("platformkit-nats", RuntimeError("the NATS event loop thread died"))
            return
        dead = self.pool.dead_puller()
        if dead is not None:
            self._crash(f"pull-{dead[0]}", dead[1])

    def health(self, stuck: str | None = None) -> dict[str, Any]:
        """What the health file says now (``stuck``: a subscription the watchdog found stuck)."""
        now = time.monotonic()
        stuck_subscriptions = self.pool.stuck(float(conf.settings.HANDLER_TIMEOUT_SECONDS))
        stopped = self.stop_event.is_set()
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(now - self._started, 1),
            "broker_connected": self.transport.connected.is_set(),
            "stuck_handlers": stuck_subscriptions or ([stuck] if stuck else []),
            "healthy": not stuck_subscriptions
            and not stuck
            and not stopped
            and not self._starting
            and self._crashed is None
            and self.transport.connected.is_set(),
            "starting": self._starting,
            "stopped": stopped,
            "crashed": self._crashed,
            "counts": self.counts(),
            "time": time.time(),
        }

    def _write_watchdog_health(self, stuck: str | None, exit_code: int | None) -> None:
        # exit_code: the watchdog is about to end the process (os._exit), so
        # this is the last state a probe will read: stopped, with the code.
        if exit_code is not None:
            self.exit_code = exit_code
        self.health_file.write(stuck=stuck, final=exit_code is not None)

    def _run_forever(self) -> None:
        self._starting = False  # from here a signal stops gracefully: units may be in flight
        if self.want_relay and self.pool.lanes:
            sys.setswitchinterval(min(sys.getswitchinterval(), SHARED_SWITCH_INTERVAL_SECONDS))
        if self.want_relay:
            self.relay = Relay(self.transport, using=self.using)
            self.threads.spawn("platformkit-relay", functools.partial(self.relay.run, self.stop_event))
        self.pool.start()
        self.threads.spawn("platformkit-stream-watch", self.watch.run)
        self._watchdog_thread = self.threads.spawn("platformkit-watchdog", self._watchdog)
        if self.recycle is None:
            while not self.stop_event.wait(0.5):
                pass
        elif self.recycle.wait(self.stop_event, lambda: sum(sum(c.counts.values()) for c in self.consumers)):
            # As SIGTERM stops: nothing more is fetched, what was fetched and not
            # started is handed back uncounted, in-flight units finish and ack.
            self.exit_code = EXIT_RECYCLE
            self.stop_event.set()

    # -- burst --
    def _run_burst(self) -> None:
        """Drain everything, then stop (``burst.drain``)."""
        self._starting = False
        self.relay = Relay(self.transport, using=self.using) if self.want_relay else None
        self.pool.start()
        self._watchdog_thread = self.threads.spawn("platformkit-watchdog", self._watchdog)
        not_drained = burst.drain(
            relay=self.relay,
            pool=self.pool,
            broker=self.transport,
            using=self.using,
            stop_event=self.stop_event,
            timeout_seconds=self.burst_timeout_seconds,
            wait_for_outbox=self.burst_waits_for_relay,
        )
        if not_drained:  # a crash meanwhile keeps its own exit code
            self.exit_code = not_drained
