"""The worker process: relay + one consumer thread per subscription + the
scheduler, sharing one NATS connection. Stopping is cooperative: SIGTERM or
SIGINT stops fetching, lets in-flight handlers finish and ack, and exits 0.
A handler stuck past its timeout plus a grace period makes the process exit
non-zero so its supervisor restarts it (a Python thread can't be killed).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from django.db import DatabaseError, connections

from . import conf
from .consumer import Consumer, Subscription, subscriptions as registered_subscriptions
from .exceptions import BrokerUnavailable, ConsumerDrift
from .models import OutboxEvent
from .relay import Relay
from .transport import Transport

logger = logging.getLogger(__name__)

#: Exit status when a handler is stuck past HANDLER_TIMEOUT_SECONDS + grace.
EXIT_STUCK_HANDLER = 3
#: How often an idle consumer re-checks that its durable still exists.
DURABLE_CHECK_SECONDS = 30.0
#: How often the worker logs its counts at INFO when they changed.
PROGRESS_LOG_SECONDS = 10.0


class Worker:
    """Compose relay, consumers and scheduler over one ``Transport``.

    ``relay``/``consumers``/``scheduler`` switch the parts on; ``jobs``
    names the periodic jobs the scheduler runs (default: all). ``burst``:
    drain the outbox and every consumer (nothing pending, nothing awaiting
    ack or retry), run no jobs, then return. ``health_file``: a JSON file
    rewritten every second with liveness and counts.
    ``connect_timeout_seconds``: with ``burst``, how long to keep trying to
    reach NATS before failing (a running worker waits for it forever).
    """

    def __init__(
        self,
        *,
        transport: Transport | None = None,
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
    ) -> None:
        self.transport = transport or Transport()
        self.using = using or conf.settings.DATABASE_ALIAS
        self.want_relay = relay
        self.want_consumers = consumers
        self.want_scheduler = scheduler and not burst
        self.burst = burst
        self.burst_timeout_seconds = burst_timeout_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self.subscriptions = list(registered_subscriptions() if subscriptions is None else subscriptions)
        self.health_file = Path(health_file) if health_file else None
        self.stop_event = threading.Event()
        self.relay: Relay | None = None
        self.consumers: list[Consumer] = []
        self.exit_code = 0
        self._threads: list[threading.Thread] = []
        self._started = time.monotonic()
        self._scheduler: Any = None
        self._watchdog_thread: threading.Thread | None = None
        self._threads_done = threading.Event()
        self.job_names = None if jobs is None else list(jobs)  # None: every registered job

    # -- lifecycle --
    def install_signal_handlers(self) -> None:
        def handle(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.stop_event.is_set():
                # Asked twice: the operator means it. In-flight transactions roll
                # back with the connections; their messages are redelivered.
                logger.warning("worker stopping now signal=%s (second request): in-flight handlers are abandoned", name)
                logging.shutdown()
                os._exit(1)
            logger.info("worker stopping signal=%s: finishing in-flight handlers (send it again to stop at once)", name)
            self.stop_event.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> int:
        """Run until stopped (or drained, with ``burst``). Returns the exit code."""
        # A burst is a script's step: fail it rather than wait forever for a broker.
        if not self.transport.connect_until(self.stop_event, give_up_after_seconds=self.connect_timeout_seconds if self.burst else None):
            return 0
        self._retry_until_stopped(self.transport.ensure_stream, f"stream {conf.settings.STREAM}")
        if self.want_consumers:
            for subscription in self.subscriptions:
                consumer = Consumer(subscription, self.transport, using=self.using, stop=self.stop_event)
                self._retry_until_stopped(consumer.ensure, f"durable {subscription.durable}")
                self.consumers.append(consumer)
            # A subscription's further concurrent consumers (no more than there
            # are threads: two on one thread would only take turns).
            threads = int(conf.settings.CONSUMER_THREADS)
            for subscription in self.subscriptions:
                self.consumers += [
                    Consumer(subscription, self.transport, using=self.using, stop=self.stop_event, instance=instance)
                    for instance in range(1, min(subscription.concurrency, threads))
                ]
        logger.info(
            "worker started pid=%s relay=%s subscriptions=%s scheduler=%s burst=%s",
            os.getpid(), self.want_relay, ",".join(s.name for s in self.subscriptions) if self.want_consumers else "-",
            self.want_scheduler, self.burst,
        )
        try:
            if self.burst:
                self._run_burst()
            else:
                self._run_forever()
        finally:
            self.stop_event.set()
            # The watchdog keeps watching until the others are done: a handler
            # stuck past its timeout + grace still ends the process (status 3)
            # instead of hanging the shutdown forever.
            for thread in self._threads:
                if thread is not self._watchdog_thread:
                    thread.join()
            self._threads_done.set()
            if self._watchdog_thread is not None:
                self._watchdog_thread.join()
            self.transport.close()
            connections.close_all()
            counts = self.counts()
            logger.info("worker stopped exit=%s %s", self.exit_code, " ".join(f"{k}={v}" for k, v in counts.items()))
        return self.exit_code

    def _retry_until_stopped(self, func, what: str) -> None:
        delay = 0.5
        while not self.stop_event.is_set():
            try:
                func()
                return
            except ConsumerDrift:
                raise
            except (BrokerUnavailable, nats.errors.Error, TimeoutError) as exc:
                logger.error("%s: broker unavailable error=%s; retrying in %.1fs", what, exc, delay)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10)

    def counts(self) -> dict[str, int]:
        totals: dict[str, int] = {"relayed": self.relay.totals.stored if self.relay else 0}
        for consumer in self.consumers:
            for key, value in consumer.counts.items():
                totals[key] = totals.get(key, 0) + value
        return totals

    # -- threads --
    def _spawn(self, name: str, target, *args) -> threading.Thread:
        thread = threading.Thread(target=self._guard, args=(name, target, *args), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _guard(self, name: str, target, *args) -> None:
        try:
            target(*args)
        except Exception:
            logger.exception("worker thread crashed thread=%s; stopping the worker", name)
            self.exit_code = 1
            self.stop_event.set()
        finally:
            connections.close_all()

    def _consume_loop(self, group: list[tuple[Consumer, threading.Event]]) -> None:
        """Serve a group of subscriptions from one thread (with its own
        database connection). With several, each fetch waits a share of a
        second, so an idle subscription can't hold up a busy one for long."""
        fetch_timeout = max(0.05, 1.0 / len(group))
        delays = {id(c): 0.5 for c, _ in group}
        verified = {id(c): time.monotonic() for c, _ in group}
        while not self.stop_event.is_set():
            for consumer, idle in group:
                if self.stop_event.is_set():
                    break
                delay = delays[id(consumer)]
                name = consumer.subscription.name
                try:
                    fetched = consumer.poll(timeout=fetch_timeout)
                    delays[id(consumer)] = 0.5
                    if fetched == 0:
                        idle.set()
                        if time.monotonic() - verified[id(consumer)] > DURABLE_CHECK_SECONDS:
                            # A pull on a durable that vanished (a broker that lost its
                            # store) just times out; re-ensure it now and then.
                            verified[id(consumer)] = time.monotonic()
                            consumer.ensure()
                    else:
                        idle.clear()
                except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError) as exc:
                    logger.error("consumer subscription=%s error=%s; re-creating the durable", name, exc)
                    self.transport.forget_pull(consumer.subscription.durable)
                    self.stop_event.wait(delay)
                    self._retry_until_stopped(consumer.ensure, f"durable {consumer.subscription.durable}")
                except (BrokerUnavailable, nats.errors.Error, TimeoutError, OSError) as exc:
                    logger.error("consumer subscription=%s broker error=%s; retrying in %.1fs", name, exc, delay)
                    self.stop_event.wait(delay)
                    delays[id(consumer)] = min(delay * 2, 10)
                except DatabaseError as exc:
                    logger.error("consumer subscription=%s database error=%s; retrying in %.1fs", name, exc, delay)
                    connections[self.using].close()
                    self.stop_event.wait(delay)
                    delays[id(consumer)] = min(delay * 2, 10)

    def _spawn_consumers(self) -> list[threading.Event]:
        """At most CONSUMER_THREADS threads; subscriptions dealt round-robin,
        and the k-th further consumer of a subscription k threads past its
        first, so a subscription's consumers never share a thread."""
        count = min(int(conf.settings.CONSUMER_THREADS), len(self.consumers))
        groups: list[list[tuple[Consumer, threading.Event]]] = [[] for _ in range(count)]
        idles = []
        first: dict[str, int] = {}
        for consumer in self.consumers:
            if consumer.instance == 0:
                first[consumer.subscription.name] = len(first)
        for consumer in self.consumers:
            idle = threading.Event()
            idles.append(idle)
            groups[(first[consumer.subscription.name] + consumer.instance) % count].append((consumer, idle))
        groups = [group for group in groups if group]  # the offsets can leave a thread without work
        for number, group in enumerate(groups):
            self._spawn(f"platformkit-consumer-{number}", self._consume_loop, group)
        return idles

    def _watchdog(self) -> None:
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        grace = float(conf.settings.HANDLER_STUCK_GRACE_SECONDS)
        warned: set[int] = set()
        last_counts, last_logged = self.counts(), time.monotonic()
        while not self._threads_done.wait(1.0):
            now = time.monotonic()
            if now - last_logged >= PROGRESS_LOG_SECONDS:
                counts = self.counts()
                if counts != last_counts:
                    logger.info("progress %s", " ".join(f"{k}={counts[k] - last_counts.get(k, 0)}" for k in counts))
                last_counts, last_logged = counts, now
            for consumer in self.consumers:
                started = consumer.handler_started
                if started is None:
                    warned.discard(id(consumer))
                    continue
                running = now - started
                if running > timeout and id(consumer) not in warned:
                    warned.add(id(consumer))
                    logger.error(
                        "handler stuck subscription=%s running=%.0fs timeout=%ss: its ack is no longer extended; "
                        "the worker exits in %.0fs unless it returns", consumer.subscription.name, running, timeout, timeout + grace - running,
                    )
                if running > timeout + grace:
                    logger.critical("handler stuck subscription=%s running=%.0fs: exiting status=%s so the supervisor restarts the worker", consumer.subscription.name, running, EXIT_STUCK_HANDLER)
                    self._write_health(stuck=consumer.subscription.name)
                    logging.shutdown()
                    os._exit(EXIT_STUCK_HANDLER)
            self._write_health()

    def health(self, stuck: str | None = None) -> dict[str, Any]:
        now = time.monotonic()
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        stuck_subscriptions = sorted({c.subscription.name for c in self.consumers if c.handler_started is not None and now - c.handler_started > timeout})
        return {
            "pid": os.getpid(),
            "uptime_seconds": round(now - self._started, 1),
            "broker_connected": self.transport.connected.is_set(),
            "stuck_handlers": stuck_subscriptions or ([stuck] if stuck else []),
            "healthy": not stuck_subscriptions and not stuck and self.transport.connected.is_set(),
            "counts": self.counts(),
            "time": time.time(),
        }

    def _write_health(self, stuck: str | None = None) -> None:
        if self.health_file is None:
            return
        tmp = self.health_file.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.health(stuck)))
            tmp.replace(self.health_file)
        except OSError as exc:  # a full disk must not take the worker down; the probe will notice
            logger.warning("health file not written path=%s error=%s", self.health_file, exc)

    def _run_forever(self) -> None:
        if self.want_relay:
            self.relay = Relay(self.transport, using=self.using)
            self._spawn("platformkit-relay", self.relay.run, self.stop_event)
        self._spawn_consumers()
        if self.want_scheduler:
            from .jobs import Scheduler

            self._scheduler = Scheduler(using=self.using, jobs=self.job_names)
            self._spawn("platformkit-scheduler", self._scheduler.run, self.stop_event)
        self._watchdog_thread = self._spawn("platformkit-watchdog", self._watchdog)
        while not self.stop_event.wait(0.5):
            pass

    # -- burst --
    def _run_burst(self) -> None:
        """Drain everything, then stop: nothing pending in the outbox, and no
        durable with messages pending, awaiting ack or awaiting a retry."""
        self.relay = Relay(self.transport, using=self.using) if self.want_relay else None
        idles = self._spawn_consumers()
        self._watchdog_thread = self._spawn("platformkit-watchdog", self._watchdog)
        deadline = None if self.burst_timeout_seconds is None else time.monotonic() + self.burst_timeout_seconds
        quiet = 0
        while not self.stop_event.is_set():
            if self.relay is not None:
                try:
                    self.relay.drain(self.stop_event)
                except DatabaseError as exc:
                    logger.error("relay database error=%s", exc)
                    connections[self.using].close()
            if self._drained(idles):
                quiet += 1
                if quiet >= 2:
                    return
            else:
                quiet = 0
            if deadline is not None and time.monotonic() > deadline:
                logger.error("burst: not drained after %ss; stopping", self.burst_timeout_seconds)
                self.exit_code = 1
                return
            self.stop_event.wait(0.2)

    def _drained(self, idles: list[threading.Event]) -> bool:
        try:
            if self.want_relay and OutboxEvent.objects.using(self.using).due().exists():  # rows due later stay pending
                return False
        except DatabaseError:
            connections[self.using].close()
            return False
        if not all(idle.is_set() for idle in idles):
            logger.debug("burst check: consumers still fetching")
            return False
        for durable in dict.fromkeys(c.subscription.durable for c in self.consumers):
            try:
                info = self.transport.consumer_info(durable)
            except Exception:  # noqa: BLE001
                return False
            logger.debug("burst check consumer=%s pending=%s ack_pending=%s", durable, info.num_pending, info.num_ack_pending)
            if info.num_pending or info.num_ack_pending:
                return False
        return True
