"""The shop's django.tasks tasks, run by django_platformkit's OutboxBackend
(settings.TASKS). ``send_receipt.enqueue()`` in the order view is one outbox
row in the order's transaction: no ``transaction.on_commit()`` needed."""

from django.tasks import task

from .models import Order


@task(queue_name="emails")
def send_receipt(order_id: int) -> str:
    """Compose the receipt of one order and "send" it (a real mailer here
    would be at least once: a crash after sending and before the commit
    sends it again on the retry). Returns the subject line, kept as the
    task's result."""
    order = Order.objects.get(pk=order_id)
    return f"Receipt for order {order.pk}: {order.quantity} x {order.sku}, {order.total}"
