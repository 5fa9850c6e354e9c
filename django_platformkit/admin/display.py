"""What every admin table of the package shares: ``ReadOnlyAdmin`` (nothing
added, edited or deleted by hand; query-string lookups limited to the list's
own filters, a 400 otherwise) and the small display helpers (first lines,
JSON, preformatted text, durations). Every page module builds on it; it
registers nothing.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.exceptions import DisallowedModelAdminLookup
from django.db.models import Model
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import gettext as _

from django_platformkit.jobs.specs import JobSpec

#: Lookup suffixes a list filter or the date hierarchy puts in the query string.
_FILTER_SUFFIXES = ("", "__exact", "__isnull")
_DATE_SUFFIXES = ("__year", "__month", "__day", "__gte", "__lt")


def clipped_line(text: str, limit: int = 120) -> str:
    """The first non-blank line of ``text``, cut to ``limit`` characters with an ellipsis."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def truncated_html(text: str) -> str:
    """The first line, cut by CSS to the column's width (full line on hover)."""
    line = clipped_line(text, limit=500)
    return format_html('<span class="platformkit-trunc" title="{}">{}</span>', line, line) if line else "—"


def pretty_json(value: Any) -> str:
    """``value`` as indented JSON in a ``<pre>`` block (HTML)."""
    return format_html(
        '<pre class="platformkit-json">{}</pre>', json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    )


def pre_html(text: str) -> str:
    """``text`` in a ``<pre>`` block (HTML), or a dash when empty."""
    return format_html('<pre class="platformkit-pre">{}</pre>', text) if text else "—"


def breakable(name: str) -> str:
    """A dotted name (an event, a subscription, a task's path) as HTML that
    may wrap after each dot: two short lines instead of one column too wide
    for a list at 1280 px."""
    return format_html_join(mark_safe(".<wbr>"), "{}", ((part,) for part in str(name).split(".")))


def uuid_or_none(term: str) -> uuid.UUID | None:
    """``term`` as a UUID (a search box's text), or None when it isn't one."""
    try:
        return uuid.UUID(term.strip())
    except ValueError:
        return None


if TYPE_CHECKING:
    ModelAdminOf = admin.ModelAdmin
else:

    class ModelAdminOf(admin.ModelAdmin):
        # django-stubs makes ModelAdmin generic in its model (ModelAdmin[M]);
        # Django's class can't be subscripted at run time.
        def __class_getitem__(cls, model: Any) -> type:
            return cls


class NoWritesAdmin:
    """Mixed into every admin of ours: nobody adds, edits or deletes a row by
    hand (the named actions call the library instead)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin[ModelT: Model](NoWritesAdmin, ModelAdminOf[ModelT]):
    """Operational tables are evidence: nobody adds, edits or deletes a row
    by hand. State changes are named actions that call the library."""

    list_per_page = 50
    change_list_template = "admin/django_platformkit/change_list.html"

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """Only what the list's own filters and date hierarchy produce. Django
        lets any lookup on a local field through (``?error__regex=(`` is a
        500 from PostgreSQL, ``?payload__card__number=`` filters on payload
        keys a view-only user never sees): here they are a 400."""
        return lookup in self._allowed_lookups(request)

    def _allowed_lookups(self, request: HttpRequest) -> set[str]:
        allowed: set[str] = set()
        for item in self.get_list_filter(request):
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                if item.parameter_name is not None:
                    allowed.add(item.parameter_name)
            else:
                name = item[0] if isinstance(item, (list, tuple)) else item
                if isinstance(name, str):  # our lists name fields, never Field objects
                    allowed.update(name + suffix for suffix in _FILTER_SUFFIXES)
        if self.date_hierarchy:
            allowed.update(self.date_hierarchy + suffix for suffix in _DATE_SUFFIXES)
        return allowed

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        try:
            return super().changelist_view(request, extra_context=extra_context)
        except DisallowedModelAdminLookup as exc:
            # A 400 that says what to do, instead of Django's bare "Bad Request".
            offered = ", ".join(sorted(self._allowed_lookups(request))) or _("nothing")
            return HttpResponseBadRequest(
                _(
                    "%(error)s: this list filters only by what it offers (%(offered)s). "
                    "Use the filters beside the list or the search box."
                )
                % {"error": exc, "offered": offered},
                content_type="text/plain; charset=utf-8",
            )

    def _url(self, model: type[Model], view: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:django_platformkit_{model._meta.model_name}_{view}", args=args)


def schedule_text(spec: JobSpec | None) -> str:
    """A job's schedule as the admin says it: ``every 0:00:20``,
    ``cron 0 3 * * * (Europe/Paris)``, or that it is no longer declared."""
    if spec is None:
        return _("— (no longer declared)")
    if spec.every is not None:
        return _("every %(interval)s") % {"interval": spec.every}
    return _("cron %(expression)s (%(zone)s)") % {"expression": spec.cron, "zone": spec.timezone}


def duration_text(started: Any, finished: Any) -> str:
    """How long a run took, in ms under a second; a dash when it never reported."""
    if started is None or finished is None:
        return _("— (never reported)")
    from django_platformkit.templatetags.platformkit_admin import age_text

    seconds = (finished - started).total_seconds()
    return _("%(ms)d ms") % {"ms": round(seconds * 1000)} if seconds < 1 else age_text(seconds)
