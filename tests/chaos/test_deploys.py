"""Deploys and crashes in the middle of work (issue 11): an attempt counts a
handler run, never a delivery. Real worker processes over the scenario's own
PostgreSQL and NATS, stopped with SIGTERM (a deploy) or SIGKILL (a crash, an
OOM kill); the handler's own record of each run (``testapp_attempt``) is
compared with what the worker reported (effects, dead letters)."""

from __future__ import annotations

import json
import time

import psycopg
import pytest

from tests.conftest import wait_for

from .harness import EVENT, HANDLER_TIMEOUT_SECONDS, REPORTED

# 600 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

DEPLOY_EVENT = "testapp.deploy"
DEPLOY_SUB = "testapp.deploy_step"
SCENARIOS = {"PLATFORMKIT_TEST_SCENARIOS": "1"}


def publish_rows(database_url: str, event: str, payloads: list[dict]) -> list[str]:
    """Pending outbox rows of ``event``, one per payload, in this order (what
    ``publish()`` writes, in one transaction); their ids."""
    with psycopg.connect(database_url, autocommit=True) as conn, conn.transaction():
        return [
            str(
                conn.execute(
                    "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at) "
                    "VALUES (gen_random_uuid(), %s, NULL, %s::jsonb, '{}'::jsonb, clock_timestamp()) RETURNING id",
                    [event, json.dumps(payload)],
                ).fetchone()[0]
            )
            for payload in payloads
        ]


def query(database_url: str, statement: str, params=None) -> list[tuple]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(statement, params).fetchall()


def attempts_seen(database_url: str, subscription: str) -> dict[str, list[int]]:
    """Event id -> the ``attempt`` numbers its handler saw, in run order."""
    seen: dict[str, list[int]] = {}
    for event_id, attempt in query(
        database_url,
        "SELECT event_id::text, attempt FROM testapp_attempt WHERE subscription = %s ORDER BY id",
        [subscription],
    ):
        seen.setdefault(event_id, []).append(attempt)
    return seen


def effects(database_url: str, subscription: str) -> dict[str, int]:
    return dict(
        query(
            database_url,
            "SELECT event_id::text, count(*) FROM testapp_effect WHERE subscription = %s GROUP BY 1",
            [subscription],
        )
    )


def dead_letters(database_url: str, subscription: str) -> dict[str, tuple[int, str, str]]:
    """Event id -> (attempts, error, traceback) of its dead letter."""
    rows = query(
        database_url,
        "SELECT event_id::text, attempts, error, traceback FROM platformkit_dead_letters WHERE subscription = %s",
        [subscription],
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def report(name: str, **figures) -> None:
    line = f"scenario={name} " + " ".join(f"{k}={v}" for k, v in figures.items())
    REPORTED.append(line)
    print(line, flush=True)


def restart_with_sigterm(rig, worker, times: int, *, every_seconds: float, what: str) -> list[tuple[int | None, float]]:
    """SIGTERM ``worker`` ``times`` times, ``every_seconds`` after it is at
    work (0: at once), starting it again each time; the exits (status, seconds)."""
    exits = []
    for _ in range(times):
        if every_seconds:
            worker.wait_for_log("worker started")
        time.sleep(every_seconds)
        code, seconds = worker.terminate(timeout=60)
        rig.fault(f"SIGTERM {worker.role} ({what}): exit={code} after {seconds:.1f}s")
        exits.append((code, round(seconds, 1)))
        worker.start()
    return exits


def test_three_sigterm_restarts_mid_backlog_handle_every_event_once_at_attempt_1(make_rig, nats_server):
    """A 20-event backlog of 0.3 s handlers, MAX_ATTEMPTS 3, three deploys
    in the middle: no hand-back counts, so nothing is dead-lettered and no
    handler ever sees attempt 2."""
    rig = make_rig("deploys_sigterm_x3", nats_server.url, PLATFORMKIT_TEST_MAX_ATTEMPTS="3", **SCENARIOS)
    ids = publish_rows(rig.database_url, DEPLOY_EVENT, [{"n": n, "sleep": 0.3} for n in range(20)])
    worker = rig.worker(1, subscriptions=[DEPLOY_SUB], relay=True)
    exits = restart_with_sigterm(rig, worker, 3, every_seconds=1.2, what="mid-backlog")
    wait_for(
        lambda: len(effects(rig.database_url, DEPLOY_SUB)) + len(dead_letters(rig.database_url, DEPLOY_SUB)) >= 20,
        timeout=120,
        what="every event handled or dead-lettered",
    )
    time.sleep(3)  # one ack wait more: a redelivery that would double an effect shows
    done, dead, seen = (
        effects(rig.database_url, DEPLOY_SUB),
        dead_letters(rig.database_url, DEPLOY_SUB),
        attempts_seen(rig.database_url, DEPLOY_SUB),
    )
    report(
        rig.name,
        events=20,
        faults=rig.faults,
        handled=len(done),
        duplicated=sum(n - 1 for n in done.values()),
        dead_lettered=len(dead),
        attempts_above_1=sum(a > 1 for runs in seen.values() for a in runs),
    )
    assert all(code == 0 for code, _ in exits), (exits, rig.logs())
    assert dead == {}, f"healthy events dead-lettered: {list(dead.values())[:3]}"
    assert done == dict.fromkeys(ids, 1), f"not handled exactly once: {done}"
    assert {i: seen.get(i) for i in ids} == {i: [1] for i in ids}, (
        f"attempts seen other than [1]: { {i: s for i, s in seen.items() if s != [1]} }"
    )


def test_a_hang_in_a_batch_then_sigkill_costs_the_other_events_nothing(make_rig, nats_server):
    """One handler of a backlog hangs past HANDLER_TIMEOUT_SECONDS; while it
    hangs the worker is SIGKILLed. After the restart every other event runs
    once at attempt 1; the hanging one is dead-lettered after its own runs,
    with the timeout as its error."""
    rig = make_rig("hang_then_sigkill", nats_server.url, **SCENARIOS)
    hang = HANDLER_TIMEOUT_SECONDS + 1.0
    payloads = [{"n": n, "hang": hang} if n == 3 else {"n": n, "sleep": 0.05} for n in range(40)]
    ids = publish_rows(rig.database_url, DEPLOY_EVENT, payloads)
    hanging, healthy = ids[3], [i for n, i in enumerate(ids) if n != 3]
    worker = rig.worker(1, subscriptions=[DEPLOY_SUB], relay=True)
    wait_for(
        lambda: hanging in attempts_seen(rig.database_url, DEPLOY_SUB), timeout=120, what="the hanging handler to start"
    )
    time.sleep(0.5)
    worker.kill()
    rig.fault("SIGKILL worker1 while a handler hangs")
    worker.start()
    wait_for(
        lambda: (
            len(effects(rig.database_url, DEPLOY_SUB)) >= len(healthy)
            and hanging in dead_letters(rig.database_url, DEPLOY_SUB)
        ),
        timeout=240,
        what="the healthy events handled and the hanging one dead-lettered",
    )
    time.sleep(3)
    done, dead, seen = (
        effects(rig.database_url, DEPLOY_SUB),
        dead_letters(rig.database_url, DEPLOY_SUB),
        attempts_seen(rig.database_url, DEPLOY_SUB),
    )
    report(
        rig.name,
        events=len(ids),
        faults=rig.faults,
        handled=len(done),
        dead_lettered=len(dead),
        healthy_dead_lettered=sum(i in dead for i in healthy),
        hanging_runs=len(seen.get(hanging, [])),
    )
    assert {i: dead[i][1][:120] for i in healthy if i in dead} == {}, "healthy events of the batch dead-lettered"
    assert done == dict.fromkeys(healthy, 1)
    assert {i: seen.get(i) for i in healthy} == {i: [1] for i in healthy}
    attempts, error, _ = dead[hanging]
    assert "HANDLER_TIMEOUT_SECONDS" in error, f"the hanging event's dead letter does not carry the timeout: {error!r}"
    # Its own attempts: MAX_ATTEMPTS (5) runs, counted 1..5 - the run the
    # SIGKILL cut included (a first run that lasts gets its record while it
    # runs, so its redelivery knows it started).
    runs = seen[hanging]
    assert (attempts, runs) == (5, [1, 2, 3, 4, 5]), (runs, attempts)


def test_a_real_failure_then_two_restarts_keeps_its_error_and_counts_runs_in_order(make_rig, nats_server):
    """An event whose handler raises, retried while the worker is restarted
    twice mid-backlog: the attempts it saw run 1, 2, 3 ... with no gap or
    step back, and its dead letter carries the handler's error and traceback
    after exactly MAX_ATTEMPTS (5) runs."""
    rig = make_rig("failure_then_restarts", nats_server.url, **SCENARIOS)
    payloads = [{"n": 0, "fail": True}] + [{"n": n, "sleep": 0.3} for n in range(1, 40)]
    ids = publish_rows(rig.database_url, DEPLOY_EVENT, payloads)
    failing, healthy = ids[0], ids[1:]
    worker = rig.worker(1, subscriptions=[DEPLOY_SUB], relay=True)
    wait_for(
        lambda: failing in attempts_seen(rig.database_url, DEPLOY_SUB),
        timeout=120,
        what="the first failure",
        interval=0.05,
    )
    # The first deploy lands inside the failure's 1 s backoff: what the
    # stopping worker hands back is queued for redelivery ahead of the retry,
    # so after the restart the retry sits behind the backlog - where the
    # second deploy finds it fetched and not started.
    time.sleep(0.3)
    exits = restart_with_sigterm(rig, worker, 1, every_seconds=0, what="inside the failure's backoff")
    exits += restart_with_sigterm(rig, worker, 1, every_seconds=1.5, what="with the retry fetched behind the backlog")
    wait_for(
        lambda: (
            failing in dead_letters(rig.database_url, DEPLOY_SUB)
            and len(effects(rig.database_url, DEPLOY_SUB)) + len(dead_letters(rig.database_url, DEPLOY_SUB)) >= len(ids)
        ),
        timeout=240,
        what="the failing event dead-lettered and the rest handled",
    )
    time.sleep(3)
    done, dead, seen = (
        effects(rig.database_url, DEPLOY_SUB),
        dead_letters(rig.database_url, DEPLOY_SUB),
        attempts_seen(rig.database_url, DEPLOY_SUB),
    )
    runs = seen[failing]
    report(
        rig.name,
        events=len(ids),
        faults=rig.faults,
        runs_of_failing=runs,
        healthy_dead_lettered=sum(i in dead for i in healthy),
    )
    assert all(code == 0 for code, _ in exits), exits
    attempts, error, traceback = dead[failing]
    assert runs == [1, 2, 3, 4, 5], f"the attempts the failing handler saw: {runs}"
    assert attempts == 5
    assert "scenario failure n=0" in error, f"the dead letter lost the handler's error: {error!r}"
    assert "ScenarioFailure" in traceback and "_scenarios.py" in traceback, (
        f"the dead letter lost the traceback: {traceback!r}"
    )
    assert {i: dead[i][1][:120] for i in healthy if i in dead} == {}
    assert done == dict.fromkeys(healthy, 1)


def test_a_read_only_database_window_loses_doubles_and_dead_letters_nothing(make_rig, nats_server, chaos_postgres):
    """25 s of ``default_transaction_read_only`` on the scenario's server
    (every session, at once, through a configuration reload) while a relay
    and two workers drain a backlog: no claim, stamp or dead letter can be
    written, and afterwards every event is handled once - none lost, none
    doubled, none dead-lettered."""
    events = 3000
    rig = make_rig("read_only_window", nats_server.url)
    publish_rows(rig.database_url, EVENT, [{"writer": 0, "n": n} for n in range(events // 2)])
    rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for worker in workers:
        worker.wait_for_log("worker started")
    wait_for(lambda: sum(rig.progress()[2].values()) > 0, timeout=60, what="the first effects")
    # Half the backlog a moment later, so the relay has rows pending when the window opens.
    publish_rows(rig.database_url, EVENT, [{"writer": 1, "n": n} for n in range(events - events // 2)])
    admin = psycopg.connect(chaos_postgres.url, autocommit=True)
    try:
        admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        admin.execute("SELECT pg_reload_conf()")
        rig.fault("database read-only for 25 s")
        effects_at_open = sum(rig.progress()[2].values())
        time.sleep(25)
    finally:
        admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
        admin.execute("SELECT pg_reload_conf()")
        admin.close()
    rig.fault("database writable again")
    try:
        tally = rig.wait_until_settled(events, timeout=240)
    except AssertionError:
        tally = rig.tally()  # report the figures of a run that never settled, then fail on them
    report(
        rig.name,
        events=tally.events,
        faults=rig.faults,
        lost=tally.lost,
        duplicated=tally.duplicated + tally.stray,
        dead_lettered=tally.dead_letters,
        pending=tally.pending,
        effects_at_open=effects_at_open,
    )
    assert effects_at_open < 2 * events, "the backlog was drained before the window opened: the scenario proved nothing"
    rig.assert_exactly_once(tally, events)
