"""``subscribe(..., rate_limit=...)``: handler starts across every worker
process together, never above the rate in a window of the period's length;
a subscription on the same event without a limit is not slowed. Real
PostgreSQL, NATS and worker processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from django.db import connection, transaction

from django_platformkit import conf, declare, publish, subscribe
from django_platformkit.consume.ratelimit import RateLimiter
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.devservices import free_port
from django_platformkit.exceptions import ConfigurationError
from tests.conftest import manage, run_to_exit, wait_for, worker_env
from tests.testapp.models import Effect

# 240 s: a rate limit is proven over whole periods of it (several seconds
# each), with a worker process started per test.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

EVENTS = 200
LIMIT = 20  # per second: tests/testapp/_features.py RATE_LIMIT
#: What a window may exceed the limit by (docs/guide/events.md, "Rate
#: limits"): the slots never do, but a start lags its slot by the time a pool
#: thread takes to wake and claim - milliseconds, up to ~0.1 s for a cold
#: process's first run - so a late start can share a window with later slots.
TOLERANCE = max(1, LIMIT // 10)


def starts(subscription: str) -> list[float]:
    return sorted(e.payload["started"] for e in Effect.objects.filter(subscription=subscription))


def most_in_any_window(times: list[float], seconds: float) -> int:
    """The most starts in any half-open window [t, t + seconds) (a window starting at a start is the worst)."""
    best, j = 0, 0
    for i, t in enumerate(times):
        while j < len(times) and times[j] < t + seconds:
            j += 1
        best = max(best, j - i)
    return best


@pytest.mark.process
def test_two_worker_processes_share_one_limit_and_an_unlimited_twin_is_not_slowed(broker, registries):
    from tests.testapp._features import RATE_LIMIT

    assert conf.rate("RATE_LIMIT", RATE_LIMIT).count == LIMIT
    rated = declare("testapp.rated")
    with transaction.atomic():
        for n in range(EVENTS):
            publish(rated, {"n": n})
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1")
    workers = [manage("runworker", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.rated_limited").count() >= EVENTS,
            timeout=120,
            interval=0.5,
            what="the rate-limited subscription to drain",
        )
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        for proc in workers:
            proc.wait(60)
    limited, free = starts("testapp.rated_limited"), starts("testapp.rated_free")
    assert len(limited) == EVENTS and len(free) == EVENTS  # each once
    pids = {e.payload["pid"] for e in Effect.objects.filter(subscription="testapp.rated_limited")}
    assert len(pids) == 2, "both worker processes took part"
    assert most_in_any_window(limited, 1.0) <= LIMIT + TOLERANCE
    drained = limited[-1] - limited[0]
    implied = (EVENTS - 1) / LIMIT  # evenly spaced starts: 9.95 s
    assert implied * 0.95 <= drained <= implied * 1.3, drained
    # The unlimited twin ran at its own pace: done long before the limited one.
    assert free[-1] - free[0] < implied / 2, free[-1] - free[0]


def test_the_limiter_hands_out_evenly_spaced_slots_to_every_taker():
    from django_platformkit.conf import Rate

    first = RateLimiter("testapp.spaced", Rate(10, 1.0), "default")
    second = RateLimiter("testapp.spaced", Rate(10, 1.0), "default")  # another worker's
    waits = [first.take(), second.take(), first.take(), second.take()]
    assert waits[0] == 0.0
    # 0.1 s and the margin for starts that lag their slot: 0.05 s per second, 0.105 s apart.
    assert first.spacing_seconds == pytest.approx(0.105)
    # Each later taker waits one more spacing, give or take the statements' own time.
    for n, wait in enumerate(waits[1:], start=1):
        assert n * 0.105 - 0.05 <= wait <= n * 0.105 + 0.001, waits
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM platformkit_rate_limits WHERE name = 'testapp.spaced'")
        assert cursor.fetchone()[0] == 1


def test_a_subscription_without_a_limit_has_no_limiter_and_a_bad_rate_is_refused_by_a_worker(registries):
    from django_platformkit.consume.pool import Lane

    declare("testapp.unlimited")

    @subscribe("testapp.unlimited", name="testapp.unlimited")
    def unlimited(event):
        pass

    assert Lane(get_subscription("testapp.unlimited"), []).limiter is None  # type: ignore[arg-type]
    # Not an import error (the check says it, E011); a worker started without the checks refuses it.
    subscribe("testapp.unlimited", name="testapp.bad", rate_limit="10/x")(unlimited)
    with pytest.raises(ConfigurationError, match=r"rate_limit must be a rate like '100/s', '30/m' or '1000/h'"):
        Lane(get_subscription("testapp.bad"), [])  # type: ignore[arg-type]


def test_a_limited_lane_fetches_one_delivery_per_free_slot_and_never_early(registries):
    from django_platformkit.consume.pool import ConsumerPool, Lane

    declare("testapp.limited")

    @subscribe("testapp.limited", name="testapp.limited", rate_limit="5/s", concurrency=2)
    def limited(event):
        pass

    lane = Lane(get_subscription("testapp.limited"), [object(), object()])  # type: ignore[list-item]
    lane.unit_size = 50
    lane.per_message = 0.0001
    pool = ConsumerPool(None, [lane], using="default", stop_event=threading.Event(), spawn=None)  # type: ignore[arg-type]
    assert pool._credit(lane, 100) == 1
    assert lane.early_fetch_in(1) is None


# --- how the field's tools broke on rate limits, tried here first ------------
#
# - A rate-limited unit holds a worker's slot while it waits, so unrelated work on
#   the same worker stalls (Celery: celery/celery#8119, its docs warning of
#   #10291; Sidekiq's limiter holding threads: sidekiq/sidekiq#4744).
# - A changed limit is not applied to the bucket already stored (bucket4j's
#   supplier read only for a missing key: thingsboard/tbmq#355; a cached GCRA
#   interval: scality/cloudserver#6046).
# - Work that waited out an outage runs on top of the fresh work (no turn taken again).


def start_times(path: Path, subscription: str | None = None) -> list[float]:
    """Every handler start the workers appended to ``path`` (PLATFORMKIT_TEST_STARTS_FILE), sorted."""
    lines = path.read_text().splitlines() if path.exists() else []
    return sorted(float(line.split()[0]) for line in lines if subscription is None or line.split()[2] == subscription)


def test_a_reservation_made_under_another_rate_is_judged_again_under_the_new_one():
    from django_platformkit.conf import Rate

    hourly = RateLimiter("testapp.changed", Rate(1, 3600.0), "default")
    fast = RateLimiter("testapp.changed", Rate(20, 1.0), "default")
    assert hourly.take() == 0.0
    assert 3590 < hourly.take() <= hourly.spacing_seconds  # the next start reserved an hour ahead
    # Raised to 20/s (a deploy): the last start handed out plus the new spacing, not the hour.
    assert fast.take() <= fast.spacing_seconds
    assert fast.spacing_seconds - 0.01 <= fast.take() <= 2 * fast.spacing_seconds
    # Lowered again: within one period of the new limit, counted from the last start.
    assert 3590 < hourly.take() <= hourly.spacing_seconds + 2 * fast.spacing_seconds
    # A row from before the spacing was stored: at most one new spacing away.
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_rate_limits (name, next_at, spacing_seconds) "
            "VALUES ('testapp.old_row', clock_timestamp() + interval '1 hour', NULL)"
        )
    assert RateLimiter("testapp.old_row", Rate(20, 1.0), "default").take() <= fast.spacing_seconds


def _stop(workers: list[subprocess.Popen]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in workers:
        assert proc.wait(60) == 0


@pytest.mark.process
@pytest.mark.parametrize("old", ["1/h", "2/m"])
def test_a_raised_limit_takes_effect_within_one_period_of_the_new_one(broker, registries, tmp_path, old):
    rated = declare("testapp.rated")
    events = 10
    with transaction.atomic():
        for n in range(events):
            publish(rated, {"n": n})
    log = tmp_path / "worker.log"
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1", PLATFORMKIT_TEST_RATE_LIMIT=old)
    with log.open("w") as out:
        worker = manage("runworker", "--subscription", "testapp.rated_limited", env=env, stdout=out, stderr=out)
        try:
            wait_for(lambda: len(starts("testapp.rated_limited")) >= 1, timeout=60, what="the first start")
            time.sleep(2.0)  # the next unit took its slot, an hour (or 30 s) ahead
            assert len(starts("testapp.rated_limited")) == 1
        finally:
            _stop([worker])
    # The deploy: the same subscription at 20/s.
    new = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1", PLATFORMKIT_TEST_RATE_LIMIT="20/s")
    with log.open("a") as out:
        worker = manage("runworker", "--subscription", "testapp.rated_limited", env=new, stdout=out, stderr=out)
        try:
            # Nine more starts at 20/s: half a second once the worker runs (30 s for its start-up).
            wait_for(
                lambda: len(starts("testapp.rated_limited")) >= events,
                timeout=30,
                interval=0.2,
                what=f"the backlog at the new limit ({old} -> 20/s)",
            )
        finally:
            _stop([worker])
    after = starts("testapp.rated_limited")[1:]
    assert most_in_any_window(after, 1.0) <= LIMIT, log.read_text()[-3000:]


@pytest.mark.process
@pytest.mark.django_tasks
def test_an_unlimited_subscription_and_the_default_queue_beside_limited_ones_start_at_once(
    broker, registries, tmp_path
):
    """Default settings: as many limited lanes as CONSUMER_THREADS, and two
    task queues limited to 12/m, each with a unit waiting 5 s for its turn,
    beside an unlimited subscription and the default task queue."""
    from django.conf import settings

    from tests.conftest import tasks_registered
    from tests.testapp import tasks

    throttled, prompt = declare("testapp.throttled"), declare("testapp.prompt")
    rated_tasks = {
        "default": {
            "BACKEND": "django_platformkit.tasks.OutboxBackend",
            "QUEUES": ["default", "emails", *settings.RATED_QUEUES],
            "OPTIONS": {"QUEUES": settings.RATED_QUEUES},
        }
    }
    with tasks_registered(rated_tasks), transaction.atomic():
        for n in range(3):
            publish(throttled, {"n": n})  # each limited subscription: one start now, the next in 5 s
            for queue in settings.RATED_QUEUES:
                tasks.note_start.using(queue_name=queue).enqueue(queue, time.time())
    env = worker_env(
        broker,
        PLATFORMKIT_TEST_FEATURES="1",
        PLATFORMKIT_TEST_STARVATION="1",
        PLATFORMKIT_TEST_TASKS="1",
        PLATFORMKIT_TEST_TASKS_RATED="1",
    )
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = manage("runworker", env=env, stdout=out, stderr=out)
        try:
            wait_for(
                lambda: (
                    Effect.objects.filter(subscription__startswith="testapp.throttled_").count()
                    >= conf.settings.CONSUMER_THREADS
                    and Effect.objects.filter(subscription__startswith="slow_").count() >= 2
                ),
                timeout=60,
                what="each limited subscription's and queue's first start",
            )
            time.sleep(0.5)  # their next units wait for their turns now
            published = {}
            with tasks_registered(rated_tasks):
                for n in range(20):
                    with transaction.atomic():
                        published[str(publish(prompt, {"n": n}))] = time.time()
                    tasks.note_start.enqueue("default", time.time())
                    time.sleep(0.15)
            wait_for(
                lambda: (
                    Effect.objects.filter(subscription="testapp.prompt").count() >= 20
                    and Effect.objects.filter(subscription="default").count() >= 20
                ),
                timeout=60,
                what="the unlimited subscription's events and the default queue's tasks",
            )
        finally:
            _stop([worker])
    delays = sorted(
        e.payload["started"] - published[str(e.event_id)] for e in Effect.objects.filter(subscription="testapp.prompt")
    )
    queued = sorted(e.payload["started"] - e.payload["enqueued"] for e in Effect.objects.filter(subscription="default"))
    # Relayed, fetched and started as with no limit anywhere: well under the 5 s a turn waits.
    assert delays[-1] < 1.5, (delays, log.read_text()[-3000:])
    assert queued[-1] < 1.5, (queued, log.read_text()[-3000:])


class DatabaseGate:
    """A TCP proxy between worker processes and PostgreSQL that the test
    closes: ``down()`` resets every connection through it and refuses new
    ones (the server went away), ``up()`` lets them through again."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self._up = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="database-gate", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._link, "127.0.0.1", self.port), self._loop
        ).result(10)

    def down(self) -> None:
        def close_all() -> None:
            self._up = False
            for writer in list(self._writers):
                writer.transport.abort()  # a reset, as a server that died gives

        self._loop.call_soon_threadsafe(close_all)

    def up(self) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_up", True)

    def close(self) -> None:
        self.down()
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _link(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if not self._up:
            client_w.transport.abort()
            return
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self._writers.update((client_w, server_w))
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        self._writers.difference_update((client_w, server_w))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()


@pytest.mark.process
def test_starts_after_a_database_outage_stay_within_the_rate_in_every_one_second_window(broker, registries, tmp_path):
    """Two workers, four units each in flight at 20/s; PostgreSQL goes away
    for 4 s mid-backlog. Units that waited out the outage take a fresh turn."""
    rated = declare("testapp.rated")
    events = 200
    with transaction.atomic():
        for n in range(events):
            publish(rated, {"n": n})
    settings_dict = connection.settings_dict
    gate = DatabaseGate(settings_dict["HOST"] or "127.0.0.1", int(settings_dict["PORT"] or 5432))
    password = f":{settings_dict['PASSWORD']}" if settings_dict.get("PASSWORD") else ""
    through_gate = f"postgres://{settings_dict['USER']}{password}@127.0.0.1:{gate.port}/{settings_dict['NAME']}"
    starts_file = tmp_path / "starts.txt"
    env = worker_env(
        broker,
        PLATFORMKIT_TEST_FEATURES="1",
        PLATFORMKIT_TEST_RATE_CONCURRENCY="4",
        PLATFORMKIT_TEST_STARTS_FILE=str(starts_file),
        DATABASE_URL=through_gate,
    )
    logs = [tmp_path / f"worker{n}.log" for n in range(2)]
    workers = []
    try:
        for path in logs:
            with path.open("w") as out:
                workers.append(
                    manage("runworker", "--subscription", "testapp.rated_limited", env=env, stdout=out, stderr=out)
                )
        wait_for(lambda: len(start_times(starts_file)) >= 40, timeout=90, what="the backlog under way")
        gate.down()
        went_down = time.time()
        time.sleep(4.0)
        gate.up()
        came_up = time.time()
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.rated_limited").count() >= events,
            timeout=120,
            interval=0.5,
            what="the backlog handled after the outage",
        )
        _stop(workers)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        gate.close()
    text = "".join(path.read_text() for path in logs)
    assert "database unavailable" in text or "rate limits: database" in text, text[-3000:]  # the outage happened
    times = start_times(starts_file, "testapp.rated_limited")
    assert len(times) >= events
    # The outage's excess: every window that overlaps the outage or the recovery after it (the units
    # that waited it out start again then) holds at most the rate - 28 did before.
    around = [t for t in times if went_down - 1.0 <= t <= came_up + 3.0]
    assert most_in_any_window(around, 1.0) <= LIMIT, (most_in_any_window(around, 1.0), text[-3000:])
    # Away from it, a start's lag behind its slot on a busy machine, as for any limited subscription.
    assert most_in_any_window(times, 1.0) <= LIMIT + TOLERANCE, text[-3000:]


@pytest.mark.process
@pytest.mark.parametrize("bad", ["0/s", "-1/s", "1e9/s", "10/x", ""])
def test_a_rate_that_is_no_rate_is_a_check_error_naming_the_forms_never_an_import_traceback(broker, bad):
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1", PLATFORMKIT_TEST_RATE_LIMIT=bad)
    code, output = run_to_exit("check", env=env)
    assert code == 1, output
    assert "Traceback" not in output, output
    assert f"(platformkit.E011) subscription 'testapp.rated_limited': rate_limit={bad!r} is not a rate" in output
    assert "'100/s', '30/m' or '1000/h'" in output
    # Another command runs (the declarations imported without a traceback) ...
    code, output = run_to_exit("showmigrations", "django_platformkit", "--skip-checks", env=env)
    assert code == 0 and "Traceback" not in output, output
    if bad == "10/x":
        # ... and a worker started without the checks refuses it in one line instead of running it unlimited.
        code, output = run_to_exit("runworker", "--burst", "--skip-checks", env=env, timeout=120)
        assert code == 1 and "Traceback" not in output, output
        assert "rate_limit must be a rate like '100/s'" in output
