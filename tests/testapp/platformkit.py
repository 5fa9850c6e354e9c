"""Declarations of the test app: events, and subscriptions whose effects the
tests count. Behaviour switches come from the payload, so one process can
run every scenario."""

import os
import time

from django_platformkit import declare, subscribe

from .models import Effect

ORDER_PLACED = declare("testapp.order_placed", description="An order was placed.")
declare(
    "testapp.with_schema",
    schema={
        "type": "object",
        "required": ["sku"],
        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
    },
)
declare("testapp.flaky")
declare("testapp.slow")


@subscribe(ORDER_PLACED)
def record_order(event):
    Effect.objects.create(
        subscription="testapp.record_order", event_id=event.id, payload=event.payload, tenant_seen=event.tenant or ""
    )


@subscribe("testapp.order_placed", name="testapp.count_order")
def count_order(event):
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('platformkit.tenant', true)")
        seen = cursor.fetchone()[0]
    Effect.objects.create(subscription="testapp.count_order", event_id=event.id, tenant_seen=seen or "")


@subscribe("testapp.flaky", max_attempts=3, backoff_seconds=[0.2, 0.2])
def flaky(event):
    from ._attempts import note_attempt

    note_attempt("testapp.flaky", event)
    Effect.objects.create(subscription="testapp.flaky", event_id=event.id)
    if event.payload.get("fail_until", 0) >= event.attempt or event.payload.get("always_fail"):
        raise RuntimeError(f"flaky failure on attempt {event.attempt}")


@subscribe("testapp.slow")
def slow(event):
    from ._attempts import note_attempt

    note_attempt("testapp.slow", event)
    if event.attempt in event.payload.get("kill_on_attempts", ()):
        os.kill(os.getpid(), 9)
    time.sleep(float(event.payload.get("sleep", 0)))
    Effect.objects.create(subscription="testapp.slow", event_id=event.id)


if os.environ.get("PLATFORMKIT_TEST_JOBS"):
    from . import _jobs  # noqa: F401 - periodic jobs for tests/jobs/test_scheduler.py's worker processes
if os.environ.get("PLATFORMKIT_TEST_SCENARIOS"):
    from . import _scenarios  # noqa: F401 - the worker-runtime scenarios' subscriptions (tests/chaos/test_deploys.py)
if os.environ.get("PLATFORMKIT_TEST_FROM_NOW"):
    from . import _from_now  # noqa: F401 - a backfill=False subscription the reconciliation scenarios prune
if os.environ.get("PLATFORMKIT_TEST_FEATURES"):
    from . import _features  # noqa: F401 - rate limit and recycling subscriptions for real worker processes
