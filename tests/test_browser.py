"""Once in a real browser: an operator signs in, opens a dead letter, replays
it with a reason and sees the admin say so. Headless Chromium is the system's
(Debian's ``chromium``), driven by Playwright from PyPI; no browser download.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.consumer import record_dead_letter
from django_platformkit.models import DeadLetter, OutboxEvent

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic",
]
PASSWORD = "replay-with-care-1"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no system Chromium at {CHROMIUM} (apt-get install chromium)"),
]


@pytest.fixture
def operator(transactional_db) -> User:
    user = User.objects.create_user("olga", password=PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_platformkit", codename__in=["view_deadletter", "replay_deadletter"])
    )
    return user


@pytest.fixture
def failed_event(transactional_db) -> DeadLetter:
    with transaction.atomic():
        event_id = publish("testapp.flaky", {"order": 7})
    OutboxEvent.objects.filter(pk=event_id).update(published_at=timezone.now())
    record_dead_letter(
        subscription="testapp.flaky", event_id=event_id, name="testapp.flaky", tenant=None, attempts=3,
        error="RuntimeError: card declined", traceback="Traceback (most recent call last):\nRuntimeError: card declined",
    )
    return DeadLetter.objects.get(event_id=event_id)


def test_an_operator_replays_a_dead_letter_with_a_reason_in_chromium(live_server, operator, failed_event, tmp_path_factory, monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the ORM calls
    # below are still plain synchronous ones, so Django may allow them.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import expect, sync_playwright

    shots = tmp_path_factory.mktemp("browser")
    screenshot = shots / "dead-letter-replayed.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(15_000)
            page.goto(f"{live_server.url}/admin/login/?next=/admin/django_platformkit/deadletter/")
            page.fill("#id_username", "olga")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")

            page.locator("#result_list").get_by_role("link", name="testapp.flaky").click()
            expect(page.locator(".field-traceback_text pre")).to_contain_text("RuntimeError: card declined")
            expect(page.locator(".field-payload pre")).to_contain_text('"order": 7')
            page.screenshot(path=str(shots / "dead-letter.png"), full_page=True)

            page.click("a.platformkit-replay")
            page.fill("#id_reason", "card processor fixed")
            page.screenshot(path=str(shots / "replay-reason.png"), full_page=True)
            page.click(".submit-row input[type=submit]")

            success = page.locator("ul.messagelist li.success")
            expect(success).to_contain_text("Replayed 1 dead letter (testapp.flaky for testapp.flaky)")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    print(f"screenshot: {screenshot}")
    assert screenshot.stat().st_size > 0
    assert not DeadLetter.objects.filter(pk=failed_event.pk).exists()
    audit = OutboxEvent.objects.get(name="platformkit.event_replayed")
    assert (audit.payload["actor"], audit.payload["reason"]) == ("olga", "card processor fixed")
    assert os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] == "true"
