"""1-2: what an event costs the request that publishes it, against the
same row written by a bare ORM insert in the same kind of transaction."""

from __future__ import annotations

import time

from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_platformkit import conf, publish, publish_many

from .benchapp.models import Row
from .benchapp.platformkit import PUBLISH
from .harness import Result, Sizes, log, ratio_result, reset_tables


def _payload(i: int) -> dict:
    return {"order_id": i, "sku": f"sku-{i}", "qty": 1, "total": "19.90"}


def _publish_rate(n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        with transaction.atomic():
            publish(PUBLISH, _payload(i))
    return n / (time.perf_counter() - started)


def _create_rate(n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        with transaction.atomic():
            Row.objects.create(name="bench.publish", payload=_payload(i))
    return n / (time.perf_counter() - started)


def _publish_many_rate(batches: int) -> float:
    started = time.perf_counter()
    for b in range(batches):
        with transaction.atomic():
            publish_many(PUBLISH, [_payload(b * 100 + i) for i in range(100)])
    return batches * 100 / (time.perf_counter() - started)


def _bulk_create_rate(batches: int) -> float:
    started = time.perf_counter()
    for b in range(batches):
        with transaction.atomic():
            Row.objects.bulk_create([Row(name="bench.publish", payload=_payload(b * 100 + i)) for i in range(100)])
    return batches * 100 / (time.perf_counter() - started)


def _interleaved(reps: int, a, b) -> tuple[list[float], list[float]]:
    """Alternate the two sides so drift on a shared machine hits both alike."""
    xs, ys = [], []
    for _ in range(reps):
        reset_tables()
        xs.append(a())
        reset_tables()
        ys.append(b())
    return xs, ys


def _statements(func) -> int:
    """Statements one call sends inside its transaction (BEGIN and COMMIT aside)."""
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        func()
    return len(captured.captured_queries)


def run_publish(sizes: Sizes) -> list[Result]:
    n = sizes.publish_events
    trips = {
        "publish": _statements(lambda: publish(PUBLISH, _payload(0))),
        "create": _statements(lambda: Row.objects.create(name="bench.publish", payload=_payload(0))),
        "publish_many_100": _statements(lambda: publish_many(PUBLISH, [_payload(i) for i in range(100)])),
        "bulk_create_100": _statements(
            lambda: Row.objects.bulk_create([Row(name="bench.publish", payload=_payload(i)) for i in range(100)])
        ),
    }
    _publish_rate(200), _create_rate(200)  # warm up connections and caches
    log(f"publish(): {n} events, one transaction each, vs Row.objects.create (x{sizes.reps})")
    ours, floor = _interleaved(sizes.reps, lambda: _publish_rate(n), lambda: _create_rate(n))
    results = [
        ratio_result(
            "publish",
            "publish() per event in atomic()",
            ours,
            floor,
            unit="events/s",
            floor_what="Model.objects.create in atomic()",
            at_least=0.85,
            note=f"RELAY_LISTEN={conf.settings.RELAY_LISTEN}; statements per event: publish() {trips['publish']}, create() {trips['create']}",
            detail={"statements": trips},
        )
    ]
    # Where the cost goes: the same publish() without the wake-up NOTIFY.
    with override_settings(PLATFORMKIT={**conf.settings.user_settings, "RELAY_LISTEN": False}):
        quiet, floor2 = _interleaved(sizes.reps, lambda: _publish_rate(n), lambda: _create_rate(n))
    results.append(
        ratio_result(
            "publish_no_notify",
            "(info) publish() with RELAY_LISTEN=False",
            quiet,
            floor2,
            unit="events/s",
            floor_what="Model.objects.create in atomic()",
            at_least=0.85,
            note="no pg_notify: poll-only relay",
        )
    )
    results[-1].target, results[-1].met = "info", None

    batches = sizes.publish_many_batches
    _publish_many_rate(5), _bulk_create_rate(5)
    log(f"publish_many(): {batches} x 100 events vs bulk_create of 100 rows (x{sizes.reps})")
    ours, floor = _interleaved(sizes.reps, lambda: _publish_many_rate(batches), lambda: _bulk_create_rate(batches))
    results.append(
        ratio_result(
            "publish_many",
            "publish_many() of 100 per atomic()",
            ours,
            floor,
            unit="events/s",
            floor_what="bulk_create(100 rows) in atomic()",
            at_least=0.8,
            note=f"statements per 100: publish_many() {trips['publish_many_100']}, bulk_create() {trips['bulk_create_100']}",
        )
    )
    reset_tables()
    return results
