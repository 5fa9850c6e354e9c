"""The admin's view of ``django.tasks`` tasks: the outbox rows that are tasks,
read-only, listed and filtered by the task's function path (the queue is
only where it ran), with when it finished and how long its last run took;
each task's page has its arguments, result and the errors of every failed
attempt. The only state change is the named action **Replay failed
tasks…**, which asks for a reason and calls ``replay()`` (the same verb,
permission and confirmation page as a dead letter's Replay). Registered on
import (``admin/__init__.py`` imports it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from django_platformkit.admin import bulk
from django_platformkit.admin.cancelling import cancel_selected
from django_platformkit.admin.display import NoWritesAdmin, duration_text
from django_platformkit.models import DeadLetter, OutboxTask, TaskResultRecord
from django_platformkit.tasks.queues import queue_of
from django_platformkit.templatetags.platformkit_admin import when_html

REPLAY_PERMISSION = "django_platformkit.replay_deadletter"
#: The task filter offers the function paths of this many newest tasks: uuid7
#: keys are time-ordered, so that is the primary key's index read backwards,
#: a bounded read however large the outbox grows.
TASK_PATHS_FROM = 10_000


class _Alias:
    alias = "default"


def _result(obj: OutboxTask) -> Any:
    """The task's ``TaskResult``, or the reason there is none to show."""
    from django_platformkit.tasks.results import load_result

    try:
        return load_result(_Alias(), obj.pk)
    except ImportError:  # Django 5.2: no django.tasks to read a result with
        return _("read with Django 6.0 or later (django.tasks)")
    except Exception as exc:
        return str(exc)


if TYPE_CHECKING:
    from datetime import datetime
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    class _Outcome(TypedDict):
        _succeeded: bool
        _failed: bool
        _finished_at: datetime | None
        _last_run_at: datetime | None

    # OutboxTaskAdmin.get_queryset()'s rows, with their two EXISTS.
    _AnnotatedTask = WithAnnotations[OutboxTask, _Outcome]
    # django-stubs makes ModelAdmin generic in its model; Django's own class
    # can't be subscripted at run time.
    _TaskModelAdmin = admin.ModelAdmin[OutboxTask]
else:
    _TaskModelAdmin = admin.ModelAdmin


def _status_label(status: str) -> str:
    """Django's own words for a ``TaskResultStatus`` value (translated by Django)."""
    try:
        from django.tasks.base import TaskResultStatus
    except ImportError:  # Django 5.2: no django.tasks; the same words, ours to translate
        return str(_STATUS_LABELS.get(status, status))
    return str(TaskResultStatus(status).label)


# Django 6's TaskResultStatus labels, for the rows a 5.2 project keeps from a 6.x one.
_STATUS_LABELS = {
    "READY": gettext_lazy("Ready"),
    "RUNNING": gettext_lazy("Running"),
    "FAILED": gettext_lazy("Failed"),
    "SUCCESSFUL": gettext_lazy("Successful"),
}


class TaskStatusFilter(admin.SimpleListFilter):
    title = gettext_lazy("status")
    parameter_name = "task_status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("successful", _("successful")),
            ("failed", _("failed (dead-lettered)")),
            ("unfinished", _("ready / running / retrying")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[_AnnotatedTask]) -> QuerySet[_AnnotatedTask]:
        if self.value() == "successful":
            return queryset.filter(_succeeded=True)
        if self.value() == "failed":
            return queryset.filter(_failed=True)
        if self.value() == "unfinished":
            return queryset.filter(_succeeded=False, _failed=False)
        return queryset


class TaskPathFilter(admin.SimpleListFilter):
    """The task's function path (``payload["task"]``), as ``@task`` named it."""

    title = gettext_lazy("task")
    parameter_name = "task"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        newest = OutboxTask.objects.order_by("-id").values("id")[:TASK_PATHS_FROM]
        paths = set(
            OutboxTask.objects.filter(id__in=newest)
            .annotate(path=KeyTextTransform("task", "payload"))
            .order_by()
            .values_list("path", flat=True)
            .distinct()
        )
        if self.value():  # chosen from an older page: still offered, so the list says what it shows
            paths.add(self.value())
        return [(path, path) for path in sorted(p for p in paths if p)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[OutboxTask]) -> QuerySet[OutboxTask]:
        return queryset.filter(payload__task=self.value()) if self.value() else queryset


class OutboxTaskAdmin(NoWritesAdmin, _TaskModelAdmin):
    list_display = ("created", "task_path", "status", "finished", "duration", "arguments")
    list_display_links = ("created", "task_path")
    list_filter = (TaskStatusFilter, TaskPathFilter)
    date_hierarchy = "created_at"
    search_fields = ("payload__task",)
    search_help_text = gettext_lazy("Search by the task's function path.")
    list_per_page = 50
    actions = ["replay_failed", cancel_selected]
    change_list_template = "admin/django_platformkit/change_list.html"
    fields = (
        "id",
        "task_path",
        "queue",
        "priority",
        "status",
        "arguments_detail",
        "created",
        "run_after",
        "published",
        "started_at",
        "last_attempted_at",
        "finished_at",
        "return_value",
        "errors",
        "worker_ids",
        "dead_letter_link",
    )
    readonly_fields = fields

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(REPLAY_PERMISSION)

    def get_queryset(self, request: HttpRequest) -> QuerySet[OutboxTask]:
        # Per page row, lookups off the results' primary key and the dead letters' event index:
        # whether it ended, when (a success's finish, else its dead letter), and when its last run began.
        result = TaskResultRecord.objects.filter(event_id=OuterRef("pk"))
        success = result.filter(status="SUCCESSFUL")
        dead = DeadLetter.objects.filter(event_id=OuterRef("pk")).order_by("-failed_at")
        return (
            super()
            .get_queryset(request)
            .annotate(
                _succeeded=Exists(success),
                _failed=Exists(dead),
                _finished_at=Coalesce(
                    Subquery(success.values("finished_at")[:1]), Subquery(dead.values("failed_at")[:1])
                ),
                _last_run_at=Subquery(result.values("last_attempted_at")[:1]),
            )
        )

    @admin.display(description=gettext_lazy("created at"), ordering="created_at")
    def created(self, obj: OutboxTask) -> str:
        return when_html(obj.created_at)

    @admin.display(description=gettext_lazy("run after"), ordering="not_before")
    def run_after(self, obj: OutboxTask) -> str:
        return when_html(obj.not_before)

    @admin.display(description=gettext_lazy("published at"))
    def published(self, obj: OutboxTask) -> str:
        return when_html(obj.published_at)

    @admin.display(description=gettext_lazy("task"))
    def task_path(self, obj: OutboxTask) -> str:
        """The path, and under it a priority other than the default (no column of its own: the list fits 1280 px)."""
        path = str((obj.payload or {}).get("task", "?"))
        priority = self.priority(obj)
        if not priority:
            return path
        label = _("priority %(priority)s") % {"priority": priority}
        return format_html('{}<br><span class="platformkit-source pk-priority">{}</span>', path, label)

    @admin.display(description=gettext_lazy("queue"))
    def queue(self, obj: OutboxTask) -> str:
        return queue_of(obj.name) or "?"

    @admin.display(description=gettext_lazy("priority"))
    def priority(self, obj: OutboxTask) -> int:
        """As enqueued (Django's -100..100; absent from the payload: 0)."""
        value = (obj.payload or {}).get("priority", 0)
        return value if isinstance(value, int) else 0

    @admin.display(description=gettext_lazy("status"))
    def status(self, obj: OutboxTask) -> str:
        if getattr(obj, "_succeeded", False):
            return _status_label("SUCCESSFUL")
        if getattr(obj, "_failed", False):
            return _status_label("FAILED")
        result = _result(obj)
        status = _status_label(str(result.status)) if not isinstance(result, str) else "?"
        if obj.not_before is not None and obj.not_before > timezone.now():  # deferred: say until when
            return format_html("{}<br>{}", status, format_html(_("run after {when}"), when=when_html(obj.not_before)))
        return status

    @admin.display(description=gettext_lazy("finished at"), ordering="_finished_at")
    def finished(self, obj: OutboxTask) -> str:
        return when_html(getattr(obj, "_finished_at", None))

    @admin.display(description=gettext_lazy("duration"))
    def duration(self, obj: OutboxTask) -> str:
        """The run that finished it: from that run's start to the task's end."""
        started, finished = getattr(obj, "_last_run_at", None), getattr(obj, "_finished_at", None)
        return duration_text(started, finished) if started is not None and finished is not None else "—"

    @admin.display(description=gettext_lazy("arguments"))
    def arguments(self, obj: OutboxTask) -> str:
        payload = obj.payload or {}
        text = ", ".join(
            [json.dumps(a, ensure_ascii=False) for a in payload.get("args", [])]
            + [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in payload.get("kwargs", {}).items()]
        )
        text = text if len(text) <= 500 else text[:499] + "…"
        return format_html('<span class="platformkit-trunc" title="{}">{}</span>', text, text) if text else "—"

    @admin.display(description=gettext_lazy("arguments"))
    def arguments_detail(self, obj: OutboxTask) -> str:
        payload = obj.payload or {}
        return format_html(
            '<pre class="platformkit-json">{}</pre>',
            json.dumps(
                {"args": payload.get("args", []), "kwargs": payload.get("kwargs", {})}, indent=2, ensure_ascii=False
            ),
        )

    def _from_result(self, obj: OutboxTask, attr: str) -> Any:
        result = _result(obj)
        if isinstance(result, str):
            return result
        return getattr(result, attr)

    def _when_from_result(self, obj: OutboxTask, attr: str) -> str:
        value = self._from_result(obj, attr)
        return value if isinstance(value, str) else when_html(value)

    @admin.display(description=gettext_lazy("started at"))
    def started_at(self, obj: OutboxTask) -> str:
        return self._when_from_result(obj, "started_at")

    @admin.display(description=gettext_lazy("last attempted at"))
    def last_attempted_at(self, obj: OutboxTask) -> str:
        return self._when_from_result(obj, "last_attempted_at")

    @admin.display(description=gettext_lazy("finished at"))
    def finished_at(self, obj: OutboxTask) -> str:
        return self._when_from_result(obj, "finished_at")

    @admin.display(description=gettext_lazy("return value"))
    def return_value(self, obj: OutboxTask) -> str:
        result = _result(obj)
        if isinstance(result, str) or str(result.status) != "SUCCESSFUL":
            return "—"
        return format_html(
            '<pre class="platformkit-json">{}</pre>', json.dumps(result.return_value, indent=2, ensure_ascii=False)
        )

    @admin.display(description=gettext_lazy("errors (one per failed attempt)"))
    def errors(self, obj: OutboxTask) -> str:
        result = _result(obj)
        if isinstance(result, str) or not result.errors:
            return "—"
        return format_html_join(
            "",
            '<p>{}. {}</p><pre class="platformkit-pre">{}</pre>',
            ((n, e.exception_class_path, e.traceback) for n, e in enumerate(result.errors, 1)),
        )

    @admin.display(description=gettext_lazy("workers"))
    def worker_ids(self, obj: OutboxTask) -> str:
        result = _result(obj)
        return "—" if isinstance(result, str) else (", ".join(result.worker_ids) or "—")

    @admin.display(description=gettext_lazy("dead letter"))
    def dead_letter_link(self, obj: OutboxTask) -> str:
        dead = DeadLetter.objects.filter(event_id=obj.pk).first()
        if dead is None:
            return "—"
        url = reverse(f"{self.admin_site.name}:django_platformkit_deadletter_change", args=[dead.pk])
        return format_html('<a href="{}">{}</a>', url, dead.error_summary or _("dead letter"))

    @admin.action(permissions=["replay"], description=gettext_lazy("Replay failed tasks…"))
    def replay_failed(self, request: HttpRequest, queryset: QuerySet[OutboxTask]) -> HttpResponse | None:
        """Ask for a reason (the dead letters' confirmation page), then
        ``replay()`` each selected task's dead letter."""
        chosen = bulk.selection(request, queryset)  # the selection, or every task the filter matches
        dead = DeadLetter.objects.filter(event_id__in=chosen.rows.values("pk")).order_by("-failed_at")
        if bulk.nothing_matches(self, request, chosen, _("replay")):
            return None
        if not dead.exists():
            self.message_user(request, _("None of the selected tasks failed: nothing to replay."), messages.WARNING)
            return None
        reason = (request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        if confirmed and reason:
            from django_platformkit.admin.deadletters import DeadLetterAdmin
            from django_platformkit.exceptions import ReplayRefused
            from django_platformkit.operate.deadletters import BatchLog, replay, replay_blocker

            actor = request.user.get_username()
            log = BatchLog("replay", actor=actor, reason=reason)
            # The admin's history of the replay, as the dead letters' own Replay leaves it.
            history = DeadLetterAdmin(DeadLetter, self.admin_site)
            done = 0
            for row in dead.iterator(chunk_size=500):
                # Refused as the dead letters' own Replay refuses it: a queue no
                # longer in TASKS would leave the re-sent task unhandled, its dead letter gone.
                blocked = replay_blocker(row.event_id, row.name, row.subscription)
                if blocked:
                    self._refused(request, row, blocked)
                    continue
                try:
                    replay(row.event_id, subscription=row.subscription, actor=actor, reason=reason)
                    done += 1
                except ReplayRefused as exc:
                    self._refused(request, row, str(exc))
                    continue
                history.log_operator_action(request, row, "replay", reason)
                log.done()
            log.close()
            if done:
                text = ngettext(
                    "Replayed %(n)d failed task: pending again, the worker runs it next.",
                    "Replayed %(n)d failed tasks: pending again, the worker runs them next.",
                    done,
                )
                self.message_user(request, text % {"n": done}, messages.SUCCESS)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": _("Replay failed tasks"),
            "opts": self.model._meta,
            "verb": "replay",
            "rows": list(dead[:100]),
            "count": dead.count(),
            "reason": reason,
            "reason_missing": confirmed and not reason,
            "from_object": False,
            "across": chosen.across,
            **chosen.form(),
            "action_name": "replay_failed",
            "changelist_url": reverse(f"{self.admin_site.name}:django_platformkit_outboxtask_changelist"),
        }
        return TemplateResponse(request, "admin/django_platformkit/deadletter/confirm.html", context)

    def _refused(self, request: HttpRequest, row: DeadLetter, why: str) -> None:
        text = _("Did not replay task %(event_id)s: %(why)s") % {"event_id": row.event_id, "why": why}
        self.message_user(request, text, messages.ERROR)


admin.site.register(OutboxTask, OutboxTaskAdmin)
