"""Template filters of the operator's console: times to the second with a
relative age, ages in seconds as short text, and sparklines."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html

from django_platformkit.admin.figures import sparkline_svg

register = template.Library()


def age_text(seconds: float | None) -> str:
    """``7.2`` -> ``"7 s"``, ``192`` -> ``"3 min 12 s"``, ``7500`` -> ``"2 h 5 min"``, ``None`` -> ``"—"``."""
    if seconds is None:
        return "—"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s} s" if s else f"{minutes} min"
    hours, m = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {m} min" if m else f"{hours} h"
    days, h = divmod(hours, 24)
    return f"{days} d {h} h" if h else f"{days} d"


def when_html(value: datetime | None, *, relative: bool = True) -> str:
    """An aware datetime as ``2026-12-01 09:23:51 UTC`` (local time zone, to
    the second) with its age (``3 min 12 s ago``, ``in 5 min``); "—" for None."""
    if value is None:
        return "—"
    local = timezone.localtime(value)
    text = local.strftime("%Y-%m-%d %H:%M:%S %Z")
    if not relative:
        return format_html('<time datetime="{}">{}</time>', value.isoformat(), text)
    now = timezone.now()
    seconds = (value - now).total_seconds()
    rel = f"in {age_text(seconds)}" if seconds > 0 else f"{age_text(-seconds)} ago"
    return format_html(
        '<time datetime="{}">{}</time><span class="platformkit-age"> · {}</span>', value.isoformat(), text, rel
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
