"""The console's one way of writing a time (``2026-12-01 09:23:51 UTC ·
3 min 12 s ago``), its short ages, and the overview's sparklines
(django_platformkit.templatetags.platformkit_admin)."""

from __future__ import annotations

import datetime

import pytest
from django.test import override_settings
from django.utils import timezone

from django_platformkit.templatetags.platformkit_admin import age_text, sparkline_svg, when_html, when_text

pytestmark = pytest.mark.unit


def test_sparklines_are_svg_polylines_scaled_to_their_peak():
    svg = str(sparkline_svg([0] * 59 + [10], width=120, height=24, label="handled"))
    points = svg.split('points="')[1].split('"')[0].split()
    assert len(points) == 60
    assert points[0] == "2.0,22.0" and points[-1] == "118.0,2.0"
    assert "<title>handled: peak 10 per minute over the last hour</title>" in svg
    assert sparkline_svg(None) == "—"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "—"), (0.4, "0 s"), (7.2, "7 s"), (60, "1 min"), (192, "3 min 12 s"), (7200, "2 h"), (7500, "2 h 5 min")]
    + [(3 * 86400, "3 d"), (3 * 86400 + 3600, "3 d 1 h"), (-5, "0 s")],
)
def test_ages_are_short_and_carry_their_unit(seconds, text):
    assert age_text(seconds) == text


def test_a_time_is_written_to_the_second_with_its_zone_and_its_age():
    at = timezone.now().replace(microsecond=0) - datetime.timedelta(minutes=3, seconds=12)
    html = str(when_html(at))
    assert html.startswith(f'<time datetime="{at.isoformat()}">{at:%Y-%m-%d %H:%M:%S} UTC</time>')
    assert html.endswith(('<span class="platformkit-age"> · 3 min 12 s ago</span>', "3 min 13 s ago</span>"))
    later = timezone.now() + datetime.timedelta(minutes=5, seconds=30)
    assert "in 5 min" in str(when_html(later))
    assert str(when_html(at, relative=False)) == f'<time datetime="{at.isoformat()}">{at:%Y-%m-%d %H:%M:%S} UTC</time>'
    assert when_html(None) == "—"


def test_a_time_is_shown_in_the_sites_time_zone():
    at = datetime.datetime(2026, 7, 1, 12, 0, 5, tzinfo=datetime.UTC)
    with override_settings(TIME_ZONE="Europe/Paris"):
        assert when_text(at) == "2026-07-01 14:00:05 CEST"
