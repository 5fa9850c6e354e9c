"""What the overview page concludes from its figures: each subscription's
state (ok / lagging / failing), whether a job is overdue, which workers
are folded away. Plain rules over plain values, with ``now`` passed in:
no query, no clock of its own. A threshold that depends on a setting is
derived from it here, so the page and the operating guide say one rule.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import TextChoices
from django.utils.translation import gettext_lazy as _

from django_platformkit import conf
from django_platformkit.jobs.specs import JobSpec


class SubscriptionState(TextChoices):
    """A subscription's state on the overview: paused when an operator
    paused it (it explains its wait), else the worst that applies (failing,
    then lagging)."""

    #: Nothing is retrying or dead-lettered, and nothing has waited longer than ``lagging_after_seconds()``.
    OK = "ok", _("ok")
    #: The oldest unhandled event has waited longer than ``lagging_after_seconds()``:
    #: the consumers are behind, or none runs, or the relay is behind.
    LAGGING = "lagging", _("lagging")
    #: The handler raises: events are retrying, or dead letters wait for an operator.
    FAILING = "failing", _("failing")
    #: An operator paused it (``manage.py pause``): no worker starts its handler, its events wait.
    PAUSED = "paused", _("paused")


class WorkerState(TextChoices):
    """A worker's state from its heartbeat row."""

    #: Beat within ``ALIVE_AFTER_SECONDS`` and connected to the broker (or not saying otherwise).
    ALIVE = "alive", _("alive")
    #: Beats, runs its jobs, but has not reached NATS (or lost it): it consumes nothing meanwhile.
    WAITING_FOR_BROKER = "waiting_for_broker", _("waiting for the broker")
    #: No beat for ``ALIVE_AFTER_SECONDS`` and no clean exit: killed, or hung.
    SILENT = "silent", _("silent")
    #: Exited cleanly.
    STOPPED = "stopped", _("stopped")


def lagging_after_seconds() -> float:
    """How long the oldest unhandled event of a subscription may wait before
    the subscription is *lagging*: ``ACK_WAIT_SECONDS``. A consumer that
    keeps up starts each event within one ack wait (the broker itself
    redelivers a message not acknowledged by then), so an event older than
    that is waiting behind a backlog, for a consumer that does not run, or
    for the relay."""
    return float(conf.settings.ACK_WAIT_SECONDS)


def subscription_state(
    *,
    retrying: int,
    open_dead_letters: int,
    oldest_unhandled_age_seconds: float | None,
    lagging_after: float,
    paused: bool = False,
) -> SubscriptionState:
    """The state of one subscription.

    Args:
        paused: an operator paused it.
        retrying: events that failed and wait for their next attempt (no claim yet).
        open_dead_letters: dead letters no operator has replayed or discarded.
        oldest_unhandled_age_seconds: how long the oldest event not handled
            yet has waited (stream or outbox), or None when nothing waits.
        lagging_after: ``lagging_after_seconds()``.

    Returns:
        ``PAUSED`` when paused, else ``FAILING`` when anything retries or a dead letter is open, else
        ``LAGGING`` when the oldest unhandled event is older than
        ``lagging_after``, else ``OK``.
    """
    if paused:
        return SubscriptionState.PAUSED
    if retrying or open_dead_letters:
        return SubscriptionState.FAILING
    if oldest_unhandled_age_seconds is not None and oldest_unhandled_age_seconds > lagging_after:
        return SubscriptionState.LAGGING
    return SubscriptionState.OK


#: A due slot still unclaimed this long after it came makes its job overdue:
#: the scheduler wakes at least once a second and, after a database error,
#: tries again within ``jobs.scheduler.OUTAGE_MAX_SECONDS`` (5 s); twice that
#: is no scheduler at all. Written out, not imported: a web process never
#: loads the scheduler; tests/admin/test_states.py holds the two together.
OVERDUE_AFTER_SECONDS = 10.0


def missed_slot(
    spec: JobSpec, last_slot: datetime | None, now: datetime, *, enabled_at: datetime | None = None
) -> datetime | None:
    """The first slot after ``last_slot`` that no scheduler claimed although
    it came more than ``OVERDUE_AFTER_SECONDS`` before ``now``, or None: the
    job is on time, or has never run (there is no slot to count from).

    A job whose run outlasts its interval is overdue too: the scheduler
    skips its slots while it runs (they are never doubled). A job an
    operator enabled again at ``enabled_at`` counts from then: the slots it
    skipped while disabled were skipped on purpose. (A disabled job is not
    asked: it is shown as disabled.)"""
    if last_slot is None:
        return None
    following = spec.next_slot(max(last_slot, enabled_at) if enabled_at is not None else last_slot)
    return following if now - following > timedelta(seconds=OVERDUE_AFTER_SECONDS) else None


def worker_state(*, alive: bool, stopped_at: datetime | None, waiting_for_broker: bool) -> WorkerState:
    """A worker's state: a clean exit, else silence, else waiting for the broker, else alive."""
    if stopped_at is not None:
        return WorkerState.STOPPED
    if not alive:
        return WorkerState.SILENT
    return WorkerState.WAITING_FOR_BROKER if waiting_for_broker else WorkerState.ALIVE


#: A worker that exited cleanly is listed this long after its last beat,
#: then folded away under "stopped earlier" (a deploy's restarts are news
#: for a few minutes, not for a day).
STOPPED_SHOWN_FOR = timedelta(minutes=5)
#: A worker that fell silent (killed or hung, maybe with work in hand) stays listed longer.
SILENT_SHOWN_FOR = timedelta(hours=1)


def folded(state: WorkerState, last_seen: datetime, now: datetime) -> bool:
    """Whether the overview folds the worker away: stopped for longer than
    ``STOPPED_SHOWN_FOR``, or silent for longer than ``SILENT_SHOWN_FOR``."""
    if state == WorkerState.STOPPED:
        return now - last_seen > STOPPED_SHOWN_FOR
    if state == WorkerState.SILENT:
        return now - last_seen > SILENT_SHOWN_FOR
    return False
