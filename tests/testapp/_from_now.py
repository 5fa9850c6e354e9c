"""A ``backfill=False`` subscription to the orders, for the reconciliation
scenarios (tests/chaos/test_reconcile.py): an app a management container
may lack, so ``stream prune`` run there sees its live durable as unowned.
Loaded only in processes started with ``PLATFORMKIT_TEST_FROM_NOW=1``."""

from django_platformkit import subscribe

from .models import Effect


@subscribe("testapp.order_placed", name="testapp.record_order_from_now", backfill=False)
def record_order_from_now(event):
    Effect.objects.create(subscription="testapp.record_order_from_now", event_id=event.id)
