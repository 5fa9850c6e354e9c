"""The shop's own tables: orders (written by the view) and what the two
subscriptions write (a confirmation per order, one counter row)."""

from django.db import models


class Order(models.Model):
    customer = models.EmailField()
    sku = models.CharField(max_length=64)
    quantity = models.PositiveIntegerField()
    unit_price = models.DecimalField(max_digits=10, decimal_places=2)
    total = models.DecimalField(max_digits=12, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} {self.quantity} x {self.sku}"


class Confirmation(models.Model):
    """Written by ``shop.send_confirmation``. Deliberately no unique key on
    ``order``: a second run of the handler would show up as a second row, so
    counting rows checks exactly-once handling (the claim is what prevents it)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="confirmations")
    event_id = models.UUIDField()
    message = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"confirmation of order {self.order_id}"


class OrderStats(models.Model):
    """Counter rows, updated by ``shop.count_order`` with
    ``UPDATE ... SET orders = orders + 1`` so concurrent handlers never lose an
    increment (a read-modify-write in Python would)."""

    name = models.CharField(max_length=64, primary_key=True)
    orders = models.BigIntegerField(default=0)
    items = models.BigIntegerField(default=0)
    revenue = models.DecimalField(max_digits=16, decimal_places=2, default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "order stats"

    def __str__(self) -> str:
        return f"{self.name}: {self.orders} orders"
