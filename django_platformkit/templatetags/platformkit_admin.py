"""Template filters of the operator's console, and the one way it writes a
time: ``2026-12-01 09:23:51 UTC`` (the site's time zone, to the second)
with its age beside it, on every page of the package. Ages in seconds as
short text, and the overview's sparklines, rendered on the server."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html
from django.utils.translation import gettext as _

register = template.Library()

#: The console's one date format (``strftime``): sortable, to the second, with the zone.
WHEN_FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def age_text(seconds: float | None) -> str:
    """``7.2`` -> ``"7 s"``, ``192`` -> ``"3 min 12 s"``, ``7500`` -> ``"2 h 5 min"``, ``None`` -> ``"—"``."""
    if seconds is None:
        return "—"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return _("%(s)d s") % {"s": seconds}
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return (_("%(m)d min %(s)d s") if s else _("%(m)d min")) % {"m": minutes, "s": s}
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return (_("%(h)d h %(m)d min") if m else _("%(h)d h")) % {"h": hours, "m": m}
    days, h = divmod(hours, 24)
    return (_("%(d)d d %(h)d h") if h else _("%(d)d d")) % {"d": days, "h": h}


def when_text(value: datetime) -> str:
    """``value`` (aware) in the site's time zone, in ``WHEN_FORMAT``."""
    return timezone.localtime(value).strftime(WHEN_FORMAT)


def when_html(value: datetime | None, *, relative: bool = True) -> str:
    """An aware datetime as ``2026-12-01 09:23:51 UTC`` in a ``<time>``
    element, followed (``relative``) by its age (``3 min 12 s ago``,
    ``in 5 min``); "—" for None."""
    if value is None:
        return "—"
    text = when_text(value)
    if not relative:
        return format_html('<time datetime="{}">{}</time>', value.isoformat(), text)
    seconds = (value - timezone.now()).total_seconds()
    rel = (
        _("in %(age)s") % {"age": age_text(seconds)} if seconds > 0 else _("%(age)s ago") % {"age": age_text(-seconds)}
    )
    return format_html(
        '<time datetime="{}">{}</time><span class="platformkit-age"> · {}</span>', value.isoformat(), text, rel
    )


def ago_html(value: datetime | None) -> str:
    """An aware datetime as its age alone (``5 min ago``) in a ``<time>``
    element whose title is the time itself, for a sentence; "—" for None."""
    if value is None:
        return "—"
    seconds = (value - timezone.now()).total_seconds()
    rel = (
        _("in %(age)s") % {"age": age_text(seconds)} if seconds > 0 else _("%(age)s ago") % {"age": age_text(-seconds)}
    )
    return format_html('<time datetime="{}" title="{}">{}</time>', value.isoformat(), when_text(value), rel)


def sparkline_svg(
    values: Sequence[float] | None, *, width: int = 120, height: int = 24, label: str = "", unit: str = ""
) -> str:
    """A server-rendered SVG polyline of ``values`` (oldest first), scaled to
    its own maximum, with a ``<title>`` for screen readers and hover. Returns
    safe HTML (``format_html``); "—" for None."""
    if values is None:
        return "—"
    values = list(values)
    peak = max(values) if values else 0
    n = max(len(values) - 1, 1)
    pad = 2
    points = " ".join(
        f"{pad + i * (width - 2 * pad) / n:.1f},{height - pad - ((v / peak) if peak else 0) * (height - 2 * pad):.1f}"
        for i, v in enumerate(values)
    )
    title = (
        _("%(label)s: peak %(peak)s%(unit)s per minute over the last hour")
        % {"label": label, "peak": f"{peak:g}", "unit": unit}
        if label
        else ""
    )
    return format_html(
        '<svg class="platformkit-spark" width="{}" height="{}" viewBox="0 0 {} {}" role="img" aria-label="{}">'
        "<title>{}</title>"
        '<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{}"/></svg>',
        width,
        height,
        width,
        height,
        title,
        title,
        points,
    )


@register.filter
def age(seconds: float | None) -> str:
    return age_text(seconds)


@register.filter
def when(value: datetime | None) -> str:
    return when_html(value)


@register.filter
def spark(values: Any, label: str = "") -> str:
    return sparkline_svg(values, label=label)
