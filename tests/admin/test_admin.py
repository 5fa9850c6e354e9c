"""The admin operators work in: read-only tables with filters, search and
dates; Replay and Discard as named actions that ask for a reason, run as the
signed-in user and need the replay permission, not just staff status."""

from __future__ import annotations

import datetime
import json
import re
import uuid
import zoneinfo
from html import unescape

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.jobs import specs as jobs
from django_platformkit.models import DeadLetter, HandledEvent, JobState, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter

pytestmark = pytest.mark.django_db

CHANGELIST = "admin:django_platformkit_deadletter_changelist"
TRACEBACK = 'Traceback (most recent call last):\n  File "handler.py", line 3\nRuntimeError: card declined'


def _user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, is_staff=True)  # no password: no slow hashing
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_platformkit", codename__in=codenames)
    )
    return user


VIEW_ALL = ("view_deadletter", "view_outboxevent", "view_handledevent", "view_jobstate")


@pytest.fixture
def operator() -> User:
    return _user("olga", *VIEW_ALL, "replay_deadletter")


@pytest.fixture
def viewer() -> User:
    return _user("victor", *VIEW_ALL)


def dead_letter(
    name: str = "testapp.flaky",
    *,
    subscription: str = "testapp.flaky",
    tenant: str | None = None,
    payload: dict | None = None,
    error: str = "RuntimeError: card declined\nsecond line",
    attempts: int = 3,
) -> DeadLetter:
    with transaction.atomic():
        event_id = publish(name, payload if payload is not None else {"order": 7, "note": "ünïcode"}, tenant=tenant)
    OutboxEvent.objects.filter(pk=event_id).update(published_at=timezone.now())
    assert record_dead_letter(
        subscription=subscription,
        event_id=event_id,
        name=name,
        tenant=tenant,
        attempts=attempts,
        error=error,
        traceback=TRACEBACK,
    )
    return DeadLetter.objects.get(event_id=event_id, subscription=subscription)


def messages_of(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def changelist(client, **params):
    response = client.get(reverse(CHANGELIST), params)
    assert response.status_code == 200
    return response


# --- dead letters: list, filters, dates, search, detail -----------------------


def test_the_dead_letter_list_shows_time_and_attempts_event_subscription_tenant_event_id_and_the_first_error_line(
    client, viewer
):
    row = dead_letter(tenant="acme", attempts=4)
    client.force_login(viewer)
    response = changelist(client)
    html = response.content.decode()
    for column in (
        "column-failed",
        "column-event_name",
        "column-subscription_task",
        "column-tenant",
        "column-event_id",
        "column-error_first_line",
    ):
        assert column in html
    assert "testapp.<wbr>flaky" in html and "acme" in html and "after 4 attempts" in html
    assert str(row.event_id) in html
    assert 'title="RuntimeError: card declined">RuntimeError: card declined</span>' in html
    assert "second line" not in html


def test_dead_letters_filter_by_subscription_event_name_and_tenant(client, viewer):
    dead_letter("testapp.flaky", subscription="testapp.flaky", tenant="acme")
    dead_letter("testapp.order_placed", subscription="testapp.record_order", tenant="globex")
    dead_letter("testapp.order_placed", subscription="testapp.count_order")
    client.force_login(viewer)
    assert changelist(client).context["cl"].result_count == 3
    assert changelist(client, subscription="testapp.record_order").context["cl"].result_count == 1
    assert changelist(client, name="testapp.order_placed").context["cl"].result_count == 2
    assert changelist(client, tenant="acme").context["cl"].result_count == 1
    assert changelist(client, tenant__isnull="True").context["cl"].result_count == 1


def test_dead_letters_have_a_date_hierarchy_on_the_failure_time(client, viewer):
    old, new = dead_letter(), dead_letter()
    DeadLetter.objects.filter(pk=old.pk).update(failed_at=datetime.datetime(2024, 3, 1, 12, tzinfo=datetime.UTC))
    client.force_login(viewer)
    response = changelist(client, failed_at__year="2024")
    assert [row.pk for row in response.context["cl"].result_list] == [old.pk]
    assert response.context["cl"].date_hierarchy == "failed_at"
    assert new.pk not in [row.pk for row in response.context["cl"].result_list]


def test_dead_letters_search_by_event_id_and_error_text(client, viewer):
    wanted = dead_letter(error="ValueError: sku 42 unknown")
    dead_letter(error="RuntimeError: card declined")
    client.force_login(viewer)
    by_id = changelist(client, q=str(wanted.event_id))
    assert [row.pk for row in by_id.context["cl"].result_list] == [wanted.pk]
    by_part_of_id = changelist(client, q=str(wanted.event_id)[-12:])
    assert [row.pk for row in by_part_of_id.context["cl"].result_list] == [wanted.pk]
    by_error = changelist(client, q="sku 42")
    assert [row.pk for row in by_error.context["cl"].result_list] == [wanted.pk]


def test_the_dead_letter_page_shows_the_payload_as_json_the_traceback_and_links_the_outbox_row(client, viewer):
    row = dead_letter(payload={"order": 7, "lines": [{"sku": "A-1", "qty": 2}]})
    client.force_login(viewer)
    response = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk]))
    assert response.status_code == 200
    html = response.content.decode()
    pretty = json.dumps({"order": 7, "lines": [{"sku": "A-1", "qty": 2}]}, indent=2, sort_keys=True).replace(
        '"', "&quot;"
    )
    assert pretty in html
    assert "RuntimeError: card declined" in html and "File &quot;handler.py&quot;, line 3" in html
    assert reverse("admin:django_platformkit_outboxevent_change", args=[row.event_id]) in html
    assert 'name="_save"' not in html
    # No replay permission, no Replay/Discard buttons.
    assert "platformkit-replay" not in html


def test_the_dead_letter_page_offers_replay_and_discard_to_an_operator(client, operator):
    row = dead_letter()
    client.force_login(operator)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    assert reverse("admin:django_platformkit_deadletter_replay", args=[row.pk]) in html
    assert reverse("admin:django_platformkit_deadletter_discard", args=[row.pk]) in html


def test_a_dead_letter_whose_outbox_row_is_gone_says_so(client, viewer):
    event_id = uuid.uuid4()
    record_dead_letter(
        subscription="testapp.flaky",
        event_id=event_id,
        name="(malformed)",
        tenant=None,
        attempts=1,
        error="malformed",
        traceback="{not json",
    )
    row = DeadLetter.objects.get(event_id=event_id)
    client.force_login(viewer)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    assert "not in the outbox" in html


def test_nobody_adds_edits_or_deletes_a_dead_letter_by_hand(client, admin_user):
    row = dead_letter()
    client.force_login(admin_user)
    assert client.get(reverse("admin:django_platformkit_deadletter_add")).status_code == 403
    assert (
        client.post(reverse("admin:django_platformkit_deadletter_change", args=[row.pk]), {"attempts": 1}).status_code
        == 403
    )
    assert client.get(reverse("admin:django_platformkit_deadletter_delete", args=[row.pk])).status_code == 403
    actions = [name for name, _ in changelist(client).context["action_form"].fields["action"].choices]
    assert "delete_selected" not in actions
    assert {"replay_selected", "discard_selected"} <= set(actions)


def test_staff_without_view_permission_sees_no_dead_letters(client):
    dead_letter()
    client.force_login(_user("stan"))
    assert client.get(reverse(CHANGELIST)).status_code == 403


# --- Replay ------------------------------------------------------------------


def malformed_dead_letter() -> DeadLetter:
    """A malformed message's dead letter on testapp.slow: its id is no outbox row."""
    gone = uuid.uuid4()
    record_dead_letter(
        subscription="testapp.slow",
        event_id=gone,
        name="(malformed)",
        tenant=None,
        attempts=1,
        error="malformed",
        traceback="",
    )
    return DeadLetter.objects.get(event_id=gone)


def _action(client, action: str, rows: list[DeadLetter], **extra):
    data = {"action": action, "_selected_action": [str(r.pk) for r in rows], **extra}
    if "confirm" not in extra:
        data["index"] = "0"
    return client.post(reverse(CHANGELIST), data)


def test_replay_asks_for_a_reason_then_replays_as_the_signed_in_user(client, operator):
    row = dead_letter()
    client.force_login(operator)
    page = _action(client, "replay_selected", [row])
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="reason"' in html and str(row.event_id) in html
    assert DeadLetter.objects.filter(pk=row.pk).exists()

    done = _action(client, "replay_selected", [row], confirm="yes", reason="card processor fixed")
    assert done.status_code == 302
    assert messages_of(done) == [
        "Replayed 1 dead letter (testapp.flaky for testapp.flaky): pending again, the relay sends it next."
    ]
    assert not DeadLetter.objects.filter(pk=row.pk).exists()
    assert not HandledEvent.objects.filter(event_id=row.event_id).exists()
    assert OutboxEvent.objects.get(pk=row.event_id).published_at is None
    audit = OutboxEvent.objects.get(name="platformkit.event_replayed")
    assert audit.payload == {
        "event_id": str(row.event_id),
        "name": "testapp.flaky",
        "subscription": "testapp.flaky",
        "actor": "olga",
        "reason": "card processor fixed",
    }


@pytest.mark.parametrize("action", ["replay_selected", "discard_selected"])
def test_an_action_on_dead_letters_gone_meanwhile_says_so_and_writes_nothing(client, operator, action):
    # A form sent twice, or a list another operator acted on since it loaded:
    # the rows are gone, and the action did nothing and said nothing.
    row = dead_letter()
    client.force_login(operator)
    first = _action(client, "replay_selected", [row], confirm="yes", reason="card processor fixed")
    assert first.status_code == 302 and not DeadLetter.objects.exists()
    client.get(reverse(CHANGELIST))  # the first action's message is shown and gone
    data = {"action": action, "_selected_action": [str(row.pk)], "confirm": "yes", "reason": "card processor fixed"}
    again = client.post(reverse(CHANGELIST), data, follow=True)
    assert [str(m) for m in again.context["messages"]] == [
        f"Nothing to {action.split('_')[0]}: the selected dead letters are gone (replayed or discarded meanwhile?). "
        "The list below is what is left."
    ]
    assert OutboxEvent.objects.filter(name="platformkit.event_replayed").count() == 1


def test_replay_without_a_reason_asks_again_and_changes_nothing(client, operator):
    row = dead_letter()
    client.force_login(operator)
    response = _action(client, "replay_selected", [row], confirm="yes", reason="   ")
    assert response.status_code == 200
    assert "a reason is required" in response.content.decode()
    assert DeadLetter.objects.filter(pk=row.pk).exists()
    assert not OutboxEvent.objects.filter(name="platformkit.event_replayed").exists()


def test_replay_of_many_rows_reports_each_outcome(client, operator):
    first, second = dead_letter(), dead_letter("testapp.order_placed", subscription="testapp.record_order")
    malformed = malformed_dead_letter()
    gone = malformed.event_id
    client.force_login(operator)
    done = _action(client, "replay_selected", [first, second, malformed], confirm="yes", reason="deploy 42 fixed it")
    assert done.status_code == 302
    text = messages_of(done)
    assert text[0].startswith("Replayed 2 dead letters (")
    assert text[1] == (
        f"Did not replay (malformed) {gone} for testapp.slow: it is a malformed message (bytes on our subjects "
        "that were never an event of this project's outbox), so there is nothing to send again; Discard it to accept the failure."
    )
    assert list(DeadLetter.objects.values_list("pk", flat=True)) == [malformed.pk]


def test_the_replay_confirmation_says_which_selected_ones_will_not_be_replayed(client, operator):
    healthy = dead_letter()
    malformed = malformed_dead_letter()
    gone = malformed.event_id
    client.force_login(operator)
    page = _action(client, "replay_selected", [healthy, malformed])
    assert page.status_code == 200
    html = page.content.decode()
    start = html.index('id="platformkit-not-replayed"')
    section = html[start : html.index("</div>", start)]
    assert "1 of the selected will not be replayed" in section
    assert f"(malformed) {gone} for testapp.slow: it is a malformed message" in section
    assert "Discard it to accept the failure" in section
    assert str(healthy.event_id) not in section
    # A selection that can all be replayed shows no such section.
    assert 'id="platformkit-not-replayed"' not in _action(client, "replay_selected", [healthy]).content.decode()
    # Discard's confirmation has nothing to warn about.
    assert 'id="platformkit-not-replayed"' not in _action(client, "discard_selected", [malformed]).content.decode()
    assert DeadLetter.objects.count() == 2


def test_a_dead_letter_of_a_subscription_this_build_lacks_is_not_replayed_and_says_why(client, operator):
    healthy, retired = dead_letter(), dead_letter(subscription="retired.old_handler")
    client.force_login(operator)
    page = _action(client, "replay_selected", [healthy, retired])
    text = unescape(page.content.decode())
    section = text[
        text.index('id="platformkit-not-replayed"') : text.index("</div>", text.index("platformkit-not-replayed"))
    ]
    assert "1 of the selected will not be replayed" in section
    assert "declares no subscription 'retired.old_handler'" in section
    done = _action(client, "replay_selected", [healthy, retired], confirm="yes", reason="fixed")
    assert done.status_code == 302
    assert any("declares no subscription 'retired.old_handler'" in m for m in messages_of(done))
    assert list(DeadLetter.objects.values_list("pk", flat=True)) == [retired.pk]  # the operator still sees it


def test_replay_needs_the_replay_permission_not_just_staff(client, viewer):
    row = dead_letter()
    client.force_login(viewer)
    response = _action(client, "replay_selected", [row], confirm="yes", reason="trying")
    assert response.status_code == 200  # the plain list: no action ran
    assert DeadLetter.objects.filter(pk=row.pk).exists()
    assert not OutboxEvent.objects.filter(name="platformkit.event_replayed").exists()
    assert changelist(client).context["action_form"] is None  # no action this user may run
    assert client.get(reverse("admin:django_platformkit_deadletter_replay", args=[row.pk])).status_code == 403
    assert (
        client.post(
            reverse("admin:django_platformkit_deadletter_replay", args=[row.pk]), {"confirm": "yes", "reason": "x"}
        ).status_code
        == 403
    )
    assert DeadLetter.objects.filter(pk=row.pk).exists()


def test_replay_from_the_dead_letter_page(client, operator):
    row = dead_letter()
    client.force_login(operator)
    url = reverse("admin:django_platformkit_deadletter_replay", args=[row.pk])
    page = client.get(url)
    assert page.status_code == 200 and 'name="reason"' in page.content.decode()
    done = client.post(url, {"confirm": "yes", "reason": "retry after fix"})
    assert done.status_code == 302 and done["Location"] == reverse(CHANGELIST)
    assert messages_of(done)[0].startswith("Replayed 1 dead letter")
    assert not DeadLetter.objects.filter(pk=row.pk).exists()


def test_the_page_of_a_dead_letter_that_is_gone_redirects(client, operator):
    client.force_login(operator)
    response = client.get(reverse("admin:django_platformkit_deadletter_replay", args=[987654]))
    assert response.status_code == 302


# --- Discard -------------------------------------------------------------------


def test_discard_removes_the_dead_letter_keeps_the_claim_and_leaves_the_row_purgeable(client, operator):
    row = dead_letter()
    client.force_login(operator)
    page = _action(client, "discard_selected", [row])
    assert page.status_code == 200 and 'name="reason"' in page.content.decode()
    done = _action(client, "discard_selected", [row], confirm="yes", reason="order was cancelled")
    assert done.status_code == 302
    assert messages_of(done) == [
        "Discarded 1 dead letter (testapp.flaky for testapp.flaky): the failure is accepted, nothing runs it again."
    ]
    assert not DeadLetter.objects.filter(pk=row.pk).exists()
    assert HandledEvent.objects.filter(subscription="testapp.flaky", event_id=row.event_id).exists()
    outbox = OutboxEvent.objects.get(pk=row.event_id)
    assert outbox.published_at is not None  # published, no dead letter describes it: purge may take it
    assert not OutboxEvent.objects.filter(name="platformkit.event_replayed").exists()


def test_discard_needs_the_replay_permission_and_a_reason(client, viewer, operator):
    row = dead_letter()
    client.force_login(viewer)
    _action(client, "discard_selected", [row], confirm="yes", reason="no")
    assert (
        client.post(
            reverse("admin:django_platformkit_deadletter_discard", args=[row.pk]), {"confirm": "yes", "reason": "x"}
        ).status_code
        == 403
    )
    assert DeadLetter.objects.filter(pk=row.pk).exists()
    client.force_login(operator)
    response = client.post(
        reverse("admin:django_platformkit_deadletter_discard", args=[row.pk]), {"confirm": "yes", "reason": ""}
    )
    assert response.status_code == 200 and "a reason is required" in response.content.decode()
    assert DeadLetter.objects.filter(pk=row.pk).exists()


# --- the outbox, claims and jobs ------------------------------------------------


def test_the_outbox_list_shows_status_age_and_the_relay_lag_at_the_top(client, viewer):
    with transaction.atomic():
        pending = publish("testapp.order_placed", {"n": 1}, tenant="acme")
        published = publish("testapp.flaky", {"n": 2})
    OutboxEvent.objects.filter(pk=published).update(published_at=timezone.now())
    OutboxEvent.objects.filter(pk=pending).update(created_at=timezone.now() - datetime.timedelta(minutes=7))
    client.force_login(viewer)
    url = reverse("admin:django_platformkit_outboxevent_changelist")
    response = client.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="platformkit-outbox-lag"' in html
    assert "Pending: <strong>1</strong>" in html and "oldest pending: <strong>7 min</strong> old" in html
    for column in ("column-status", "column-age", "column-name", "column-tenant"):
        assert column in html
    assert [r.pk for r in client.get(url, {"status": "pending"}).context["cl"].result_list] == [pending]
    assert [r.pk for r in client.get(url, {"status": "published"}).context["cl"].result_list] == [published]
    assert [r.pk for r in client.get(url, {"name": "testapp.flaky"}).context["cl"].result_list] == [published]
    assert [r.pk for r in client.get(url, {"q": str(pending)}).context["cl"].result_list] == [pending]
    assert [r.pk for r in client.get(url, {"q": "order_placed"}).context["cl"].result_list] == [pending]


def test_an_empty_outbox_says_nothing_is_waiting(client, viewer):
    client.force_login(viewer)
    html = client.get(reverse("admin:django_platformkit_outboxevent_changelist")).content.decode()
    assert "Pending: <strong>0</strong>" in html and "nothing waiting for the relay" in html


def test_an_outbox_row_page_is_read_only_and_links_its_dead_letters_and_claims(client, admin_user):
    row = dead_letter(payload={"order": 9})
    client.force_login(admin_user)
    response = client.get(reverse("admin:django_platformkit_outboxevent_change", args=[row.event_id]))
    html = response.content.decode()
    assert response.status_code == 200
    assert "&quot;order&quot;: 9" in html
    assert f"{reverse(CHANGELIST)}?q={row.event_id}" in html and "1 dead letter(s)" in html and "1 claim(s)" in html
    assert 'name="_save"' not in html
    assert client.get(reverse("admin:django_platformkit_outboxevent_add")).status_code == 403
    assert (
        client.post(
            reverse("admin:django_platformkit_outboxevent_change", args=[row.event_id]), {"name": "x"}
        ).status_code
        == 403
    )


def test_claims_are_read_only_with_search_by_event_id(client, admin_user):
    row = dead_letter()
    client.force_login(admin_user)
    url = reverse("admin:django_platformkit_handledevent_changelist")
    response = client.get(url, {"q": str(row.event_id)})
    assert response.status_code == 200
    assert [c.event_id for c in response.context["cl"].result_list] == [row.event_id]
    claim = HandledEvent.objects.get(event_id=row.event_id)
    assert client.get(reverse("admin:django_platformkit_handledevent_change", args=[claim.pk])).status_code == 200
    assert client.get(reverse("admin:django_platformkit_handledevent_add")).status_code == 403
    assert (
        client.post(
            reverse("admin:django_platformkit_handledevent_change", args=[claim.pk]), {"subscription": "x"}
        ).status_code
        == 403
    )


def test_job_state_is_read_only(client, admin_user):
    JobState.objects.create(name="testapp.gone_job", last_error="Boom\nmore")
    client.force_login(admin_user)
    response = client.get(reverse("admin:django_platformkit_jobstate_changelist"))
    assert response.status_code == 200
    html = response.content.decode()
    assert "testapp.gone_job" in html and "— (no longer declared)" in html and "Boom" in html
    assert client.get(reverse("admin:django_platformkit_jobstate_add")).status_code == 403
    assert (
        client.post(
            reverse("admin:django_platformkit_jobstate_change", args=["testapp.gone_job"]), {"name": "x"}
        ).status_code
        == 403
    )


def test_job_state_shows_schedule_with_its_time_zone_last_run_and_next_slot(client, admin_user, registries):
    def nightly_report():
        pass

    jobs.job(cron="0 3 * * *", timezone="Europe/Paris", name="testapp.nightly_report")(nightly_report)
    slot = datetime.datetime(2026, 1, 5, 2, tzinfo=datetime.UTC)
    JobState.objects.create(
        name="testapp.nightly_report", last_slot=slot, started_at=slot, finished_at=slot + datetime.timedelta(seconds=3)
    )
    client.force_login(admin_user)
    response = client.get(reverse("admin:django_platformkit_jobstate_changelist"))
    html = response.content.decode()
    assert "cron 0 3 * * * (Europe/Paris)" in html
    assert "column-next_slot" in html and "column-last_run" in html and "column-on_time" in html
    assert (
        '<time datetime="2026-01-05T02:00:00+00:00">2026-01-05 02:00:00 UTC</time>' in html
    )  # the last slot, to the second
    row = JobState.objects.get(name="testapp.nightly_report")
    spec = {s.name: s for s in jobs.jobs()}["testapp.nightly_report"]
    expected = spec.next_slot(timezone.now())
    assert expected.astimezone(zoneinfo.ZoneInfo("Europe/Paris")).hour == 3
    shown = str(response.context["cl"].model_admin.next_slot(row))
    assert (
        f'<time datetime="{expected.isoformat()}">{expected:%Y-%m-%d %H:%M:%S} UTC</time>' in shown
        and " · in " in shown
    )
    detail = client.get(reverse("admin:django_platformkit_jobstate_change", args=["testapp.nightly_report"]))
    assert detail.status_code == 200 and "Europe/Paris" in detail.content.decode()


# --- what an operator reads: times, terminal claims, attempts, history ---------


def test_list_times_show_seconds_and_a_relative_age(client, viewer):
    row = dead_letter()
    at = datetime.datetime(2026, 3, 1, 7, 5, 42, tzinfo=datetime.UTC)
    DeadLetter.objects.filter(pk=row.pk).update(failed_at=at)
    HandledEvent.objects.filter(event_id=row.event_id).update(handled_at=at)
    client.force_login(viewer)
    html = changelist(client).content.decode()
    assert '<time datetime="2026-03-01T07:05:42+00:00">2026-03-01 07:05:42 UTC</time>' in html
    assert '<span class="platformkit-age"> · ' in html and " ago</span>" in html
    claims = client.get(reverse("admin:django_platformkit_handledevent_changelist")).content.decode()
    assert "2026-03-01 07:05:42 UTC" in claims
    outbox = client.get(reverse("admin:django_platformkit_outboxevent_change", args=[row.event_id])).content.decode()
    assert "field-relay_lag" in outbox and "field-published" in outbox


def test_a_terminal_claim_is_marked_as_such_on_the_claims_list_and_the_outbox_row(client, viewer):
    failed = dead_letter()
    with transaction.atomic():
        ok = publish("testapp.order_placed", {"n": 1})
    HandledEvent.objects.create(subscription="testapp.record_order", event_id=ok)
    HandledEvent.objects.create(
        subscription="testapp.count_order", event_id=failed.event_id
    )  # handled by another subscription
    client.force_login(viewer)
    url = reverse("admin:django_platformkit_handledevent_changelist")
    response = client.get(url)
    kinds = {(c.subscription, c.event_id): c.terminal for c in response.context["cl"].result_list}
    assert kinds == {
        ("testapp.flaky", failed.event_id): True,
        ("testapp.record_order", ok): False,
        ("testapp.count_order", failed.event_id): False,
    }
    html = response.content.decode()
    assert html.count("terminal: dead-lettered</strong>") == 1
    assert [c.subscription for c in client.get(url, {"kind": "terminal"}).context["cl"].result_list] == [
        "testapp.flaky"
    ]
    assert {c.subscription for c in client.get(url, {"kind": "handled"}).context["cl"].result_list} == {
        "testapp.record_order",
        "testapp.count_order",
    }
    detail = client.get(reverse("admin:django_platformkit_outboxevent_change", args=[failed.event_id])).content.decode()
    claims = detail[detail.index('class="platformkit-claims"') :]
    assert "<td>testapp.count_order</td><td>handled</td>" in claims
    assert (
        '<td>testapp.flaky</td><td><strong class="platformkit-terminal">terminal: dead-lettered</strong></td>' in claims
    )


def test_the_claims_list_costs_the_same_queries_for_one_row_or_many(client, viewer, django_assert_max_num_queries):
    for _ in range(20):
        dead_letter()
    client.force_login(viewer)
    with django_assert_max_num_queries(12):  # the terminal mark is an EXISTS in the list's query, not a query per row
        assert client.get(reverse("admin:django_platformkit_handledevent_changelist")).status_code == 200


def _attempts_as_the_runtime_writes_them(row: DeadLetter) -> None:
    """What the consumer records (models.Attempt): two failures with their
    errors, then a run that started and never reported (the worker died)."""
    from django_platformkit.models import Attempt

    start = timezone.now() - datetime.timedelta(minutes=3)
    Attempt.objects.create(
        subscription=row.subscription,
        event_id=row.event_id,
        attempt=1,
        outcome=Attempt.FAILED,
        started_at=start,
        finished_at=start + datetime.timedelta(milliseconds=40),
        error="TimeoutError: gateway timed out",
        traceback="Traceback ...\nTimeoutError: gateway timed out",
        worker="web-1:4242",
    )
    Attempt.objects.create(
        subscription=row.subscription,
        event_id=row.event_id,
        attempt=2,
        outcome=Attempt.FAILED,
        started_at=start + datetime.timedelta(minutes=1),
        finished_at=start + datetime.timedelta(minutes=1, seconds=3),
        error="RuntimeError: card declined",
        traceback=TRACEBACK,
        worker="web-2:77",
    )
    Attempt.objects.create(
        subscription=row.subscription,
        event_id=row.event_id,
        attempt=3,
        outcome=Attempt.RUNNING,
        started_at=start + datetime.timedelta(minutes=2),
        worker="web-1:4243",
    )
    # Another subscription's attempts on the same event are not this dead letter's history.
    Attempt.objects.create(
        subscription="testapp.other", event_id=row.event_id, attempt=1, outcome=Attempt.FAILED, error="NotMine"
    )


def test_a_dead_letter_page_lists_each_attempt_when_it_ran_and_what_it_raised(client, viewer):
    row = dead_letter()
    _attempts_as_the_runtime_writes_them(row)
    client.force_login(viewer)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    table = html[
        html.index('class="platformkit-attempts"') : html.index("</table>", html.index('class="platformkit-attempts"'))
    ]
    assert table.count('<tr class="platformkit-attempt-') == 3
    assert table.index("TimeoutError: gateway timed out") < table.index("RuntimeError: card declined")
    assert "web-1:4242" in table and "web-2:77" in table and "40 ms" in table and "3 s" in table
    assert "— (never reported)" in table and "platformkit-attempt-running" in table
    assert "NotMine" not in table


def test_a_dead_letter_without_attempt_rows_says_there_is_no_per_attempt_record(client, viewer):
    row = dead_letter()
    client.force_login(viewer)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    assert "no per-attempt record" in html


def test_replay_and_discard_leave_admin_history_with_actor_and_reason(client, operator):
    from django.contrib.admin.models import CHANGE, DELETION, LogEntry

    replayed, discarded = dead_letter(), dead_letter("testapp.order_placed", subscription="testapp.record_order")
    client.force_login(operator)
    _action(client, "replay_selected", [replayed], confirm="yes", reason="card processor fixed")
    client.post(
        reverse("admin:django_platformkit_deadletter_discard", args=[discarded.pk]),
        {"confirm": "yes", "reason": "order was cancelled"},
    )
    entries = {
        (e.content_type.model, e.object_id, e.action_flag): (e.user.username, e.get_change_message())
        for e in LogEntry.objects.all()
    }
    assert entries == {
        ("deadletter", str(replayed.pk), CHANGE): (
            "olga",
            f"Replayed for subscription testapp.flaky (event {replayed.event_id}). Reason: card processor fixed",
        ),
        ("outboxevent", str(replayed.event_id), CHANGE): (
            "olga",
            f"Replayed for subscription testapp.flaky (event {replayed.event_id}). Reason: card processor fixed",
        ),
        ("deadletter", str(discarded.pk), DELETION): (
            "olga",
            f"Discarded for subscription testapp.record_order (event {discarded.event_id}). Reason: order was cancelled",
        ),
        ("outboxevent", str(discarded.event_id), CHANGE): (
            "olga",
            f"Discarded for subscription testapp.record_order (event {discarded.event_id}). Reason: order was cancelled",
        ),
    }
    history = client.get(
        reverse("admin:django_platformkit_outboxevent_history", args=[replayed.event_id])
    ).content.decode()
    assert "card processor fixed" in history and "olga" in history


def test_a_refused_replay_leaves_no_admin_history(client, operator):
    from django.contrib.admin.models import LogEntry

    gone = uuid.uuid4()
    record_dead_letter(
        subscription="testapp.slow",
        event_id=gone,
        name="(malformed)",
        tenant=None,
        attempts=1,
        error="malformed",
        traceback="",
    )
    client.force_login(operator)
    _action(client, "replay_selected", list(DeadLetter.objects.all()), confirm="yes", reason="try")
    assert not LogEntry.objects.exists()


# --- issue 12 item 16: a malformed dead letter offers Discard only -----------------


def test_a_malformed_dead_letter_offers_discard_only_and_says_why(client, operator):
    event_id = uuid.uuid4()
    record_dead_letter(
        subscription="testapp.flaky",
        event_id=event_id,
        name="(malformed)",
        tenant=None,
        attempts=1,
        error="malformed message on subject=pktest._.testapp.flaky stream_seq=9: not JSON",
        traceback="{not json",
    )
    row = DeadLetter.objects.get(event_id=event_id)
    client.force_login(operator)
    page = reverse("admin:django_platformkit_deadletter_change", args=[row.pk])
    html = client.get(page).content.decode()
    assert "platformkit-replay" not in html
    assert reverse("admin:django_platformkit_deadletter_discard", args=[row.pk]) in html
    assert (
        'id="platformkit-no-replay"' in html
        and "it is a malformed message" in html
        and "Discard it to accept the failure" in html
    )
    # A hand-typed Replay URL is told why and sent back, not to a confirmation that can only fail.
    response = client.get(reverse("admin:django_platformkit_deadletter_replay", args=[row.pk]))
    assert response.status_code == 302 and response["Location"] == page
    assert messages_of(response)[0].startswith(f"No replay for (malformed) {event_id}: it is a malformed message")
    assert (
        client.post(
            reverse("admin:django_platformkit_deadletter_replay", args=[row.pk]), {"confirm": "yes", "reason": "x"}
        ).status_code
        == 302
    )
    assert DeadLetter.objects.filter(pk=row.pk).exists()
    # Discard works.
    done = client.post(
        reverse("admin:django_platformkit_deadletter_discard", args=[row.pk]),
        {"confirm": "yes", "reason": "garbage on the wire"},
    )
    assert done.status_code == 302 and not DeadLetter.objects.filter(pk=row.pk).exists()


def test_a_dead_letter_whose_row_was_purged_offers_discard_only(client, operator):
    row = dead_letter()
    OutboxEvent.objects.filter(pk=row.event_id).delete()
    client.force_login(operator)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    assert "platformkit-replay" not in html and "its outbox row is gone (purged)" in html


def test_a_healthy_dead_letter_says_nothing_about_replay(client, operator):
    row = dead_letter()
    client.force_login(operator)
    html = client.get(reverse("admin:django_platformkit_deadletter_change", args=[row.pk])).content.decode()
    assert "platformkit-no-replay" not in html and "platformkit-replay" in html


# --- issue 12 item 12: only the filters the admin offers -------------------------------


@pytest.mark.parametrize(
    "url_name, params",
    [
        ("deadletter", {"error__regex": "("}),
        ("deadletter", {"tenant__regex": "["}),
        ("deadletter", {"event_id__startswith": "0"}),
        ("deadletter", {"traceback__icontains": "card"}),
        ("outboxevent", {"payload__card__number": "4111"}),
        ("outboxevent", {"payload__has_key": "card"}),
        ("outboxevent", {"name__regex": "("}),
        ("handledevent", {"event_id__regex": "("}),
        ("jobstate", {"last_error__regex": "("}),
        ("attempt", {"traceback__regex": "("}),
    ],
)
def test_a_lookup_the_list_does_not_offer_is_refused_with_400_not_a_500(client, viewer, url_name, params):

    viewer.user_permissions.add(
        Permission.objects.get(content_type__app_label="django_platformkit", codename="view_attempt")
    )
    dead_letter()
    client.force_login(viewer)
    response = client.get(reverse(f"admin:django_platformkit_{url_name}_changelist"), params)
    assert response.status_code == 400
    (lookup,) = params
    assert response.content.decode().startswith(
        f"Filtering by {lookup} not allowed: this list filters only by what it offers ("
    )
    assert "Use the filters beside the list or the search box." in response.content.decode()


def test_the_filters_the_lists_offer_still_work_from_the_query_string(client, viewer):
    row = dead_letter(tenant="acme")
    client.force_login(viewer)
    for params in (
        {"subscription": "testapp.flaky"},
        {"subscription__exact": "testapp.flaky"},
        {"tenant__isnull": "False"},
        {"failed_at__year": str(row.failed_at.year)},
        {"failed_at__year": str(row.failed_at.year), "failed_at__month": str(row.failed_at.month)},
        {"q": str(row.event_id)},
        {"o": "1"},
    ):
        assert [r.pk for r in changelist(client, **params).context["cl"].result_list] == [row.pk], params
    claims = client.get(
        reverse("admin:django_platformkit_handledevent_changelist"),
        {"handled_at__year": str(row.failed_at.year), "kind": "terminal"},
    )
    assert claims.status_code == 200 and len(claims.context["cl"].result_list) == 1


# --- one date format on every page ---------------------------------------------------

#: The console's one way of writing a time: to the second, with the zone.
ONE_FORMAT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC")
#: What a time looks like in any other format Django or Python would print.
ANY_TIME = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2})?(?:\.\d+)?(?:[+-]\d{2}:?\d{2}|Z)?(?: [A-Z]{2,5})?)?"
)
OTHER_FORMATS = re.compile(r"\b(?:a\.m\.|p\.m\.|noon|midnight)|\b[A-Z][a-z]{2,8}\.? \d{1,2}, \d{4}")


def _visible_text(html: str) -> str:
    """The page's text without tags (a ``<time datetime="...">``'s attribute is
    the machine's copy) and without the date hierarchy's navigation (months
    and days to click, not times)."""
    html = re.sub(r'<nav class="toplinks">.*?</nav>', " ", html, flags=re.S)
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return unescape(re.sub(r"<[^>]+>", " ", html))


def test_every_page_of_the_console_writes_times_in_one_format(client, registries):
    from django_platformkit.models import Attempt, TaskResultRecord
    from django_platformkit.runtime.heartbeat import Heartbeat

    operator = User.objects.create_superuser("ursula", password=None)
    row = dead_letter()
    Attempt.objects.create(
        subscription=row.subscription, event_id=row.event_id, attempt=1, outcome=Attempt.FAILED, error="E"
    )
    Attempt.objects.filter(event_id=row.event_id).update(finished_at=timezone.now())
    jobs.job(every=datetime.timedelta(minutes=5), name="testapp.report")(lambda: None)
    now = timezone.now()
    JobState.objects.create(name="testapp.report", last_slot=now, started_at=now, finished_at=now)
    task = OutboxEvent.objects.create(
        name="platformkit.task_default",
        payload={"task": "tests.testapp.tasks.record", "args": ["x"], "kwargs": {}},
        published_at=now,
        not_before=now + datetime.timedelta(hours=1),
    )
    TaskResultRecord.objects.create(
        event_id=task.pk, status="SUCCESSFUL", started_at=now, last_attempted_at=now, finished_at=now
    )
    Heartbeat([], worker="web-1:1").beat()
    claim = HandledEvent.objects.get(event_id=row.event_id)
    attempt = Attempt.objects.get(event_id=row.event_id)
    pages = {
        "overview": reverse("admin:django_platformkit_overview"),
        "outbox list": reverse("admin:django_platformkit_outboxevent_changelist"),
        "outbox row": reverse("admin:django_platformkit_outboxevent_change", args=[row.event_id]),
        "claims list": reverse("admin:django_platformkit_handledevent_changelist"),
        "claim": reverse("admin:django_platformkit_handledevent_change", args=[claim.pk]),
        "attempts list": reverse("admin:django_platformkit_attempt_changelist"),
        "attempt": reverse("admin:django_platformkit_attempt_change", args=[attempt.pk]),
        "dead letters list": reverse(CHANGELIST),
        "dead letter": reverse("admin:django_platformkit_deadletter_change", args=[row.pk]),
        "replay confirmation": reverse("admin:django_platformkit_deadletter_replay", args=[row.pk]),
        "jobs list": reverse("admin:django_platformkit_jobstate_changelist"),
        "job": reverse("admin:django_platformkit_jobstate_change", args=["testapp.report"]),
        "tasks list": reverse("admin:django_platformkit_outboxtask_changelist"),
        "task": reverse("admin:django_platformkit_outboxtask_change", args=[task.pk]),
    }
    client.force_login(operator)
    for page, url in pages.items():
        response = client.get(url)
        assert response.status_code == 200, page
        text = _visible_text(response.content.decode())
        times = ANY_TIME.findall(text)
        assert times, f"{page}: no time shown at all"
        assert [t for t in times if not ONE_FORMAT.fullmatch(t)] == [], f"{page} writes a time in another format"
        assert not OTHER_FORMATS.search(text), f"{page}: {OTHER_FORMATS.search(text)}"
