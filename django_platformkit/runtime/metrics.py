"""Prometheus metrics for a worker or relay process (``--metrics-port``).

Counters and the handler-duration histogram are fed by the package's own
signals (``django_platformkit.signals``), so the consumer, relay and scheduler
know nothing about Prometheus. Gauges that need a query or a broker call
(outbox backlog and lag, consumer pending, open dead letters) are computed at
scrape time by a custom collector with a short timeout - never per event.
Each ``Metrics`` has a registry of its own (not prometheus-client's global
default), so tests and two workers in one process don't clash.

Needs the ``metrics`` extra (``prometheus-client``). Names and labels follow
Prometheus' conventions ("Metric and label naming", prometheus.io/docs):
base units (seconds), ``_total`` on counters, snake_case labels. The
``task`` label is a ``django.tasks`` task's dotted path: bounded by the
task functions the code defines (never an argument, id or priority), so a
series per (subscription, task) pair that ran; a queue's priority bands are
subscriptions, so a task enqueued at several bands' priorities has a series
per band.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from django.db import connections, transaction

from django_platformkit import conf, signals
from django_platformkit._tables import DEAD_LETTER_TABLE, DUE_BACKLOG_SQL
from django_platformkit.broker.port import Broker
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.wire import HandlingOutcome, task_path

logger = logging.getLogger(__name__)

#: ``platformkit_handled_total`` outcomes: one per settled delivery.
OUTCOMES = (
    HandlingOutcome.HANDLED,
    HandlingOutcome.RETRIED,
    HandlingOutcome.DEAD_LETTERED,
    HandlingOutcome.SKIPPED,
    HandlingOutcome.MALFORMED,
)
#: Handler runs take milliseconds to minutes; the default buckets stop at 10 s.
DURATION_BUCKETS_SECONDS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    float("inf"),
)
#: How long a scrape may wait for PostgreSQL and for NATS (each), in seconds.
SCRAPE_TIMEOUT_SECONDS = 2.0

_OUTBOX_SQL = DUE_BACKLOG_SQL  # due rows and how long the oldest has waited (deferred tasks are not lag)
_DEAD_LETTERS_SQL = f"SELECT subscription, count(*) FROM {DEAD_LETTER_TABLE} GROUP BY subscription"


class ConsumerInfos(Protocol):
    """What the scrape asks the broker: each durable's counts (``Broker.consumer_infos``)."""

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> list[Any]: ...


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError:
        raise ConfigurationError(
            "metrics need prometheus-client: pip install 'django-platformkit[metrics]' (or drop --metrics-port)."
        ) from None
    return prometheus_client


class Metrics:
    """The metrics of one process.

    ``using``: the outbox's database alias (default ``DATABASE_ALIAS``).
    ``transport``: a connected ``Transport`` for ``platformkit_consumer_pending``
    (None: that gauge is left out). ``subscriptions``: whose durables to ask
    about (``Subscription`` objects; default none). ``scrape_timeout_seconds``:
    the bound on each scrape-time query and broker call.
    ``multiprocess_dir``: serve, instead of this process's own counters and
    histograms, what every process writing prometheus-client's multiprocess
    files into that folder counted (``runworker --processes``: the children
    count, the supervisor serves); the scrape-time gauges are still this
    process's own. ``scrape_lock`` is held while they are computed.

    Raises ``ConfigurationError`` when prometheus-client isn't installed.
    ``connect()`` starts listening to the signals; ``serve(port)`` exposes
    ``/metrics``; ``close()`` undoes both. Every signal of the process is
    counted, whichever worker sent it.
    """

    def __init__(
        self,
        *,
        using: str | None = None,
        transport: Broker | ConsumerInfos | None = None,
        subscriptions: Sequence[Any] = (),
        scrape_timeout_seconds: float = SCRAPE_TIMEOUT_SECONDS,
        multiprocess_dir: str | None = None,
    ) -> None:
        pc = _prometheus()
        self._pc = pc
        self.using = using or conf.settings.DATABASE_ALIAS
        self.transport = transport
        self.subscriptions = list(subscriptions)
        self.scrape_timeout_seconds = scrape_timeout_seconds
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.scrape_lock = threading.Lock()
        # Sharing the files: this process's own would be counted twice, so they stay out of the registry.
        own = self.registry if multiprocess_dir is None else None
        self.relayed = pc.Counter(
            "platformkit_relayed",
            "Outbox rows the relay sent and the stream stored (broker-side duplicates included).",
            registry=own,
        )
        self.relay_dead_lettered = pc.Counter(
            "platformkit_relay_dead_lettered",
            "Outbox rows the broker refused for good (dead letters of platformkit.relay).",
            registry=own,
        )
        self.handled = pc.Counter(
            "platformkit_handled",
            "Deliveries settled, by subscription, outcome (handled, retried, dead_lettered, skipped, malformed) "
            "and task (a django.tasks task's dotted path; empty for other events).",
            ["subscription", "outcome", "task"],
            registry=own,
        )
        self.duration = pc.Histogram(
            "platformkit_handler_duration_seconds",
            "How long a handler ran, successful or not (skips excluded), by subscription and task.",
            ["subscription", "task"],
            buckets=DURATION_BUCKETS_SECONDS,
            registry=own,
        )
        self.latency = pc.Histogram(
            "platformkit_delivery_latency_seconds",
            "From an event's commit (or a task's run_after) to its handler's start, per handler run, by "
            "subscription and task (a django.tasks task's dotted path; empty for other events).",
            ["subscription", "task"],
            buckets=DURATION_BUCKETS_SECONDS,
            registry=own,
        )
        self.job_runs = pc.Counter(
            "platformkit_job_runs",
            "Periodic job runs, by job and outcome (succeeded, failed).",
            ["job", "outcome"],
            registry=own,
        )
        for sub in self.subscriptions:  # a subscription that never ran still shows 0, not a missing series
            for outcome in OUTCOMES:
                self.handled.labels(sub.name, outcome, "")
        if multiprocess_dir is not None:
            import prometheus_client.multiprocess

            prometheus_client.multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        self.registry.register(_ScrapeCollector(self))
        self._uid = f"platformkit-metrics-{id(self)}"
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- signal receivers (run in worker threads: prometheus-client is thread-safe) --
    def _on_handled(
        self,
        sender: Any,
        *,
        subscription: str,
        outcome: str,
        event: Any = None,
        duration_seconds: float = 0.0,
        delivery_latency_seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        task = task_path(event.name, event.payload) if event is not None else ""
        self.handled.labels(subscription, outcome, task).inc()
        if outcome == HandlingOutcome.HANDLED:
            self.duration.labels(subscription, task).observe(duration_seconds)
            if delivery_latency_seconds is not None:
                self.latency.labels(subscription, task).observe(delivery_latency_seconds)

    def _on_failed(
        self,
        sender: Any,
        *,
        subscription: str,
        will_retry: bool,
        event: Any = None,
        duration_seconds: float = 0.0,
        delivery_latency_seconds: float | None = None,
        **kwargs: Any,
    ) -> None:
        task = task_path(event.name, event.payload) if event is not None else ""
        self.duration.labels(subscription, task).observe(duration_seconds)
        if delivery_latency_seconds is not None:
            self.latency.labels(subscription, task).observe(delivery_latency_seconds)
        if will_retry:  # the last failure is counted once, by event_dead_lettered
            self.handled.labels(subscription, HandlingOutcome.RETRIED, task).inc()

    def _on_dead_lettered(self, sender: Any, *, subscription: str, task: str = "", **kwargs: Any) -> None:
        self.handled.labels(subscription, HandlingOutcome.DEAD_LETTERED, task).inc()

    def _on_malformed(self, sender: Any, *, subscription: str, **kwargs: Any) -> None:
        self.handled.labels(subscription, HandlingOutcome.MALFORMED, "").inc()

    def _on_relayed(self, sender: Any, *, stored: int, dead_lettered: int = 0, **kwargs: Any) -> None:
        if stored:
            self.relayed.inc(stored)
        if dead_lettered:
            self.relay_dead_lettered.inc(dead_lettered)

    def _on_job(self, sender: Any, *, job: str, outcome: str, **kwargs: Any) -> None:
        self.job_runs.labels(job, outcome).inc()

    def _receivers(self) -> Iterable[tuple[Any, Any]]:
        return (
            (signals.event_handled, self._on_handled),
            (signals.event_failed, self._on_failed),
            (signals.event_dead_lettered, self._on_dead_lettered),
            (signals.event_malformed, self._on_malformed),
            (signals.events_relayed, self._on_relayed),
            (signals.job_finished, self._on_job),
        )

    def connect(self) -> Metrics:
        """Start counting what the signals report; returns self."""
        for signal, receiver in self._receivers():
            signal.connect(receiver, weak=False, dispatch_uid=self._uid)
        return self

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` (Prometheus text format 0.0.4) on ``addr:port``
        from a daemon thread; ``port=0`` picks a free port. Returns the port.
        Raises ``OSError`` when the port is taken."""
        self._server, self._thread = self._pc.start_http_server(port, addr=addr, registry=self.registry)
        bound = int(self._server.server_port)
        logger.info("metrics serving addr=%s port=%s path=/metrics", addr, bound)
        return bound

    def drop_listener_copy(self) -> None:
        """In a process forked from this one: close its copy of the listening
        socket (the parent goes on serving; the child must not hold the port)."""
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.socket.close()

    def exposition(self) -> bytes:
        """What a scrape returns now (text format)."""
        text: bytes = self._pc.generate_latest(self.registry)
        return text

    def close(self) -> None:
        for signal, _ in self._receivers():
            signal.disconnect(dispatch_uid=self._uid)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- scrape-time figures --
    def _database_figures(self) -> tuple[tuple[int, float], list[tuple[str, int]]] | None:
        connection = connections[self.using]
        was_open, nested = connection.connection is not None, connection.in_atomic_block
        try:
            with transaction.atomic(using=self.using), connection.cursor() as cursor:
                if not nested:  # inside a caller's transaction the setting would outlive the scrape
                    # A scrape must never queue behind a slow backlog count.
                    cursor.execute(
                        "SELECT set_config('statement_timeout', %s, true)",
                        [str(int(self.scrape_timeout_seconds * 1000))],
                    )
                cursor.execute(_OUTBOX_SQL)
                pending, lag = cursor.fetchone()
                cursor.execute(_DEAD_LETTERS_SQL)
                dead = [(str(s), int(n)) for s, n in cursor.fetchall()]
            return (int(pending), float(lag)), dead
        except Exception as exc:
            logger.warning("metrics: database figures unavailable error=%s", exc)
            return None
        finally:
            # The HTTP server runs each scrape in a thread of its own: never
            # leave that thread's connection open (a caller's own one stays).
            if not was_open and not connection.in_atomic_block:
                connection.close()

    def _broker_figures(self) -> list[tuple[str, int, int]] | None:
        if not self.subscriptions or self.transport is None:
            return None
        subs = list(self.subscriptions)
        try:
            infos = self.transport.consumer_infos([s.durable for s in subs], timeout=self.scrape_timeout_seconds)
        except Exception as exc:
            logger.warning("metrics: broker figures unavailable error=%s", exc or type(exc).__name__)
            return None
        return [
            (s.name, int(i.num_pending or 0), int(i.num_ack_pending or 0))
            for s, i in zip(subs, infos, strict=True)
            if i is not None
        ]


class _ScrapeCollector:
    """The gauges computed at scrape time (see ``Metrics``)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def _families(self) -> dict[str, Any]:
        core = self.metrics._pc.core
        return {
            "pending": core.GaugeMetricFamily(
                "platformkit_outbox_pending",
                "Outbox rows due and not yet relayed (a task deferred with run_after counts once it is due).",
            ),
            "lag": core.GaugeMetricFamily(
                "platformkit_outbox_lag_seconds",
                "How long the oldest due outbox row has waited for the relay (0 when none): the relay lag.",
            ),
            "dead": core.GaugeMetricFamily(
                "platformkit_dead_letters", "Open dead letters, by subscription.", labels=["subscription"]
            ),
            "consumer": core.GaugeMetricFamily(
                "platformkit_consumer_pending",
                "Messages in the stream the subscription's durable has not been delivered yet.",
                labels=["subscription"],
            ),
            "ack": core.GaugeMetricFamily(
                "platformkit_consumer_ack_pending",
                "Messages delivered to the subscription and not acknowledged yet (in flight).",
                labels=["subscription"],
            ),
            "up": core.GaugeMetricFamily(
                "platformkit_scrape_ok",
                "1 when the scrape reached the source, 0 when it timed out or failed.",
                labels=["source"],
            ),
        }

    def describe(self) -> list[Any]:
        # Without this the registry would collect() - query the database - at registration.
        return list(self._families().values())

    def collect(self) -> Iterable[Any]:
        with self.metrics.scrape_lock:
            return self._collect()

    def _collect(self) -> list[Any]:
        started = time.monotonic()
        families = self._families()
        db = self.metrics._database_figures()
        families["up"].add_metric(["database"], 1 if db is not None else 0)
        if db is not None:
            (pending, lag), dead = db
            families["pending"].add_metric([], pending)
            families["lag"].add_metric([], lag)
            for subscription, count in dead:
                families["dead"].add_metric([subscription], count)
        broker = self.metrics._broker_figures()
        if self.metrics.subscriptions:
            families["up"].add_metric(["nats"], 1 if broker is not None else 0)
        for name, num_pending, num_ack_pending in broker or ():
            families["consumer"].add_metric([name], num_pending)
            families["ack"].add_metric([name], num_ack_pending)
        logger.debug("metrics scraped duration=%.3fs", time.monotonic() - started)
        return list(families.values())


def serve_metrics(
    port: int,
    *,
    transport: Broker | None = None,
    subscriptions: Sequence[Any] = (),
    using: str | None = None,
    addr: str = "0.0.0.0",
) -> Metrics:
    """What ``--metrics-port`` does: make a ``Metrics``, connect it to the
    signals and serve it on ``port``. Raises ``ConfigurationError`` without
    prometheus-client, ``OSError`` when the port is taken."""
    metrics = Metrics(using=using, transport=transport, subscriptions=subscriptions).connect()
    try:
        metrics.serve(port, addr)
    except BaseException:
        metrics.close()
        raise
    return metrics
