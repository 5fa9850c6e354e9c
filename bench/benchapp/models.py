"""The benchmark's tables: ``Row`` is the bare ORM insert that ``publish()``
is measured against (the outbox row's columns, without its partial indexes
or NOTIFY), ``Sink`` is what every benchmark handler - ours, procrastinate's,
pgqueuer's - inserts one row into, stamped with the database clock."""

from django.db import models

from django_platformkit._ids import uuid7
from django_platformkit.models import ClockTimestamp


class Row(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    name = models.CharField(max_length=200)
    tenant = models.CharField(max_length=64, null=True, blank=True)
    payload = models.JSONField()
    headers = models.JSONField(default=dict)
    created_at = models.DateTimeField(db_default=ClockTimestamp)

    class Meta:
        db_table = "bench_row"


class Sink(models.Model):
    """One row per handler run. ``at``: ``clock_timestamp()`` when the
    handler ran; ``occurred_at``: the event's outbox ``created_at`` (also the
    database clock), so ``at - occurred_at`` is commit-to-handler latency."""

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=32)
    event_id = models.CharField(max_length=64, null=True)
    occurred_at = models.DateTimeField(null=True)
    at = models.DateTimeField(db_default=ClockTimestamp)

    class Meta:
        db_table = "bench_sink"
