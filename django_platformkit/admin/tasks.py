"""The admin's view of ``django.tasks`` tasks: the outbox rows that are tasks,
read-only, with function path, arguments, status, result and the errors of
every failed attempt. The only state change is the named action **Replay
failed tasks…**, which asks for a reason and calls ``replay()`` (the same
verb, permission and confirmation page as a dead letter's Replay).
Registered by ``admin.py``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from django_platformkit.admin.cancelling import cancel_selected
from django_platformkit.admin.display import NoWritesAdmin
from django_platformkit.models import DeadLetter, OutboxTask, TaskResultRecord
from django_platformkit.tasks.queues import queue_of

REPLAY_PERMISSION = "django_platformkit.replay_deadletter"


class _Alias:
    alias = "default"


def _result(obj: OutboxTask) -> Any:
    """The task's ``TaskResult``, or the reason there is none to show."""
    from django_platformkit.tasks.results import load_result

    try:
        return load_result(_Alias(), obj.pk)
    except Exception as exc:
        return str(exc)


if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    class _Outcome(TypedDict):
        _succeeded: bool
        _failed: bool

    # OutboxTaskAdmin.get_queryset()'s rows, with their two EXISTS.
    _AnnotatedTask = WithAnnotations[OutboxTask, _Outcome]
    # django-stubs makes ModelAdmin generic in its model; Django's own class
    # can't be subscripted at run time.
    _TaskModelAdmin = admin.ModelAdmin[OutboxTask]
else:
    _TaskModelAdmin = admin.ModelAdmin


class TaskStatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "task_status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("successful", "successful"),
            ("failed", "failed (dead-lettered)"),
            ("unfinished", "ready / running / retrying"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[_AnnotatedTask]) -> QuerySet[_AnnotatedTask]:
        if self.value() == "successful":
            return queryset.filter(_succeeded=True)
        if self.value() == "failed":
            return queryset.filter(_failed=True)
        if self.value() == "unfinished":
            return queryset.filter(_succeeded=False, _failed=False)
        return queryset


class OutboxTaskAdmin(NoWritesAdmin, _TaskModelAdmin):
    list_display = ("created_at", "task_path", "queue", "status", "arguments", "not_before")
    list_display_links = ("created_at", "task_path")
    list_filter = (TaskStatusFilter, "name")
    date_hierarchy = "created_at"
    search_fields = ("payload__task",)
    search_help_text = "Search by the task's function path."
    list_per_page = 50
    actions = ["replay_failed", cancel_selected]
    fields = (
        "id",
        "task_path",
        "queue",
        "status",
        "arguments_detail",
        "created_at",
        "not_before",
        "published_at",
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
        # Two EXISTS per page row, off the results' primary key and the dead letters' event index.
        return (
            super()
            .get_queryset(request)
            .annotate(
                _succeeded=Exists(TaskResultRecord.objects.filter(event_id=OuterRef("pk"), status="SUCCESSFUL")),
                _failed=Exists(DeadLetter.objects.filter(event_id=OuterRef("pk"))),
            )
        )

    @admin.display(description="task")
    def task_path(self, obj: OutboxTask) -> str:
        return str((obj.payload or {}).get("task", "?"))

    @admin.display(description="queue")
    def queue(self, obj: OutboxTask) -> str:
        return queue_of(obj.name) or "?"

    @admin.display(description="status")
    def status(self, obj: OutboxTask) -> str:
        if getattr(obj, "_succeeded", False):
            return "SUCCESSFUL"
        if getattr(obj, "_failed", False):
            return "FAILED"
        result = _result(obj)
        return str(result.status) if not isinstance(result, str) else "?"

    @admin.display(description="arguments")
    def arguments(self, obj: OutboxTask) -> str:
        payload = obj.payload or {}
        text = ", ".join(
            [json.dumps(a, ensure_ascii=False) for a in payload.get("args", [])]
            + [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in payload.get("kwargs", {}).items()]
        )
        return text if len(text) <= 100 else text[:99] + "…"

    @admin.display(description="arguments")
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

    @admin.display(description="started at")
    def started_at(self, obj: OutboxTask) -> Any:
        return self._from_result(obj, "started_at") or "—"

    @admin.display(description="last attempted at")
    def last_attempted_at(self, obj: OutboxTask) -> Any:
        return self._from_result(obj, "last_attempted_at") or "—"

    @admin.display(description="finished at")
    def finished_at(self, obj: OutboxTask) -> Any:
        return self._from_result(obj, "finished_at") or "—"

    @admin.display(description="return value")
    def return_value(self, obj: OutboxTask) -> str:
        result = _result(obj)
        if isinstance(result, str) or str(result.status) != "SUCCESSFUL":
            return "—"
        return format_html(
            '<pre class="platformkit-json">{}</pre>', json.dumps(result.return_value, indent=2, ensure_ascii=False)
        )

    @admin.display(description="errors (one per failed attempt)")
    def errors(self, obj: OutboxTask) -> str:
        result = _result(obj)
        if isinstance(result, str) or not result.errors:
            return "—"
        return format_html_join(
            "",
            '<p>{}. {}</p><pre class="platformkit-pre">{}</pre>',
            ((n, e.exception_class_path, e.traceback) for n, e in enumerate(result.errors, 1)),
        )

    @admin.display(description="workers")
    def worker_ids(self, obj: OutboxTask) -> str:
        result = _result(obj)
        return "—" if isinstance(result, str) else (", ".join(result.worker_ids) or "—")

    @admin.display(description="dead letter")
    def dead_letter_link(self, obj: OutboxTask) -> str:
        dead = DeadLetter.objects.filter(event_id=obj.pk).first()
        if dead is None:
            return "—"
        url = reverse(f"{self.admin_site.name}:django_platformkit_deadletter_change", args=[dead.pk])
        return format_html('<a href="{}">{}</a>', url, dead.error_summary or "dead letter")

    @admin.action(permissions=["replay"], description="Replay failed tasks…")
    def replay_failed(self, request: HttpRequest, queryset: QuerySet[OutboxTask]) -> HttpResponse | None:
        """Ask for a reason (the dead letters' confirmation page), then
        ``replay()`` each selected task's dead letter."""
        dead = DeadLetter.objects.filter(event_id__in=list(queryset.values_list("pk", flat=True))).order_by(
            "-failed_at"
        )
        if not dead.exists():
            self.message_user(request, "None of the selected tasks failed: nothing to replay.", messages.WARNING)
            return None
        reason = (request.POST.get("reason") or "").strip()
        confirmed = request.method == "POST" and request.POST.get("confirm") == "yes"
        if confirmed and reason:
            from django_platformkit.admin.deadletters import DeadLetterAdmin
            from django_platformkit.exceptions import ReplayRefused
            from django_platformkit.operate.deadletters import replay, replay_blocker

            actor = request.user.get_username()
            # The admin's history of the replay, as the dead letters' own Replay leaves it.
            history = DeadLetterAdmin(DeadLetter, self.admin_site)
            done = 0
            for row in dead:
                # Refused as the dead letters' own Replay refuses it: a queue no
                # longer in TASKS would leave the re-sent task unhandled, its dead letter gone.
                blocked = replay_blocker(row.event_id, row.name, row.subscription)
                if blocked:
                    self.message_user(request, f"Did not replay task {row.event_id}: {blocked}", messages.ERROR)
                    continue
                try:
                    replay(row.event_id, subscription=row.subscription, actor=actor, reason=reason)
                    done += 1
                except ReplayRefused as exc:
                    self.message_user(request, f"Did not replay task {row.event_id}: {exc}", messages.ERROR)
                    continue
                history._log(request, row, "replay", reason)
            if done:
                self.message_user(
                    request,
                    f"Replayed {done} failed task{'s' if done != 1 else ''}: pending again, the worker runs {'them' if done != 1 else 'it'} next.",
                    messages.SUCCESS,
                )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Replay failed tasks",
            "opts": self.model._meta,
            "verb": "replay",
            "rows": list(dead[:100]),
            "count": dead.count(),
            "reason": reason,
            "reason_missing": confirmed and not reason,
            "from_object": False,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "selected_ids": [str(pk) for pk in queryset.values_list("pk", flat=True)],
            "action_name": "replay_failed",
            "select_across": request.POST.get("select_across", "0"),
            "changelist_url": reverse(f"{self.admin_site.name}:django_platformkit_outboxtask_changelist"),
        }
        return TemplateResponse(request, "admin/django_platformkit/deadletter/confirm.html", context)


admin.site.register(OutboxTask, OutboxTaskAdmin)
