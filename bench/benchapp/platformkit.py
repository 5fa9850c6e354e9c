"""The benchmark's events and subscriptions: one event per measurement, so
each durable sees only its own backlog. Every handler does one INSERT."""

from django.db import connections

from django_platformkit import conf, declare, subscribe
from django_platformkit.consumer import Subscription

PUBLISH = declare("bench.publish")
RELAY = declare("bench.relay")
HANDLE = declare("bench.handle")
HANDLE_BATCH = declare("bench.handle_batch")
HANDLE_BATCH_CONCURRENT = declare("bench.handle_batch_concurrent")
LATENCY = declare("bench.latency")
BACKLOG = declare("bench.backlog")

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


subscribe(HANDLE, name="bench.sink_tx")(_sink("tx"))
subscribe(LATENCY, name="bench.sink_latency")(_sink("latency"))
subscribe(BACKLOG, name="bench.sink_backlog")(_sink("backlog"))
if BATCH_SUPPORTED:
    subscribe(HANDLE_BATCH, name="bench.sink_batch", batch=True)(_sink("batch"))
if CONCURRENCY_SUPPORTED:
    subscribe(HANDLE_BATCH_CONCURRENT, name="bench.sink_batch_concurrent", batch=True, concurrency=CONCURRENCY)(_sink("batch_concurrent"))
