"""The worker process: relay + the consumer runtime + the scheduler, sharing
one NATS connection.

The consumer runtime (``pool.py``, mixed into ``Worker``) owns how
deliveries reach handlers: a lane per subscription pulling only what can
start now, and ``CONSUMER_THREADS`` pool threads taking units round-robin.
This module owns the lifecycle: start-up, threads, watchdog, health, burst.

Stopping is cooperative: SIGTERM or SIGINT stops pulling, NAKs at once what
was fetched and not started, lets in-flight units finish and ack, and exits
0. A handler stuck past its timeout plus a grace period makes the process
exit 3 (the watchdog, ``health.py``), and a crash of any worker thread or of
the event loop makes it exit 1, so its supervisor restarts it (never a live
process that no longer consumes). ``supervisor.py`` runs the relay and
scheduler in one process and N consumer processes under one parent
(``runworker --processes N``); ``runrelay`` is this worker with the relay
alone.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections

from . import conf
from ._retry import Backoff
from .consumer import Consumer
from .exceptions import BrokerUnavailable, ConfigurationError, ConsumerDrift, ConsumerNotFound, DatabaseUnavailable
from .health import EXIT_STUCK_HANDLER as EXIT_STUCK_HANDLER  # where it was defined before health.py
from .health import HealthFile, Watchdog
from .heartbeat import Heartbeat
from .identity import database_identity
from .models import OutboxEvent
from .pool import POOL_ERROR_BACKOFF_SECONDS as POOL_ERROR_BACKOFF_SECONDS  # where they were defined before pool.py
from .pool import UNIT_TARGET_SECONDS as UNIT_TARGET_SECONDS
from .pool import ConsumerPool, _Lane, pool_thread_count
from .pool import desired_consumer_config as desired_consumer_config
from .relay import Relay, RelayStats
from .subscriptions import Subscription
from .subscriptions import subscriptions as registered_subscriptions
from .transport import Transport, event_loop_kind

if TYPE_CHECKING:
    from nats.js import api

logger = logging.getLogger(__name__)

#: Exit status when a worker thread or the event loop died.
EXIT_CRASHED = 1
#: Kept for compatibility: the runtime no longer polls durables. A pull lane
#: notices a lost durable (a broker that lost its store) by two missed idle
#: heartbeats of its waiting request (PULL_HEARTBEAT_SECONDS) and re-ensures it.
DURABLE_CHECK_SECONDS = 30.0
#: The GIL switch interval while the relay shares the process with
#: consumers (Python's default is 5 ms): a relay draining a backlog is
#: CPU-bound, and every time a consumer thread's database or NATS answer
#: arrives it would wait up to one interval for the GIL (the convoy effect
#: that dropped consumers to 30-70 handlings/s). ``--processes`` avoids it.
SHARED_SWITCH_INTERVAL_SECONDS = 0.001
#: Start-up waits for an unavailable broker or database (stream, durables):
#: doubling from the first to the cap, in seconds.
START_UP_RETRY_FIRST_SECONDS = 0.5
START_UP_RETRY_MAX_SECONDS = 10.0


class Worker(ConsumerPool):
    """Compose relay, consumer runtime and scheduler over one ``Transport``.

    ``relay``/``consumers``/``scheduler`` switch the parts on; ``jobs``
    names the periodic jobs the scheduler runs (default: all). ``burst``:
    drain the outbox and every consumer (nothing pending, nothing awaiting
    ack or retry), run no jobs, then return. ``health_file``: a JSON file
    rewritten every second with liveness and counts, and a final
    ``{"healthy": false, "stopped": true}`` when the worker ends.
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
        self.health_file = HealthFile(health_file) if health_file else None
        self.stop_event = threading.Event()
        self.relay: Relay | None = None
        self.consumers: list[Consumer] = []
        self.exit_code = 0
        self._threads: list[threading.Thread] = []
        self._pool: list[threading.Thread] = []
        self._started = time.monotonic()
        self._give_up_at: float | None = None  # run-once modes: when start-up stops waiting for the broker
        self._scheduler: Any = None
        self._watchdog_thread: threading.Thread | None = None
        self._threads_done = threading.Event()
        self.job_names = None if jobs is None else list(jobs)  # None: every registered job
        self._lanes: list[_Lane] = []
        self._cond = threading.Condition()
        self._ready: collections.deque[_Lane] = collections.deque()  # lanes with a unit queued, in turn
        self._starting = True
        # Re-entrant: the final write may come from a signal handler on a thread that holds it.
        self._health_lock = threading.RLock()
        self._crashed: str | None = None
        self._batch_size = int(conf.settings.CONSUMER_BATCH_SIZE)

    # -- lifecycle --
    def install_signal_handlers(self) -> None:
        def handle(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if self._starting:
                # Nothing is fetched or running yet: nothing to finish. Leave now
                # rather than after a connect or durable check that may take long.
                logger.info("worker stopping signal=%s during start-up: nothing in flight; exit=0", name)
                self.stop_event.set()
                self._write_final_health()
                logging.shutdown()
                os._exit(0)
            if self.stop_event.is_set():
                # Asked twice: the operator means it. In-flight transactions roll
                # back with the connections; their messages are redelivered.
                logger.warning("worker stopping now signal=%s (second request): in-flight handlers are abandoned", name)
                self._write_final_health()
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
        self._start_up_health()
        try:
            self._refuse_a_small_connection_pool()
            # A burst is a script's step: fail it rather than wait forever for a broker.
            if not self._connect_and_ensure_stream(give_up=self.burst):
                return self._stopped_in_start_up()
            if self.want_consumers:
                for subscription in self.subscriptions:
                    want = desired_consumer_config(subscription)
                    self._retry_until_stopped(
                        functools.partial(self._ensure_durable, subscription, want),
                        f"durable {subscription.durable}",
                        self._give_up_at,
                    )
                    consumers = [
                        Consumer(
                            subscription, self.transport, using=self.using, stop=self.stop_event, instance=instance
                        )
                        for instance in range(subscription.concurrency)
                    ]
                    self.consumers += consumers
                    self._lanes.append(_Lane(subscription, consumers))
            if self.stop_event.is_set():
                return self._stopped_in_start_up()
        except BaseException:
            self._write_final_health()
            self.transport.close()
            raise
        self.heartbeat = Heartbeat(
            [s.name for s in self.subscriptions] if self.want_consumers else [], using=self.using
        )  # the admin overview's "workers seen"
        logger.info(
            "worker started pid=%s relay=%s subscriptions=%s threads=%s batch_size=%s scheduler=%s burst=%s loop=%s",
            os.getpid(),
            self.want_relay,
            len(self._lanes) if self.want_consumers else "-",
            pool_thread_count([lane.subscription for lane in self._lanes]),
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

    def _refuse_a_small_connection_pool(self) -> None:
        """Raise ``ConfigurationError`` when Django's connection pool
        (``DATABASES[alias]["OPTIONS"]["pool"]``, 4 connections by default)
        is smaller than what this process keeps at once: each handler thread
        and the relay keep a connection for the worker's life (a worker is
        one long request), so a thread left without one waited for ever,
        logging "couldn't get a connection" as a database outage, while its
        events stalled."""
        connection = connections[self.using]
        if not (connection.settings_dict.get("OPTIONS") or {}).get("pool"):
            return
        pool: Any = getattr(connection, "pool", None)  # the PostgreSQL backend's (Django 5.1+)
        threads = pool_thread_count(self.subscriptions) if self.want_consumers else 0
        lanes = int(conf.settings.RELAY_LANES) if self.want_relay else 0
        # + one for the heartbeat and the burst's checks, + one a job's run holds while it runs.
        others = 2 if self.want_scheduler else 1
        needed = threads + lanes + others
        if pool is not None and pool.max_size < needed:
            raise ConfigurationError(
                f"DATABASES[{self.using!r}]['OPTIONS']['pool'] allows {pool.max_size} connections, but this worker "
                f"keeps up to {needed} at once ({threads} handler threads (CONSUMER_THREADS), {lanes} relay lanes "
                f"(RELAY_LANES), {others} for the heartbeat{' and the jobs' if self.want_scheduler else ''}): "
                "with fewer, a thread waits for a "
                f"connection for ever and its events stall. Give the pool max_size >= {needed} (with min_size), or "
                "run the worker with a settings module without 'pool' (its threads keep their connections anyway)."
            )

    def relay_once(self) -> RelayStats | None:
        """One relay pass on this worker's start-up path (``runrelay --once``):
        connect and ensure the stream as ``run()`` does - giving up after
        ``connect_timeout_seconds`` with ``BrokerUnavailable`` saying what is
        not available - relay what is due now, close. Returns the pass's
        ``RelayStats`` (``temporary``: rows left pending by a refusal worth
        retrying; ``deferred``: pending rows not due yet), or None when
        stopped during start-up. A database it can't reach raises
        ``DatabaseUnavailable`` after one attempt (see
        ``_reach_the_database_once``); a database error of the pass
        propagates; the rows it concerns stay pending."""
        try:
            self._reach_the_database_once()
            if not self._connect_and_ensure_stream(give_up=True):
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

    def _reach_the_database_once(self) -> None:
        """A script's step (``relay_once``) fails fast on a database it can't
        reach: one attempt, bounded by ``connect_timeout_seconds``, instead of
        the start-up's retries (~25 s of them before it gave up; the
        long-running relay keeps them). Raises ``DatabaseUnavailable`` saying
        where the database is (no credentials) and the driver's first line."""
        from .outage import connect_timeout, database_location

        try:
            with connect_timeout(self.using, self.connect_timeout_seconds):
                database_identity(self.using)  # cached: the stream's owner check reads it again for free
        except DatabaseUnavailable as exc:
            cause = exc.__cause__ or exc
            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise DatabaseUnavailable(
                f"the database at {database_location(self.using)} is unreachable, nothing was relayed "
                f"(rows stay pending): {first_line}"
            ) from exc

    def _connect_and_ensure_stream(self, *, give_up: bool) -> bool:
        """Connect to NATS and create or check the stream (and its owner),
        waiting out a broker or database that can't answer yet. Returns False
        when stopped first. With ``give_up`` (run-once modes), raises
        ``BrokerUnavailable`` once ``connect_timeout_seconds`` have passed."""
        self._give_up_at = time.monotonic() + self.connect_timeout_seconds if give_up else None
        if not self.transport.connect_until(
            self.stop_event, give_up_after_seconds=self.connect_timeout_seconds if give_up else None
        ):
            return False
        # owner: refuse a stream another project's database owns (identity.py).
        # Read first, on its own: a database that can't answer is named as
        # the database, not as the stream.
        owner: list[str] = []
        self._retry_until_stopped(lambda: owner.append(database_identity(self.using)), "database", self._give_up_at)
        if self.stop_event.is_set():
            return False
        self._retry_until_stopped(
            lambda: self.transport.ensure_stream(owner=owner[0]),
            f"stream {conf.settings.STREAM}",
            self._give_up_at,
        )
        return not self.stop_event.is_set()

    def _ensure_durable(self, subscription: Subscription, want: api.ConsumerConfig) -> None:
        """``Transport.ensure_consumer``, and a WARNING when that created the
        durable while the stream already holds events for it: a new durable
        starts from the first retained message, so a subscription added to a
        live event runs its handler for every past event still retained."""
        try:
            self.transport.consumer_info(subscription.durable)
        except ConsumerNotFound:
            pass
        else:
            self.transport.ensure_consumer(want)
            return
        info = self.transport.ensure_consumer(want)
        with contextlib.suppress(Exception):  # the count is advice: the creation's own answer will do
            info = self.transport.consumer_info(subscription.durable)
        retained = int(getattr(info, "num_pending", 0) or 0)
        if retained:
            logger.warning(
                "new durable subscription=%s consumer=%s will run the handler for %d retained message(s) "
                "matching %s, published before it existed (a new durable starts from the first message the "
                "stream retains, up to RETENTION_DAYS back). If past events must not run it, check "
                "event.occurred_at in the handler; see the docs' 'Events, publishing, subscribing' (docs/guide/events.md).",
                subscription.name,
                subscription.durable,
                retained,
                subscription.filter_subject,
            )

    def _stopped_in_start_up(self) -> int:
        logger.info("worker stopped during start-up exit=0")
        self._write_final_health()
        self.transport.close()
        return 0

    def _shutdown(self) -> None:
        self._starting = False
        with self._cond:
            self._cond.notify_all()
        for lane in self._lanes:
            if lane.puller is not None:
                lane.puller.stop()
        # Nothing is fetched any more: hand back what waits now, not after the
        # in-flight units (early fetch queues a unit behind a running one).
        self._hand_back_queued()
        # The watchdog keeps watching until the others are done: a handler
        # stuck past its timeout + grace still ends the process (status 3)
        # instead of hanging the shutdown forever.
        for thread in self._threads:
            if thread is not self._watchdog_thread:
                thread.join()
        self._hand_back_queued()  # again: a puller whose stop timed out may have delivered since
        self._threads_done.set()
        if self._watchdog_thread is not None:
            self._watchdog_thread.join()
        self.transport.close()
        connections.close_all()
        self._write_final_health()
        logger.info(
            "worker stopped exit=%s uptime=%.0fs totals %s",
            self.exit_code,
            time.monotonic() - self._started,
            " ".join(f"{k}={v}" for k, v in self.counts().items()),
        )

    def _retry_until_stopped(self, func: Callable[[], object], what: str, give_up_at: float | None = None) -> None:
        """Call ``func`` until it returns or ``stop_event`` is set, waiting
        out a broker or database that can't answer (JetStream starting, a
        cluster electing its leader). Past ``give_up_at`` (monotonic seconds;
        run-once modes) raises ``BrokerUnavailable`` saying ``what`` is not
        available. ``ConsumerDrift`` is raised at once: waiting can't fix it."""
        delay = Backoff(START_UP_RETRY_FIRST_SECONDS, START_UP_RETRY_MAX_SECONDS)
        while not self.stop_event.is_set():
            try:
                func()
                return
            except ConsumerDrift:
                raise
            except (BrokerUnavailable, DatabaseUnavailable, TimeoutError) as exc:
                why = self.transport.redact(str(exc) or type(exc).__name__)
                if give_up_at is not None and time.monotonic() + delay.current > give_up_at:
                    raise BrokerUnavailable(f"the {what} is not available: {why}") from exc
                logger.error("%s not available error=%s; retrying in %.1fs", what, why, delay.current)
                self.stop_event.wait(delay.next())

    def counts(self) -> dict[str, int]:
        totals: dict[str, int] = {"relayed": self.relay.totals.stored if self.relay else 0}
        for consumer in self.consumers:
            for key, value in consumer.counts.items():
                totals[key] = totals.get(key, 0) + value
        return totals

    # -- threads --
    def _spawn(self, name: str, target: Callable[..., object], *args: Any) -> threading.Thread:
        thread = threading.Thread(target=self._guard, args=(name, target, *args), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _guard(self, name: str, target: Callable[..., object], *args: Any) -> None:
        try:
            target(*args)
        except BaseException as exc:
            self._crash(name, exc)
        finally:
            connections.close_all()

    def _crash(self, name: str, exc: BaseException | None) -> None:
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
        with self._cond:
            self._cond.notify_all()

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
        loop_thread = self.transport._thread
        if loop_thread is not None and not loop_thread.is_alive():
            self._crash("platformkit-nats", RuntimeError("the NATS event loop thread died"))
            return
        for lane in self._lanes:
            puller = lane.puller
            if puller is not None and (
                puller.error is not None or (puller.future is not None and puller.future.done())
            ):
                self._crash(f"pull-{puller.durable}", puller.error or RuntimeError("the pull lane ended"))
                return

    def health(self, stuck: str | None = None) -> dict[str, Any]:
        now = time.monotonic()
        timeout = float(conf.settings.HANDLER_TIMEOUT_SECONDS)
        stuck_subscriptions = sorted(
            {
                c.subscription.name
                for c in self.consumers
                if c.handler_started is not None and now - c.handler_started > timeout
            }
        )
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

    def _start_up_health(self) -> None:
        """With a health file: write it every second while the worker starts
        (``"starting": true``, not healthy) - a broker or database it waits
        for can take long, and a probe reads the file's age. The watchdog
        takes over once the worker runs."""
        if self.health_file is None:
            return

        def beat() -> None:
            while True:
                # Under the lock the final write takes too: a start-up state
                # can't land after the final one.
                with self._health_lock:
                    if not self._starting or self.stop_event.is_set():
                        return
                    with contextlib.suppress(Exception):
                        self._write_health()
                self.stop_event.wait(1.0)

        threading.Thread(target=beat, name="platformkit-start-up-health", daemon=True).start()

    def _write_health(self, stuck: str | None = None, final: bool = False) -> None:
        if self.health_file is None:
            return
        state = self.health(stuck)
        if final:
            state.update(healthy=False, stopped=True, exit_code=self.exit_code)
        self.health_file.write(state)

    def _write_watchdog_health(self, stuck: str | None, exit_code: int | None) -> None:
        # exit_code: the watchdog is about to end the process (os._exit), so
        # this is the last state a probe will read: stopped, with the code.
        if exit_code is not None:
            self.exit_code = exit_code
        self._write_health(stuck=stuck, final=exit_code is not None)

    def _write_final_health(self) -> None:
        # A probe must never read "healthy" from a worker that has exited.
        with self._health_lock, contextlib.suppress(Exception):
            self._write_health(final=True)

    def _run_forever(self) -> None:
        self._starting = False  # from here a signal stops gracefully: units may be in flight
        if self.want_relay and self._lanes:
            sys.setswitchinterval(min(sys.getswitchinterval(), SHARED_SWITCH_INTERVAL_SECONDS))
        if self.want_relay:
            self.relay = Relay(self.transport, using=self.using)
            self._spawn("platformkit-relay", self.relay.run, self.stop_event)
        self._start_runtime()
        if self.want_scheduler:
            from .scheduler import Scheduler

            self._scheduler = Scheduler(using=self.using, jobs=self.job_names)
            self._spawn("platformkit-scheduler", self._scheduler.run, self.stop_event)
        self._watchdog_thread = self._spawn("platformkit-watchdog", self._watchdog)
        while not self.stop_event.wait(0.5):
            pass

    # -- burst --
    def _run_burst(self) -> None:
        """Drain everything, then stop: nothing pending in the outbox, and no
        durable with messages pending, awaiting ack or awaiting a retry."""
        self._starting = False
        self.relay = Relay(self.transport, using=self.using) if self.want_relay else None
        self._start_runtime()
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
            if self._drained():
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

    def _drained(self) -> bool:
        try:
            if self.want_relay and OutboxEvent.objects.using(self.using).due().exists():  # rows due later stay pending
                return False
        except DatabaseError:
            connections[self.using].close()
            return False
        with self._cond:
            if any(lane.busy or lane.queue for lane in self._lanes):
                return False
        if not all(lane.puller is None or lane.puller.idle.is_set() for lane in self._lanes):
            logger.debug("burst check: consumers still fetching")
            return False
        for lane in self._lanes:
            try:
                info = self.transport.consumer_info(lane.subscription.durable)
            except Exception:
                return False
            logger.debug(
                "burst check consumer=%s pending=%s ack_pending=%s",
                lane.subscription.durable,
                info.num_pending,
                info.num_ack_pending,
            )
            if info.num_pending or info.num_ack_pending:
                return False
        return True
