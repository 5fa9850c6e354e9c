"""The admin screenshots the documentation shows, taken again: one command.

    .venv/bin/python docs/screenshots.py            # writes docs/images/*.png
    .venv/bin/python docs/screenshots.py --out /tmp/shots

Runs the example project (``example_project/``) on throwaway PostgreSQL and
NATS (never your ``DATABASE_URL`` / ``NATS_URL``: the pictures must not show
your data) with real traffic: orders through ``POST /orders/``, a worker run
that handles them and their receipt tasks and dead-letters the two that fail,
then a worker that serves one subscription and the scheduler until the job
has run once. That worker stops (the overview lists it as stopped) and
another takes over without the scheduler (so the job's next slot goes
unclaimed: overdue) and with ``shop.send_confirmation`` too, which then
fails on an order deleted under it and retries: the page shows a failing
subscription with its error, a lagging task queue with its failing task by
name, an overdue job and both workers. Then an operator's controls: the
failing subscription paused with a reason, a job disabled and another run
by hand. It drives the admin in headless Chromium (the system's
``/usr/bin/chromium``, Debian's package, through Playwright from the test
extra; never ``playwright install``) at 1280 px and writes one PNG per page.
Takes about two and a half minutes (2 min 0-30 s measured on 2 shared
cores): the example's job runs once a minute, and the script waits for its
first run and for its next slot to go by.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "example_project"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
USER, PASSWORD = "olga", "screenshots-only-1"
ORDERS = 24  # handled before the pictures
BACKLOG = 12  # placed while only shop.count_order is served: the others wait
SKUS = ["tea", "coffee", "cocoa", "mate", "chai"]


def say(text: str) -> None:
    print(f"screenshots: {text}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshots: gave up waiting for {what} after {timeout:.0f} s")
        time.sleep(0.5)


def manage(*args: str, **kwargs) -> subprocess.Popen:
    """``example_project/manage.py <args>`` as a process of its own (it
    inherits the throwaway servers' URLs from this environment)."""
    return subprocess.Popen([sys.executable, str(EXAMPLE / "manage.py"), *args], cwd=EXAMPLE, **kwargs)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def place_orders(client, count: int, start: int = 0) -> list[int]:
    ids = []
    for n in range(start, start + count):
        body = {
            "customer": f"customer{n}@example.com",
            "sku": SKUS[n % len(SKUS)],
            "quantity": 1 + n % 3,
            "unit_price": "4.50",
        }
        response = client.post("/orders/", json.dumps(body), content_type="application/json")
        assert response.status_code == 201, response.content
        ids.append(response.json()["order_id"])
    return ids


def traffic() -> int:
    """Orders handled, two dead letters (an order deleted before its
    confirmation and its receipt ran), and a burst worker's run. Returns the
    deleted order's id."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.test import Client, override_settings

    from shop.models import Order

    # The failures below are on purpose: keep their tracebacks out of this command's output.
    logging.disable(logging.CRITICAL)
    call_command("migrate", verbosity=0, interactive=False)
    User.objects.create_superuser(USER, f"{USER}@example.com", PASSWORD)
    client = Client()
    ids = place_orders(client, ORDERS)
    gone = ids[len(ids) // 2]
    Order.objects.filter(pk=gone).delete()  # support deleted it before the confirmation and receipt ran
    # Short retries for this run only: three attempts, 0.5 s and 1 s apart.
    fast = dict(settings.PLATFORMKIT, MAX_ATTEMPTS=3, BACKOFF_SECONDS=[0.5, 1])
    with override_settings(PLATFORMKIT=fast):
        call_command("runworker", "--burst", verbosity=0)
    logging.disable(logging.NOTSET)
    return gone


def shoot(base: str, out: Path, gone: int, nats_server) -> list[Path]:
    import re

    from playwright.sync_api import Page, expect, sync_playwright

    from django_platformkit.models import DeadLetter, JobState
    from shop.models import Order

    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(20_000)
            page.goto(f"{base}/admin/login/?next=/admin/django_platformkit/overview/")
            page.fill("#id_username", USER)
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            expect(page.locator("#platformkit-subscriptions")).to_be_visible()
            expect(page.locator('#platformkit-jobs tr[data-job="shop.report_sales"]')).to_contain_text("overdue")
            expect(page.locator('#platformkit-subscriptions tr[data-why="shop.send_confirmation"]')).to_contain_text(
                "DoesNotExist"
            )

            def save(name: str, *, full_page: bool = True, shown: Page | None = None) -> None:
                shown = shown or page
                wide, window = shown.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
                if wide > window:  # the docs promise pages readable at 1280 px
                    raise SystemExit(f"screenshots: {shown.url} scrolls sideways: {wide} px wide at {window} px")
                path = out / name
                shown.screenshot(path=str(path), full_page=full_page)
                written.append(path)
                say(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")

            save("overview.png")

            # The same page in German: a browser that asks for it (Accept-Language), the
            # example project's LocaleMiddleware, the catalogue the wheel ships.
            german = browser.new_context(viewport=VIEWPORT, locale="de-DE").new_page()
            german.goto(f"{base}/admin/login/?next=/admin/django_platformkit/overview/")
            german.fill("#id_username", USER)
            german.fill("#id_password", PASSWORD)
            german.click("input[type=submit]")
            expect(german.locator('#platformkit-jobs tr[data-job="shop.report_sales"]')).to_contain_text("überfällig")
            save("overview-de.png", shown=german)
            german.context.close()

            page.locator('tr[data-why="shop.send_confirmation"] .pk-last-error a').click()
            expect(page).to_have_url(re.compile(r"/attempt/"))
            save("attempts.png", full_page=False)

            page.goto(f"{base}/admin/django_platformkit/outboxtask/")
            expect(page.locator("#result_list")).to_be_visible()
            save("tasks.png", full_page=False)

            page.goto(f"{base}/admin/django_platformkit/deadletter/")
            expect(page.locator("#result_list")).to_be_visible()
            save("dead-letters.png")

            letter = DeadLetter.objects.get(subscription="shop.send_confirmation")
            page.goto(f"{base}/admin/django_platformkit/deadletter/{letter.pk}/change/")
            expect(page.locator(".field-error_text pre")).to_contain_text("DoesNotExist")
            save("dead-letter.png")

            # The fix, then the replay: the order is back (restored from a backup).
            Order.objects.create(
                pk=gone, customer="restored@example.com", sku="tea", quantity=1, unit_price="4.50", total="4.50"
            )
            page.click("a.platformkit-replay")
            page.fill("#id_reason", f"order {gone} restored from the backup")
            save("replay-reason.png", full_page=False)
            page.click(".submit-row input[type=submit]")
            expect(page.locator("ul.messagelist li.success")).to_contain_text("Replayed 1 dead letter")
            save("replayed.png", full_page=False)

            # The operator's controls: a subscription paused with a reason...
            page.goto(f"{base}/admin/django_platformkit/overview/?refresh=0")
            page.locator('tr[data-subscription="shop.send_confirmation"] a.pk-pause').click()
            page.fill("#id_reason", "the mail relay is being moved; back at 14:00")
            page.click(".submit-row input[type=submit]")
            expect(page.locator('tr[data-why="shop.send_confirmation"]')).to_contain_text("Paused by")
            save("overview-paused.png", full_page=False)
            # ...the failing task by its dotted path, under its queue...
            page.goto(f"{base}/admin/django_platformkit/overview/?refresh=0")
            expect(page.locator("#platformkit-subscriptions tr[data-task]").first).to_be_visible()
            tasks = out / "overview-tasks.png"
            page.locator("#platformkit-subscriptions").screenshot(path=str(tasks))
            written.append(tasks)
            say(f"wrote {tasks.relative_to(ROOT) if tasks.is_relative_to(ROOT) else tasks}")
            # ...and the jobs list with a job disabled and a run asked for (no worker runs jobs now).
            page.goto(f"{base}/admin/django_platformkit/jobstate/")
            for action, job, reason in (
                ("disable_jobs", "platformkit.outbox_purge", "a big migration runs tonight"),
                ("run_now", "shop.report_sales", "the 09:00 report was lost"),
            ):
                page.locator(f'#result_list input[name="_selected_action"][value="{job}"]').check()
                page.select_option('select[name="action"]', action)
                page.click('button[name="index"]')
                page.fill("#id_reason", reason)
                page.click(".submit-row input[type=submit]")
                expect(page.locator("ul.messagelist li.success")).to_be_visible()
            expect(page.locator("#result_list")).to_contain_text("disabled")
            save("jobs.png", full_page=False)

            assert JobState.objects.filter(name="shop.report_sales").exists()
            nats_server.stop()
            page.goto(f"{base}/admin/django_platformkit/overview/")
            expect(page.locator("#platformkit-broker-down")).to_contain_text("NATS is unreachable")
            save("overview-nats-down.png")
        finally:
            browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="where the PNGs go")
    out = parser.parse_args().out.resolve()
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"screenshots: no Chromium at {CHROMIUM}: apt-get install chromium")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("DATABASE_URL", "NATS_URL", "DJANGO_SETTINGS_MODULE"):
        os.environ.pop(name, None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API runs a loop in this thread
    sys.path.insert(0, str(EXAMPLE))

    from example_project.services import throwaway_services

    with throwaway_services() as started:
        import django

        django.setup()
        say("servers: " + ", ".join(f"{s.what} {s.url}" for s in started))
        gone = traffic()

        from datetime import timedelta

        from django.test import Client

        from django_platformkit.models import Attempt, JobState

        port = free_port()
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        server = manage("runserver", f"127.0.0.1:{port}", "--noreload", **quiet)
        # One subscription served (and the relay and the scheduler): the
        # others show a backlog, the job runs, the worker is alive.
        worker = manage("runworker", "--subscription", "shop.count_order", **quiet)
        try:
            time.sleep(2)  # the worker's durables and heartbeat first
            place_orders(Client(), BACKLOG, start=ORDERS)
            say("waiting for the example's job shop.report_sales (once a minute)")
            wait_until(
                lambda: JobState.objects.filter(name="shop.report_sales", finished_at__isnull=False).exists(),
                "the job's first run",
                timeout=90,
            )
            # That worker stops (listed as stopped); the next runs no jobs, so
            # the job's next slot goes unclaimed, and serves send_confirmation too.
            stop(worker)
            worker = manage(
                "runworker",
                "--subscription",
                "shop.count_order",
                "--subscription",
                "shop.send_confirmation",
                "--no-jobs",
                **quiet,
            )
            ran = JobState.objects.get(name="shop.report_sales").last_slot
            say("waiting for the job's next slot to go unclaimed (overdue)")
            wait_until(lambda: _db_now() > ran + timedelta(seconds=60 + 12), "the job's next slot", timeout=90)
            retrying = doomed_order(Client(), start=ORDERS + BACKLOG)
            wait_until(
                lambda: Attempt.objects.filter(subscription="shop.send_confirmation", event_id=retrying).exists(),
                "send_confirmation's first failure",
                timeout=30,
            )
            wait_until(lambda: _listening(port), "runserver", timeout=30)
            nats = next(s.server for s in started if s.what == "NATS")
            written = shoot(f"http://127.0.0.1:{port}", out, gone, nats)
        finally:
            stop(worker)
            stop(server)
    say(f"{len(written)} screenshots in {out}")


def doomed_order(client, start: int):
    """An order deleted in the transaction that placed it: its confirmation
    fails (DoesNotExist) and retries, 1, 5, 15 and 30 s apart (the default
    BACKOFF_SECONDS): the pictures are taken within that minute. Returns the
    event id."""
    from django.db import transaction

    from django_platformkit.models import OutboxEvent
    from shop.models import Order

    with transaction.atomic():
        order_id = place_orders(client, 1, start=start)[0]
        Order.objects.filter(pk=order_id).delete()
    return OutboxEvent.objects.filter(name="shop.order_placed", payload__order_id=order_id).values_list(
        "id", flat=True
    )[0]


def _db_now():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    main()
