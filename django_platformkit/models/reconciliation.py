"""Reconciliation's table (``operate/reconcile.py`` decides, ``operate/
reconcile_rows.py`` is its one write path): per subscription, where it began
in the stream - kept when its durable is deleted, so one made again is owed
what it missed and a ``backfill=False`` one is never backfilled - how far
its events are reconciled, and what its last passes did, for the overview.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_platformkit._tables import SUBSCRIPTIONS_TABLE


class SubscriptionState(models.Model):
    """What reconciliation keeps of a subscription. ``origin_*``: the stream
    (by its creation time) and the sequence its durable first started after:
    nothing at or before it is owed to it. ``reconciled_*``: the cursor, how
    far its events are reconciled; ``staged_*``: the horizon a pass saw and
    when, the cursor once no late stamp can land below it. ``note``: why its
    last pass did nothing; ``resent``: ``{cause: count}`` of its last pass
    that sent something again (at ``resent_at``)."""

    name = models.CharField(verbose_name=_("subscription"), max_length=200, primary_key=True)
    first_seen_at = models.DateTimeField(verbose_name=_("first seen at"), db_default=Now())
    origin_stream_created = models.DateTimeField(verbose_name=_("began in the stream created at"))
    origin_seq = models.BigIntegerField(verbose_name=_("began after the sequence"), db_default=0)
    reconciled_stream_created = models.DateTimeField(null=True, blank=True)
    reconciled_seq = models.BigIntegerField(db_default=0)
    staged_stream_created = models.DateTimeField(null=True, blank=True)
    staged_seq = models.BigIntegerField(db_default=0)
    staged_at = models.DateTimeField(null=True, blank=True)
    reconciled_at = models.DateTimeField(verbose_name=_("reconciled at"), null=True, blank=True)
    note = models.TextField(
        verbose_name=_("note"), blank=True, db_default="", help_text=_("why its last pass did nothing")
    )
    resent_at = models.DateTimeField(verbose_name=_("re-sent at"), null=True, blank=True)
    resent = models.JSONField(verbose_name=_("re-sent"), db_default={}, help_text=_("{cause: count} of that pass"))

    class Meta:
        db_table = SUBSCRIPTIONS_TABLE
        verbose_name = _("subscription state")
        verbose_name_plural = _("subscription states")

    def __str__(self) -> str:
        return self.name
