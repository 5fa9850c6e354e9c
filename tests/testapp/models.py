from django.db import models


class Effect(models.Model):
    """One row per handler run that committed: duplicates show up as extra rows."""

    subscription = models.CharField(max_length=200)
    event_id = models.UUIDField()
    tenant_seen = models.CharField(max_length=64, blank=True, default="")
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)


class Attempt(models.Model):
    """Written outside the handler's transaction (autocommit connection), so
    failed attempts are counted too."""

    subscription = models.CharField(max_length=200)
    event_id = models.UUIDField()
    attempt = models.IntegerField()
    at = models.DateTimeField(auto_now_add=True)


class Order(models.Model):
    total = models.DecimalField(max_digits=10, decimal_places=2, default=0)
