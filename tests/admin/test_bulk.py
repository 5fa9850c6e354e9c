"""The operator actions over every row a list's filter matches (Django
admin's "Select all N", ``select_across``): the confirmation says how many,
the action reaches every one of them and no other, a filter of more rows
than Django accepts form fields (``DATA_UPLOAD_MAX_NUMBER_FIELDS``) still
fits, rows that arrive after the confirmation are left alone, and an empty
filter is a clear message with nothing written. Real PostgreSQL and NATS."""

from __future__ import annotations

import time
import uuid

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

DEAD_LETTERS = reverse("admin:django_platformkit_deadletter_changelist")
OUTBOX = reverse("admin:django_platformkit_outboxevent_changelist")


@pytest.fixture
def operator(client) -> User:
    user = User.objects.create_user("olga", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_platformkit",
            codename__in=["view_deadletter", "view_outboxevent", "replay_deadletter"],
        )
    )
    client.force_login(user)
    return user


def dead_letters(n: int, *, subscription: str = "testapp.record_order") -> list[uuid.UUID]:
    """``n`` published orders that ``subscription`` gave up on."""
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(n)]
    OutboxEvent.objects.filter(pk__in=ids).update(published_at=timezone.now())
    for event_id in ids:
        record_dead_letter(
            subscription=subscription,
            event_id=event_id,
            name="testapp.order_placed",
            tenant=None,
            attempts=3,
            error="RuntimeError: warehouse down",
            traceback="",
        )
    return ids


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_a_bulk_replay_of_150_dead_letters_over_the_filter_replays_every_one_and_a_worker_handles_them(
    client, operator, broker, run_worker
):
    ids = dead_letters(150)
    others = dead_letters(3, subscription="testapp.count_order")  # outside the filter: left alone
    url = f"{DEAD_LETTERS}?subscription=testapp.record_order"
    listed = client.get(url).content.decode()
    assert "Select all 150" in " ".join(listed.split())  # the list shows a page of 50, and offers all 150

    page_ids = [
        str(pk)
        for pk in DeadLetter.objects.filter(subscription="testapp.record_order").values_list("pk", flat=True)[:50]
    ]
    confirm = client.post(
        url, {"action": "replay_selected", "_selected_action": page_ids, "select_across": "1", "index": "0"}
    )
    html = " ".join(confirm.content.decode().split())
    assert "150 dead letters match the current filter: every one is acted on" in html
    assert 'value="Replay 150 dead letters"' in html
    assert html.count('name="_selected_action"') == 1, "all N posts no list of ids"
    upto = str(DeadLetter.objects.filter(subscription="testapp.record_order").order_by("-pk").first().pk)
    assert f'name="upto" value="{upto}"' in html

    started = time.monotonic()
    done = client.post(
        url,
        {
            "action": "replay_selected",
            "_selected_action": page_ids[:1],
            "select_across": "1",
            "upto": upto,
            "count": "150",
            "confirm": "yes",
            "reason": "the warehouse is back",
        },
    )
    took = time.monotonic() - started
    print(f"bulk replay of 150 dead letters: {took:.2f} s in one request")
    assert done.status_code == 302
    assert messages_of(done)[0].startswith("Replayed 150 dead letters (")
    assert not DeadLetter.objects.filter(subscription="testapp.record_order").exists()
    assert DeadLetter.objects.filter(event_id__in=others).count() == 3
    assert OutboxEvent.objects.filter(name="platformkit.event_replayed").count() == 150
    assert LogEntry.objects.count() == 300  # on each dead letter and its outbox row
    assert OutboxEvent.objects.filter(pk__in=ids, published_at__isnull=True).count() == 150

    run_worker(subscriptions=[get_subscription("testapp.record_order")], timeout=120)
    assert Effect.objects.filter(subscription="testapp.record_order", event_id__in=ids).count() == 150
    assert (
        HandledEvent.objects.filter(subscription="testapp.record_order", event_id__in=ids, outcome="handled").count()
        == 150
    )


def test_select_all_of_an_empty_filter_says_so_and_writes_nothing(client, operator):
    dead_letters(2)
    url = f"{DEAD_LETTERS}?subscription=testapp.count_order"  # no dead letter of it
    for verb in ("replay_selected", "discard_selected"):
        response = client.post(url, {"action": verb, "_selected_action": ["1"], "select_across": "1", "index": "0"})
        assert response.status_code == 302
        client.get(url)  # the message is shown (and gone)
        assert messages_of(response) == [
            f"Nothing matches the current filter: nothing to {verb.split('_')[0]}, nothing was written."
        ]
    assert DeadLetter.objects.count() == 2 and not LogEntry.objects.exists()
    assert not OutboxEvent.objects.filter(
        name__in=["platformkit.event_replayed", "platformkit.event_discarded"]
    ).exists()
    response = client.post(
        f"{OUTBOX}?name=testapp.nothing",
        {"action": "cancel_selected", "_selected_action": ["x"], "select_across": "1", "index": "0"},
    )
    assert messages_of(response) == ["Nothing matches the current filter: nothing to cancel, nothing was written."]
    assert not HandledEvent.objects.filter(outcome="cancelled").exists()


def test_all_of_1200_rows_fits_in_the_form_and_rows_arriving_after_the_confirmation_are_left_alone(client, operator):
    # 1200 ids as form fields passed Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1000): the POST was refused.
    dead_letters(1200)
    url = f"{DEAD_LETTERS}?subscription=testapp.record_order"
    confirm = client.post(
        url, {"action": "discard_selected", "_selected_action": ["0"], "select_across": "1", "index": "0"}
    )
    html = confirm.content.decode()
    assert "1200 dead letters match the current filter" in html
    form = {
        "action": "discard_selected",
        "_selected_action": [html.split('name="_selected_action" value="')[1].split('"')[0]],
        "select_across": "1",
        "upto": html.split('name="upto" value="')[1].split('"')[0],
        "count": "1200",
        "confirm": "yes",
        "reason": "the orders were refunded by hand",
    }
    late = dead_letters(2)  # after the operator read "1200"
    done = client.post(url, form)
    assert done.status_code == 302, done.content[:300]
    assert messages_of(done)[0].startswith("Discarded 1200 dead letters (")
    assert list(DeadLetter.objects.values_list("event_id", flat=True).order_by("event_id")) == sorted(late)
