"""Periodic jobs: slots (epoch-aligned, cron across DST and leap days),
declaration errors, and once per slot across schedulers and worker
processes - with hung, failing and killed runs. Schedulers in this process
read an injected clock; the worker processes read the real one."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import zlib
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from django_platformkit.exceptions import ConfigurationError
from django_platformkit.jobs import specs as jobs_module
from django_platformkit.jobs.locks import advisory_key
from django_platformkit.jobs.scheduler import Scheduler
from django_platformkit.jobs.specs import PURGE_JOB, current_slot, job, jobs, validate_schedule
from django_platformkit.models import JobState
from tests.conftest import manage, worker_env
from tests.testapp._jobs import RUNS_TABLE, RUNS_TABLE_DDL

AMSTERDAM = ZoneInfo("Europe/Amsterdam")
db = pytest.mark.django_db(transaction=True)


class FakeClock:
    """A clock that stays where the test puts it."""

    def __init__(self, moment: datetime) -> None:
        self.moment = moment

    def now(self) -> datetime:
        return self.moment

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        self.moment += timedelta(seconds=seconds)
        return stop.is_set()


@pytest.fixture
def registry():
    """Jobs declared in a test are forgotten after it."""
    saved = dict(jobs_module._jobs)
    yield
    jobs_module._jobs.clear()
    jobs_module._jobs.update(saved)


class Runs:
    """What the in-process jobs did: (job name, slot) per run, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, datetime]] = []

    def note(self, name: str) -> None:
        with self.lock:
            self.items.append((name, current_slot()))

    def slots(self, name: str) -> list[datetime]:
        return [slot for job_name, slot in self.items if job_name == name]


@pytest.fixture
def runs(registry):
    return Runs()


def declare(runs: Runs, name: str, body=None, **schedule) -> str:
    def func():
        runs.note(name)
        if body is not None:
            body()

    func.__qualname__ = func.__name__ = name.replace(".", "_")
    job(name=name, **schedule)(func)
    return name


def tick(scheduler: Scheduler, clock: FakeClock, moment: datetime) -> None:
    """Move the clock, tick, and wait for the runs that tick started."""
    clock.moment = moment
    for thread in scheduler.tick():
        thread.join(10)
        assert not thread.is_alive(), "a job run did not finish"


def drive(
    scheduler: Scheduler, clock: FakeClock, start: datetime, end: datetime, step: timedelta = timedelta(minutes=10)
) -> None:
    moment = start
    while moment <= end:
        tick(scheduler, clock, moment)
        moment += step


def local_day(year: int, month: int, day: int, zone=AMSTERDAM) -> tuple[datetime, datetime]:
    start = datetime(year, month, day, tzinfo=zone)
    return start.astimezone(UTC), (start + timedelta(days=1)).astimezone(UTC)  # wall-clock day: 23 to 25 hours


# --- slots ---------------------------------------------------------------------


def test_every_slots_are_multiples_of_the_interval_since_the_epoch(registry):
    job(every=timedelta(minutes=7), name="testapp.seven")(lambda: None)
    spec = jobs_module._jobs["testapp.seven"]
    after = datetime(2026, 5, 1, 12, 0, 1, tzinfo=UTC)
    slot = spec.next_slot(after)
    assert (slot - datetime(1970, 1, 1, tzinfo=UTC)) % timedelta(minutes=7) == timedelta(0)
    assert after < slot <= after + timedelta(minutes=7)
    assert spec.prev_slot(slot) == slot and spec.next_slot(slot) == slot + timedelta(minutes=7)
    # A worker in another zone computes the same slot.
    assert spec.next_slot(after.astimezone(AMSTERDAM)) == slot
    assert spec.schedule_text == "every 0:07:00"


@pytest.mark.parametrize(
    ("day", "expression", "expected_local"),
    [
        ((2026, 3, 29), "30 2 * * *", ["03:00+0200"]),  # 02:30 doesn't exist: first valid time after the gap
        ((2026, 10, 25), "30 2 * * *", ["02:30+0200"]),  # 02:30 happens twice: once
        ((2026, 3, 29), "0 12 * * *", ["12:00+0200"]),
        ((2026, 10, 25), "0 12 * * *", ["12:00+0100"]),
        ((2028, 2, 29), "0 9 29 2 *", ["09:00+0100"]),
    ],
)
def test_cron_slots_in_amsterdam_across_dst_and_the_leap_day(registry, day, expression, expected_local):
    job(cron=expression, timezone="Europe/Amsterdam", name="testapp.local")(lambda: None)
    spec = jobs_module._jobs["testapp.local"]
    slots = spec.slots_between(*local_day(*day))
    assert [s.astimezone(AMSTERDAM).strftime("%H:%M%z") for s in slots] == expected_local
    assert spec.schedule_text == f"cron {expression} (Europe/Amsterdam)"


@pytest.mark.parametrize(
    ("day", "hourly", "quarterly"),
    [((2026, 3, 29), 23, 92), ((2026, 10, 25), 25, 100), ((2028, 2, 29), 24, 96)],
)
def test_interval_and_wildcard_cron_jobs_follow_real_time_on_23_and_25_hour_days(registry, day, hourly, quarterly):
    job(every=timedelta(hours=1), name="testapp.hourly")(lambda: None)
    job(cron="0 * * * *", timezone="Europe/Amsterdam", name="testapp.on_the_hour")(lambda: None)
    job(cron="*/15 * * * *", timezone="Europe/Amsterdam", name="testapp.quarterly")(lambda: None)
    window = local_day(*day)
    assert len(jobs_module._jobs["testapp.hourly"].slots_between(*window)) == hourly
    assert len(jobs_module._jobs["testapp.on_the_hour"].slots_between(*window)) == hourly
    assert len(jobs_module._jobs["testapp.quarterly"].slots_between(*window)) == quarterly


def test_the_29_february_job_waits_eight_years_across_2100(registry):
    job(cron="0 0 29 2 *", name="testapp.leap")(lambda: None)
    spec = jobs_module._jobs["testapp.leap"]
    assert spec.next_slot(datetime(2097, 1, 1, tzinfo=UTC)) == datetime(2104, 2, 29, tzinfo=UTC)
    assert spec.prev_slot(datetime(2103, 1, 1, tzinfo=UTC)) == datetime(2096, 2, 29, tzinfo=UTC)


# --- declarations ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "fragment"),
    [
        ({}, "give a schedule"),
        ({"every": timedelta(minutes=1), "cron": "* * * * *"}, "not both"),
        ({"every": 60}, "every must be a datetime.timedelta"),
        ({"every": timedelta(0)}, "at least one second"),
        ({"every": timedelta(hours=1), "timezone": "Europe/Paris"}, "applies to cron only"),
        ({"cron": "*/5 * * * * *"}, "has 6 field(s); write exactly five"),
        ({"cron": "@daily"}, "has 1 field(s)"),
        ({"cron": "0 0 L * *"}, "is not plain cron syntax"),
        ({"cron": "0 0 * * 1#2"}, "is not plain cron syntax"),
        ({"cron": "0 0 ? * *"}, "is not plain cron syntax"),
        ({"cron": "H * * * *"}, "is not plain cron syntax"),
        ({"cron": "5/15 * * * *"}, "'a/n' means different things"),
        ({"cron": "*/90 * * * *"}, "the step must be 1 to 59"),
        ({"cron": "0 22-2 * * *"}, "runs backwards"),
        ({"cron": "0 24 * * *"}, "out of range"),
        ({"cron": "0 0 */2 * mon"}, "crons disagree"),
        ({"cron": "0 0 31 2 *"}, "can never fire"),
        ({"cron": "0 0 31 4,6,9,11 *"}, "can never fire"),
        ({"cron": "0 0 * * *", "timezone": "Mars/Olympus"}, "not a time zone zoneinfo knows"),
    ],
)
def test_a_schedule_that_cant_run_is_refused_with_the_fix(registry, schedule, fragment):
    kwargs = {"every": None, "cron": None, "timezone": "UTC", **schedule}
    problems = validate_schedule(**kwargs)
    assert len(problems) == 1 and fragment in problems[0]

    def report():
        pass

    with pytest.raises(ConfigurationError, match="report") as raised:
        job(name="testapp.report", **schedule)(report)
    assert fragment in str(raised.value) and "test_scheduler" in str(raised.value)
    assert "testapp.report" not in jobs_module._jobs


def test_valid_schedules_pass_and_a_never_firing_one_is_found_quickly():
    for cron in (
        "0 0 29 2 *",
        "0 9 * * mon-fri",
        "*/5 * * * *",
        "0 0 1-31/2 * 1",
        "0 0 31 4,6 1",
        "0 0 * * 7",
        "15 2 * JAN-mar SUN",
    ):
        assert validate_schedule(every=None, cron=cron, timezone="Europe/Amsterdam") == [], cron
    assert validate_schedule(every=timedelta(seconds=1), cron=None, timezone="UTC") == []
    started = time.perf_counter()
    assert validate_schedule(every=None, cron="0 0 31 2 *", timezone="UTC")
    assert time.perf_counter() - started < 0.05


def test_two_jobs_with_one_name_are_refused_and_names_default_to_the_app_label(registry):
    def nightly():
        pass

    job(every=timedelta(days=1))(nightly)
    assert jobs_module._jobs["tests.nightly"].declared_in.endswith(
        "test_two_jobs_with_one_name_are_refused_and_names_default_to_the_app_label.<locals>.nightly"
    )

    def other():
        pass

    with pytest.raises(ConfigurationError, match="two jobs are named 'tests.nightly'"):
        job(every=timedelta(days=1), name="tests.nightly")(other)
    with pytest.raises(ConfigurationError, match="name 'not-a-name' is invalid"):
        job(every=timedelta(days=1), name="not-a-name")(other)


def test_the_registry_is_sorted_and_holds_the_hourly_purge():
    names = [spec.name for spec in jobs()]
    assert names == sorted(names)
    purge_job = next(spec for spec in jobs() if spec.name == PURGE_JOB)
    assert purge_job.every == timedelta(hours=1) and purge_job.schedule_text == "every 1:00:00"


def test_runworker_refuses_an_unknown_job():
    with pytest.raises(CommandError, match="unknown job.*testapp.nope"):
        call_command("runworker", "--job", "testapp.nope")


# --- once per slot, in this process ----------------------------------------------


@db
def test_a_cron_job_runs_once_per_minute_boundary_across_two_skewed_schedulers(runs):
    name = declare(runs, "testapp.minutely", cron="* * * * *")
    base = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)
    ahead, behind = FakeClock(base), FakeClock(base)
    a, b = Scheduler(clock=ahead, jobs=[name]), Scheduler(clock=behind, jobs=[name])
    try:
        for offset in (0, 29.6, 30.1, 60, 89.5, 90.2, 100, 130):
            tick(a, ahead, base + timedelta(seconds=offset + 0.4))
            tick(b, behind, base + timedelta(seconds=offset))
    finally:
        a.close(), b.close()
    assert runs.slots(name) == [datetime(2026, 6, 1, 12, 1, tzinfo=UTC), datetime(2026, 6, 1, 12, 2, tzinfo=UTC)]
    state = JobState.objects.get(name=name)
    assert state.last_slot == datetime(2026, 6, 1, 12, 2, tzinfo=UTC) and state.finished_at and not state.last_error


@db
def test_a_lock_alone_is_not_enough_the_ledger_skips_a_slot_already_run(runs):
    name = declare(runs, "testapp.quick", every=timedelta(seconds=1))
    base = datetime(2026, 6, 1, 12, 0, 0, 500000, tzinfo=UTC)
    fast, slow = FakeClock(base), FakeClock(base)
    a, b = Scheduler(clock=fast, jobs=[name]), Scheduler(clock=slow, jobs=[name])
    try:
        tick(a, fast, base), tick(b, slow, base)
        for step in range(1, 9):
            # a runs each slot and releases its lock before b, 0.7 s behind, gets there
            tick(a, fast, base + timedelta(seconds=step))
            tick(b, slow, base + timedelta(seconds=step - 0.7))
    finally:
        a.close(), b.close()
    slots = runs.slots(name)
    assert len(slots) == len(set(slots)) == 8


@db
def test_a_hung_job_keeps_its_lock_skips_its_slots_and_delays_no_other_job(runs, caplog):
    release = threading.Event()
    hung = declare(runs, "testapp.hung", lambda: release.wait(20), every=timedelta(seconds=1))
    quick = declare(runs, "testapp.on_time", every=timedelta(seconds=1))
    base = datetime(2026, 6, 1, 12, 0, 0, 200000, tzinfo=UTC)
    clock, other_clock = FakeClock(base), FakeClock(base)
    worker, other_worker = Scheduler(clock=clock, jobs=[hung, quick]), Scheduler(clock=other_clock, jobs=[hung, quick])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        clock.moment = other_clock.moment = base
        worker.tick(), other_worker.tick()
        for step in (1, 2, 3):
            clock.moment = base + timedelta(seconds=step)
            for thread in worker.tick():
                thread.join(0.5)
            # another worker, a little later: the hung job's lock is held there too
            tick(other_worker, other_clock, base + timedelta(seconds=step, milliseconds=300))
        assert runs.slots(hung) == [datetime(2026, 6, 1, 12, 0, 1, tzinfo=UTC)]
        assert runs.slots(quick) == [datetime(2026, 6, 1, 12, 0, s, tzinfo=UTC) for s in (1, 2, 3)]
        messages = [r.getMessage() for r in caplog.records]
        assert sum("job still running, slot skipped name=testapp.hung" in m for m in messages) == 2
        assert any("job still running in another worker, slot skipped name=testapp.hung" in m for m in messages)
        release.set()
        assert worker.join(10)
        tick(worker, clock, base + timedelta(seconds=4))
        assert runs.slots(hung)[-1] == datetime(2026, 6, 1, 12, 0, 4, tzinfo=UTC)
    finally:
        release.set()
        worker.join(10), other_worker.join(10)
        worker.close(), other_worker.close()


@db
def test_jobs_whose_names_collide_under_crc32_both_run_at_once(runs):
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    assert advisory_key("plumless") != advisory_key("buckeroo")
    both = threading.Barrier(2, timeout=10)  # each waits, holding its lock, until the other runs too
    for name in ("plumless", "buckeroo"):
        declare(runs, name, both.wait, every=timedelta(minutes=1))
    base = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)
    clock = FakeClock(base)
    scheduler = Scheduler(clock=clock, jobs=["plumless", "buckeroo"])
    try:
        tick(scheduler, clock, base)
        tick(scheduler, clock, base + timedelta(seconds=30))
    finally:
        scheduler.close()
    assert not both.broken
    assert sorted(name for name, _ in runs.items) == ["buckeroo", "plumless"]


@db
def test_a_failing_job_is_logged_recorded_and_retried_at_the_next_slot(runs, caplog):
    attempts = []

    def fail_once():
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("report server down")

    name = declare(runs, "testapp.flaky_report", fail_once, every=timedelta(minutes=5))
    base = datetime(2026, 6, 1, 12, 4, tzinfo=UTC)
    clock = FakeClock(base)
    scheduler = Scheduler(clock=clock, jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        tick(scheduler, clock, base)
        tick(scheduler, clock, base + timedelta(minutes=1))
        failed = JobState.objects.get(name=name)
        assert failed.last_error.startswith("RuntimeError: report server down") and "Traceback" in failed.last_error
        record = next(r for r in caplog.records if "job failed name=testapp.flaky_report" in r.getMessage())
        assert record.levelno == logging.ERROR and record.exc_info is not None
        tick(scheduler, clock, base + timedelta(minutes=6))
    finally:
        scheduler.close()
    assert len(attempts) == 2
    retried = JobState.objects.get(name=name)
    assert (
        retried.last_slot == datetime(2026, 6, 1, 12, 10, tzinfo=UTC)
        and retried.last_error == ""
        and retried.finished_at
    )


@db
def test_a_run_that_loses_its_database_session_logs_an_error_not_success(runs, caplog):
    def drop_my_lock_session():
        if runs.slots("testapp.loses_session")[1:]:
            return  # only the first run loses its session
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                ["platformkit job testapp.loses_session"],
            )
            assert cursor.fetchone()[0]

    name = declare(runs, "testapp.loses_session", drop_my_lock_session, every=timedelta(minutes=1))
    base = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)
    clock = FakeClock(base)
    scheduler = Scheduler(clock=clock, jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        tick(scheduler, clock, base)
        tick(scheduler, clock, base + timedelta(seconds=30))
        messages = [(r.levelno, r.getMessage()) for r in caplog.records if "testapp.loses_session" in r.getMessage()]
        assert any(level == logging.ERROR and "lost its database session" in m for level, m in messages)
        assert not any("job finished" in m for _, m in messages)
        # The next slot takes a fresh connection and runs normally.
        tick(scheduler, clock, base + timedelta(seconds=90))
    finally:
        scheduler.close()
    assert len(runs.slots(name)) == 2
    assert JobState.objects.get(name=name).last_slot == datetime(2026, 6, 1, 12, 2, tzinfo=UTC)


@db
def test_a_database_outage_is_two_log_lines_for_the_job_locks_not_an_error_per_slot(runs, caplog):
    # README "The database goes away": an outage is two log lines per
    # process. The job locks logged an ERROR at every slot of every job
    # instead: an every-second job, one error tracker alert a second.
    name = declare(runs, "testapp.outage_minutely", every=timedelta(minutes=1))
    base = datetime(2026, 6, 1, 12, 1, tzinfo=UTC)
    clock = FakeClock(base - timedelta(seconds=30))
    scheduler = Scheduler(clock=clock, jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    port = connection.settings_dict["PORT"]
    try:
        tick(scheduler, clock, base - timedelta(seconds=30))
        tick(scheduler, clock, base)  # runs 12:01 and keeps the lock connection
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                [f"platformkit job {name}"],
            )
        connection.close()
        connection.settings_dict["PORT"] = "1"  # nothing listens: every reconnect is refused
        for minute in range(1, 6):
            tick(scheduler, clock, base + timedelta(minutes=minute))
        connection.settings_dict["PORT"] = port
        tick(scheduler, clock, base + timedelta(minutes=6))
    finally:
        connection.settings_dict["PORT"] = port
        scheduler.close()
    assert len(runs.slots(name)) == 2  # the first slot and the one after the outage
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2, lines
    (start_level, start), (end_level, end) = lines
    assert start_level == logging.ERROR and "database unavailable" in start and "slots are skipped" in start
    assert end_level == logging.WARNING and end.startswith("job locks: database back after") and "skipped=5" in end


@db
def test_a_worker_starting_late_catches_up_the_newest_missed_slot_once(runs, caplog):
    hourly = declare(runs, "testapp.hourly_sync", every=timedelta(hours=1))
    strict = declare(runs, "testapp.strict_sync", every=timedelta(hours=1), grace=timedelta(minutes=5))
    fresh = declare(runs, "testapp.fresh_sync", every=timedelta(hours=1))
    for name in (hourly, strict):
        JobState.objects.create(name=name, last_slot=datetime(2026, 6, 1, 8, tzinfo=UTC))
    # No worker ran from 09:00 to 12:20: 09:00, 10:00, 11:00 and 12:00 were missed.
    clock = FakeClock(datetime(2026, 6, 1, 12, 20, tzinfo=UTC))
    scheduler = Scheduler(clock=clock, jobs=[hourly, strict, fresh])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        tick(scheduler, clock, clock.moment)
        tick(scheduler, clock, clock.moment + timedelta(minutes=1))
        assert runs.slots(hourly) == [datetime(2026, 6, 1, 12, tzinfo=UTC)]
        assert runs.slots(strict) == [] and runs.slots(fresh) == []
        # One WARNING per job, with how many: 09:00-11:00 (12:00 runs), and 09:00-12:00 past a 5-minute grace.
        skipped = [r for r in caplog.records if "missed slots skipped" in r.getMessage()]
        assert [r.levelno for r in skipped] == [logging.WARNING, logging.WARNING]
        assert "name=testapp.hourly_sync skipped=3 " in skipped[0].getMessage()
        assert "the newest runs now (catch-up)" in skipped[0].getMessage()
        assert "name=testapp.strict_sync skipped=4 " in skipped[1].getMessage()
        tick(scheduler, clock, datetime(2026, 6, 1, 13, 0, 1, tzinfo=UTC))
    finally:
        scheduler.close()
    for name in (hourly, strict, fresh):
        assert runs.slots(name)[-1] == datetime(2026, 6, 1, 13, tzinfo=UTC)


@db
@pytest.mark.parametrize(
    ("day", "hourly_runs"),
    [((2026, 3, 29), 23), ((2026, 10, 25), 25), ((2028, 2, 29), 24)],
)
def test_a_scheduler_on_an_injected_clock_runs_the_dst_and_leap_day_counts(runs, day, hourly_runs):
    night = declare(runs, "testapp.night", cron="30 2 * * *", timezone="Europe/Amsterdam")
    noon = declare(runs, "testapp.noon", cron="0 12 * * *", timezone="Europe/Amsterdam")
    leap = declare(runs, "testapp.leap_day", cron="0 9 29 2 *", timezone="Europe/Amsterdam")
    hourly = declare(runs, "testapp.every_hour", every=timedelta(hours=1))
    start, end = local_day(*day)
    clock = FakeClock(start)
    # Calendar arithmetic years ahead: the guard against clocks ahead of the database's is off.
    scheduler = Scheduler(clock=clock, jobs=[night, noon, leap, hourly], max_ahead_seconds=None)
    try:
        drive(scheduler, clock, start - timedelta(minutes=10), end + timedelta(minutes=10))
    finally:
        scheduler.close()

    def on_the_day(name):
        return [s.astimezone(AMSTERDAM) for s in runs.slots(name) if start <= s < end]

    assert len(on_the_day(hourly)) == hourly_runs
    assert [s.strftime("%H:%M") for s in on_the_day(noon)] == ["12:00"]
    assert [s.strftime("%H:%M") for s in on_the_day(night)] == (["03:00"] if day == (2026, 3, 29) else ["02:30"])
    assert [s.strftime("%m-%d %H:%M") for s in on_the_day(leap)] == (["02-29 09:00"] if day == (2028, 2, 29) else [])
    for name in (night, noon, leap, hourly):
        assert len(runs.slots(name)) == len(set(runs.slots(name)))


# --- once per slot, across worker processes -----------------------------------------


@pytest.fixture
def runs_table(django_db_blocker):
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(RUNS_TABLE_DDL)
    yield RUNS_TABLE
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {RUNS_TABLE}")


def recorded(job_name: str) -> list[tuple[datetime, int]]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT slot, pid FROM {RUNS_TABLE} WHERE job = %s ORDER BY at", [job_name])
        return cursor.fetchall()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_workers(broker, tmp_path, job_name: str, count: int):
    env = worker_env(broker, PLATFORMKIT_TEST_JOBS="1")
    logs = [tmp_path / f"worker{i}.log" for i in range(count)]
    procs = []
    for log in logs:
        with log.open("w") as stderr:
            procs.append(manage("runworker", "--no-relay", "--job", job_name, env=env, stderr=stderr))
    wait_for(lambda: all("scheduler started" in log.read_text() for log in logs), 60, "the workers' schedulers")
    return procs, logs


def stop_workers(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            raise


@pytest.mark.process
@db
def test_three_worker_processes_run_an_every_second_job_once_per_slot(broker, runs_table, tmp_path):
    name = "testapp.every_second"
    procs, logs = start_workers(broker, tmp_path, name, 3)
    try:
        watch_from = datetime.now(UTC)
        time.sleep(5)
        watch_to = datetime.now(UTC)
    finally:
        stop_workers(procs)
    assert [p.returncode for p in procs] == [0, 0, 0], [log.read_text()[-2000:] for log in logs]
    slots = [slot for slot, _ in recorded(name)]
    assert len(slots) == len(set(slots)), "a slot ran twice"
    expected = [s for s in range(int(watch_from.timestamp()) + 1, int(watch_to.timestamp()))]
    assert [int(s.timestamp()) for s in sorted(slots) if expected[0] <= s.timestamp() <= expected[-1]] == expected


@pytest.mark.process
@db
def test_a_worker_killed_mid_job_releases_its_lock_and_the_next_slots_run_once(broker, runs_table, tmp_path):
    name = "testapp.hangs_first"
    procs, logs = start_workers(broker, tmp_path, name, 2)
    key = advisory_key(name) & 0xFFFFFFFFFFFFFFFF

    def lock_holders() -> list[int]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s AND l.objsubid = 1",
                [key >> 32, key & 0xFFFFFFFF],
            )
            return [row[0] for row in cursor.fetchall()]

    try:
        wait_for(lambda: len(recorded(name)) == 1, 30, "the first run")
        hung_slot, hung_pid = recorded(name)[0]
        time.sleep(2.5)
        assert len(recorded(name)) == 1, "a slot ran while the hung run held the lock"
        assert len(lock_holders()) == 1
        hung = next(p for p in procs if p.pid == hung_pid)
        os.kill(hung_pid, signal.SIGKILL)
        hung.wait(10)
        killed_at = datetime.now(UTC)
        wait_for(lambda: not lock_holders(), 10, "the dead worker's lock to go with its connection")
        wait_for(lambda: len(recorded(name)) >= 4, 20, "three more runs")
    finally:
        stop_workers(procs)
    later = recorded(name)[1:]
    survivor = next(p for p in procs if p.pid != hung_pid)
    assert {pid for _, pid in later} == {survivor.pid}
    slots = [slot for slot, _ in recorded(name)]
    assert len(slots) == len(set(slots)) and hung_slot not in [slot for slot, _ in later]
    assert all(slot > hung_slot for slot, _ in later) and later[0][0] <= killed_at + timedelta(seconds=3)
    log = logs[procs.index(survivor)].read_text()
    assert "job still running in another worker, slot skipped name=testapp.hangs_first" in log


# --- one clock: the database's ------------------------------------------------


def _database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


@db
def test_a_worker_whose_clock_is_a_day_ahead_does_not_claim_tomorrows_slot(runs, caplog):
    name = declare(runs, "testapp.clock_ahead_probe", every=timedelta(seconds=1))
    ahead = FakeClock(_database_now() + timedelta(days=1))
    fast = Scheduler(clock=ahead, jobs=[name])
    correct = Scheduler(jobs=[name])  # the default clock: the database's
    caplog.set_level(logging.DEBUG, logger="django_platformkit")
    try:
        tick(fast, ahead, ahead.moment)
        tick(fast, ahead, ahead.moment + timedelta(seconds=1.5))  # tomorrow's slot is due on the fast clock
        assert runs.slots(name) == []
        assert not JobState.objects.filter(name=name, last_slot__isnull=False).exists(), "no slot claimed"
        warning = next(r for r in caplog.records if "ahead of the database clock" in r.getMessage())
        assert warning.levelno == logging.WARNING and f"name={name}" in warning.getMessage()
        # The correct worker still runs the slots that are due now.
        correct.tick()
        time.sleep(1.2)
        for thread in correct.tick():
            thread.join(10)
    finally:
        fast.close(), correct.close()
    assert len(runs.slots(name)) == 1
    ran = runs.slots(name)[0]
    assert abs((ran - _database_now()).total_seconds()) < 5
    assert JobState.objects.get(name=name).last_slot == ran


@db
def test_the_default_clock_reads_the_database_time():
    from django_platformkit.jobs.clocks import DatabaseClock

    clock = DatabaseClock()
    assert abs((clock.now() - _database_now()).total_seconds()) < 1.0
    assert clock.now().tzinfo is not None


@db
def test_the_database_clock_keeps_running_forward_while_the_database_cant_answer():
    # A failed re-reading must keep the offset: it moved the clock's base
    # instead, so time ran backwards (by 5 s less than the resync interval)
    # and then stood still for the whole outage.
    from django_platformkit.jobs.clocks import DatabaseClock

    clock = DatabaseClock(resync_seconds=0.2)
    before = clock.now()
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # nothing listens: a real refused connection
    try:
        readings = []
        for _ in range(4):
            time.sleep(0.3)
            readings.append(clock.now())
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port
    assert readings == sorted(readings) and readings[0] > before, (before, readings)
    assert (readings[-1] - before).total_seconds() >= 1.1, (before, readings)
    # Back: re-read on the next due resync, still on the database's time.
    time.sleep(5.1)
    assert abs((clock.now() - _database_now()).total_seconds()) < 1.0


@db
def test_a_slot_skipped_for_lateness_is_logged_at_warning_with_why(runs, caplog):
    name = declare(runs, "testapp.late_minutely", every=timedelta(minutes=1), grace=timedelta(seconds=5))
    base = datetime(2026, 6, 1, 12, 0, 30, tzinfo=UTC)
    clock = FakeClock(base)
    scheduler = Scheduler(clock=clock, jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        tick(scheduler, clock, base)
        tick(scheduler, clock, base + timedelta(minutes=3, seconds=45))  # 12:01 was due; ticking resumes at 12:04:15
    finally:
        scheduler.close()
    record = next(r for r in caplog.records if "slot skipped, too late" in r.getMessage())
    assert record.levelno == logging.WARNING and "grace=" in record.getMessage()
    # 12:01, 12:02 and 12:03 never ran, and 12:04 is past its 5 s grace: one line says four.
    assert "skipped=4 " in record.getMessage()
    assert sum("slot skipped" in r.getMessage() for r in caplog.records) == 1


@db
def test_a_job_error_holding_a_nul_is_recorded_escaped_with_its_finish(runs, caplog):
    def raise_nul():
        raise ValueError("a\x00b")

    name = declare(runs, "testapp.nul_error", raise_nul, every=timedelta(minutes=5))
    base = datetime(2026, 6, 1, 12, 4, tzinfo=UTC)
    clock = FakeClock(base)
    scheduler = Scheduler(clock=clock, jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        tick(scheduler, clock, base)
        tick(scheduler, clock, base + timedelta(minutes=1))
    finally:
        scheduler.close()
    state = JobState.objects.get(name=name)
    assert state.finished_at is not None
    assert state.last_error.startswith("ValueError: a\\x00b")
    messages = [r.getMessage() for r in caplog.records]
    assert not any("lost its database session" in m for m in messages), messages


@db
def test_a_future_slot_left_in_the_ledger_by_a_clock_ahead_is_replaced_not_respected(runs, caplog):
    name = declare(runs, "testapp.ledger_heal_probe", every=timedelta(seconds=1))
    JobState.objects.create(name=name, last_slot=_database_now() + timedelta(days=1))  # as an older build let it happen
    scheduler = Scheduler(jobs=[name])
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        scheduler.tick()
        time.sleep(1.2)
        for thread in scheduler.tick():
            thread.join(10)
    finally:
        scheduler.close()
    assert len(runs.slots(name)) == 1
    assert JobState.objects.get(name=name).last_slot == runs.slots(name)[0]
    assert any(r.levelno == logging.WARNING and "ledger held a slot ahead" in r.getMessage() for r in caplog.records)


# --- on time, by the job's own clock; skipped slots said; a failing job shown ---


@pytest.mark.process
@db
def test_a_job_never_starts_before_its_slot_by_its_own_clock(runs_table):
    """A scheduler whose view of the database's clock runs 0.3 s ahead of
    this machine's (a database server whose clock is ahead, or the estimate
    between two readings): the job still sees its slot come by its own clock."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, PLATFORMKIT_TEST_JOBS="1", PYTHONPATH=str(ROOT))
    env["PLATFORMKIT_TEST_DB_NAME"] = connection.settings_dict["NAME"]
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.ahead_scheduler", "--job", "testapp.every_second"]
        + ["--ahead-seconds", "0.3", "--seconds", "5"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT slot, seen FROM {RUNS_TABLE} WHERE job = 'testapp.every_second'")
        seen = cursor.fetchall()
    assert len(seen) >= 3, done.stderr[-3000:]
    early = [(slot, at) for slot, at in seen if at < slot]
    assert early == [], f"started before the slot by the job's clock: {early}"


@pytest.mark.process
@db
def test_a_worker_starting_after_downtime_warns_once_how_many_slots_were_skipped(broker, runs_table, tmp_path):
    name = "testapp.every_second"
    with connection.cursor() as cursor:
        cursor.execute("SELECT date_trunc('second', clock_timestamp()) - interval '20 seconds'")
        last = cursor.fetchone()[0]
    JobState.objects.create(name=name, last_slot=last)
    procs, logs = start_workers(broker, tmp_path, name, 1)
    try:
        wait_for(lambda: len(recorded(name)) >= 1, 30, "the catch-up run")
    finally:
        stop_workers(procs)
    log = logs[0].read_text()
    lines = [line for line in log.splitlines() if "missed slots skipped name=testapp.every_second" in line]
    assert len(lines) == 1 and " WARNING " in lines[0], log[-3000:]
    skipped = int(lines[0].split("skipped=")[1].split()[0])
    assert 18 <= skipped <= 40, lines[0]  # the 19 slots after the last run, and those the start-up took


@pytest.mark.process
@db
def test_a_job_that_fails_every_run_is_failing_on_the_overview_and_counted_in_its_header(
    broker, runs_table, tmp_path, admin_client
):
    from django.urls import reverse

    name = "testapp.always_fails"
    procs, logs = start_workers(broker, tmp_path, name, 1)
    try:
        wait_for(lambda: len(recorded(name)) >= 2, 30, "two failed runs")
        wait_for(lambda: JobState.objects.filter(name=name).exclude(last_error="").exists(), 30, "the error recorded")
    finally:
        stop_workers(procs)
    page = admin_client.get(reverse("admin:django_platformkit_overview")).content.decode()
    row = page.split(f'data-job="{name}"', 1)[1].split("</tr>", 1)[0]
    assert "failing" in row and "on time" not in row, row
    assert "1 job failing" in page
    listing = admin_client.get(reverse("admin:django_platformkit_jobstate_changelist")).content.decode()
    assert "pk-job-failing" in listing
