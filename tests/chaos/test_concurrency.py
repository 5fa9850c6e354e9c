"""Everything at once: two relays and three workers over the same outbox
and durables while four writers publish, and a periodic job every second
scheduled by all three workers: no effect doubled, none lost, and one job
run per slot."""

from __future__ import annotations

import psycopg
import pytest

from tests.testapp._jobs import RUNS_TABLE, RUNS_TABLE_DDL

from .harness import scaled

# 1200 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]

JOB = "testapp.every_second"


def test_two_relays_and_three_workers_with_a_periodic_job_double_nothing(make_rig, nats_server):
    events = scaled(20_000)
    rig = make_rig("relays2_workers3_job", nats_server.url, PLATFORMKIT_TEST_JOBS="1")
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        conn.execute(RUNS_TABLE_DDL)
    relays = [rig.relay(1), rig.relay(2)]
    workers = [rig.worker(i, jobs=[JOB]) for i in (1, 2, 3)]
    for process in [*relays, *workers]:
        process.wait_for_log("started")
    rig.wait_for_writers(rig.writers(4, events, seconds=24))
    tally = rig.wait_until_settled(events, timeout=900)
    for process in [*relays, *workers]:
        code, _ = process.terminate()
        assert code == 0, process.tail()
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        runs, slots, first, last, pids = conn.execute(
            f"SELECT count(*), count(DISTINCT slot), min(slot), max(slot), count(DISTINCT pid) FROM {RUNS_TABLE} WHERE job = %s",
            [JOB],
        ).fetchone()
    doubled_slots = runs - slots
    span = int((last - first).total_seconds()) + 1 if runs else 0
    rig.report(tally, extra_duplicates=doubled_slots)
    print(
        f"job {JOB}: runs={runs} slots={slots} doubled={doubled_slots} skipped={span - slots} of {span} seconds, by {pids} workers"
    )
    assert doubled_slots == 0
    assert slots >= 10, "the job hardly ran: the scheduler did not keep up"
    rig.assert_exactly_once(tally, events)
