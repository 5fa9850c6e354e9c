"""A worker's parts, assembled once from its ``WorkerOptions``: the run's
shared state (``runstate.py``), the start-up, the consumer pool with its
lanes, the stream watch, the clock side (heartbeat, scheduler, controls,
reconciliation), the relay and the health file. Each part is given what it
reads - the run's state, the pool, the watch - never a callback into the
worker, and the pool is built here and only here: start-up ensures its
durables, it never replaces it. ``worker.py`` drives their lifecycle.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

from django_platformkit import conf
from django_platformkit.broker.port import Broker
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.pausing import Pauses
from django_platformkit.consume.pool import ConsumerPool, Lane, pool_connection_count
from django_platformkit.consume.subscriptions import subscriptions as registered_subscriptions
from django_platformkit.outbox.relay import Relay
from django_platformkit.runtime.clockside import ClockSide
from django_platformkit.runtime.health import HealthReport
from django_platformkit.runtime.heartbeat import Heartbeat
from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.runstate import EXIT_CRASHED, RunState
from django_platformkit.runtime.startup import StartUp
from django_platformkit.runtime.streamwatch import StreamWatch
from django_platformkit.runtime.threads import Threads

logger = logging.getLogger(__name__)


class WorkerParts:
    """Every part of one worker, built for ``options`` over ``broker``.

    Args:
        options: What the worker runs.
        broker: The worker's broker (not connected yet).

    Raises:
        ConfigurationError: A subscription's ``rate_limit`` can't be read
            (the checks refuse it too: ``platformkit.E011``).
    """

    def __init__(self, options: WorkerOptions, broker: Broker) -> None:
        self.options = options
        self.broker = broker
        self.using = options.using or conf.settings.DATABASE_ALIAS
        chosen = options.subscriptions
        self.subscriptions = list(registered_subscriptions() if chosen is None else chosen)
        self.run = RunState()
        self.threads = Threads(on_crash=self.crash)
        self.start_up = StartUp(
            broker, using=self.using, stop_event=self.run.stop, connect_timeout_seconds=options.connect_timeout_seconds
        )
        self.watch = StreamWatch(broker, start_up=self.start_up, refuse=self.refuse, stop=self.run.stop)
        self.pool = self._consumer_pool()
        self.run.on_stop(self.pool.notify_stopping)
        self.clock_side = ClockSide(
            [s.name for s in self.subscriptions] if options.consumers else [],
            broker=broker,
            start_up=self.start_up,
            run=self.run,
            watch=self.watch,
            spawn=self.threads.spawn,
            scheduler=options.runs_scheduler,
            jobs=options.jobs,
            pool=self.pool if options.consumers else None,
            using=self.using,
        )
        self.relay = Relay(broker, using=self.using) if options.relay else None
        self.health_file = HealthReport(options.health_file, self.health, self.run)
        self.started_at = time.monotonic()

    def _consumer_pool(self) -> ConsumerPool:
        """The pool: with ``consumers``, one lane per subscription with its
        consumers (one per ``concurrency`` slot), which read the watch's
        ``contested`` and the controls' pauses; without, an empty one."""
        if not self.options.consumers:
            return ConsumerPool(self.broker, [], using=self.using, stop_event=self.run.stop, spawn=self.threads.spawn)
        pauses = Pauses()
        lanes = [
            Lane(
                subscription,
                [
                    Consumer(
                        subscription,
                        self.broker,
                        using=self.using,
                        stop=self.run.stop,
                        instance=i,
                        contested=self.watch.contested,
                        pauses=pauses,
                    )
                    for i in range(subscription.concurrency)
                ],
                using=self.using,
            )
            for subscription in self.subscriptions
        ]
        return ConsumerPool(
            self.broker, lanes, using=self.using, stop_event=self.run.stop, spawn=self.threads.spawn, pauses=pauses
        )

    @property
    def heartbeat(self) -> Heartbeat:
        return self.clock_side.heartbeat

    @property
    def consumers(self) -> list[Consumer]:
        return self.pool.consumers

    def refuse_a_small_connection_pool(self) -> None:
        """``StartUp.refuse_a_small_connection_pool`` (``ConfigurationError``) with this worker's threads."""
        self.start_up.refuse_a_small_connection_pool(
            threads=pool_connection_count(self.subscriptions) if self.options.consumers else 0,
            relay_lanes=int(conf.settings.RELAY_LANES) if self.options.relay else 0,
            scheduler=self.options.runs_scheduler,
        )

    # -- ending the run early --
    def crash(self, name: str, exc: BaseException) -> None:
        """A worker thread (``name``) crashed: never a live process that no
        longer consumes: stop everything and exit non-zero so the supervisor
        starts a fresh one."""
        logger.critical(
            "worker thread crashed thread=%s error=%r; stopping the worker exit=%s",
            name,
            exc,
            EXIT_CRASHED,
            exc_info=exc,
        )
        self.run.end(EXIT_CRASHED, crashed=name)

    def refuse(self, text: str) -> None:
        """The ``StreamWatch`` found the stream refused while running: stop as start-up would have refused it."""
        logger.critical("stream refused while running: %s; stopping exit=%s", text, EXIT_CRASHED)
        self.heartbeat.refusal = text
        self.run.end(EXIT_CRASHED)

    # -- what the watchdog watches (health.Watchdog) --
    def check_alive(self) -> None:
        """A dead event loop or a crashed lane means nothing is fetched any more: end the process."""
        if not self.broker.loop_alive():
            self.crash("platformkit-nats", RuntimeError("the NATS event loop thread died"))
            return
        dead = self.pool.dead_puller()
        if dead is not None:
            self.crash(f"pull-{dead[0]}", dead[1])

    def write_health(self, stuck: str | None, exit_code: int | None) -> None:
        # exit_code: the watchdog is about to end the process (os._exit), so
        # this is the last state a probe will read: stopped, with the code.
        if exit_code is not None:
            self.run.exit_code = exit_code
        self.health_file.write(stuck=stuck, final=exit_code is not None)

    def counts(self) -> dict[str, int]:
        """Totals of this process: relayed rows, and each handling outcome."""
        totals: Counter[str] = Counter({"relayed": self.relay.totals.stored if self.relay else 0})
        for consumer in self.consumers:
            totals.update(consumer.counts)
        return {str(key): value for key, value in totals.items()}

    def health(self, stuck: str | None = None) -> dict[str, Any]:
        """What the health file says now (``stuck``: a subscription the watchdog found stuck)."""
        now = time.monotonic()
        stuck_subscriptions = self.pool.stuck(float(conf.settings.HANDLER_TIMEOUT_SECONDS))
        stopped = self.run.stopping
        starting = self.run.starting
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(now - self.started_at, 1),
            "broker_connected": self.broker.connected.is_set(),
            "stuck_handlers": stuck_subscriptions or ([stuck] if stuck else []),
            "healthy": not stuck_subscriptions
            and not stuck
            and not stopped
            and not starting
            and self.run.crashed is None
            and self.broker.connected.is_set(),
            "starting": starting,
            "stopped": stopped,
            "crashed": self.run.crashed,
            "counts": self.counts(),
            "time": time.time(),
        }
