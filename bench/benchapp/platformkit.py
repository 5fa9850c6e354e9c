"""The benchmark's events and subscriptions: one event per measurement, so
each durable sees only its own backlog. Every handler does one INSERT."""

from django.db import connections

from django_platformkit import conf, declare, subscribe
from django_platformkit.consumer import Subscription

PUBLISH = declare("bench.publish")
RELAY = declare("bench.relay")
HANDLE = declare("bench.handle")
HANDLE_BATCH = declare("bench.handle_batch")
LATENCY = declare("bench.latency")
BACKLOG = declare("bench.backlog")

SINK_SQL = "INSERT INTO bench_sink (kind, event_id, occurred_at, at) VALUES (%s, %s, %s, clock_timestamp())"

#: Whether this build's subscribe() takes batch=True (the batch consumer).
BATCH_SUPPORTED = "batch" in getattr(Subscription, "__dataclass_fields__", {})


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
