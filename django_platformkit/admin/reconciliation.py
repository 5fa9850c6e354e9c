"""The overview's reconciliation section: when the workers last reconciled
the outbox with the stream, and what the last passes sent again, per
subscription and cause (``operate/reconcile.py``), read from
``platformkit_subscriptions``. A re-send means the broker lost something the
outbox still held; no pass for several intervals means no worker reconciles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import DatabaseError
from django.utils import timezone
from django.utils.translation import gettext

from django_platformkit import conf
from django_platformkit.models.reconciliation import SubscriptionState
from django_platformkit.operate.reconcile import CAUSE_TEXT, ReconcileCause

#: No pass for this many intervals: the section says no worker reconciles.
SILENT_AFTER_INTERVALS = 3


@dataclass(frozen=True)
class Resent:
    """A subscription's last pass that sent something again: when, and how many per cause (with its meaning)."""

    subscription: str
    at: datetime
    causes: list[tuple[str, int, str]]

    @property
    def total(self) -> int:
        return sum(n for _, n, _ in self.causes)


@dataclass
class ReconcileFigures:
    """``last_pass_at``: the newest pass of any subscription (None: none
    yet); ``resent``: each subscription's last re-send, newest first;
    ``notes``: why the last pass did nothing for a subscription, by text."""

    interval_seconds: float
    last_pass_at: datetime | None = None
    resent: list[Resent] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)
    error: str = ""

    @property
    def silent(self) -> bool:
        """No pass within ``SILENT_AFTER_INTERVALS`` intervals (while subscriptions are recorded)."""
        if self.last_pass_at is None:
            return False
        quiet = timedelta(seconds=SILENT_AFTER_INTERVALS * self.interval_seconds)
        return timezone.now() - self.last_pass_at > quiet


def collect(using: str | None = None) -> ReconcileFigures:
    """The section's figures; a database error is said, not raised."""
    figures = ReconcileFigures(float(conf.settings.RECONCILE_INTERVAL_SECONDS))
    try:
        rows = list(
            SubscriptionState.objects.using(using or conf.settings.DATABASE_ALIAS).values_list(
                "name", "reconciled_at", "note", "resent_at", "resent"
            )
        )
    except DatabaseError as exc:
        figures.error = " ".join(str(exc).split())
        return figures
    for name, reconciled_at, note, resent_at, resent in rows:
        if reconciled_at is not None and (figures.last_pass_at is None or reconciled_at > figures.last_pass_at):
            figures.last_pass_at = reconciled_at
        if note:
            figures.notes.setdefault(note, []).append(name)
        if resent_at is not None and resent:
            causes = [
                (cause, int(n), gettext(CAUSE_TEXT[ReconcileCause(cause)])) for cause, n in sorted(resent.items())
            ]
            figures.resent.append(Resent(name, resent_at, causes))
    figures.resent.sort(key=lambda r: r.at, reverse=True)
    return figures
