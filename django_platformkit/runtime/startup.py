"""A worker's start-up: the broker reached, the stream made or checked (its
owner, the database instance holding it, its limits), each subscription's
durable ensured - each waited out while it can't answer yet (JetStream
starting, a cluster electing its leader, a database restarting), never a
crash loop, and logged as one line, then one a minute (``WaitingLog``).
``waiting`` says what it waits for, for the heartbeat: the worker's jobs
and heartbeat run meanwhile. Its consumer pool (``parts.py``) pulls once
the durables are ensured. Run-once modes (``--burst``, ``runrelay
--once``) give up after a bound instead, saying what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from django.db import connections

from django_platformkit import conf
from django_platformkit._retry import Backoff, WaitingLog
from django_platformkit.broker.port import Broker
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import (
    BrokerUnavailable,
    ConfigurationError,
    ConsumerDrift,
    ConsumerNotFound,
    DatabaseUnavailable,
)
from django_platformkit.identity import database_identity, database_instance
from django_platformkit.outage import connect_timeout, database_location, is_database_error

logger = logging.getLogger(__name__)

#: Start-up waits for an unavailable broker or database (stream, durables):
#: doubling from the first to the cap, in seconds.
START_UP_RETRY_FIRST_SECONDS = 0.5
START_UP_RETRY_MAX_SECONDS = 10.0


class StartUp:
    """Gets a worker's broker and database ready.

    Args:
        broker: The worker's broker.
        using: The database alias of the outbox and the claims.
        stop_event: Set to stop waiting (a signal during start-up).
        connect_timeout_seconds: Run-once modes: how long to keep trying.
    """

    def __init__(
        self, broker: Broker, *, using: str, stop_event: threading.Event, connect_timeout_seconds: float
    ) -> None:
        self.broker = broker
        self.using = using
        self.stop_event = stop_event
        self.connect_timeout_seconds = connect_timeout_seconds
        #: Run-once modes: when start-up stops waiting (monotonic seconds), else None.
        self.give_up_at: float | None = None
        #: What start-up waits for on the broker's side now, and why ("" while not waiting).
        self.waiting = ""
        #: This database's identity and instance, once read (``connect_and_ensure_stream``).
        self.owner: str | None = None
        self.instance: str | None = None

    def refuse_a_small_connection_pool(self, *, threads: int, relay_lanes: int, scheduler: bool) -> None:
        """Refuse a Django connection pool smaller than what the worker keeps at once.

        Each handler thread and relay lane keeps a connection for the
        worker's life (a worker is one long request), so with
        ``DATABASES[alias]["OPTIONS"]["pool"]`` (4 connections by default)
        too small, a thread left without one waited for ever, logging
        "couldn't get a connection" as a database outage, while its events stalled.

        Raises:
            ConfigurationError: The pool's ``max_size`` is below what is needed, with the number.
        """
        connection = connections[self.using]
        if not (connection.settings_dict.get("OPTIONS") or {}).get("pool"):
            return
        pool = getattr(connection, "pool", None)  # the PostgreSQL backend's (Django 5.1+)
        # + one for the heartbeat and the burst's checks, + one reconciliation keeps
        # (runtime/reconciling.py), + one a job's run holds while it runs, + one the
        # control watch keeps (it reads the pauses and job switches every few seconds).
        others = (3 if scheduler else 2) + (1 if threads or scheduler else 0)
        needed = threads + relay_lanes + others
        if pool is not None and pool.max_size < needed:
            raise ConfigurationError(
                f"DATABASES[{self.using!r}]['OPTIONS']['pool'] allows {pool.max_size} connections, but this worker "
                f"keeps up to {needed} at once ({threads} handler threads (CONSUMER_THREADS), {relay_lanes} relay lanes "
                f"(RELAY_LANES), {others} for the heartbeat, reconciliation, the controls"
                f"{' and the jobs' if scheduler else ''}): "
                "with fewer, a thread waits for a "
                f"connection for ever and its events stall. Give the pool max_size >= {needed} (with min_size), or "
                "run the worker with a settings module without 'pool' (its threads keep their connections anyway)."
            )

    def reach_the_database_once(self) -> None:
        """A script's step (``runrelay --once``) fails fast on a database it
        can't reach: one attempt, bounded by ``connect_timeout_seconds``,
        instead of the start-up's retries.

        Raises:
            DatabaseUnavailable: Saying where the database is (no
                credentials) and the driver's first line.
        """
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

    def connect_and_ensure_stream(self, *, give_up: bool) -> bool:
        """Connect to the broker and create or check the stream (and its
        owner), waiting out a broker or database that can't answer yet.

        Args:
            give_up: Run-once modes: raise ``BrokerUnavailable`` once
                ``connect_timeout_seconds`` have passed.

        Returns:
            False when stopped first.
        """
        self.give_up_at = time.monotonic() + self.connect_timeout_seconds if give_up else None
        where = f"NATS server at {conf.redact_url(self.broker.url)}"
        self.retry_until_stopped(self.broker.connect, where, broker=True)
        if self.stop_event.is_set():
            return False

        # owner: refuse a stream another project's database owns, or a live
        # copy of this one holds (identity.py). Read first, on its own: a
        # database that can't answer is named as the database, not as the stream.
        def read_identity() -> None:
            self.owner, self.instance = database_identity(self.using), database_instance(self.using)

        self.retry_until_stopped(read_identity, "database")
        if self.stop_event.is_set():
            return False
        self.retry_until_stopped(
            lambda: self.broker.ensure_stream(owner=self.owner, instance=self.instance),
            f"stream {conf.settings.STREAM}",
            broker=True,
        )
        return not self.stop_event.is_set()

    def ensure_durables(self, subscriptions: Sequence[Subscription]) -> None:
        """Each subscription's durable, created or updated (``ensure_durable``),
        before its consumers pull; stops early when ``stop_event`` is set."""
        for subscription in subscriptions:
            self.ensure_durable(subscription)

    def ensure_durable(self, subscription: Subscription) -> None:
        """The subscription's durable, created or updated, waited out while the broker can't answer."""
        self.retry_until_stopped(
            lambda: self._ensure_durable(subscription), f"durable {subscription.durable}", broker=True
        )

    def _ensure_durable(self, subscription: Subscription) -> None:
        """``Broker.ensure_consumer``, and a WARNING when that created the
        durable while the stream already holds events for it: a new durable
        starts from the first retained message, so a subscription added to a
        live event runs its handler for every past event still retained."""
        want = subscription.consumer_config()
        try:
            self.broker.consumer_info(subscription.durable)
        except ConsumerNotFound:
            pass
        else:
            self.broker.ensure_consumer(want)
            return
        info = self.broker.ensure_consumer(want)
        with contextlib.suppress(Exception):  # the count is advice: the creation's own answer will do
            info = self.broker.consumer_info(subscription.durable)
        self._record_origin(subscription)
        retained = int(info.num_pending or 0)
        if not subscription.backfill:
            logger.info(
                "new durable subscription=%s consumer=%s starts with the events published from now on "
                "(backfill=False): retained ones are not run",
                subscription.name,
                subscription.durable,
            )
        elif retained:
            logger.warning(
                "new durable subscription=%s consumer=%s will run the handler for %d retained message(s) "
                "matching %s, published before it existed (a new durable starts from the first message the "
                "stream retains, up to RETENTION_DAYS back). If past events must not run it, subscribe with "
                "backfill=False (before its durable exists); see the docs' 'Events, publishing, subscribing' (docs/guide/events.md).",
                subscription.name,
                subscription.durable,
                retained,
                subscription.filter_subject,
            )

    def _record_origin(self, subscription: Subscription) -> None:
        """The subscription begins here, unless it began before (a durable
        deleted and made again keeps its first origin, so it is owed what it
        missed): with ``backfill`` at the stream's start, else after the
        stream's last message when its durable was made. Reconciliation owes
        it nothing from before (``operate/reconcile.py``). A durable this
        build did not make is recorded by the next reconciliation, from then on."""
        from django_platformkit.operate.reconcile_rows import record_origin

        facts = self.broker.stream_facts(owner=self.owner, instance=self.instance)
        (durable,) = self.broker.durable_facts([subscription.durable])
        if facts is None or facts.created is None or durable is None:
            return
        start = 0 if subscription.backfill else durable.delivered
        try:
            if record_origin(subscription.name, (facts.created, start), using=self.using):
                logger.info(
                    "subscription began subscription=%s stream_created=%s after_stream_seq=%s",
                    subscription.name,
                    facts.created.isoformat(),
                    start,
                )
        except Exception as exc:
            if not is_database_error(exc):
                raise
            logger.warning(
                "subscription's beginning not recorded subscription=%s error=%s: reconciliation records it from "
                "its next pass on",
                subscription.name,
                exc,
            )

    def wait_for(self, func: Callable[[], object], what: str, *, give_up: bool) -> None:
        """``retry_until_stopped(func, what)`` from the start of a worker,
        giving up after ``connect_timeout_seconds`` in run-once modes
        (``give_up``: ``BrokerUnavailable`` saying ``what`` is not available)."""
        self.give_up_at = time.monotonic() + self.connect_timeout_seconds if give_up else None
        self.retry_until_stopped(func, what)

    def retry_until_stopped(self, func: Callable[[], object], what: str, *, broker: bool = False) -> None:
        """Call ``func`` until it returns or ``stop_event`` is set, waiting
        out a broker or database that can't answer; logged as one line,
        then one a minute with the time waited, and the end.

        Args:
            func: The step.
            what: What it waits for, in the log and ``waiting``.
            broker: It waits for the broker's side (NATS, the stream, a
                durable): ``waiting`` says so meanwhile, for the heartbeat.

        Raises:
            BrokerUnavailable: Past ``give_up_at`` (run-once modes), saying ``what`` is not available.
            ConsumerDrift: At once: waiting can't fix it.
        """
        delay = Backoff(START_UP_RETRY_FIRST_SECONDS, START_UP_RETRY_MAX_SECONDS)
        waiting = WaitingLog(logger, what)
        try:
            while not self.stop_event.is_set():
                try:
                    func()
                    waiting.done()
                    return
                except ConsumerDrift:
                    raise
                except (BrokerUnavailable, DatabaseUnavailable, TimeoutError) as exc:
                    why = self.broker.redact(str(exc) or type(exc).__name__)
                    if self.give_up_at is not None and time.monotonic() + delay.current > self.give_up_at:
                        raise BrokerUnavailable(f"the {what} is not available: {why}") from exc
                    if broker:
                        self.waiting = f"{what}: {why}"
                    # Run-once modes (a bound to give up at) run no jobs meanwhile: don't say they do.
                    meanwhile = "jobs and the heartbeat run meanwhile; " if self.give_up_at is None else ""
                    waiting.failed(why, meanwhile=f"{meanwhile}nothing is lost")
                    self.stop_event.wait(delay.next())
        finally:
            self.waiting = ""
