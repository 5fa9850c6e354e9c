"""The overview's answer to "which task?": under each task queue's
subscription row, the tasks that subscription handled in the last hour or
holds dead letters of, by dotted path, with those counts and the newest
error; and a queue's priority bands folded away while they have nothing to
show (no message waiting or in flight, nothing handled, retrying or
dead-lettered), so a queue with only default-priority work reads as one row.

Two bounded queries under the page's ``statement_timeout`` (``Timed``): an
hour of task claims joined to their outbox rows by primary key, and the
task queues' dead letters likewise. Too slow: a note, not a hung page.
"""

from __future__ import annotations

from dataclasses import dataclass

from django_platformkit._tables import DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit.admin.figures import Overview, SubscriptionFigures
from django_platformkit.admin.queries import Timed
from django_platformkit.tasks.queues import DEFAULT_BAND, split_task_name
from django_platformkit.wire import TASK_EVENT_PREFIX

#: A subscription row lists at most this many tasks (the busiest and the failing first).
TASKS_PER_SUBSCRIPTION = 20

_LIKE_TASKS = TASK_EVENT_PREFIX.replace("_", "\\_") + "%"
# Successes of the last hour (no dead letter beside the claim), as figures._HANDLED_SQL counts them.
_HANDLED_BY_TASK_SQL = (
    f"SELECT h.subscription, o.payload->>'task', count(*) FROM {HANDLED_TABLE} h "
    f"JOIN {OUTBOX_TABLE} o ON o.id = h.event_id "
    "WHERE h.subscription LIKE %s AND h.handled_at >= now() - interval '1 hour' "
    f"AND NOT EXISTS (SELECT 1 FROM {DEAD_LETTER_TABLE} d WHERE d.subscription = h.subscription AND d.event_id = h.event_id) "
    "GROUP BY 1, 2"
)
_DEAD_BY_TASK_SQL = (
    f"SELECT d.subscription, o.payload->>'task', count(*), (array_agg(d.error ORDER BY d.failed_at DESC))[1] "
    f"FROM {DEAD_LETTER_TABLE} d JOIN {OUTBOX_TABLE} o ON o.id = d.event_id "
    "WHERE d.subscription LIKE %s GROUP BY 1, 2"
)


@dataclass
class TaskFigures:
    """One task's line under its queue's subscription row."""

    path: str
    handled_1h: int = 0
    open_dead_letters: int = 0
    #: The first line of its newest dead letter's error ("" when none).
    last_error_line: str = ""


def quiet_band(s: SubscriptionFigures) -> bool:
    """A task queue's priority band other than the default one with nothing to show now."""
    split = split_task_name(s.name)
    return (
        split is not None
        and split[1] != DEFAULT_BAND
        and s.registered
        and not (s.num_pending or s.num_ack_pending or s.handled_1h or s.open_dead_letters or s.failure.retrying)
        and s.oldest_unhandled_age_seconds is None
        and not s.broker_error
    )


def add_task_figures(overview: Overview, alias: str) -> None:
    """Give each task queue's subscription row of ``overview`` its tasks
    (``SubscriptionFigures.tasks``) and drop the quiet priority bands."""
    overview.subscriptions = [s for s in overview.subscriptions if not quiet_band(s)]
    rows = {s.name: s for s in overview.subscriptions if s.name.startswith(TASK_EVENT_PREFIX)}
    if not rows:
        return
    q = Timed(alias, overview.notes)
    found: dict[tuple[str, str], TaskFigures] = {}
    for subscription, path, count in q.rows(_HANDLED_BY_TASK_SQL, [_LIKE_TASKS], "handled per task") or []:
        found.setdefault((subscription, path or "?"), TaskFigures(path or "?")).handled_1h = int(count)
    for subscription, path, count, error in q.rows(_DEAD_BY_TASK_SQL, [_LIKE_TASKS], "dead letters per task") or []:
        task = found.setdefault((subscription, path or "?"), TaskFigures(path or "?"))
        task.open_dead_letters = int(count)
        task.last_error_line = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    for (subscription, _path), task in found.items():
        if subscription in rows:
            rows[subscription].tasks.append(task)
    for s in rows.values():
        s.tasks.sort(key=lambda t: (-t.open_dead_letters, -t.handled_1h, t.path))
        del s.tasks[TASKS_PER_SUBSCRIPTION:]
