"""The overview's Pause and Resume (admin/pausing.py): only for operators
with the replay permission, a confirmation that says what a pause does and
asks why, then the pause with its LogEntry and audit event; the overview
shows who paused, when and why, and offers Resume. Real PostgreSQL."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from django_platformkit.models import OutboxEvent
from django_platformkit.models.controls import Pause

pytestmark = pytest.mark.django_db(transaction=True)

OVERVIEW = "admin:django_platformkit_overview"
PAUSE = "admin:django_platformkit_overview_pause"
RESUME = "admin:django_platformkit_overview_resume"
SUB = "testapp.record_order"


def user(name: str, *codenames: str) -> User:
    made = User.objects.create_user(name, is_staff=True)
    made.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_platformkit", codename__in=codenames)
    )
    return made


def test_a_viewer_without_the_permission_sees_no_pause_and_may_not_pause(client):
    client.force_login(user("vera", "view_outboxevent"))
    page = client.get(reverse(OVERVIEW)).content.decode()
    assert "Pause…" not in page and reverse(PAUSE) not in page
    assert client.get(reverse(PAUSE), {"subscription": SUB}).status_code == 403
    assert client.post(reverse(PAUSE), {"subscription": SUB, "confirm": "yes", "reason": "x"}).status_code == 403
    assert not Pause.objects.exists()


def test_an_operator_pauses_with_a_reason_the_overview_says_who_and_why_and_resume_ends_it(client, broker):
    client.force_login(user("olga", "view_outboxevent", "replay_deadletter"))
    page = client.get(reverse(OVERVIEW)).content.decode()
    assert f'href="{reverse(PAUSE)}?subscription={SUB}"' in page
    confirm = client.get(reverse(PAUSE), {"subscription": SUB}).content.decode()
    assert "no worker starts its handler" in confirm and "nothing is lost, no attempt is counted" in confirm

    missing = client.post(reverse(PAUSE) + f"?subscription={SUB}", {"confirm": "yes", "reason": "  "})
    assert "a reason is required" in missing.content.decode()
    assert not Pause.objects.exists()

    done = client.post(
        reverse(PAUSE), {"subscription": SUB, "confirm": "yes", "reason": "card processor down"}, follow=True
    )
    text = " ".join(done.content.decode().split())
    assert f"Paused {SUB}: within seconds no worker starts its handlers" in text
    assert Pause.objects.get().paused_by == "olga"
    row = text[text.index(f'data-why="{SUB}"') :]
    row = row[: row.index("</tr>")]
    assert "Paused by <strong>olga</strong>" in row and "card processor down" in row and "Resume…" in row
    assert 'class="platformkit-state platformkit-state-paused">paused<' in text and "1 paused" in text
    assert LogEntry.objects.get().action_flag == ADDITION
    assert OutboxEvent.objects.get(name="platformkit.subscription_paused").payload["reason"] == "card processor down"

    resumed = client.post(reverse(RESUME), {"subscription": SUB, "confirm": "yes"}, follow=True)
    assert f"Resumed {SUB}: its waiting events run again." in resumed.content.decode()
    assert not Pause.objects.exists()
    assert [e.action_flag for e in LogEntry.objects.order_by("action_time")] == [ADDITION, DELETION]


def test_an_unknown_name_is_an_error_message_and_nothing_is_written(client):
    client.force_login(user("olga", "view_outboxevent", "replay_deadletter"))
    done = client.post(
        reverse(PAUSE), {"subscription": "testapp.record_ordr", "confirm": "yes", "reason": "x"}, follow=True
    )
    assert "did you mean &#x27;testapp.record_order&#x27;" in done.content.decode()
    assert not Pause.objects.exists() and not LogEntry.objects.exists()
