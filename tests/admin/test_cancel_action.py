"""The admin's Cancel action on outbox events and tasks: it asks for a
reason, runs ``cancel()`` as the signed-in user, leaves a LogEntry on the
outbox row, and needs the operator permission, not just staff status."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import transaction
from django.urls import reverse

from django_platformkit import publish
from django_platformkit.models import HandledEvent, OutboxEvent

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_platformkit_outboxevent_changelist"


def _user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_platformkit", codename__in=codenames)
    )
    return user


def _cancel(client, event_id, **extra):
    data = {"action": "cancel_selected", "_selected_action": [str(event_id)], **extra}
    if "confirm" not in extra:
        data["index"] = "0"
    return client.post(reverse(CHANGELIST), data)


def test_cancel_asks_for_a_reason_then_cancels_as_the_signed_in_user_with_a_log_entry(client):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    client.force_login(_user("olga", "view_outboxevent", "replay_deadletter"))
    page = _cancel(client, event_id)
    assert page.status_code == 200
    assert 'name="reason"' in page.content.decode() and str(event_id) in page.content.decode()
    assert not HandledEvent.objects.exists()
    missing = _cancel(client, event_id, confirm="yes", reason="  ")
    assert missing.status_code == 200 and "a reason is required" in missing.content.decode()

    done = _cancel(client, event_id, confirm="yes", reason="order withdrawn")
    assert done.status_code == 302
    texts = [str(m) for m in get_messages(done.wsgi_request)]
    assert any(t.startswith("Cancelled 1 event (testapp.order_placed ") and "order withdrawn" in t for t in texts), (
        texts
    )
    assert set(HandledEvent.objects.values_list("subscription", "outcome")) == {
        ("testapp.count_order", "cancelled"),
        ("testapp.record_order", "cancelled"),
    }
    audit = OutboxEvent.objects.get(name="platformkit.event_cancelled")
    assert audit.payload["actor"] == "olga" and audit.payload["reason"] == "order withdrawn"
    entry = LogEntry.objects.get(object_id=str(event_id))
    assert entry.user.username == "olga" and "order withdrawn" in entry.change_message

    again = _cancel(client, event_id, confirm="yes", reason="twice")
    assert any("already cancelled" in str(m) for m in get_messages(again.wsgi_request))
    assert OutboxEvent.objects.filter(name="platformkit.event_cancelled").count() == 1


def test_staff_without_the_operator_permission_cannot_cancel(client):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    from django.contrib import admin
    from django.test import RequestFactory

    from django_platformkit.models import OutboxTask

    def offered(user) -> list[bool]:
        request = RequestFactory().get("/")
        request.user = user
        return [
            "cancel_selected" in admin.site._registry[model].get_actions(request) for model in (OutboxEvent, OutboxTask)
        ]

    victor = _user("victor", "view_outboxevent", "view_outboxtask")
    client.force_login(victor)
    # Not offered on the events' list nor the tasks' (it was, and then answered 403).
    assert offered(victor) == [False, False]
    assert "cancel_selected" not in client.get(reverse(CHANGELIST)).content.decode()
    response = _cancel(client, event_id, confirm="yes", reason="no")  # a forged post cancels nothing
    assert response.status_code in (200, 302, 403)
    assert not HandledEvent.objects.exists()
    assert offered(_user("olga", "view_outboxevent", "view_outboxtask", "replay_deadletter")) == [True, True]
