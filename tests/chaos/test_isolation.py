"""Faults that come from neighbours and from time, not from crashes: a second
project on the same NATS with the same settings, a short purge followed by a
re-created durable, and a worker whose clock runs a day ahead. Each ends with
every event handled exactly once (or every slot run once), nothing crossing
from one project's database into the other's."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import timedelta

import psycopg
import pytest

from tests.conftest import wait_for
from tests.testapp._jobs import RUNS_TABLE_DDL

from .conftest import TEMPLATE_DB, _url
from .harness import (
    ACK_WAIT_SECONDS,
    PREFIX,
    ROOT,
    STREAM,
    SUBSCRIPTIONS,
    Process,
    Rig,
    Tally,
    consumers_idle,
    nats_call,
    scaled,
)

# 900 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


@pytest.fixture
def other_database(chaos_postgres):
    """A second project's database: migrated like the first, its own identity."""
    name = f"chaos_other_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(chaos_postgres.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    url = _url(chaos_postgres, name)
    with psycopg.connect(url, autocommit=True) as conn:
        # A database cloned from a template keeps the template's identity (it is
        # a copy of the same project); a second project's migrate makes its own.
        conn.execute("UPDATE platformkit_identity SET database_id = gen_random_uuid()")
    yield url
    with psycopg.connect(chaos_postgres.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_two_projects_on_one_nats_the_second_with_the_same_settings_is_refused_then_both_work_apart(
    make_rig, nats_server, other_database, tmp_path
):
    events = scaled(1_000)
    a = make_rig("two_projects", nats_server.url)
    a.relay()
    a_worker = a.worker(1)
    a_worker.wait_for_log("worker started")
    same = Rig(
        "two_projects_b_same", database_url=other_database, nats_urls=nats_server.url, workdir=tmp_path / "b_same"
    )
    own = Rig(
        "two_projects_b_own",
        database_url=other_database,
        nats_urls=nats_server.url,
        workdir=tmp_path / "b_own",
        PLATFORMKIT_TEST_STREAM=STREAM + "_B",
        PLATFORMKIT_TEST_PREFIX=PREFIX + "b",
    )
    try:
        # The same STREAM and SUBJECT_PREFIX as project A: refused, saying what to change.
        for refused in (same.worker(1), same.relay()):
            wait_for(lambda: not refused.running, timeout=120, what=f"{refused.role} of the second project to exit")
            assert refused.popen.returncode != 0, refused.tail()
            log = refused.log_path.read_text()
            assert "belongs to another project's database" in log, log[-3000:]
            assert "PLATFORMKIT['STREAM']" in log and "PLATFORMKIT['SUBJECT_PREFIX']" in log
        a.fault("second project started with the same settings: refused")
        # Its own stream and prefix: both projects work, and nothing crosses.
        own.relay()
        own.worker(1).wait_for_log("worker started")
        writers = a.writers(2, events, seconds=10) + own.writers(2, events, seconds=10)
        a.wait_for_writers(writers)
        tally_a = a.finish(events, timeout=300)
        tally_b = own.finish(events, timeout=300)
        assert tally_a.stray == tally_b.stray == 0
        assert a_worker.running and a_worker.generation == 1
    finally:
        same.stop_all()
        own.stop_all()


def _effects(url: str) -> tuple[int, int]:
    """(effect rows, distinct (subscription, event) pairs) of the testapp subscriptions."""
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*), count(DISTINCT (subscription, event_id)) FROM testapp_effect WHERE subscription = ANY(%s)",
            [list(SUBSCRIPTIONS)],
        ).fetchone()


def test_purge_older_than_one_second_then_durables_re_created_runs_nothing_twice(make_rig, nats_server):
    events = scaled(500)
    rig = make_rig("short_purge_durable_recreated", nats_server.url)
    rig.relay()
    worker = rig.worker(1)
    worker.wait_for_log("worker started")
    rig.wait_for_writers(rig.writers(2, events, seconds=5))
    rig.wait_until_settled(events, timeout=300)
    time.sleep(1.5)
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "manage.py"), "purgeoutbox", "--older-than", "1s"],
        env=rig.env(),
        cwd=ROOT,
        check=True,
    )
    code, _ = worker.terminate()
    assert code == 0, worker.tail()

    async def remove_durables(js):
        for sub in SUBSCRIPTIONS:
            await js.delete_consumer(STREAM, sub.replace(".", "-"))

    nats_call(rig.nats_urls, remove_durables)  # `nats consumer rm`, as the README suggests after drift
    rig.fault("purgeoutbox --older-than 1s, then every durable deleted")
    worker.start().wait_for_log("worker started")  # makes the durables again: deliver all
    wait_for(lambda: consumers_idle(rig.nats_urls), timeout=300, what="the re-created durables to deliver everything")
    time.sleep(ACK_WAIT_SECONDS + 1)
    rows, pairs = _effects(rig.database_url)
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        dead = conn.execute("SELECT count(*) FROM platformkit_dead_letters").fetchone()[0]
    tally = Tally(
        events=events,
        lost=events * len(SUBSCRIPTIONS) - pairs,
        duplicated=rows - pairs,
        pending=0,
        dead_letters=dead,
        stray=0,
    )
    rig.report(tally)
    assert (tally.lost, tally.duplicated, tally.dead_letters) == (0, 0, 0), rig.logs()


def test_a_worker_whose_clock_is_a_day_ahead_claims_no_slot_and_the_others_run_every_one(make_rig, nats_server):
    seconds = 20
    rig = make_rig("clock_ahead_worker", nats_server.url, PLATFORMKIT_TEST_JOBS="1")
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        conn.execute(RUNS_TABLE_DDL)  # the jobs' own definition of their runs table
    ahead = Process(
        rig,
        "ahead",
        [
            sys.executable,
            "-m",
            "tests.chaos.ahead_scheduler",
            "--job",
            "testapp.every_second",
            "--seconds",
            str(seconds + 5),
        ],
        rig.env(),
    )
    rig.processes.append(ahead)
    ahead.wait_for_log("scheduler started")
    rig.fault("a scheduler a day ahead")
    workers = [rig.worker(n, subscriptions=(), jobs=["testapp.every_second"]) for n in (1, 2)]
    for worker in workers:
        worker.wait_for_log("scheduler started")
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        start = conn.execute("SELECT clock_timestamp()").fetchone()[0]
    time.sleep(seconds)
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        end = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        runs = conn.execute(
            "SELECT count(*), count(DISTINCT slot), count(*) FILTER (WHERE slot > clock_timestamp()) FROM pk_test_job_runs "
            "WHERE job = 'testapp.every_second' AND slot > %s AND slot < %s",
            [start + timedelta(seconds=2), end - timedelta(seconds=2)],
        ).fetchone()
    expected = int((end - start).total_seconds()) - 4
    total, distinct, future = runs
    tally = Tally(
        events=expected,
        lost=max(0, expected - distinct),
        duplicated=total - distinct + future,
        pending=0,
        dead_letters=0,
        stray=0,
    )
    rig.report(tally)
    assert future == 0 and total == distinct, runs
    assert distinct >= expected - 3, (runs, expected, rig.logs())  # a loaded two-core machine may pause a tick or two
    assert "ahead of the database clock" in ahead.log_path.read_text()
