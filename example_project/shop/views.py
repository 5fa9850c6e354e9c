"""``POST /orders/``: the order row and its event commit together or not at all."""

import json
from decimal import Decimal

from django.db import transaction
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from django_platformkit import publish

from .forms import OrderForm
from .models import Order
from .platformkit import ORDER_PLACED

try:  # django.tasks is Django 6+; on 5.2 the order view publishes the event only
    from .tasks import send_receipt
except ImportError:
    send_receipt = None


@csrf_exempt  # a JSON API for machines; browser sessions don't call it
@require_POST
def place_order(request):
    """Body: ``{"customer": email, "sku": str, "quantity": int >= 1,
    "unit_price": "12.50"}``. Returns 201 ``{"order_id": int, "event_id":
    uuid, "receipt_task_id": uuid}``; 400 ``{"error": str, "fields": {...}}`` for a body that is not a
    JSON object or fails validation."""
    try:
        data = json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return JsonResponse({"error": f"the body is not valid JSON: {exc}"}, status=400)
    if not isinstance(data, dict):
        return JsonResponse({"error": f"the body must be a JSON object, got {type(data).__name__}"}, status=400)
    form = OrderForm(data)
    if not form.is_valid():
        return JsonResponse({"error": "invalid order", "fields": form.errors.get_json_data()}, status=400)
    order = form.cleaned_data
    with transaction.atomic():
        # One transaction: a rollback (here or in the caller) leaves neither
        # the order nor its event; a commit leaves both.
        row = Order.objects.create(
            customer=order["customer"],
            sku=order["sku"],
            quantity=order["quantity"],
            unit_price=order["unit_price"],
            total=(order["unit_price"] * order["quantity"]).quantize(Decimal("0.01")),
        )
        event_id = publish(
            ORDER_PLACED,
            {
                "order_id": row.pk,
                "customer": row.customer,
                "sku": row.sku,
                "quantity": row.quantity,
                "total": row.total,
            },
        )
        # A django.tasks task: also one outbox row in this transaction.
        receipt = send_receipt.enqueue(row.pk) if send_receipt is not None else None
    return JsonResponse(
        {"order_id": row.pk, "event_id": str(event_id), "receipt_task_id": receipt.id if receipt else None}, status=201
    )
