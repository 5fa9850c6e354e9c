"""The tables: the outbox (event log and job queue in one), the claims that
make handling exactly-once, the attempts that say how often a handler really
ran, the dead letters an operator acts on, and the slot ledger behind "once
per slot". Table names are part of the public
contract (DESIGN.md), defined once in ``_tables``. Reconciliation's state per
subscription (``reconciliation.py``) and the operator's controls - paused
subscriptions, job switches (``controls.py``) - have modules of their own,
imported here: Django finds an app's models in its ``models``.
"""

from __future__ import annotations

from typing import Self, cast
from uuid import UUID

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_platformkit._ids import uuid7
from django_platformkit._tables import (
    ATTEMPTS_TABLE,
    DEAD_LETTER_TABLE,
    HANDLED_TABLE,
    JOBS_TABLE,
    OUTBOX_TABLE,
    RATE_LIMITS_TABLE,
    TASK_RESULTS_TABLE,
    WORKERS_TABLE,
)
from django_platformkit.models.controls import JobControl, Pause  # noqa: F401 - Django finds them here
from django_platformkit.models.reconciliation import SubscriptionState  # noqa: F401 - Django finds it here
from django_platformkit.wire import AttemptOutcome, HandlingOutcome

#: ``clock_timestamp()`` rather than ``now()``: ``now()`` is the transaction's
#: start, so every event of one transaction would tie and lose its order.
ClockTimestamp = models.Func(function="clock_timestamp", output_field=models.DateTimeField())


class OutboxQuerySet(models.QuerySet["OutboxEvent"]):
    def pending(self) -> Self:
        return self.filter(published_at__isnull=True)

    def published(self) -> Self:
        return self.filter(published_at__isnull=False)

    def due(self) -> Self:
        """Pending rows the relay may send now: no not-before time, or one that has passed."""
        return self.pending().filter(models.Q(not_before__isnull=True) | models.Q(not_before__lte=Now()))


class OutboxEvent(models.Model):
    """One published event: written by ``publish()`` in the caller's
    transaction, stamped by the relay once JetStream acknowledged it."""

    id = models.UUIDField(verbose_name=_("event id"), primary_key=True, default=uuid7, editable=False)
    name = models.CharField(verbose_name=_("name"), max_length=200)
    tenant = models.CharField(verbose_name=_("tenant"), max_length=64, null=True, blank=True)
    payload = models.JSONField(verbose_name=_("payload"))
    headers = models.JSONField(verbose_name=_("headers"), default=dict)
    created_at = models.DateTimeField(verbose_name=_("created at"), db_default=ClockTimestamp)
    published_at = models.DateTimeField(verbose_name=_("published at"), null=True, blank=True)
    # A deferred task's run_after (django.tasks): the relay leaves the row
    # pending until then. NULL for every plain event.
    not_before = models.DateTimeField(verbose_name=_("not before"), null=True, blank=True)
    # Where the broker stored its last send (stamped with published_at): the
    # stream by its creation time - a reset or lost stream is made again with
    # another - and the sequence the PubAck gave. What reconciliation reads.
    stream_created = models.DateTimeField(verbose_name=_("stream created"), null=True, blank=True)
    stream_seq = models.BigIntegerField(verbose_name=_("stream sequence"), null=True, blank=True)

    objects = OutboxQuerySet.as_manager()

    class Meta:
        db_table = OUTBOX_TABLE
        verbose_name = _("outbox event")
        verbose_name_plural = _("outbox events")
        indexes = [
            # The relay walks this index in relay order; it stays as small as
            # the due backlog however large the table grows. Deferred rows are
            # not in it: a million tasks due tomorrow would otherwise sit in
            # front of every due row and be skipped one by one on each batch.
            models.Index(
                fields=["created_at", "id"],
                condition=models.Q(published_at__isnull=True, not_before__isnull=True),
                name="platformkit_outbox_pending",
            ),
            # Deferred rows by due time: the relay takes the due ones from the
            # front and learns from the first one how long it may sleep.
            models.Index(
                fields=["not_before", "id"],
                condition=models.Q(published_at__isnull=True, not_before__isnull=False),
                name="platformkit_outbox_deferred",
            ),
            # Purge finds old published rows without a sequential scan.
            models.Index(
                fields=["published_at"],
                condition=models.Q(published_at__isnull=False),
                name="platformkit_outbox_published",
            ),
            # Reconciliation walks one event's sends in stream order, from where its last pass stopped.
            models.Index(
                fields=["name", "stream_created", "stream_seq"],
                condition=models.Q(stream_seq__isnull=False),
                name="platformkit_outbox_stream",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.id}"

    @property
    def is_pending(self) -> bool:
        return self.published_at is None


#: The outcomes a claim row records (``HandledEvent.outcome``).
CLAIM_OUTCOMES = (HandlingOutcome.HANDLED, HandlingOutcome.DEAD_LETTERED, HandlingOutcome.CANCELLED)


class HandledQuerySet(models.QuerySet["HandledEvent"]):
    def for_event(self, event_id: UUID | str) -> Self:
        return self.filter(event_id=event_id)


class HandledEvent(models.Model):
    """A claim: subscription S handled (or gave up on) event E. Inserted in
    the handler's own transaction, so it commits exactly when its work does."""

    id = models.BigAutoField(primary_key=True)
    subscription = models.CharField(verbose_name=_("subscription"), max_length=200)
    event_id = models.UUIDField(verbose_name=_("event id"))
    handled_at = models.DateTimeField(verbose_name=_("handled at"), db_default=Now())
    #: Why the claim exists: ``handled`` (the handler committed), ``dead_lettered``
    #: (a dead letter's terminal claim) or ``cancelled`` (``cancel()``). A database
    #: default, so the claim statement of the hot path doesn't name it.
    outcome = models.CharField(
        verbose_name=_("outcome"),
        max_length=16,
        db_default=HandlingOutcome.HANDLED.value,
        choices=[(o.value, o.value) for o in CLAIM_OUTCOMES],
    )

    objects = HandledQuerySet.as_manager()

    class Meta:
        db_table = HANDLED_TABLE
        verbose_name = _("claim")
        verbose_name_plural = _("claims")
        constraints = [
            models.UniqueConstraint(fields=["subscription", "event_id"], name="platformkit_handled_once"),
        ]
        indexes = [
            models.Index(fields=["event_id"], name="platformkit_handled_event"),
            # The overview's "handled in the last 5 min / hour", "last handled
            # at" and throughput sparkline: a range scan per subscription
            # instead of a walk over every claim ever made.
            models.Index(fields=["subscription", "handled_at"], name="platformkit_handled_recent"),
        ]

    def __str__(self) -> str:
        return f"{self.subscription} handled {self.event_id}"


class AttemptQuerySet(models.QuerySet["Attempt"]):
    def for_event(self, event_id: UUID | str, subscription: str | None = None) -> Self:
        rows = self.filter(event_id=event_id)
        return rows if subscription is None else rows.filter(subscription=subscription)

    def counted(self) -> Self:
        """The runs that count against ``max_attempts``: failed, or started
        and never reported (the worker died or hung in them)."""
        return self.filter(outcome__in=[Attempt.FAILED, Attempt.RUNNING])

    def never_reported(self) -> Self:
        """Runs that started and have no outcome: the worker died or hung in them (or is still in them)."""
        return self.filter(outcome=Attempt.RUNNING)

    def last_failure(self) -> Attempt | None:
        """The newest failed run with its error and traceback, or None."""
        return self.filter(outcome=Attempt.FAILED).order_by("-attempt").first()


class Attempt(models.Model):
    """One run of a handler for (subscription, event), the history behind
    ``ReceivedEvent.attempt`` and a dead letter's ``attempts`` (DESIGN.md
    "Attempts"). Written only when it carries news: a failure (after its
    transaction rolled back), or the start of a run on a redelivery, so a
    run that never reports still counts. The first, usual delivery that
    succeeds writes no row at all.

    ``outcome``: ``running`` (started, no outcome yet - counts: the worker
    died or hung in it), ``failed`` (counts), ``handled``, or ``interrupted``
    (the run was cut short by a database outage or a stopping worker through
    no fault of the handler - does not count)."""

    RUNNING = AttemptOutcome.RUNNING
    FAILED = AttemptOutcome.FAILED
    HANDLED = AttemptOutcome.HANDLED
    INTERRUPTED = AttemptOutcome.INTERRUPTED
    OUTCOMES = [(outcome.value, outcome.value) for outcome in AttemptOutcome]

    id = models.BigAutoField(primary_key=True)
    subscription = models.CharField(verbose_name=_("subscription"), max_length=200)
    event_id = models.UUIDField(verbose_name=_("event id"))
    attempt = models.PositiveIntegerField(
        verbose_name=_("attempt"), help_text=_("1-based: the how-many-th run of the handler")
    )
    outcome = models.CharField(verbose_name=_("outcome"), max_length=16, choices=OUTCOMES, default=RUNNING)
    started_at = models.DateTimeField(verbose_name=_("started at"), db_default=Now())
    finished_at = models.DateTimeField(verbose_name=_("finished at"), null=True, blank=True)
    error = models.TextField(verbose_name=_("error"), blank=True, default="")
    traceback = models.TextField(verbose_name=_("traceback"), blank=True, default="")
    worker = models.CharField(
        verbose_name=_("worker"),
        max_length=200,
        blank=True,
        default="",
        help_text=_("host:pid of the worker that ran it"),
    )

    objects = AttemptQuerySet.as_manager()

    class Meta:
        db_table = ATTEMPTS_TABLE
        verbose_name = _("attempt")
        verbose_name_plural = _("attempts")
        ordering = ["subscription", "event_id", "attempt"]
        constraints = [
            models.UniqueConstraint(fields=["subscription", "event_id", "attempt"], name="platformkit_attempt_once"),
        ]
        indexes = [models.Index(fields=["event_id"], name="platformkit_attempt_event")]

    def __str__(self) -> str:
        return f"{self.subscription} attempt {self.attempt} of {self.event_id}: {self.outcome}"


class DeadLetter(models.Model):
    """An event a subscription gave up on after its last attempt (or that the
    relay could not send at all: subscription ``platformkit.relay``). Written
    together with a terminal claim; the payload's only copy is the outbox row."""

    id = models.BigAutoField(primary_key=True)
    event_id = models.UUIDField(verbose_name=_("event id"))
    subscription = models.CharField(verbose_name=_("subscription"), max_length=200)
    name = models.CharField(verbose_name=_("name"), max_length=200)
    tenant = models.CharField(verbose_name=_("tenant"), max_length=64, null=True, blank=True)
    attempts = models.PositiveIntegerField(verbose_name=_("attempts"), default=0)
    error = models.TextField(verbose_name=_("error"), blank=True, default="")
    traceback = models.TextField(verbose_name=_("traceback"), blank=True, default="")
    failed_at = models.DateTimeField(verbose_name=_("failed at"), db_default=Now())
    #: A malformed message's place in the stream (``nats stream get STREAM
    #: SEQ`` fetches it whole); null for an event of the outbox.
    stream_seq = models.BigIntegerField(verbose_name=_("stream sequence"), null=True, blank=True)

    class Meta:
        db_table = DEAD_LETTER_TABLE
        verbose_name = _("dead letter")
        verbose_name_plural = _("dead letters")
        ordering = ["-failed_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["subscription", "event_id"], name="platformkit_dead_letter_once"),
        ]
        indexes = [models.Index(fields=["event_id"], name="platformkit_dead_letter_event")]
        permissions = [("replay_deadletter", _("Can replay or discard dead letters"))]

    def __str__(self) -> str:
        # The admin's title of the dead letter's page and its History.
        return gettext("%(subscription)s gave up on %(name)s %(event_id)s") % {
            "subscription": self.subscription,
            "name": self.name,
            "event_id": self.event_id,
        }

    @property
    def error_summary(self) -> str:
        return (self.error or "").strip().splitlines()[0][:200] if self.error else ""


class JobState(models.Model):
    """The slot ledger of one periodic job: the newest slot claimed, and how
    its last run went."""

    name = models.CharField(verbose_name=_("name"), max_length=200, primary_key=True)
    last_slot = models.DateTimeField(verbose_name=_("last slot"), null=True, blank=True)
    started_at = models.DateTimeField(verbose_name=_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(verbose_name=_("finished at"), null=True, blank=True)
    last_error = models.TextField(verbose_name=_("last error"), blank=True, default="")

    class Meta:
        db_table = JOBS_TABLE
        verbose_name = _("job state")
        verbose_name_plural = _("job states")

    def __str__(self) -> str:
        return self.name


class WorkerState(models.TextChoices):
    """What a worker is doing, as its heartbeat row says (``platformkit_workers.state``)."""

    #: Started; the broker not reached yet. Its jobs and heartbeat run already (they need only PostgreSQL).
    STARTING = "starting", "starting"
    #: NATS, the stream or a durable can't be reached yet: jobs run, nothing is relayed or consumed.
    WAITING_FOR_BROKER = "waiting_for_broker", "waiting for the broker"
    #: Relaying, consuming and running jobs, as asked.
    RUNNING = "running", "running"
    #: Running while another live database with this identity tried the stream
    #: (a staging copy): messages this outbox doesn't know are handed back, not
    #: terminated. ``detail`` says which, and the fix.
    CONTESTED = "contested", "contested"
    #: Stopped: its stream was refused (another project's, a live copy's, or
    #: limits that could discard unhandled events). ``detail`` says why, and the fix.
    REFUSED = "refused", "refused"


class WorkerHeartbeat(models.Model):
    """A worker process that is (or was recently) running: written by
    ``heartbeat.Heartbeat`` from the worker's watchdog every few seconds, read
    by the admin overview ("workers seen"). ``worker`` is ``host:pid``;
    ``stopped_at`` is set by a clean shutdown (a killed worker just stops
    beating)."""

    worker = models.CharField(max_length=200, primary_key=True, help_text="host:pid")
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_default=Now())
    stopped_at = models.DateTimeField(null=True, blank=True)
    subscriptions = models.JSONField(default=list, help_text="the subscription names this worker consumes")
    version = models.CharField(max_length=50, blank=True, default="", help_text="django_platformkit version")
    state = models.CharField(max_length=32, choices=WorkerState.choices, default=WorkerState.RUNNING)
    detail = models.TextField(blank=True, default="", help_text="why it waits or was refused, and the fix")
    instance = models.CharField(
        max_length=64, blank=True, default="", help_text="the database instance it works for (system id:database oid)"
    )

    class Meta:
        db_table = WORKERS_TABLE
        verbose_name = "worker heartbeat"
        ordering = ["-last_seen"]

    def __str__(self) -> str:
        return self.worker


class Overview(OutboxEvent):
    """No table of its own: the admin's overview page
    (``admin:django_platformkit_overview``) hangs off this proxy so the app
    index links it like any table and the page has a place in the URL
    scheme (``/admin/django_platformkit/overview/``)."""

    class Meta:
        proxy = True
        verbose_name = _("overview")
        verbose_name_plural = _("overview")


class TaskResultRecord(models.Model):
    """What a ``django.tasks`` task run left behind (``django_platformkit.tasks``):
    the return value, written with the claim in the task's own transaction,
    and one error per failed attempt, written after its rollback. The task's
    arguments and enqueue time are the outbox row's; READY/RUNNING/FAILED are
    derived when read (no row, a held lock, a dead letter). Deleted with its
    outbox row (a database-level cascade), so a result lives as long as the
    row that purge keeps."""

    event_id = models.UUIDField(primary_key=True)
    status = models.CharField(
        max_length=16, blank=True, default="", help_text=_("SUCCESSFUL once a run committed; '' before")
    )
    return_value = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    errors = models.JSONField(default=list, help_text=_("[{exception_class_path, traceback}] per failed attempt"))
    worker_ids = models.JSONField(default=list, help_text=_("host:pid per run, in order"))

    class Meta:
        db_table = TASK_RESULTS_TABLE
        verbose_name = _("task result")
        verbose_name_plural = _("task results")

    def __str__(self) -> str:
        return f"task {self.event_id}: {self.status or 'not finished'}"


class TaskQuerySet(OutboxQuerySet):
    def failed(self) -> Self:
        return self.filter(models.Exists(DeadLetter.objects.filter(event_id=models.OuterRef("pk"))))

    def successful(self) -> Self:
        return self.filter(
            models.Exists(TaskResultRecord.objects.filter(event_id=models.OuterRef("pk"), status="SUCCESSFUL"))
        )


_TaskManagerBase = models.Manager.from_queryset(TaskQuerySet)


class TaskManager(_TaskManagerBase["OutboxEvent"]):
    def get_queryset(self) -> TaskQuerySet:
        # from_queryset(TaskQuerySet) builds a TaskQuerySet; django-stubs types
        # the inherited get_queryset() as a plain QuerySet.
        rows = cast(TaskQuerySet, super().get_queryset())
        return rows.filter(name__startswith="platformkit.task_")


class OutboxTask(OutboxEvent):
    """The outbox rows that are ``django.tasks`` tasks (for the admin)."""

    # A proxy narrows its parent's manager to task rows; django-stubs types
    # OutboxEvent.objects as the exact as_manager() class, so any other
    # manager here reads as an incompatible override.
    objects = TaskManager()  # type: ignore[assignment,misc]

    class Meta:
        proxy = True
        verbose_name = _("task")
        verbose_name_plural = _("tasks")


class RateLimit(models.Model):
    """The shared limiter of a rate-limited subscription (``subscribe(...,
    rate_limit=...)``): the earliest time its next handler may start, moved
    on by ``period / count`` with each start any worker takes, and that
    spacing, so a taker under another limit judges the reservation again."""

    name = models.CharField(verbose_name=_("subscription"), max_length=200, primary_key=True)
    next_at = models.DateTimeField(verbose_name=_("next start at"))
    spacing_seconds = models.FloatField(
        verbose_name=_("spacing (seconds)"),
        null=True,
        help_text=_("period / count of the limit the next start was reserved under"),
    )

    class Meta:
        db_table = RATE_LIMITS_TABLE
        verbose_name = _("rate limit")
        verbose_name_plural = _("rate limits")

    def __str__(self) -> str:
        return f"{self.name}: next start at {self.next_at}"
