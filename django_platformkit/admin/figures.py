"""The figures behind the admin overview page (``admin:django_platformkit_overview``):
is every subscription keeping up, how far behind is the relay, which jobs
ran, which workers are alive.

Owns the queries and the one broker round trip; the admin only renders what
``collect()`` returns. Two sources:

- the database, in bounded, indexed queries under a ``statement_timeout``:
  claims by (subscription, handled_at) over the last hour, the outbox's
  partial indexes (pending rows; published in the last hour), dead letters
  by subscription, the slot ledger, worker heartbeats, and the attempt
  history behind each subscription's retries (``failures.py``);
- NATS (``broker/figures.py``), through a one-off connection with a hard total deadline
  (``BROKER_TIMEOUT_SECONDS``): each durable's ``num_pending``,
  ``num_ack_pending``, ``num_redelivered``, and the time of the oldest
  message not yet acknowledged. When NATS is unreachable the database
  figures still render and ``Overview.broker_error`` says why.

The page's shape (a few figures per queue plus a one-hour sparkline) follows
Oban Web's queue table and River UI's job-state counts; the lag definition
(the oldest unrelayed row's age) is the Go platformkit's outbox-lag gauge.
What the page concludes from the figures (states, overdue jobs, folded
workers) follows the rules of ``states.py``.

Why one module: the overview's value types and the queries that fill
them change together (a figure added is a field and a query), and
``collect()`` is their one entry point.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, transaction
from django.utils import timezone

from django_platformkit import conf
from django_platformkit._tables import (
    DEAD_LETTER_TABLE,
    DUE_BACKLOG_SQL,
    HANDLED_TABLE,
    OUTBOX_TABLE,
    PAUSES_TABLE,
    WORKERS_TABLE,
)
from django_platformkit.admin import states
from django_platformkit.admin.failures import Failure, failures
from django_platformkit.admin.jobfigures import JobFigures, job_figures
from django_platformkit.admin.queries import Timed
from django_platformkit.admin.states import SubscriptionState, WorkerState
from django_platformkit.broker.figures import BROKER_TIMEOUT_SECONDS, broker_figures
from django_platformkit.broker.standing import StreamStanding
from django_platformkit.consume.pausing import pause_key
from django_platformkit.models import WorkerState as BeatState
from django_platformkit.models.controls import Pause
from django_platformkit.runtime.heartbeat import ALIVE_AFTER_SECONDS

logger = logging.getLogger(__name__)

#: Sparkline resolution: one bucket per minute over the last hour.
BUCKETS = 60
BUCKET_SECONDS = 60
#: Workers whose last beat is older than this are not listed at all.
WORKERS_SEEN_WITHIN = timedelta(hours=24)


@dataclass
class SubscriptionFigures:
    """One subscription's row. Broker fields are None when NATS didn't answer.
    ``throughput_per_minute``: handled per minute, oldest first (``BUCKETS``
    entries), or None when the query timed out."""

    name: str
    event: str
    durable: str
    registered: bool = True
    num_pending: int | None = None
    num_ack_pending: int | None = None
    num_redelivered: int | None = None
    handled_5m: int = 0
    handled_1h: int = 0
    open_dead_letters: int = 0
    last_handled_at: datetime | None = None
    oldest_unhandled_age_seconds: float | None = None
    #: "broker" (the oldest message in the stream not yet acknowledged),
    #: "outbox" (the oldest row of this event the relay has not sent yet,
    #: when that is older, or NATS didn't answer), or "" (nothing waits).
    oldest_unhandled_source: str = ""
    broker_error: str = ""
    throughput_per_minute: list[int] | None = None
    #: ``max_attempts`` of the subscription (None: not declared in this build).
    max_attempts: int | None = None
    #: Events retrying now, since when it fails, its newest error.
    failure: Failure = field(default_factory=Failure)
    state: SubscriptionState = SubscriptionState.OK
    #: The oldest unhandled event waited past the lagging threshold (failing or not).
    behind: bool = False
    #: The pause an operator set on it (who, when, why), or None; ``pause_key``: the name it is kept under.
    paused: Pause | None = None
    pause_key: str = ""
    #: A task queue's tasks lately, by dotted path (``taskfigures.TaskFigures``): rows under its row.
    tasks: list[Any] = field(default_factory=list)


@dataclass
class OutboxFigures:
    """``oldest_pending_age_seconds`` is the relay lag; the lists hold one
    value per minute, oldest first: rows relayed, and the worst
    ``published_at - created_at`` (seconds) among them."""

    pending: int = 0
    oldest_pending_age_seconds: float | None = None
    relayed_5m: int = 0
    relayed_per_minute: list[int] | None = None
    lag_seconds_per_minute: list[float] | None = None


@dataclass
class WorkerFigures:
    """One worker's heartbeat row. ``beat``: what the row says the worker is
    doing (``models.WorkerState``: starting, waiting_for_broker, running,
    contested, refused); ``detail``: why it waits or was refused, and the fix
    ("" otherwise); ``instance``: the database instance it works for.
    ``state``: what the page shows of it (``states.worker_state``)."""

    worker: str
    started_at: datetime
    last_seen: datetime
    stopped_at: datetime | None
    subscriptions: list[str]
    version: str
    alive: bool
    beat: str = BeatState.RUNNING
    detail: str = ""
    instance: str = ""
    waiting_for_broker_since: datetime | None = None

    @property
    def waiting_for_broker(self) -> bool:
        """It beats (its jobs run) but has not reached the broker, or lost it."""
        return self.beat in (BeatState.STARTING, BeatState.WAITING_FOR_BROKER)

    @property
    def state(self) -> WorkerState:
        return states.worker_state(
            alive=self.alive, stopped_at=self.stopped_at, waiting_for_broker=self.waiting_for_broker
        )


@dataclass
class Overview:
    """What ``collect()`` returns. ``broker_error``: empty when NATS answered,
    else why not (credentials redacted). ``notes``: figures that could not be
    computed, one sentence each. ``stream_standing``: the stream as the
    broker holds it, judged for this database; ``stream_problems`` and
    ``identity_conflict`` say what of it could lose events (a limit that could
    discard unhandled events, a live copy of this database on the same
    stream), each naming the problem and its fix: the page shows them in a
    banner above everything."""

    generated_at: datetime
    nats_url: str
    stream: str
    subscriptions: list[SubscriptionFigures]
    outbox: OutboxFigures
    jobs: list[JobFigures]
    workers: list[WorkerFigures]
    broker_error: str = ""
    notes: list[str] = field(default_factory=list)
    #: The age past which a subscription is lagging (``states.lagging_after_seconds``).
    lagging_after_seconds: float = 0.0
    #: The stream as the broker holds it, judged for this database (None when NATS didn't answer).
    stream_standing: StreamStanding | None = None

    @property
    def broker_ok(self) -> bool:
        return not self.broker_error

    @property
    def workers_listed(self) -> list[WorkerFigures]:
        """The workers the page lists: alive, waiting, or stopped recently."""
        return [w for w in self.workers if not states.folded(w.state, w.last_seen, self.generated_at)]

    @property
    def workers_folded(self) -> list[WorkerFigures]:
        """The workers the page folds away (``states.folded``)."""
        return [w for w in self.workers if states.folded(w.state, w.last_seen, self.generated_at)]

    @property
    def stream_problems(self) -> list[str]:
        """Each limit of the stream that could discard unhandled events, with its fix (workers refuse such a stream)."""
        return [str(p) for p in self.stream_standing.problems] if self.stream_standing else []

    @property
    def identity_conflict(self) -> str:
        """A live copy of this database holds or tried the stream: who, and the fix ("" when none)."""
        judgement = self.stream_standing.judgement if self.stream_standing else None
        return judgement.text if judgement is not None else ""


# --- the database ----------------------------------------------------------------


def _buckets(rows: Sequence[tuple[int, Any]], *, empty: Any = 0) -> list[Any]:
    """``(minutes_ago, value)`` rows -> ``BUCKETS`` values, oldest first."""
    values = [empty] * BUCKETS
    for minutes_ago, value in rows:
        if 0 <= int(minutes_ago) < BUCKETS:
            values[BUCKETS - 1 - int(minutes_ago)] = value
    return values


_MINUTES_AGO = f"floor(extract(epoch FROM (now() - {{col}})) / {BUCKET_SECONDS})::int"

# Claims of the last hour that are successes (no dead letter beside them),
# per subscription and minute: the (subscription, handled_at) index.
_HANDLED_SQL = (
    f"SELECT h.subscription, {_MINUTES_AGO.format(col='h.handled_at')} AS minutes_ago, count(*) "
    f"FROM {HANDLED_TABLE} h WHERE h.subscription = ANY(%s) AND h.handled_at >= now() - interval '1 hour' "
    f"AND NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.subscription = h.subscription AND d.event_id = h.event_id) "
    "GROUP BY 1, 2"
)
# The newest success claim per subscription: one backward index scan each.
_LAST_HANDLED_SQL = (
    "SELECT s.name, (SELECT h.handled_at FROM " + HANDLED_TABLE + " h WHERE h.subscription = s.name "
    f"AND NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.subscription = h.subscription AND d.event_id = h.event_id) "
    "ORDER BY h.handled_at DESC LIMIT 1) FROM unnest(%s::text[]) AS s(name)"
)
_DEAD_SQL = f"SELECT subscription, count(*) FROM {DEAD_LETTER_TABLE} GROUP BY subscription"
# Both walk the partial index of pending rows.
_PENDING_SQL = DUE_BACKLOG_SQL  # due rows and how long the oldest has waited (deferred tasks are not lag)
_PENDING_BY_NAME_SQL = f"SELECT name, extract(epoch FROM now() - min(created_at)) FROM {OUTBOX_TABLE} WHERE published_at IS NULL AND (not_before IS NULL OR not_before <= now()) AND name = ANY(%s) GROUP BY name"
# The last hour of relayed rows: the partial index on published_at.
_RELAYED_SQL = (
    f"SELECT {_MINUTES_AGO.format(col='published_at')} AS minutes_ago, count(*), "
    "max(extract(epoch FROM published_at - created_at)) "
    f"FROM {OUTBOX_TABLE} WHERE published_at IS NOT NULL AND published_at >= now() - interval '1 hour' GROUP BY 1"
)
_PAUSES_SQL = f"SELECT name, paused_at, paused_by, reason FROM {PAUSES_TABLE}"
_WORKERS_SQL = (
    f"SELECT worker, started_at, last_seen, stopped_at, subscriptions, version, "
    f"(stopped_at IS NULL AND last_seen >= now() - %s) AS alive, state, detail, instance FROM {WORKERS_TABLE} "
    "WHERE last_seen >= now() - %s ORDER BY alive DESC, last_seen DESC LIMIT 100"
)


def _database_figures(
    subs: list[SubscriptionFigures], alias: str, notes: list[str]
) -> tuple[OutboxFigures, list[JobFigures], list[WorkerFigures]]:
    q = Timed(alias, notes)
    names = [s.name for s in subs]
    by_name = {s.name: s for s in subs}

    dead = q.rows(_DEAD_SQL, [], "open dead letters") or []
    for subscription, count in dead:
        if subscription not in by_name:  # dead letters of a subscription that is gone (or the relay's)
            row = SubscriptionFigures(name=subscription, event="—", durable="—", registered=False)
            subs.append(row)
            by_name[subscription] = row
            names.append(subscription)
        by_name[subscription].open_dead_letters = int(count)

    handled = q.rows(_HANDLED_SQL, [names], "handled per subscription")
    if handled is not None:
        per: dict[str, list[tuple[int, int]]] = {}
        for subscription, minutes_ago, count in handled:
            per.setdefault(subscription, []).append((minutes_ago, int(count)))
        for s in subs:
            s.throughput_per_minute = _buckets(per.get(s.name, []))
            s.handled_1h = sum(s.throughput_per_minute)
            s.handled_5m = sum(s.throughput_per_minute[-5:])
    for subscription, at in q.rows(_LAST_HANDLED_SQL, [names], "last handled") or []:
        by_name[subscription].last_handled_at = at

    outbox = OutboxFigures()
    pending = q.rows(_PENDING_SQL, [], "outbox pending")
    if pending:
        count, age_seconds = pending[0]
        outbox.pending = int(count)
        outbox.oldest_pending_age_seconds = float(age_seconds) if count else None
    relayed = q.rows(_RELAYED_SQL, [], "relayed per minute")
    if relayed is not None:
        outbox.relayed_per_minute = _buckets([(m, int(c)) for m, c, _lag in relayed])
        outbox.lag_seconds_per_minute = _buckets([(m, float(lag or 0)) for m, _count, lag in relayed], empty=0.0)
        outbox.relayed_5m = sum(outbox.relayed_per_minute[-5:])
    # Per event, the oldest pending row: what the overview can say about
    # "oldest unhandled" without the broker (a lower bound).
    for name, age in (
        q.rows(_PENDING_BY_NAME_SQL, [sorted({s.event for s in subs if s.registered})], "pending per event") or []
    ):
        for s in subs:
            if s.event == name:
                s.oldest_unhandled_age_seconds, s.oldest_unhandled_source = float(age), "outbox"

    job_rows = job_figures(q)
    pauses = {
        n: Pause(name=n, paused_at=at, paused_by=by, reason=why)
        for n, at, by, why in q.rows(_PAUSES_SQL, [], "pauses") or []
    }
    for s in subs:
        s.paused = pauses.get(s.pause_key or s.name)

    alive_within = timedelta(seconds=ALIVE_AFTER_SECONDS)
    workers = [
        WorkerFigures(
            worker=w,
            started_at=st,
            last_seen=seen,
            stopped_at=stopped,
            subscriptions=list(json.loads(subs_) if isinstance(subs_, str) else subs_ or []),
            version=v,
            alive=bool(alive),
            beat=state,
            detail=detail,
            instance=instance,
        )
        for w, st, seen, stopped, subs_, v, alive, state, detail, instance in q.rows(
            _WORKERS_SQL, [alive_within, WORKERS_SEEN_WITHIN], "workers"
        )
        or []
    ]
    return outbox, job_rows, workers


def _owner(alias: str) -> tuple[str | None, str | None]:
    """This project's database identity and instance, or None for what
    can't be read now (the page then shows the stream's figures unchecked)."""

    from django_platformkit import identity
    from django_platformkit.exceptions import ConfigurationError, DatabaseUnavailable

    try:
        with transaction.atomic(using=alias):  # a failed read can't abort a request's transaction
            return identity.database_identity(alias), identity.database_instance(alias)
    except (DatabaseError, DatabaseUnavailable, ConfigurationError):
        return None, None


def collect(*, using: str | None = None, broker_timeout_seconds: float = BROKER_TIMEOUT_SECONDS) -> Overview:
    """Every figure of the overview page. Never raises for an outage of
    NATS (``Overview.broker_error`` says so) or a slow query (a note says so)."""
    from django_platformkit.consume.subscriptions import subscriptions as registered
    from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError

    alias = using or conf.settings.DATABASE_ALIAS
    notes: list[str] = []
    subs = [
        SubscriptionFigures(
            name=s.name, event=s.event, durable=s.durable, max_attempts=s.max_attempts, pause_key=pause_key(s)
        )
        for s in registered()
    ]
    filters = {s.durable: s.filter_subject for s in registered()}
    outbox, job_rows, workers = _database_figures(subs, alias, notes)
    found = failures(Timed(alias, notes), [s.name for s in subs])
    for s in subs:
        s.failure = found.get(s.name, s.failure)
    broker_error = ""
    standing = None
    wanted = [(s.durable, filters[s.durable]) for s in subs if s.registered]
    if wanted:
        try:
            owner, instance = _owner(alias)
            answer = broker_figures(wanted, timeout=broker_timeout_seconds, owner=owner, instance=instance)
            figures, standing = answer.durables, answer.stream
        except (BrokerUnavailable, ConfigurationError) as exc:
            broker_error = str(exc)
            figures = {}
        for s in subs:
            f = figures.get(s.durable)
            if not f:
                continue
            if "error" in f:
                s.broker_error = f["error"]
                continue
            s.num_pending, s.num_ack_pending, s.num_redelivered = (
                f["num_pending"],
                f["num_ack_pending"],
                f["num_redelivered"],
            )
            # The older of the two: a row the relay hasn't sent yet, or a message in the stream.
            age = f["oldest_age_seconds"]
            if age is not None and (s.oldest_unhandled_age_seconds is None or age >= s.oldest_unhandled_age_seconds):
                s.oldest_unhandled_age_seconds, s.oldest_unhandled_source = age, "broker"
    lagging_after = states.lagging_after_seconds()
    for s in subs:
        s.state = states.subscription_state(
            retrying=s.failure.retrying,
            open_dead_letters=s.open_dead_letters,
            oldest_unhandled_age_seconds=s.oldest_unhandled_age_seconds,
            lagging_after=lagging_after,
            paused=s.paused is not None,
        )
        s.behind = (s.oldest_unhandled_age_seconds or 0) > lagging_after
    return Overview(
        generated_at=timezone.now(),
        nats_url=conf.redact_url(conf.settings.NATS_URL),
        stream=conf.settings.STREAM,
        subscriptions=subs,
        outbox=outbox,
        jobs=job_rows,
        workers=workers,
        broker_error=broker_error,
        notes=notes,
        lagging_after_seconds=lagging_after,
        stream_standing=standing,
    )
