"""Why a subscription is failing, for the overview page: the events retrying
now, the newest error and since when it fails, from the attempt history
(``platformkit_attempts``) and the open dead letters. Without it the page
showed "in flight 1, redelivered 1" and the reason sat on another list.

Two bounded queries per page view, whatever the number of subscriptions,
run through the page's ``statement_timeout`` wrapper (``queries.Timed``):
a query that can't finish in time becomes a note, not a hung page.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django_platformkit._tables import ATTEMPTS_TABLE, DEAD_LETTER_TABLE, HANDLED_TABLE
from django_platformkit.admin.queries import Timed
from django_platformkit.wire import AttemptOutcome

#: Attempt rows older than this are not read: an event nobody has run for a
#: day no longer counts as retrying (its subscription shows as lagging by then).
RETRYING_WITHIN = timedelta(hours=24)

_UNCLAIMED = (
    f"a.subscription = ANY(%s) AND a.started_at >= now() - %s "
    f"AND NOT EXISTS (SELECT 1 FROM {HANDLED_TABLE} h WHERE h.subscription = a.subscription AND h.event_id = a.event_id)"
)
# Retrying: no claim yet (neither handled nor given up on) and a run that
# counts ended without success - one failed, or one never reported that a
# later run followed (its worker died). A first run still running writes a
# row when slow: alone it is not a retry.
_RETRYING_SQL = (
    "SELECT subscription, count(*), min(first_at), max(attempts) FROM ("
    "SELECT a.subscription, a.event_id, min(a.started_at) AS first_at, max(a.attempt) AS attempts "
    f"FROM {ATTEMPTS_TABLE} a WHERE a.outcome IN ('{AttemptOutcome.FAILED}', '{AttemptOutcome.RUNNING}') AND {_UNCLAIMED} "
    f"GROUP BY 1, 2 HAVING bool_or(a.outcome = '{AttemptOutcome.FAILED}') OR count(*) > 1) retrying GROUP BY 1"
)
# The newest failed run per subscription among the events still unsettled.
_LAST_ERROR_SQL = (
    "SELECT DISTINCT ON (a.subscription) a.subscription, a.error, COALESCE(a.finished_at, a.started_at), a.attempt, a.event_id "
    f"FROM {ATTEMPTS_TABLE} a WHERE a.outcome = '{AttemptOutcome.FAILED}' AND {_UNCLAIMED} "
    "ORDER BY a.subscription, COALESCE(a.finished_at, a.started_at) DESC, a.id DESC"
)
# Per subscription: the newest open dead letter's error, and the oldest one's time.
_DEAD_SQL = (
    "SELECT DISTINCT ON (subscription) subscription, error, failed_at, attempts, event_id, "
    f"min(failed_at) OVER (PARTITION BY subscription) FROM {DEAD_LETTER_TABLE} ORDER BY subscription, failed_at DESC, id DESC"
)


@dataclass
class Failure:
    """One subscription's failure figures.

    ``retrying``: events that failed and wait for another attempt.
    ``since``: the first failure among them, or the oldest open dead
    letter's time, whichever is older. ``last_error``: the newest error of a
    retrying event or an open dead letter, whichever is newer, with its time
    (``last_error_at``), run number and event; ``last_error_dead`` says it is
    a dead letter's (the subscription gave up on that event).
    """

    retrying: int = 0
    retrying_attempts: int = 0
    since: datetime | None = None
    last_error: str = ""
    last_error_at: datetime | None = None
    last_error_attempt: int | None = None
    last_error_event_id: uuid.UUID | None = None
    last_error_dead: bool = False

    @property
    def last_error_line(self) -> str:
        """The newest error's first line (the whole text is on the attempt's page)."""
        return self.last_error.strip().split("\n", 1)[0]

    def _newer_error(self, error: str, at: datetime | None, attempt: int | None, event_id: Any, dead: bool) -> None:
        if at is None or (self.last_error_at is not None and at <= self.last_error_at):
            return
        self.last_error, self.last_error_at, self.last_error_attempt = error or "", at, attempt
        self.last_error_event_id, self.last_error_dead = event_id, dead

    def _older_since(self, at: datetime | None) -> None:
        if at is not None and (self.since is None or at < self.since):
            self.since = at


def failures(q: Timed, names: list[str]) -> dict[str, Failure]:
    """The failure figures of the subscriptions ``names`` (and of any other
    subscription that holds open dead letters), by subscription name."""
    found: dict[str, Failure] = {}
    for subscription, count, first_at, attempts in (
        q.rows(_RETRYING_SQL, [names, RETRYING_WITHIN], "retrying events") or []
    ):
        failure = found.setdefault(subscription, Failure())
        failure.retrying, failure.retrying_attempts = int(count), int(attempts or 0)
        failure._older_since(first_at)
    for subscription, error, at, attempt, event_id in (
        q.rows(_LAST_ERROR_SQL, [names, RETRYING_WITHIN], "retrying events") or []
    ):
        found.setdefault(subscription, Failure())._newer_error(error, at, attempt, event_id, dead=False)
    for subscription, error, at, attempts, event_id, oldest in q.rows(_DEAD_SQL, [], "last dead letters") or []:
        failure = found.setdefault(subscription, Failure())
        failure._newer_error(error, at, attempts, event_id, dead=True)
        failure._older_since(oldest)
    return found
