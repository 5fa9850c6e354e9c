"""The ways JetStream dropped messages the outbox still held (issue 32),
each re-run with real writer, relay and worker processes over a database
and a NATS server of the scenario's own: a limit edited while the relay
runs, a shortened ``max_age``, ``stream prune`` from settings that lack an
app, ``stream reset`` of the project's own stream, and an ``interest``
stream. Each ends with every event handled exactly once by every
subscription (0 lost, 0 doubled), the workers' reconciliation having sent
again what the broker dropped, and its WARNING naming the cause; each verb
that drops unread messages refused first, naming the counts.

The workers reconcile every 5 s here (``PLATFORMKIT_TEST_RECONCILE_INTERVAL``)
instead of 60, so a scenario doesn't wait out a minute per pass."""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime

import psycopg
import pytest

from tests.conftest import wait_for

from .harness import EVENT, PREFIX, SUBSCRIPTIONS, Process, Rig, nats_call, scaled

# 1200 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]

FAST = {"PLATFORMKIT_TEST_RECONCILE_INTERVAL": "5"}


def relayed(rig: Rig) -> int:
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM platformkit_outbox WHERE name = %s AND published_at IS NOT NULL", [EVENT]
        ).fetchone()[0]


def stream_messages(rig: Rig) -> int:
    async def count(js):
        return (await js.stream_info(rig.stream)).state.messages

    return nats_call(rig.nats_urls, count)


def edit_stream(rig: Rig, **settings) -> float:
    """``nats stream edit`` as a platform team might: returns when the edit was sent (unix seconds)."""

    async def edit(js):
        config = (await js.stream_info(rig.stream)).config
        for key, value in settings.items():
            setattr(config, key, value)
        sent = time.time()
        await js.update_stream(config)
        return sent

    sent: float = nats_call(rig.nats_urls, edit)
    return sent


def run(rig: Rig, role: str, *args: str, **env: str) -> tuple[int, str]:
    """A management command of the operator's, to its end: (exit status, its output)."""
    process = Process(rig, role, [sys.executable, "tests/manage.py", *args], rig.env(**env))
    rig.processes.append(process)
    wait_for(lambda: not process.running, timeout=120, what=role)
    return process.popen.returncode, process.log_path.read_text(errors="replace")


def logged_at(process: Process, text: str) -> float:
    """When ``process`` first logged a line containing ``text`` (unix seconds, from its log's timestamp)."""
    for line in process.log_path.read_text(errors="replace").splitlines():
        if text in line:
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            assert stamp, line
            return datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()
    raise AssertionError(f"{process.role} never logged {text!r}:\n{process.tail()}")


def reconciled(rig: Rig, *causes: str) -> str:
    """The workers' reconciliation WARNING naming one of ``causes``: every one re-sent to its subscriptions only."""
    lines = [
        line
        for p in rig.processes
        for line in p.log_path.read_text(errors="replace").splitlines()
        if "WARNING" in line and "reconciliation re-sent" in line
    ]
    named = [line for line in lines if any(f"{cause}=" in line for cause in causes)]
    assert named, (causes, lines, rig.logs())
    return named[0]


def started_once(rig: Rig) -> list[Process]:
    """Two workers started and stopped: their durables exist, the subscriptions began (their origins recorded)."""
    workers = [rig.worker(1), rig.worker(2)]
    for worker in workers:
        worker.wait_for_log("worker started")
    for worker in workers:
        assert worker.terminate()[0] == 0, worker.tail()
    return workers


@pytest.mark.parametrize(("setting", "value"), [("max_bytes", 150_000), ("max_msgs_per_subject", 1)])
def test_a_limit_edited_while_the_relay_runs_stops_it_at_once_and_what_it_discarded_is_sent_again(
    make_rig, nats_server, setting, value
):
    # Measured: 505 (max_bytes) and 997 (max_msgs_per_subject) of 1,000 events never handled; the
    # stream watch stopped the relay 28-30 s after the edit and nothing said what was discarded.
    events = scaled(1_000)
    rig = make_rig(f"limit_{setting}", nats_server.url, **FAST)
    workers = started_once(rig)  # then down: what the relay sends piles up unread
    relay = rig.relay()
    relay.wait_for_log("worker started")
    writers = rig.writers(2, events, seconds=10)
    wait_for(lambda: relayed(rig) >= events // 2, timeout=120, what="half the events relayed")
    edited_at = edit_stream(rig, **{setting: value})
    rig.fault(f"nats stream edit --{setting} {value} while relaying")
    wait_for(lambda: not relay.running, timeout=30, what="the relay to stop")
    assert relay.popen.returncode == 1, relay.tail()
    stopped_within = logged_at(relay, "stream refused while running") - edited_at
    assert stopped_within < 1.0, (stopped_within, relay.tail())
    assert f"{setting}={value}" in relay.log_path.read_text()
    rig.wait_for_writers(writers)
    code, out = run(rig, "update", "stream", "update")  # the operator lifts it
    assert code == 0 and f"{setting}: {value} -> unlimited" in out, out
    relay.start()
    for worker in workers:
        worker.start()
    tally = rig.finish(events, timeout=600)
    assert tally.lost == tally.duplicated == 0
    # max_bytes drops the oldest (below the first sequence); max_msgs_per_subject each subject's older
    # messages: below the first sequence of the three subjects' last, or between them.
    line = reconciled(rig, *(["discarded"] if setting == "max_bytes" else ["deleted", "discarded"]))
    print(f"stopped within {stopped_within:.3f} s of the edit; {line}", flush=True)


def test_a_shortened_max_age_is_refused_at_once_and_what_aged_out_is_sent_again(make_rig, nats_server):
    # Measured: max_age 15 s was only "stream drift"; 300 of 300 events aged out before a worker started.
    events = scaled(300)
    rig = make_rig("max_age", nats_server.url, **FAST)
    workers = started_once(rig)
    relay = rig.relay()
    relay.wait_for_log("worker started")
    rig.wait_for_writers(rig.writers(1, events, seconds=2))
    wait_for(lambda: relayed(rig) == events, timeout=60, what="every event relayed")
    edit_stream(rig, max_age=15.0, duplicate_window=15.0)
    rig.fault("nats stream edit --max-age 15s")
    wait_for(lambda: not relay.running, timeout=30, what="the relay to stop")
    assert "max_age=15: messages older than 15 s are discarded" in relay.log_path.read_text(), relay.tail()
    wait_for(lambda: stream_messages(rig) == 0, timeout=60, what="every message to age out")
    refused = rig.worker(3)  # a worker started now is refused, naming the fix
    wait_for(lambda: not refused.running, timeout=60, what="the worker to be refused")
    assert "`manage.py stream update` lengthens it to RETENTION_DAYS" in refused.log_path.read_text()
    code, out = run(rig, "update", "stream", "update")
    assert code == 0 and "max_age: 15 s -> 604800 s (RETENTION_DAYS)" in out, out
    relay.start()
    for worker in workers:
        worker.start()
    rig.finish(events, timeout=600)
    reconciled(rig, "discarded")


def test_prune_from_settings_lacking_an_app_is_refused_and_when_forced_nothing_is_lost(make_rig, nats_server):
    # Measured: a management container missing an app deleted two live durables without asking; the
    # backfill=False one was made again from "now": 489 of 650 events never ran it.
    events = scaled(650)
    subs = (*SUBSCRIPTIONS, "testapp.record_order_from_now")
    rig = make_rig("prune_without_an_app", nats_server.url, subscriptions=subs, PLATFORMKIT_TEST_FROM_NOW="1", **FAST)
    rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for worker in workers:
        worker.wait_for_log("worker started")
    writers = rig.writers(2, events, seconds=15)
    time.sleep(4)
    without_the_app = {"PLATFORMKIT_TEST_FROM_NOW": ""}
    code, out = run(rig, "prune", "stream", "prune", **without_the_app)
    assert code == 1 and "stream prune refused, nothing deleted" in out, out
    assert "testapp-record_order_from_now (pending " in out and "--yes" in out
    for worker in workers:  # a deploy: the durables' backlog grows meanwhile
        worker.terminate()
    time.sleep(2)
    code, out = run(rig, "prune_yes", "stream", "prune", "--yes", **without_the_app)  # the operator insists
    assert code == 0 and "deleted testapp-record_order_from_now" in out, out
    rig.fault("stream prune --yes from settings without the app: a backfill=False durable with a backlog deleted")
    time.sleep(2)  # relayed with no durable of its own
    for worker in workers:
        worker.start()  # they make it again from "now": its backlog and what came meanwhile never reach it
    rig.wait_for_writers(writers)
    tally = rig.finish(events, timeout=600)
    assert tally.handled["testapp.record_order_from_now"] == events
    reconciled(rig, "durable_remade")


def test_reset_of_the_projects_own_stream_says_how_many_are_unhandled_and_they_are_sent_again(make_rig, nats_server):
    # Measured: `stream reset --yes` deleted 500 unhandled events; the output said only how many messages went.
    events = scaled(500)
    rig = make_rig("reset_own_stream", nats_server.url, **FAST)
    workers = started_once(rig)
    relay = rig.relay()
    relay.wait_for_log("worker started")
    rig.wait_for_writers(rig.writers(2, events, seconds=3))
    wait_for(lambda: relayed(rig) == events, timeout=60, what="every event relayed")
    code, out = run(rig, "reset", "stream", "reset", "--yes")
    assert code == 1, out
    assert f"have not handled {2 * events:,} message(s) between them" in out, out
    assert "reconciliation sends every event a subscription has not handled again" in out
    assert stream_messages(rig) == events  # nothing deleted
    code, out = run(rig, "reset_discard", "stream", "reset", "--yes", "--discard-unhandled")
    assert code == 0 and f"with {events:,} message(s)" in out and "reconciliation sends the events" in out, out
    rig.fault("stream reset --yes --discard-unhandled of the project's own stream")
    for worker in workers:
        worker.start()
    rig.finish(events, timeout=600)
    reconciled(rig, "stream_replaced")


def test_an_interest_stream_is_refused_naming_the_way_out_that_works_and_it_loses_nothing(make_rig, nats_server):
    # Measured: 1,000 events stuck in an interest stream; the refusal said to wait for the durables to drain,
    # which no refused worker can make happen. `stream reset` then `republish` recovered them: nothing said so.
    from nats.js import api

    events = scaled(1_000)
    rig = make_rig("interest_retention", nats_server.url, **FAST)
    workers = started_once(rig)

    async def made_again_with_interest_retention(js):  # as `nats stream add --retention interest` would
        config = (await js.stream_info(rig.stream)).config
        await js.delete_stream(rig.stream)
        config.retention, config.description = api.RetentionPolicy.INTEREST, None
        await js.add_stream(config)
        for sub in SUBSCRIPTIONS:
            await js.add_consumer(
                rig.stream,
                api.ConsumerConfig(
                    durable_name=sub.replace(".", "-"),
                    description=f"django_platformkit subscription {sub}",
                    filter_subject=f"{PREFIX}.*.{EVENT}",
                    ack_policy=api.AckPolicy.EXPLICIT,
                    deliver_policy=api.DeliverPolicy.ALL,
                    max_deliver=-1,
                ),
            )

    nats_call(rig.nats_urls, made_again_with_interest_retention)
    rig.fault("stream made again with interest retention")
    rig.wait_for_writers(rig.writers(2, events, seconds=3))
    old = Process(rig, "oldrelay", [sys.executable, "-m", "tests.chaos.oldrelay"], rig.env())  # an older build's relay
    rig.processes.append(old)
    wait_for(lambda: not old.running, timeout=120, what="the old relay")
    assert f"relayed={events}" in old.log_path.read_text(), old.tail()
    refused = rig.worker(3)
    wait_for(lambda: not refused.running, timeout=60, what="the worker to be refused")
    text = refused.log_path.read_text()
    assert "retention=interest" in text and "`manage.py stream reset --yes --discard-unhandled`" in text, text
    code, out = run(rig, "reset", "stream", "reset", "--yes")
    assert code == 1 and "--discard-unhandled" in out, out
    code, out = run(rig, "reset_discard", "stream", "reset", "--yes", "--discard-unhandled")
    assert code == 0, out
    rig.relay()
    for worker in workers:
        worker.start()
    rig.finish(events, timeout=600)
    reconciled(rig, "stream_replaced")
