"""The benchmark's events and subscriptions: one event per measurement, so
each durable sees only its own backlog. Every handler does one INSERT."""

import os

from django.db import connections

from django_platformkit import conf, declare, subscribe
from django_platformkit.consume.subscriptions import Subscription

PUBLISH = declare("bench.publish")
RELAY = declare("bench.relay")
HANDLE = declare("bench.handle")
HANDLE_BATCH = declare("bench.handle_batch")
HANDLE_BATCH_CONCURRENT = declare("bench.handle_batch_concurrent")
LATENCY = declare("bench.latency")
RATED = declare("bench.rated")
BACKLOG = declare("bench.backlog")
#: Reconciliation's pass (measure_reconcile.py subscribes to it in its own process only).
RECONCILE = declare("bench.reconcile")

SINK_SQL = "INSERT INTO bench_sink (kind, event_id, occurred_at, at) VALUES (%s, %s, %s, clock_timestamp())"

#: Whether this build's subscribe() takes batch=True (the batch consumer).
BATCH_SUPPORTED = "batch" in getattr(Subscription, "__dataclass_fields__", {})
#: ... and concurrency=N (a subscription on several consumer threads).
CONCURRENCY_SUPPORTED = "concurrency" in getattr(Subscription, "__dataclass_fields__", {})
#: Consumer threads on the concurrent batch subscription: as many as
#: pgqueuer's connection pool in the same run (measure_handle.PGQUEUER_POOL_SIZE).
CONCURRENCY = 4


def _sink(kind):
    def handler(event):
        with connections[conf.settings.DATABASE_ALIAS].cursor() as cursor:
            cursor.execute(SINK_SQL, [kind, str(event.id), event.occurred_at])

    handler.__name__ = f"sink_{kind}"
    return handler


# One transaction per message, as its row says: batching is the default since issue 11.
subscribe(HANDLE, name="bench.sink_tx", **({"batch": False} if BATCH_SUPPORTED else {}))(_sink("tx"))
subscribe(LATENCY, name="bench.sink_latency")(_sink("latency"))
subscribe(BACKLOG, name="bench.sink_backlog")(_sink("backlog"))
if BATCH_SUPPORTED:
    subscribe(HANDLE_BATCH, name="bench.sink_batch", batch=True)(_sink("batch"))
#: ``subscribe(rate_limit=...)``'s limit in the rate-limit measurement (measure_ratelimit.py).
RATE_LIMIT = "50/s"
if os.environ.get("BENCH_RATELIMIT"):  # only that measurement's two workers subscribe
    subscribe(RATED, name="bench.sink_rated", rate_limit=RATE_LIMIT)(_sink("rated"))
if CONCURRENCY_SUPPORTED:
    subscribe(HANDLE_BATCH_CONCURRENT, name="bench.sink_batch_concurrent", batch=True, concurrency=CONCURRENCY)(
        _sink("batch_concurrent")
    )


# --- the realistic topology (measure_topology.py, issue 11) ----------------------
# One worker, 24 subscriptions: two on the hot event, one that a 30 x 1 s
# backlog keeps busy, 21 idle ones on a ping; plus two periodic jobs. Each
# handler is one ORM insert, the shape a user's handler has. Declared only in
# processes started with BENCH_TOPOLOGY=1 (the topology's workers), so the
# other measurements' workers and burst consumers see the bench as before;
# BENCH_IDLE_SUBSCRIPTIONS=N swaps the ping's 21 for N (the idle-CPU row).

import os  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

TOPO_HOT = declare("bench.topo_hot")
TOPO_SLOW = declare("bench.topo_slow")
TOPO_PING = declare("bench.topo_ping")
TOPO_HOT_SUBSCRIPTIONS = ("bench.topo_hot_a", "bench.topo_hot_b")
TOPO_SLOW_SUBSCRIPTION = "bench.topo_slow"
TOPO_IDLE_COUNT = 21


def topo_idle_subscriptions(count: int = TOPO_IDLE_COUNT) -> tuple[str, ...]:
    return tuple(f"bench.topo_idle_{i:03d}" for i in range(count))


def _orm_sink(kind):
    def handler(event):
        from .models import Sink

        # "at" is clock_timestamp() at the INSERT: the handler's start, give or take the ORM.
        Sink.objects.create(kind=kind, event_id=str(event.id), occurred_at=event.occurred_at)
        if event.payload.get("sleep"):
            time.sleep(float(event.payload["sleep"]))

    handler.__name__ = f"orm_sink_{kind}"
    return handler


if os.environ.get("BENCH_TOPOLOGY"):
    from django_platformkit import job

    for _name in TOPO_HOT_SUBSCRIPTIONS:
        subscribe(TOPO_HOT, name=_name)(_orm_sink(_name.rsplit(".", 1)[1]))
    subscribe(TOPO_SLOW, name=TOPO_SLOW_SUBSCRIPTION)(_orm_sink("topo_slow"))
    for _name in topo_idle_subscriptions(int(os.environ.get("BENCH_IDLE_SUBSCRIPTIONS", TOPO_IDLE_COUNT))):
        subscribe(TOPO_PING, name=_name)(_orm_sink(_name.rsplit(".", 1)[1]))

    @job(every=timedelta(seconds=5), name="bench.topo_job_often")
    def topo_job_often():
        from .models import Row

        Row.objects.filter(name="bench.topo_job").count()

    @job(every=timedelta(minutes=1), name="bench.topo_job_rare")
    def topo_job_rare():
        pass
