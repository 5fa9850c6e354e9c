"""``manage.py demo``: the core loop once, for real, with numbers.

Migrates, places ``--orders`` orders through the real URL routing and view
(``POST /orders/`` with Django's test ``Client``: each request commits an
order and its outbox row together), runs ``runworker --burst`` (relay to
JetStream, both subscriptions' durable consumers), then counts in the
database what was published, relayed and handled for this run's orders and
fails when any number is off. Throwaway servers, when the environment names
none, are started by ``manage.py`` before the settings are read.
"""

from __future__ import annotations

import io
import json
import logging
import signal
import time
from decimal import Decimal

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, connections
from django.db.models import Count, Max
from django.test import Client

from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent, TaskResultRecord
from django_platformkit.runtime.options import WorkerOptions
from django_platformkit.runtime.worker import Worker
from example_project import services

from ...models import Confirmation, Order, OrderStats
from ...platformkit import STATS_ROW

LOG_LEVELS = {0: logging.ERROR, 1: logging.INFO, 2: logging.DEBUG}
SKUS = ["tea", "coffee", "cocoa", "mate", "chai"]


def _rate(count: int, seconds: float, unit: str) -> str:
    return f"{count / seconds:,.0f} {unit}/s" if seconds > 0 else "-"


def _pg_version() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        return cursor.fetchone()[0].split()[0]


def _db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


class Command(BaseCommand):
    help = (
        "Place N orders through POST /orders/, run the worker in burst mode and print what was published, "
        "relayed and handled, counted in the database. Without DATABASE_URL / NATS_URL, throwaway PostgreSQL "
        "and NATS servers start for the run and are deleted afterwards."
    )

    def add_arguments(self, parser):
        parser.add_argument("--orders", type=int, default=500, metavar="N", help="Orders to place (default: 500).")
        parser.add_argument(
            "--timeout",
            type=float,
            default=300.0,
            metavar="SECONDS",
            help="Fail if the burst worker has not drained everything after SECONDS (default: 300).",
        )
        parser.add_argument(
            "--keep-servers",
            action="store_true",
            help="Leave the throwaway servers running afterwards and print how to use and stop them (read by manage.py).",
        )

    def handle(self, *args, **options):
        n = options["orders"]
        if n < 1:
            raise CommandError("--orders must be at least 1.")
        # The worker's log (stderr) only from -v 2 on: errors always show.
        worker_verbosity = max(0, options["verbosity"] - 1)
        logging.getLogger("django_platformkit").setLevel(LOG_LEVELS.get(worker_verbosity, logging.DEBUG))
        out = self.stdout.write
        subs = [s.name for s in subscriptions() if s.event == "shop.order_placed"]
        out(f"django_platformkit demo: {n} orders through POST /orders/, then runrelay --once and runworker --burst")

        out("\nservices")
        for server in services.started:
            out(
                f"  {server.what:<11} {server.version:<9} {server.url:<48} throwaway, started in {server.startup_seconds:.2f} s"
            )
        names = {s.what for s in services.started}
        if "PostgreSQL" not in names:
            out(f"  {'PostgreSQL':<11} {_pg_version():<9} {services.database_url():<48} from DATABASE_URL")
        if "NATS" not in names:
            out(f"  {'NATS':<11} {'':<9} {services.nats_url():<48} from NATS_URL")

        phases: list[tuple[str, float, str]] = []

        t0 = time.monotonic()
        call_command("migrate", verbosity=0, interactive=False)
        phases.append(("migrate", time.monotonic() - t0, ""))

        stats_before = OrderStats.objects.filter(name=STATS_ROW).values("orders", "items", "revenue").first() or {
            "orders": 0,
            "items": 0,
            "revenue": Decimal(0),
        }
        order_ids, event_ids, task_ids, quantity, revenue = self._place_orders(n, phases)

        # -v 1 at least: its counts line is a result, which -v 0 silences (Django's convention).
        relay_report, seconds = self._run("runrelay", "--once", verbosity=max(1, worker_verbosity))
        logging.getLogger("django_platformkit").setLevel(LOG_LEVELS.get(worker_verbosity, logging.DEBUG))
        phases.append(
            ("runrelay --once (outbox -> JetStream)", seconds, f"{_rate(n, seconds, 'events')}  [{relay_report}]")
        )

        # What `runworker --burst` runs, through the API so its counts come back.
        started_at = _db_now()
        t0 = time.monotonic()
        worker = Worker(WorkerOptions(burst=True, burst_timeout_seconds=options["timeout"]))
        if worker.run() != 0:
            raise CommandError(f"the burst worker did not drain within {options['timeout']} s: see the log above.")
        seconds = time.monotonic() - t0
        report = " ".join(f"{k}={v}" for k, v in worker.counts().items())
        phases.append(
            (
                f"runworker --burst ({len(worker.subscriptions)} durable consumers)",
                seconds,
                f"exits once drained  [{report}]",
            )
        )
        outbox = OutboxEvent.objects.filter(id__in=event_ids)
        receipts = TaskResultRecord.objects.filter(event_id__in=task_ids, status="SUCCESSFUL")
        claims = HandledEvent.objects.filter(event_id__in=event_ids)
        last_claim = claims.aggregate(last=Max("handled_at"))["last"]
        if last_claim:
            # handled_at is the claim transaction's start (database clock),
            # so this is the time until the last handler began: close enough.
            seconds = (last_claim - started_at).total_seconds()
            phases.append(
                ("  of which handling, until the last claim", seconds, _rate(n * len(subs), seconds, "handlings"))
            )

        out(f"\n{'phase':<46} seconds  rate")
        for name, seconds, note in phases:
            out(f"  {name:<44} {seconds:7.2f}  {note}".rstrip())

        stats_after = OrderStats.objects.get(name=STATS_ROW)
        per_subscription = dict(claims.values_list("subscription").annotate(n=Count("id")))
        rows = [
            ("orders created (201 from POST /orders/)", Order.objects.filter(pk__in=order_ids).count(), n),
            ("outbox rows written by publish()", outbox.count(), n),
            ("outbox rows stamped by the relay", outbox.filter(published_at__isnull=False).count(), n),
            ("outbox rows still pending", outbox.filter(published_at__isnull=True).count(), 0),
            *((f"claims of {name}", per_subscription.get(name, 0), n) for name in subs),
            (
                "confirmation rows (shop.send_confirmation)",
                Confirmation.objects.filter(order_id__in=order_ids).count(),
                n,
            ),
            ("counter: orders added (shop.count_order)", stats_after.orders - stats_before["orders"], n),
            ("counter: items added", stats_after.items - stats_before["items"], quantity),
            ("counter: revenue added", stats_after.revenue - stats_before["revenue"], revenue),
            *(
                (
                    (
                        "send_receipt tasks enqueued (outbox rows)",
                        OutboxEvent.objects.filter(id__in=task_ids).count(),
                        n,
                    ),
                    ("send_receipt tasks SUCCESSFUL (results)", receipts.count(), n),
                )
                if task_ids
                else ()
            ),
            ("dead letters", DeadLetter.objects.filter(event_id__in=[*event_ids, *task_ids]).count(), 0),
        ]
        out(f"\ncounted in the database, for this run's {n} orders        found  expected")
        wrong = []
        for label, found, expected in rows:
            mark = "" if found == expected else "   <-- MISMATCH"
            out(f"  {label:<52} {found!s:>9} {expected!s:>9}{mark}")
            if found != expected:
                wrong.append(label)
        connections.close_all()
        if wrong:
            raise CommandError(f"demo failed: {', '.join(wrong)} differ from what was expected.")
        out(
            f"\nOK: {n} orders, each published once, relayed once and handled exactly once by each of "
            f"{len(subs)} subscriptions ({', '.join(subs)})"
            + (f"; {n} send_receipt tasks ran once each." if task_ids else ".")
        )
        if options["keep_servers"] and services.started:
            out("\nThe throwaway servers keep running. Use them from another shell with:")
            out(f"  export DATABASE_URL={services.database_url()} NATS_URL={services.nats_url()}")
            for server in services.started:
                out(f"  stop {server.what}: kill {server.server.process.pid} && rm -rf {server.server.root}")

    def _run(self, *argv: str, verbosity: int) -> tuple[str, float]:
        """``call_command(*argv)``; returns (what it printed, wall seconds)."""
        printed = io.StringIO()
        # The command installs SIGINT/SIGTERM handlers for its own loop; left
        # in place they would swallow a later Ctrl-C and orphan the servers.
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        t0 = time.monotonic()
        try:
            call_command(*argv, verbosity=verbosity, stdout=printed)
        except SystemExit as exc:
            raise CommandError(f"{argv[0]} exited with status {exc.code}: see the log above.") from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return printed.getvalue().strip(), time.monotonic() - t0

    def _place_orders(self, n: int, phases: list) -> tuple[list[int], list[str], list[str], int, Decimal]:
        """POST ``n`` orders through the real URL routing, middleware and
        view; returns (order ids, event ids, receipt task ids, total quantity, total revenue)."""
        client = Client()
        order_ids, event_ids, task_ids, quantity, revenue = [], [], [], 0, Decimal(0)
        t0 = time.monotonic()
        for i in range(n):
            body = {
                "customer": f"customer{i % 97}@example.com",
                "sku": SKUS[i % len(SKUS)],
                "quantity": 1 + i % 3,
                "unit_price": f"{3 + i % 7}.50",
            }
            response = client.post("/orders/", data=json.dumps(body), content_type="application/json")
            if response.status_code != 201:
                raise CommandError(f"POST /orders/ answered {response.status_code}: {response.content[:500]!r}")
            reply = response.json()
            order_ids.append(reply["order_id"])
            event_ids.append(reply["event_id"])
            if reply["receipt_task_id"]:  # Django 6+ (django.tasks)
                task_ids.append(reply["receipt_task_id"])
            quantity += body["quantity"]
            revenue += Decimal(body["unit_price"]) * body["quantity"]
        seconds = time.monotonic() - t0
        phases.append((f"POST /orders/ x {n} (order + publish, 1 tx)", seconds, _rate(n, seconds, "orders")))
        return order_ids, event_ids, task_ids, quantity, revenue
