"""The jobs list's Run now, Disable and Enable (admin/jobcontrols.py): for
operators with the replay permission, a confirmation with a reason, then
the switch, a LogEntry on the job and the message bar; the list shows a
disabled job as disabled (never overdue) and a run asked for. Real PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse

from django_platformkit.models import JobState
from django_platformkit.models.controls import JobControl

pytestmark = pytest.mark.django_db(transaction=True)

LIST = "admin:django_platformkit_jobstate_changelist"
JOB = "platformkit.outbox_purge"


def user(name: str, *codenames: str) -> User:
    made = User.objects.create_user(name, is_staff=True)
    made.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return made


@pytest.fixture
def overdue_job(transactional_db) -> JobState:
    # Last ran three hours ago: its hourly slots since went unclaimed.
    return JobState.objects.create(
        name=JOB, last_slot=datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    )


def test_a_viewer_gets_no_job_actions(client, overdue_job):
    client.force_login(user("vera", "view_jobstate"))
    page = client.get(reverse(LIST)).content.decode()
    assert "disable_jobs" not in page and "run_now" not in page


def test_an_operator_disables_with_a_reason_and_the_list_says_disabled_not_overdue(client, overdue_job):
    client.force_login(user("olga", "view_jobstate", "replay_deadletter"))
    assert "overdue" in client.get(reverse(LIST)).content.decode()
    asked = client.post(reverse(LIST), {"action": "disable_jobs", "_selected_action": [JOB], "index": "0"})
    page = asked.content.decode()
    assert "every worker skips its slots" in page and f"<li>{JOB}</li>" in page
    missing = client.post(reverse(LIST), {"action": "disable_jobs", "_selected_action": [JOB], "confirm": "yes"})
    assert "a reason is required" in missing.content.decode() and not JobControl.objects.exists()
    done = client.post(
        reverse(LIST),
        {"action": "disable_jobs", "_selected_action": [JOB], "confirm": "yes", "reason": "moving the database"},
        follow=True,
    )
    text = " ".join(done.content.decode().split())
    assert f"Disabled {JOB}: its slots are skipped" in text
    assert "disabled</strong> by olga" in text and "moving the database" in text and "overdue" not in text
    control = JobControl.objects.get()
    assert control.disabled_by == "olga" and control.disabled_at is not None
    assert LogEntry.objects.get().change_message == "Disabled. Reason: moving the database"

    client.post(reverse(LIST), {"action": "run_now", "_selected_action": [JOB], "confirm": "yes", "reason": "one last"})
    assert "run asked for by olga" in client.get(reverse(LIST)).content.decode()
    enabled = client.post(
        reverse(LIST),
        {"action": "enable_jobs", "_selected_action": [JOB], "confirm": "yes", "reason": "done"},
        follow=True,
    )
    assert f"Enabled {JOB}: it runs from its next slot" in enabled.content.decode()
    assert "overdue" not in enabled.content.decode(), "the slots skipped while disabled are not overdue"
    assert LogEntry.objects.count() == 3
