"""The shop's events, subscriptions and periodic job, found by
django_platformkit's autodiscovery (like admin.py). Each handler runs inside
the transaction that also writes its claim, so its database writes happen
exactly once per event."""

import logging
from datetime import timedelta
from decimal import Decimal

from django.db.models import F

from django_platformkit import declare, job, subscribe

from .models import Confirmation, Order, OrderStats

#: Checked by publish() before anything is written: a payload that doesn't
#: match raises InvalidPayload naming the JSON path.
ORDER_PLACED = declare(
    "shop.order_placed",
    description="An order was placed through POST /orders/.",
    schema={
        "type": "object",
        "required": ["order_id", "customer", "sku", "quantity", "total"],
        "additionalProperties": False,
        "properties": {
            "order_id": {"type": "integer", "minimum": 1},
            "customer": {"type": "string", "minLength": 3},
            "sku": {"type": "string", "minLength": 1, "maxLength": 64},
            "quantity": {"type": "integer", "minimum": 1},
            # DjangoJSONEncoder writes Decimal as a string: no float rounding.
            "total": {"type": "string", "pattern": r"^\d+\.\d{2}$"},
        },
    },
)

STATS_ROW = "all"

logger = logging.getLogger(__name__)


@subscribe(ORDER_PLACED)
def send_confirmation(event):
    """``shop.send_confirmation``: record the confirmation we would e-mail.
    (Sending the e-mail itself would be at-least-once: a crash after sending
    and before commit sends it again on the retry.)"""
    order = Order.objects.get(pk=event.payload["order_id"])
    Confirmation.objects.create(
        order=order,
        event_id=event.id,
        message=f"Thanks {order.customer}: {order.quantity} x {order.sku}, {order.total} total.",
    )


@subscribe(ORDER_PLACED)
def count_order(event):
    """``shop.count_order``: one UPDATE ... SET orders = orders + 1; the row
    lock serialises concurrent handlers and none loses an increment."""
    increments = {
        "orders": F("orders") + 1,
        "items": F("items") + event.payload["quantity"],
        "revenue": F("revenue") + Decimal(event.payload["total"]),
    }
    if not OrderStats.objects.filter(name=STATS_ROW).update(**increments):
        # The migration creates the row; if someone deleted it, recreate it.
        # A concurrent creator makes this raise IntegrityError: the attempt
        # rolls back and the retry takes the UPDATE path.
        OrderStats.objects.create(
            name=STATS_ROW, orders=1, items=event.payload["quantity"], revenue=Decimal(event.payload["total"])
        )


@job(every=timedelta(minutes=1))
def report_sales():
    """``shop.report_sales``: once a minute, log the counters (a stand-in for a
    periodic report). One run per slot, however many workers run."""
    stats = OrderStats.objects.filter(name=STATS_ROW).first()
    if stats is not None:
        logger.info("sales orders=%s items=%s revenue=%s", stats.orders, stats.items, stats.revenue)
