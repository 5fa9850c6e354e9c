"""Which ``django.tasks`` task a row is about, on the admin lists whose rows
name only a subscription (dead letters, attempts): a task queue's
subscription runs every task of the queue, so the row also shows the task's
dotted path, read from its outbox row (``payload["task"]``: one primary-key
lookup per row shown), and the list can be filtered by it (``?task=``, as
the overview links it).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Model, OuterRef, QuerySet, Subquery
from django.db.models.fields.json import KeyTextTransform
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext_lazy

from django_platformkit.admin.display import breakable
from django_platformkit.models import OutboxEvent
from django_platformkit.wire import TASK_EVENT_PREFIX

#: The task filter offers the paths of this many newest rows' tasks: a bounded read.
TASK_PATHS_FROM = 2_000


def _task_path_of_event() -> Subquery:
    return Subquery(
        OutboxEvent.objects.filter(pk=OuterRef("event_id"))
        .annotate(path=KeyTextTransform("task", "payload"))
        .values("path")[:1]
    )


def with_task_paths[M: Model](queryset: QuerySet[M]) -> QuerySet[M]:
    """``queryset`` (rows with ``event_id`` and ``subscription``) with each
    task queue row's task path as ``_task`` (None for other rows)."""
    annotated: QuerySet[M] = queryset.annotate(_task=_task_path_of_event())  # type: ignore[assignment]
    return annotated


def subscription_and_task(obj: Any) -> str:
    """The row's subscription and, for a task queue's, the task's dotted path under it."""
    task = getattr(obj, "_task", None) if str(obj.subscription).startswith(TASK_EVENT_PREFIX) else None
    if not task:
        return breakable(obj.subscription)
    return format_html(
        '{}<br><span class="platformkit-source pk-task">{}</span>', breakable(obj.subscription), breakable(task)
    )


class TaskPathFilter(admin.SimpleListFilter):
    """The ``django.tasks`` task of the row's event (``?task=shop.tasks.send_receipt``)."""

    title = gettext_lazy("task")
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        model = model_admin.model
        newest = (
            model.objects.filter(subscription__startswith=TASK_EVENT_PREFIX)
            .order_by("-pk")
            .values("event_id")[:TASK_PATHS_FROM]
        )
        paths = set(
            OutboxEvent.objects.filter(pk__in=newest)
            .annotate(path=KeyTextTransform("task", "payload"))
            .order_by()
            .values_list("path", flat=True)
            .distinct()
        )
        chosen = self.value()
        if chosen:  # linked from the overview: offered even when older
            paths.add(chosen)
        return [(path, path) for path in sorted(p for p in paths if p)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if not self.value():
            return queryset
        # Per candidate row, its outbox row by primary key: the outbox has no index on the task path.
        rows = queryset.filter(subscription__startswith=TASK_EVENT_PREFIX).annotate(_filter_task=_task_path_of_event())
        filtered: QuerySet[Any] = rows.filter(_filter_task=self.value())
        return filtered
