"""Once in a real browser: an operator signs in, opens a dead letter, replays
it with a reason and sees the admin say so. Headless Chromium is the system's
(Debian's ``chromium``), driven by Playwright from PyPI; no browser download.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter

#: Debian's chromium; CHROMIUM_PATH names another (GitHub's runners have
#: /usr/bin/google-chrome).
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
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
        not Path(CHROMIUM).exists(),
        reason=f"no system Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM_PATH)",
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
#: The console pictures (``PLATFORMKIT_CONSOLE_SHOTS`` to put them elsewhere, e.g. /tmp/console-shots).
CONSOLE_SHOTS = Path(os.environ.get("PLATFORMKIT_CONSOLE_SHOTS") or SCREENSHOTS / "console")
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
                "view_outboxtask",
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
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker

    subs = {s.name: s for s in subscriptions()}
    # A dead letter on testapp.flaky from a real failing handler run...
    with transaction.atomic():
        publish("testapp.flaky", {"always_fail": True})
    assert Worker(WorkerOptions(burst=True, burst_timeout_seconds=60, subscriptions=[subs["testapp.flaky"]])).run() == 0
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
    assert (
        Worker(WorkerOptions(burst=True, burst_timeout_seconds=60, subscriptions=[subs["testapp.count_order"]])).run()
        == 0
    )
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


# --- the console under a retrying handler, an overdue job and stopped workers --------


def _a_task_row(path: str, *, ago_seconds: float, ran_for_seconds: float | None, failed: bool = False) -> None:
    """A ``django.tasks`` task as the outbox and its result hold it: run for
    ``ran_for_seconds`` and finished (or dead-lettered, ``failed``), or not run yet (None)."""
    from django_platformkit.models import TaskResultRecord

    created = timezone.now() - datetime.timedelta(seconds=ago_seconds)
    row = OutboxEvent.objects.create(
        name="platformkit.task_default",
        payload={"task": path, "args": ["order-7"], "kwargs": {}, "backend": "default"},
        published_at=created,
    )
    OutboxEvent.objects.filter(pk=row.pk).update(created_at=created)
    if ran_for_seconds is None:
        return
    started = created + datetime.timedelta(seconds=1)
    finished = started + datetime.timedelta(seconds=ran_for_seconds)
    TaskResultRecord.objects.create(
        event_id=row.pk,
        status="" if failed else "SUCCESSFUL",
        started_at=started,
        last_attempted_at=started,
        finished_at=None if failed else finished,
        worker_ids=["worker-1:4242"],
    )
    if failed:
        record_dead_letter(
            subscription="platformkit.task_default",
            event_id=row.pk,
            name="platformkit.task_default",
            tenant=None,
            attempts=5,
            error="smtplib.SMTPServerDisconnected: Connection unexpectedly closed",
            traceback="",
        )
        DeadLetter.objects.filter(event_id=row.pk).update(failed_at=finished)


def test_the_overview_under_a_retrying_handler_shows_the_last_error_and_leads_to_its_attempts(
    live_server, broker, console_user, registries, monkeypatch
):
    """A handler keeps failing (the next try five minutes away): the overview
    says *failing*, 1 retrying, the error and since when, and its link opens
    the attempts list with that error on screen at 1280 px. Beside it, a job
    whose last slot is 82 s old on a 20 s schedule is overdue, a worker that
    stopped a minute ago is listed as stopped, those that stopped an hour ago
    are folded away; the tasks list shows each task by path, with its finish
    and duration."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    import threading

    from playwright.sync_api import expect, sync_playwright

    from django_platformkit import declare, subscribe
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.jobs import specs as jobs
    from django_platformkit.models import Attempt, JobState, WorkerHeartbeat
    from django_platformkit.runtime.heartbeat import Heartbeat
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker
    from tests.conftest import wait_for

    declare("testapp.payment_due")

    @subscribe("testapp.payment_due", name="testapp.charge_card", max_attempts=5, backoff_seconds=[300])
    def charge_card(event):
        raise RuntimeError(f"card declined by the processor for order {event.payload['order']} (code 51)")

    with transaction.atomic():
        publish("testapp.payment_due", {"order": 7})
    worker = Worker(WorkerOptions(subscriptions=[get_subscription("testapp.charge_card")], scheduler=False))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: Attempt.objects.filter(subscription="testapp.charge_card", outcome=Attempt.FAILED).exists(),
            timeout=60,
            what="the handler's first failure",
        )
        # A job every 20 s whose last slot is 82 s old: overdue. One every hour, on time.
        jobs.job(every=datetime.timedelta(seconds=20), name="testapp.sync_prices")(lambda: None)
        jobs.job(every=datetime.timedelta(hours=1), name="testapp.hourly_report")(lambda: None)
        now = timezone.now()
        late = now - datetime.timedelta(seconds=82)
        JobState.objects.create(name="testapp.sync_prices", last_slot=late, started_at=late, finished_at=late)
        on_time = jobs.job_named("testapp.hourly_report").prev_slot(now)
        JobState.objects.create(
            name="testapp.hourly_report", last_slot=on_time, started_at=on_time, finished_at=on_time
        )
        # A worker stopped a minute ago (listed), three an hour ago (folded away).
        for n in range(4):
            Heartbeat(["testapp.charge_card"], worker=f"web-{n}:{4000 + n}").stopped()
        WorkerHeartbeat.objects.filter(worker="web-0:4000").update(last_seen=now - datetime.timedelta(minutes=1))
        WorkerHeartbeat.objects.exclude(worker__in=["web-0:4000", worker.heartbeat.worker]).filter(
            worker__startswith="web-"
        ).update(last_seen=now - datetime.timedelta(hours=1))
        # Tasks: two done, one failed for good, one not run yet.
        _a_task_row("shop.tasks.send_receipt", ago_seconds=300, ran_for_seconds=0.42)
        _a_task_row("shop.tasks.rebuild_search_index", ago_seconds=240, ran_for_seconds=75)
        _a_task_row("shop.tasks.send_receipt", ago_seconds=200, ran_for_seconds=2.5, failed=True)
        _a_task_row("shop.tasks.send_receipt", ago_seconds=5, ran_for_seconds=None)

        CONSOLE_SHOTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport=VIEWPORT)
                page.set_default_timeout(15_000)
                page.goto(f"{live_server.url}/admin/login/?next=/admin/django_platformkit/overview/")
                page.fill("#id_username", "otto")
                page.fill("#id_password", PASSWORD)
                page.click("input[type=submit]")

                row = page.locator('#platformkit-subscriptions tr[data-subscription="testapp.charge_card"]')
                expect(row.locator(".pk-state")).to_contain_text("failing")
                expect(row.locator(".pk-state")).to_contain_text("1 retrying")
                why = page.locator('#platformkit-subscriptions tr[data-why="testapp.charge_card"]')
                expect(why).to_contain_text("card declined by the processor for order 7 (code 51)")
                expect(why).to_contain_text("attempt 1 of 5")
                expect(why).to_contain_text("Failing since")
                error_link = why.locator(".pk-last-error a")
                expect(error_link).to_be_visible()
                expect(page.locator("#platformkit-summary")).to_contain_text(
                    "2 subscriptions failing"
                )  # and the task queue, below
                job = page.locator('#platformkit-jobs tr[data-job="testapp.sync_prices"]')
                expect(job.locator(".pk-job-state")).to_contain_text("overdue")
                expect(page.locator('#platformkit-jobs tr[data-job="testapp.hourly_report"]')).to_contain_text(
                    "on time"
                )
                expect(page.locator('#platformkit-workers tr[data-worker="web-0:4000"]')).to_contain_text("stopped")
                expect(page.locator("#platformkit-workers tr[data-worker]")).to_have_count(2)  # ours and web-0
                folded = page.locator("#platformkit-workers-folded")
                expect(folded.locator("summary")).to_contain_text("3 workers stopped earlier")
                expect(folded.locator('tr[data-worker="web-1:4001"]')).to_be_hidden()  # folded away
                expect(page.locator('meta[http-equiv="refresh"]')).to_have_attribute("content", "30")  # on by default
                page.screenshot(path=str(CONSOLE_SHOTS / "overview-retrying.png"), full_page=True)
                _assert_no_sideways_scroll(page, "#platformkit-subscriptions")

                error_link.click()
                expect(page).to_have_url(re.compile(r"/attempt/\?.*subscription=testapp.charge_card"))
                error = page.locator("#result_list td.field-error_first_line").first
                expect(error).to_contain_text("card declined by the processor")
                box = error.bounding_box()
                assert box is not None and box["x"] + box["width"] <= VIEWPORT["width"], box
                page.screenshot(path=str(CONSOLE_SHOTS / "attempts.png"), full_page=True)
                _assert_no_sideways_scroll(page, ".results")

                page.goto(f"{live_server.url}/admin/django_platformkit/outboxtask/")
                header = page.locator("#result_list thead").inner_text()
                for column in ("TASK", "STATUS", "FINISHED AT", "DURATION"):
                    assert column in header.upper(), header
                expect(page.locator("#changelist-filter")).to_contain_text("shop.tasks.rebuild_search_index")
                expect(page.locator("#result_list")).to_contain_text("1 min 15 s")
                page.screenshot(path=str(CONSOLE_SHOTS / "tasks.png"), full_page=True)
                _assert_no_sideways_scroll(page, ".results")

                page.goto(f"{live_server.url}/admin/django_platformkit/overview/?refresh=10")
                expect(page.locator('meta[http-equiv="refresh"]')).to_have_attribute("content", "10")
                page.click("#platformkit-refresh-pause")  # the visible pause: reading without a reload
                expect(page.locator('meta[http-equiv="refresh"]')).to_have_count(0)
                expect(page.locator("#platformkit-refresh-resume")).to_be_visible()
            finally:
                browser.close()
    finally:
        worker.stop()
        thread.join(30)
    for name in ("overview-retrying.png", "attempts.png", "tasks.png"):
        assert (CONSOLE_SHOTS / name).stat().st_size > 10_000, name


# --- the operator's controls at 1280 px: a paused subscription, the jobs list, the errors ------------


def _column_widths(page, table: str) -> dict[str, float]:
    """Each header's width in ``table``, by its column class (``column-name``) or its text."""
    return page.evaluate(
        f"""(() => Object.fromEntries([...document.querySelectorAll({table!r} + ' thead th')].map(
            th => [([...th.classList].find(c => c.startsWith('column-')) || th.innerText.trim()), th.getBoundingClientRect().width])))()"""
    )


def test_operators_pause_a_subscription_and_disable_a_job_at_1280_px_and_the_lists_fit(
    live_server, broker, console_user, registries, monkeypatch
):
    """At 1280 px: an operator pauses a subscription from the overview (with a
    reason) and the overview says who paused it, when and why; the jobs list
    with a disabled job, an overdue one, a run asked for and a long error fits
    the window, and the dead-letter list gives its ERROR column the width
    the other columns leave (it was squeezed to ~90 px)."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import expect, sync_playwright

    from django_platformkit.jobs import specs as jobs
    from django_platformkit.jobs.controls import disable, request_run
    from django_platformkit.models import JobState

    now = timezone.now()
    jobs.job(every=datetime.timedelta(seconds=20), name="testapp.sync_prices")(lambda: None)
    jobs.job(cron="30 2 * * *", timezone="Europe/Paris", name="testapp.nightly_settlement_report")(lambda: None)
    jobs.job(every=datetime.timedelta(minutes=5), name="testapp.refresh_exchange_rates")(lambda: None)
    late = now - datetime.timedelta(seconds=82)
    JobState.objects.create(name="testapp.sync_prices", last_slot=late, started_at=late, finished_at=late)
    nightly = jobs.job_named("testapp.nightly_settlement_report").prev_slot(now)
    JobState.objects.create(
        name="testapp.nightly_settlement_report",
        last_slot=nightly,
        started_at=nightly,
        finished_at=nightly + datetime.timedelta(seconds=48),
        last_error="requests.exceptions.ConnectionError: HTTPSConnectionPool(host='settlement.bank.example', "
        "port=443): Max retries exceeded with url: /v2/reports?day=" + "x" * 200,
    )
    rates = jobs.job_named("testapp.refresh_exchange_rates").prev_slot(now) - datetime.timedelta(minutes=30)
    JobState.objects.create(name="testapp.refresh_exchange_rates", last_slot=rates, started_at=rates, finished_at=rates)
    disable(["testapp.refresh_exchange_rates"], actor="otto", reason="the rates provider is migrating its API")
    request_run(["testapp.nightly_settlement_report"], actor="otto", reason="the bank re-sent yesterday's file")
    for n in range(3):
        with transaction.atomic():
            event_id = publish("testapp.slow", {"n": n})
        OutboxEvent.objects.filter(pk=event_id).update(published_at=timezone.now())
        record_dead_letter(
            subscription="testapp.slow",
            event_id=event_id,
            name="testapp.slow",
            tenant="tenant-with-a-long-name-0042",
            attempts=5,
            error="psycopg.errors.UniqueViolation: duplicate key value violates unique constraint "
            '"shop_invoice_number_key" DETAIL: Key (number)=(2026-000417) already exists.',
            traceback="",
        )

    # Failed tasks: the subscription column names the queue and the task's path.
    _a_task_row("shop.tasks.send_receipt", ago_seconds=200, ran_for_seconds=2.5, failed=True)
    _a_task_row("shop.tasks.rebuild_search_index", ago_seconds=100, ran_for_seconds=1.5, failed=True)

    CONSOLE_SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(15_000)
            page.goto(f"{live_server.url}/admin/login/?next=/admin/django_platformkit/overview/")
            page.fill("#id_username", "otto")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")

            row = page.locator('#platformkit-subscriptions tr[data-subscription="testapp.record_order"]')
            row.locator("a.pk-pause").click()
            expect(page.locator("#content-main")).to_contain_text("no worker starts its handler")
            page.fill("#id_reason", "the warehouse API is down until 14:00")
            page.click(".submit-row input[type=submit]")
            expect(page.locator("ul.messagelist li.success")).to_contain_text("Paused testapp.record_order")
            expect(row.locator(".pk-state")).to_contain_text("paused")
            why = page.locator('#platformkit-subscriptions tr[data-why="testapp.record_order"]')
            expect(why).to_contain_text("Paused by otto")
            expect(why).to_contain_text("the warehouse API is down until 14:00")
            expect(why.locator("a.pk-resume")).to_be_visible()
            job = page.locator('#platformkit-jobs tr[data-job="testapp.refresh_exchange_rates"]')
            expect(job.locator(".pk-job-state")).to_contain_text("disabled")
            expect(job).not_to_have_class(re.compile("platformkit-overdue"))
            _assert_no_sideways_scroll(page, "#platformkit-subscriptions")
            page.screenshot(path=str(CONSOLE_SHOTS / "overview-paused.png"))

            page.goto(f"{live_server.url}/admin/django_platformkit/jobstate/")
            expect(page.locator("#result_list")).to_contain_text("disabled")
            expect(page.locator("#result_list")).to_contain_text("overdue")
            expect(page.locator("#result_list")).to_contain_text("run asked for by otto")
            _assert_no_sideways_scroll(page, ".results")
            page.screenshot(path=str(CONSOLE_SHOTS / "jobs.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/django_platformkit/deadletter/")
            _assert_no_sideways_scroll(page, ".results")
            widths = _column_widths(page, "#result_list")
            table = page.evaluate("document.querySelector('#result_list').getBoundingClientRect().width")
            assert widths["column-error_first_line"] >= 0.3 * table, (widths, table)
            page.screenshot(path=str(CONSOLE_SHOTS / "dead-letters-1280.png"), full_page=True)
        finally:
            browser.close()
    for name in ("overview-paused.png", "jobs.png", "dead-letters-1280.png"):
        assert (CONSOLE_SHOTS / name).stat().st_size > 10_000, name
