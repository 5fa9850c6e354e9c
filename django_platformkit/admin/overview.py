"""The overview page (``admin:django_platformkit_overview``): is every
subscription ok, lagging, failing or paused and why, is the relay behind,
are the jobs on time, which workers run. It renders what
``figures.collect()`` returns and changes nothing itself; its Pause and
Resume links lead to ``pausing``'s confirmation pages. It reloads itself
every ``DEFAULT_REFRESH_SECONDS`` (``?refresh=SECONDS`` for one of
``REFRESH_CHOICES_SECONDS``), and ``?refresh=0`` - the page's visible
"pause refresh" - stops that while someone reads.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _

from django_platformkit import conf
from django_platformkit.admin import pausing, states
from django_platformkit.admin.display import ModelAdminOf, NoWritesAdmin
from django_platformkit.admin.taskfigures import add_task_figures
from django_platformkit.models import Attempt, DeadLetter, HandledEvent, JobState, OutboxEvent, Overview
from django_platformkit.runtime.heartbeat import ALIVE_AFTER_SECONDS

if TYPE_CHECKING:
    from django.urls import URLPattern

#: The model admins whose view permission opens the overview.
_OVERVIEW_MODELS = (OutboxEvent, HandledEvent, DeadLetter, JobState, Attempt, Overview)
#: The auto-refresh intervals the page offers; any other ``?refresh=`` is the default.
REFRESH_CHOICES_SECONDS = (10, 30, 60)
#: The page reloads itself this often unless asked otherwise: an operator
#: glancing at it sees figures at most this old (one broker round trip per reload).
DEFAULT_REFRESH_SECONDS = 30


def refresh_seconds(request: HttpRequest) -> int | None:
    """The auto-refresh interval of this request: ``?refresh=30`` (one of
    ``REFRESH_CHOICES_SECONDS``), None for ``?refresh=0`` (paused), else
    ``DEFAULT_REFRESH_SECONDS``."""
    asked = request.GET.get("refresh", "")
    if asked in ("0", "off"):
        return None
    return int(asked) if asked.isdigit() and int(asked) in REFRESH_CHOICES_SECONDS else DEFAULT_REFRESH_SECONDS


@admin.register(Overview)
class OverviewAdmin(NoWritesAdmin, ModelAdminOf[Overview]):
    """The overview page. Open to staff who may view any of the operational
    tables; it shows counts, names and error messages, never payloads."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        user = request.user
        return bool(user.is_active and user.is_staff) and any(
            user.has_perm(f"django_platformkit.view_{model._meta.model_name}") for model in _OVERVIEW_MODELS
        )

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.overview_view)
        return [
            *pausing.pause_urls(self),
            path("", view, name="django_platformkit_overview"),
            # The app index links a model's changelist: the same page.
            path("", view, name="django_platformkit_overview_changelist"),
        ]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        from django_platformkit.admin import figures, reconciliation

        if not self.has_view_permission(request):
            raise PermissionDenied
        overview = figures.collect()
        add_task_figures(overview, conf.settings.DATABASE_ALIAS)  # a task queue's tasks by name; quiet bands folded
        by_state = Counter(s.state for s in overview.subscriptions)
        consuming = {name for w in overview.workers if w.state == states.WorkerState.ALIVE for name in w.subscriptions}
        context = {
            **self.admin_site.each_context(request),
            "title": _("Overview"),
            "subtitle": None,
            "opts": self.model._meta,
            "overview": overview,
            "reconciliation": reconciliation.collect(),
            "summary": {
                "failing": by_state[states.SubscriptionState.FAILING],
                "lagging": by_state[states.SubscriptionState.LAGGING],
                "ok": by_state[states.SubscriptionState.OK],
                "paused": by_state[states.SubscriptionState.PAUSED],
                "overdue_jobs": sum(1 for j in overview.jobs if j.overdue),
                "failing_jobs": sum(1 for j in overview.jobs if j.failing),
                "workers_alive": sum(1 for w in overview.workers if w.state == states.WorkerState.ALIVE),
                "workers_waiting": sum(1 for w in overview.workers if w.state == states.WorkerState.WAITING_FOR_BROKER),
            },
            # Subscriptions no live worker consumes: why one is behind, said on its row.
            "unserved": {s.name for s in overview.subscriptions if s.registered and s.name not in consuming},
            "alive_after_seconds": int(ALIVE_AFTER_SECONDS),
            "stopped_shown_for": int(states.STOPPED_SHOWN_FOR.total_seconds() // 60),
            "silent_shown_for": int(states.SILENT_SHOWN_FOR.total_seconds() // 60),
            "refresh_seconds": refresh_seconds(request),
            "refresh_choices": REFRESH_CHOICES_SECONDS,
            "may_pause": pausing.may_pause(request),
            "links": {
                "pause": reverse(f"{self.admin_site.name}:django_platformkit_overview_pause"),
                "resume": reverse(f"{self.admin_site.name}:django_platformkit_overview_resume"),
                "dead_letters": self._url(DeadLetter, "changelist"),
                "claims": self._url(HandledEvent, "changelist"),
                "outbox": self._url(OutboxEvent, "changelist"),
                "jobs": self._url(JobState, "changelist"),
                "attempts": self._url(Attempt, "changelist"),
            },
        }
        return TemplateResponse(request, "admin/django_platformkit/overview.html", context)

    def _url(self, model: type[Model], view: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:django_platformkit_{model._meta.model_name}_{view}", args=args)
