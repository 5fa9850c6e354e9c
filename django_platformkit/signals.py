"""Django signals for what the outbox, the consumer and the scheduler do.

In the style of ``django/tasks/signals.py``: plain ``Signal()`` objects that
metrics, error trackers and test helpers connect to. Every signal is sent
once per occurrence, after the fact, and a receiver that raises is logged,
never allowed to change an outcome (they are sent with ``send_robust``).

``sender`` is the ``Subscription`` (handled/failed/dead-lettered/malformed),
the ``EventType`` (published), the ``Relay`` (events_relayed), the
``ReconcileReport`` class (events_reconciled) or the ``JobSpec`` (job_finished).

Receivers run in the thread that did the work (a handler's consumer thread,
the relay's thread, a job's thread): keep them short and thread-safe, as
``django_platformkit.runtime.metrics`` does.
"""

from __future__ import annotations

from django.dispatch import Signal

#: ``publish()``/``publish_many()`` wrote an outbox row (in the caller's
#: transaction: it may still roll back). kwargs: ``event_id`` (UUID),
#: ``name`` (str), ``tenant`` (str | None), ``payload_text`` (str, the JSON as
#: stored), ``using`` (database alias). A receiver that raises is logged and
#: ``publish()`` still returns the id: the row is written, so the caller must
#: not be told it wasn't.
event_published = Signal()

#: A delivery was settled without error. kwargs: ``subscription`` (name),
#: ``event`` (``ReceivedEvent``), ``outcome`` (``"handled"``: the handler
#: ran and committed; ``"skipped"``: a claim already existed),
#: ``duration_seconds`` (float, the handler's run; 0.0 when skipped),
#: ``delivery_latency_seconds`` (float: from the event's commit, or a task's
#: ``run_after``, to the handler's start; None when skipped or unknown).
event_handled = Signal()

#: One attempt of a handler failed (the last one included, before its dead
#: letter). kwargs: ``subscription``, ``event`` (``ReceivedEvent``),
#: ``error`` (the exception), ``attempt`` (int, 1-based handler runs),
#: ``will_retry`` (bool), ``duration_seconds`` (float),
#: ``delivery_latency_seconds`` (float or None, as for ``event_handled``).
event_failed = Signal()

#: A dead letter was written. kwargs: ``subscription``, ``event_id`` (UUID),
#: ``name`` (str), ``tenant`` (str | None), ``attempts`` (int), ``error``
#: (str, one line), ``exception`` (the last exception, or None when the event
#: was dead-lettered without running: malformed, never reported), ``task``
#: (a ``django.tasks`` task's dotted path, else "").
event_dead_lettered = Signal()

#: A periodic job's run ended. kwargs: ``job`` (name), ``slot`` (aware
#: datetime; None for a run an operator asked for by hand), ``outcome``
#: (``"succeeded"`` or ``"failed"``), ``error`` (the exception or None),
#: ``duration_seconds`` (float), ``manual_by`` (who asked for a run by hand, else None).
job_finished = Signal()

#: A message on a subscription's subject could not be read as one of this
#: project's events (not a CloudEvents envelope, a subject that contradicts
#: its body...): recorded as a dead letter named ``(malformed)``, never run.
#: kwargs: ``subscription`` (name), ``subject`` (str), ``stream_seq`` (int),
#: ``reason`` (str), ``event_id`` (the UUID it was recorded under).
event_malformed = Signal()

#: A relay batch was settled with the broker. kwargs: ``stored`` (int, rows
#: the stream accepted and that were stamped published; broker-side
#: duplicates included), ``duplicates`` (int), ``dead_lettered`` (int, rows
#: the broker refused for good), ``temporary`` (int, rows left pending for a
#: retry). Sent once per batch that selected at least one row.
events_relayed = Signal()

#: A reconciliation pass re-sent events the stream no longer held for a
#: subscription (``operate.reconcile``). kwargs: ``subscription`` (name),
#: ``cause`` (a ``ReconcileCause`` value: why the stream no longer held
#: them), ``count`` (int). Sent once per subscription and cause of a pass.
events_reconciled = Signal()
