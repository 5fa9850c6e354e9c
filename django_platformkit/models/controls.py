"""The operator's controls, as tables: a subscription or task queue an
operator paused (``Pause``), and a periodic job's switches - disabled, a run
asked for by hand, and the last such run (``JobControl``). ``models/__init__.py``
imports this module, so they are this app's models like the others; they
live apart because they are state an operator sets, not work in flight.
Written only by ``operate/pause.py`` and ``jobs/controls.py``; every worker
reads them (``runtime/controlwatch.py``), so a control set in one place
holds on every worker, a worker started later included.
"""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_platformkit._tables import JOB_CONTROLS_TABLE, PAUSES_TABLE


class Pause(models.Model):
    """A paused subscription - or task queue, under its queue's subscription
    name - while the row exists: no worker starts its handler, its messages
    wait in the stream. Resuming deletes the row; the admin's ``LogEntry``
    rows and the ``platformkit.subscription_paused`` / ``_resumed`` events
    keep the history."""

    name = models.CharField(verbose_name=_("subscription"), max_length=200, primary_key=True)
    paused_at = models.DateTimeField(verbose_name=_("paused at"), db_default=Now())
    paused_by = models.CharField(verbose_name=_("paused by"), max_length=150)
    reason = models.TextField(verbose_name=_("reason"))

    class Meta:
        db_table = PAUSES_TABLE
        verbose_name = _("pause")

    def __str__(self) -> str:
        return gettext("%(name)s paused by %(actor)s") % {"name": self.name, "actor": self.paused_by}


class JobControl(models.Model):
    """What operators set on one periodic job (no row: nothing set). While
    ``disabled_at`` is set its slots are skipped; ``enabled_at`` is when it
    was last enabled again (slots before it were skipped on purpose, never
    caught up or called overdue). ``run_requested_*`` is a run asked for by
    hand and not started yet; ``manual_*`` the last such run. The slot
    ledger (``JobState``) never sees a manual run."""

    name = models.CharField(verbose_name=_("job"), max_length=200, primary_key=True)
    disabled_at = models.DateTimeField(verbose_name=_("disabled at"), null=True, blank=True)
    disabled_by = models.CharField(verbose_name=_("disabled by"), max_length=150, blank=True, db_default="")
    disabled_reason = models.TextField(verbose_name=_("why disabled"), blank=True, db_default="")
    enabled_at = models.DateTimeField(verbose_name=_("enabled again at"), null=True, blank=True)
    run_requested_at = models.DateTimeField(verbose_name=_("run asked for at"), null=True, blank=True)
    run_requested_by = models.CharField(verbose_name=_("run asked for by"), max_length=150, blank=True, db_default="")
    run_reason = models.TextField(verbose_name=_("why run"), blank=True, db_default="")
    manual_started_at = models.DateTimeField(verbose_name=_("manual run started at"), null=True, blank=True)
    manual_finished_at = models.DateTimeField(verbose_name=_("manual run finished at"), null=True, blank=True)
    manual_by = models.CharField(verbose_name=_("manual run by"), max_length=150, blank=True, db_default="")
    manual_reason = models.TextField(verbose_name=_("why the manual run"), blank=True, db_default="")
    manual_error = models.TextField(verbose_name=_("manual run error"), blank=True, db_default="")

    class Meta:
        db_table = JOB_CONTROLS_TABLE
        verbose_name = _("job control")

    def __str__(self) -> str:
        return self.name
