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
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
PASSWORD = "replay-with-care-1"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"no system Chromium at {CHROMIUM} (apt-get install chromium)"
    ),
]


@pytest.fixture
def operator(transactional_db) -> User:
    user = User.objects.create_user("olga", password=PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_platformkit", codename__in=["view_deadletter", "replay_deadletter"]
        )
    )
    return user


@pytest.fixture
def failed_event(transactional_db) -> DeadLetter:
    with transaction.atomic():
        event_id = publish("testapp.flaky", {"order": 7})
    OutboxEvent.objects.filter(pk=event_id).update(published_at=timezone.now())
    record_dead_letter(
        subscription="testapp.flaky",
        event_id=event_id,
        name="testapp.flaky",
        tenant=None,
        attempts=3,
        error="RuntimeError: card declined",
        traceback="Traceback (most recent call last):\nRuntimeError: card declined",
    )
    return DeadLetter.objects.get(event_id=event_id)


def test_an_operator_replays_a_dead_letter_with_a_reason_in_chromium(
    live_server, operator, failed_event, tmp_path_factory, monkeypatch
):
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


# --- the overview, the dead-letter list and detail at 1280 x 800 -------------------

# gitignored; the docs' images come from docs/screenshots.py
SCREENSHOTS = Path(__file__).resolve().parents[2] / "screenshots"
VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture
def own_nats(settings):
    """A NATS of this test's own, so stopping it harms nobody else's run."""
    from django.test import override_settings

    from django_platformkit.devservices import NatsServer

    server = NatsServer().start()
    token = os.urandom(4).hex()
    config = dict(settings.PLATFORMKIT, NATS_URL=server.url, STREAM=f"B{token}", SUBJECT_PREFIX=f"b{token}")
    try:
        with override_settings(PLATFORMKIT=config):
            yield server
    finally:
        server.cleanup()


@pytest.fixture
def console_user(transactional_db) -> User:
    user = User.objects.create_user("otto", password=PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_platformkit",
            codename__in=[
                "view_deadletter",
                "view_outboxevent",
                "view_handledevent",
                "view_jobstate",
                "view_attempt",
                "replay_deadletter",
            ],
        )
    )
    return user


def _assert_no_sideways_scroll(page, box: str) -> None:
    """Neither the page nor ``box`` (the admin wraps a list in an
    ``overflow: auto`` box, which hides a too-wide table inside its own
    scrollbar) is wider than the 1280 px window."""
    page_width, window = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert page_width <= window, f"the page scrolls sideways at {window} px: {page_width} px wide"
    inner, outer, right = page.evaluate(
        f"(() => {{ const e = document.querySelector({box!r}); return [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().right]; }})()"
    )
    assert inner <= outer and right <= window, (
        f"{box} is cut off at {window} px: content {inner} px in a {outer} px box ending at {right}"
    )


def _cell(page, subscription: str, column: str) -> str:
    return (
        page.locator(f'#platformkit-subscriptions tr[data-subscription="{subscription}"] td.{column}')
        .inner_text()
        .strip()
    )


def test_the_overview_shows_a_backlog_and_a_dead_letter_and_still_renders_with_nats_stopped(
    live_server, own_nats, console_user, monkeypatch
):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import expect, sync_playwright

    from django_platformkit.broker.transport import Transport
    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.consume.subscriptions import subscriptions
    from django_platformkit.outbox.relay import Relay
    from django_platformkit.runtime.heartbeat import Heartbeat
    from django_platformkit.runtime.worker import Worker

    subs = {s.name: s for s in subscriptions()}
    # A dead letter on testapp.flaky from a real failing handler run...
    with transaction.atomic():
        publish("testapp.flaky", {"always_fail": True})
    assert Worker(burst=True, burst_timeout_seconds=60, subscriptions=[subs["testapp.flaky"]]).run() == 0
    assert DeadLetter.objects.filter(subscription="testapp.flaky").count() == 1
    # ...and one whose error is one very long line (the list must still fit 1280 px).
    with transaction.atomic():
        long_id = publish("testapp.slow", {"sku": "A-1"})
    OutboxEvent.objects.filter(pk=long_id).update(published_at=timezone.now())
    record_dead_letter(
        subscription="testapp.slow",
        event_id=long_id,
        name="testapp.slow",
        tenant="tenant-with-a-long-name-0042",
        attempts=5,
        error="psycopg.errors.UniqueViolation: duplicate key value violates unique constraint " + "x" * 400,
        traceback="Traceback (most recent call last):\n  ...\npsycopg.errors.UniqueViolation: duplicate key",
    )
    # A backlog of 7 on testapp.record_order: its durable exists, nobody consumes it.
    transport = Transport()
    transport.connect()
    try:
        Consumer(subs["testapp.record_order"], transport).ensure()
        with transaction.atomic():
            for n in range(7):
                publish("testapp.order_placed", {"n": n})
        Relay(transport).drain()
    finally:
        transport.close()
    # testapp.count_order keeps up: it handles the same 7 (throughput on the sparkline).
    assert Worker(burst=True, burst_timeout_seconds=60, subscriptions=[subs["testapp.count_order"]]).run() == 0
    with transaction.atomic():  # three rows the relay has not sent: the outbox figure with NATS gone
        for n in range(3):
            publish("testapp.order_placed", {"n": 100 + n})
    Heartbeat(
        ["testapp.count_order", "testapp.flaky", "testapp.record_order", "testapp.slow"], worker="worker-1:4242"
    ).beat()

    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(15_000)
            page.goto(f"{live_server.url}/admin/login/?next=/admin/django_platformkit/")
            page.fill("#id_username", "otto")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.get_by_role("link", name="Overview").first.click()  # linked from the app index
            expect(page.locator("#platformkit-subscriptions")).to_be_visible()
            assert _cell(page, "testapp.record_order", "pk-waiting") == "7"
            assert _cell(page, "testapp.record_order", "pk-dead-letters") == "0"
            assert _cell(page, "testapp.flaky", "pk-dead-letters") == "1"
            assert _cell(page, "testapp.flaky", "pk-waiting") == "0"
            assert (
                _cell(page, "testapp.count_order", "pk-waiting"),
                _cell(page, "testapp.count_order", "pk-handled-5m"),
            ) == ("0", "7")
            assert page.locator(".pk-outbox-pending").inner_text().strip() == "3"
            expect(page.locator("#platformkit-broker-down")).to_have_count(0)
            expect(page.locator('#platformkit-workers tr[data-worker="worker-1:4242"]')).to_contain_text("alive")
            _assert_no_sideways_scroll(page, "#platformkit-subscriptions")
            page.screenshot(path=str(SCREENSHOTS / "overview.png"))

            page.goto(f"{live_server.url}/admin/django_platformkit/deadletter/")
            expect(page.locator("#result_list")).to_contain_text("duplicate key value")
            _assert_no_sideways_scroll(page, ".results")
            page.screenshot(path=str(SCREENSHOTS / "dead-letters.png"))
            page.locator("#result_list").get_by_role("link", name="testapp.flaky").click()
            expect(page.locator(".field-error_text pre")).to_contain_text("RuntimeError: flaky failure on attempt 3")
            page.screenshot(path=str(SCREENSHOTS / "dead-letter.png"))

            own_nats.stop()
            page.goto(f"{live_server.url}/admin/django_platformkit/overview/")
            expect(page.locator("#platformkit-broker-down")).to_contain_text("NATS is unreachable")
            assert _cell(page, "testapp.record_order", "pk-waiting") == "—"
            assert _cell(page, "testapp.flaky", "pk-dead-letters") == "1"
            assert page.locator(".pk-outbox-pending").inner_text().strip() == "3"
            page.screenshot(path=str(SCREENSHOTS / "overview-nats-stopped.png"))
        finally:
            browser.close()
    for name in ("overview.png", "dead-letters.png", "dead-letter.png", "overview-nats-stopped.png"):
        assert (SCREENSHOTS / name).stat().st_size > 10_000, name
