"""The relay under a backlog: lanes keep relay order on the wire and give
their connections back; the batch query's plan doesn't depend on table
statistics; ``runrelay --once`` counts rows not due yet apart."""

import io
import json
import signal
import subprocess
import time

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from django_platformkit.models import OutboxEvent
from django_platformkit.outbox.relay import _PLAN_SQL, _SELECT_SQL, Relay
from django_platformkit.outbox.stamp import STAMP_SQL, StampKey

pytestmark = pytest.mark.django_db(transaction=True)


def fill(rows: int) -> None:
    """``rows`` pending rows in one statement, created_at in insertion order."""
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at) "
            "SELECT gen_random_uuid(), 'testapp.order_placed', NULL, jsonb_build_object('n', g), '{}'::jsonb, clock_timestamp() "
            "FROM generate_series(1, %s) AS g",
            [rows],
        )


def stream_order(transport, broker, count: int) -> list[int]:
    """The ``n`` of every message on the stream, in stream order."""

    async def read():
        sub = await transport.connection.js.pull_subscribe(
            f"{broker['SUBJECT_PREFIX']}.>", durable=None, stream=broker["STREAM"]
        )
        seen: list[int] = []
        while len(seen) < count:
            try:
                batch = await sub.fetch(min(500, count - len(seen)), timeout=5)
            except TimeoutError:
                raise AssertionError(f"the stream ran dry after {len(seen)} of {count} messages") from None
            for msg in batch:
                seen.append(json.loads(msg.data)["data"]["n"])
                await msg.ack()  # the consumer stops delivering at max_ack_pending
        await sub.unsubscribe()
        return seen

    return transport.connection.call(read(), timeout=60)


def backend_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND backend_type = 'client backend'"
        )
        return cursor.fetchone()[0]


def test_lanes_drain_a_backlog_in_relay_order_and_close_their_connections(transport, broker):
    rows = 2_300
    fill(rows)
    before = backend_connections()
    relay = Relay(transport, batch_size=200, lanes=3)
    stats = relay.drain()
    assert (stats.selected, stats.stored, stats.temporary) == (rows, rows, 0)
    assert not OutboxEvent.objects.pending().exists()
    # Lanes overlap their acks and stamps, never their sends: the stream
    # holds the rows in (created_at, id) order, as one lane would send them.
    assert stream_order(transport, broker, rows) == list(range(1, rows + 1))
    assert transport.stream_info().state.messages == rows
    # The helper lanes' connections end with the drain.
    assert backend_connections() == before


def test_a_row_the_stream_refuses_with_a_4xx_is_dead_lettered_at_once_and_the_rows_behind_it_go_on(transport, broker):
    """README "The broker goes away": a row the broker refuses for good (a 4xx
    from the stream) is dead-lettered as platformkit.relay. Against a real
    server the stream's 400 never reached the relay: nats-py's publish_async
    reply handler raises the APIError instead of setting it on the ack's
    future, so the relay waited its whole timeout for an ack, called the
    row "not accepted for now" and sent it again on every pass, forever."""
    import time

    from django_platformkit import publish
    from django_platformkit.models import DeadLetter

    async def limit():
        config = (await transport.connection.js.stream_info(broker["STREAM"])).config
        config.max_msg_size = 2000
        await transport.connection.js.update_stream(config)

    transport.connection.call(limit(), timeout=10)
    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
        big = publish("testapp.order_placed", {"n": 2, "pad": "x" * 5000})
        publish("testapp.order_placed", {"n": 3})
    started = time.monotonic()
    stats = Relay(transport, publish_timeout_seconds=5).drain()
    assert time.monotonic() - started < 4, "the relay waited for an ack that never came"
    assert (stats.stored, stats.dead_lettered, stats.temporary) == (2, 1, 0)
    assert not OutboxEvent.objects.pending().exists()
    dead = DeadLetter.objects.get()
    assert (dead.subscription, dead.event_id) == ("platformkit.relay", big)
    assert "message size exceeds maximum allowed" in dead.error


def test_a_short_first_batch_ends_the_drain_in_one_transaction(transport, django_assert_num_queries):
    fill(5)
    relay = Relay(transport, batch_size=200, lanes=3)
    # BEGIN, plan + select (one simple query), stamp, COMMIT: no second batch, so no lane beyond the first.
    with django_assert_num_queries(4):
        assert relay.drain().stored == 5


def explain(cursor, sql: str, params: list) -> str:
    cursor.execute("EXPLAIN " + sql, params)
    return "\n".join(row[0] for row in cursor.fetchall())


def test_the_batch_query_walks_the_pending_index_and_stamps_by_tid_even_with_stale_statistics():
    # Statistics taken while the table was empty, then a burst: until
    # autovacuum analyzes again the planner believes the table is tiny.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE platformkit_outbox")
    fill(20_000)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(_PLAN_SQL)
        select_plan = explain(cursor, _SELECT_SQL, [1000])
        cursor.execute(_SELECT_SQL, [1000])
        rows = cursor.fetchall()
        ctids, ids = ['{"' + '","'.join(row[i] for row in rows) + '"}' for i in (0, 1)]
        seqs = "{" + ",".join(str(n) for n in range(1, len(rows) + 1)) + "}"
        stamp_plan = explain(cursor, STAMP_SQL[StampKey.CTID], [None, ctids, seqs])
        by_id_plan = explain(cursor, STAMP_SQL[StampKey.ID], [None, ids, seqs, ids])
        transaction.set_rollback(True)
    # Relay order straight off the partial index: no sort of the whole backlog.
    assert "Index Scan using platformkit_outbox_pending" in select_plan, select_plan
    assert "Sort" not in select_plan and "Seq Scan" not in select_plan, select_plan
    # The stamp visits exactly the locked rows, not the table, named by ctid or by id.
    assert "Tid Scan" in stamp_plan and "Seq Scan" not in stamp_plan, stamp_plan
    assert "platformkit_outbox_pkey" in by_id_plan and "Seq Scan" not in by_id_plan, by_id_plan
    # Sent as the relay sends them, in one simple query: the SELECT is planned
    # after the settings before it took effect.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"{_PLAN_SQL}; EXPLAIN {_SELECT_SQL}", [1000])
        assert cursor.nextset()
        merged_plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    assert "Index Scan using platformkit_outbox_pending" in merged_plan, merged_plan
    assert "Sort" not in merged_plan and "Seq Scan" not in merged_plan, merged_plan


def test_under_server_side_binding_the_relay_sends_its_statements_one_by_one(
    transport, settings, django_assert_num_queries
):
    """A statement can't carry another under server-side binding (and
    prepared statements): the plan settings and the batch go apart there."""
    config = connection.settings_dict
    saved = dict(config.get("OPTIONS") or {})
    connection.close()
    config["OPTIONS"] = dict(saved, server_side_binding=True, prepare_threshold=0)
    try:
        fill(5)
        with django_assert_num_queries(5):  # BEGIN, plan, select, stamp, COMMIT
            assert Relay(transport, batch_size=200).drain().stored == 5
        assert not OutboxEvent.objects.pending().exists()
    finally:
        connection.close()
        config["OPTIONS"] = saved


@pytest.fixture
def signal_handlers_restored():
    """runrelay installs SIGTERM/SIGINT handlers in this process: put pytest's back."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_runrelay_once_counts_a_row_deferred_to_later_apart_from_left_pending(broker, signal_handlers_restored):
    fill(2)
    with connection.cursor() as cursor:  # a task's run_after an hour ahead: the outbox row's not_before
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at, not_before) "
            "VALUES (gen_random_uuid(), 'testapp.order_placed', NULL, '{}'::jsonb, '{}'::jsonb, now(), now() + interval '1 hour')"
        )
    out = io.StringIO()
    call_command("runrelay", "--once", "--connect-timeout", "10", stdout=out)  # exit 0: deferred isn't a failure
    assert out.getvalue() == "relayed=2 duplicates=0 dead_lettered=0 left_pending=0 deferred=1\n"
    assert OutboxEvent.objects.pending().count() == 1


def _relay_process(broker, *args: str) -> subprocess.Popen:
    """``runrelay`` in a process of its own whose database is a closed port
    (nothing listens on 127.0.0.1:1), with a password that must not show."""
    from tests.conftest import manage, worker_env

    env = worker_env(broker, DATABASE_URL="postgres://pkrelay:s3cret-pw@127.0.0.1:1/pk_down")
    del env["PLATFORMKIT_TEST_DB_NAME"]
    return manage("runrelay", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.process
def test_runrelay_once_fails_fast_with_one_line_naming_an_unreachable_database(broker):
    """--once is a script's step: it used to retry for ~25 s before failing.
    Now one attempt, a non-zero exit and one line saying where the database
    is, without its credentials, and no traceback."""
    started = time.monotonic()
    proc = _relay_process(broker, "--once", "--skip-checks")
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 1, (out, err)
    assert took < 8, f"took {took:.1f}s"  # interpreter and Django start-up included
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "CommandError: the database at 127.0.0.1:1/pk_down is unreachable, nothing was relayed (rows stay pending): "
    ), err
    assert "Traceback" not in err and "s3cret" not in err and "pkrelay" not in err
    assert out == ""


@pytest.mark.process
def test_runrelay_without_once_keeps_waiting_for_an_unreachable_database(broker):
    proc = _relay_process(broker, "--skip-checks")
    try:
        time.sleep(4)
        assert proc.poll() is None, proc.communicate()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert "waiting for database error=" in err, err
    assert "s3cret" not in err


@pytest.mark.process
@pytest.mark.django_db(transaction=True)
def test_a_busy_relay_logs_one_info_line_per_interval_and_each_pass_at_debug(broker, tmp_path):
    """300 orders committed one by one while runrelay runs: one pass each was
    one INFO line each (203 lines); now one summary per RELAY_SUMMARY_SECONDS."""
    from django_platformkit import publish
    from tests.conftest import manage, wait_for, worker_env

    log = tmp_path / "relay.log"
    with log.open("w") as out:
        proc = manage("runrelay", env=worker_env(broker), stdout=out, stderr=out)
    try:
        wait_for(lambda: "relay started" in log.read_text(), timeout=60, what="the relay")
        started = time.monotonic()
        for n in range(300):
            with transaction.atomic():
                publish("testapp.order_placed", {"n": n})
            time.sleep(0.01)
        wait_for(lambda: not OutboxEvent.objects.filter(published_at=None).exists(), timeout=60, what="all relayed")
        elapsed = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    lines = [line for line in log.read_text().splitlines() if "relayed count=" in line]
    assert lines and all(" INFO " in line for line in lines)
    assert len(lines) <= elapsed / 10 + 2, lines  # one per 10 s interval, and the last at the stop
    assert sum(int(line.split("relayed count=")[1].split()[0]) for line in lines) == 300
