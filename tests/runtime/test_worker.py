"""The consumer runtime's own behaviour (issue 11, issue 12 items 6 and 15),
against the real PostgreSQL and NATS: credit-based fetching, the durable's
max_ack_pending, ``runworker --processes``, SIGTERM during start-up, and a
dead worker thread ending the process instead of leaving it alive and idle.
(The named scenarios - deploys, 24 subscriptions, parked retries - are in
tests/runtime/test_scenarios.py and tests/chaos/.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
from django.db import transaction

from django_platformkit import publish
from tests.conftest import manage, run_to_exit, url_only_command, wait_for, worker_env
from tests.testapp.models import Effect

# 240 s: whole runworker lives (start, handle, drain, stop) and waits for
# ack wait and redelivery, several per test.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


def _subscription(name):
    from django_platformkit.consume.subscriptions import subscriptions

    return [s for s in subscriptions() if s.name == name]


def _ack_pending_while_draining(background_worker, subscription, ids, timeout):
    """Run a worker for ``subscription`` until its Effects cover ``ids``,
    sampling its durable's num_ack_pending every 50 ms: (worker, samples)."""
    from django_platformkit.broker.transport import Transport
    from django_platformkit.wire import durable_name

    worker = background_worker(subscriptions=_subscription(subscription))
    observer = Transport()
    observer.connect()
    try:
        effects = Effect.objects.filter(subscription=subscription)
        wait_for(effects.exists, timeout=30, what=f"the first event of {subscription}")
        seen = []
        while effects.count() < len(ids):
            seen.append(observer.consumer_info(durable_name(subscription)).num_ack_pending)
            assert time.monotonic() < worker.parts.started_at + timeout, "backlog not drained"
            time.sleep(0.05)
    finally:
        observer.close()
    assert seen, "sampled nothing"
    assert sorted(effects.values_list("event_id", flat=True)) == sorted(ids), "not handled exactly once"
    return worker, seen


def test_a_slow_handler_has_no_more_fetched_than_can_start(broker, background_worker):
    """Credit: with a 0.3 s handler (concurrency 1), the broker never shows
    more than one message of the backlog handed to the worker and unacked -
    the rest stay on the broker, where a stopping worker needn't hand them
    back and another worker can take them."""
    with transaction.atomic():
        ids = [publish("testapp.slow", {"sleep": 0.3, "n": n}) for n in range(12)]
    _, seen = _ack_pending_while_draining(background_worker, "testapp.slow", ids, timeout=60)
    # One unit of one message in flight (a delivery acked a moment late may
    # still show while the next is fetched): never the backlog.
    assert max(seen) <= 2, f"fetched ahead of the handler: num_ack_pending samples {seen}"


def test_max_ack_pending_is_the_setting_and_is_updated_in_place(broker, settings, transport, run_worker):
    """A durable created with JetStream's 1,000 gets the derived default
    (room for thousands of parked retries) in place; the setting overrides it."""
    from django_platformkit.broker.streams import RETRY_BACKLOG_HEADROOM, consumer_config

    transport.ensure_consumer(consumer_config("testapp.flaky", "testapp.flaky", max_ack_pending=1000))
    run_worker(subscriptions=_subscription("testapp.flaky"), scheduler=False)
    derived = transport.consumer_info("testapp-flaky").config.max_ack_pending
    assert derived >= RETRY_BACKLOG_HEADROOM > 1000
    settings.PLATFORMKIT = dict(broker, MAX_ACK_PENDING=5000)
    run_worker(subscriptions=_subscription("testapp.flaky"), scheduler=False)
    assert transport.consumer_info("testapp-flaky").config.max_ack_pending == 5000


def test_a_max_ack_pending_too_small_for_the_credit_and_retries_is_a_check_warning(broker, settings):
    from django_platformkit.checks.services import check_max_ack_pending

    settings.PLATFORMKIT = dict(broker, MAX_ACK_PENDING=1000, CONSUMER_BATCH_SIZE=100)
    warnings = [m for m in check_max_ack_pending() if m.id == "platformkit.W005"]
    assert warnings and "max_ack_pending=1000" in warnings[0].msg
    settings.PLATFORMKIT = dict(broker)
    assert not [m for m in check_max_ack_pending() if m.id == "platformkit.W005"]


def test_a_crashed_pool_thread_ends_the_worker_non_zero_and_unhealthy(broker, tmp_path, monkeypatch):
    """Issue 12 item 6: an exception escaping a pool thread (SystemExit too)
    must not leave a live process that no longer consumes."""
    from django_platformkit.consume.pool import ConsumerPool
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.runstate import EXIT_CRASHED
    from django_platformkit.runtime.worker import Worker

    def explode(self, consumer, deliveries, keep):
        raise SystemExit("a handler's SystemExit that got past the consumer")

    monkeypatch.setattr(ConsumerPool, "_handle", explode)
    health = tmp_path / "health.json"
    worker = Worker(
        WorkerOptions(scheduler=False, subscriptions=_subscription("testapp.record_order"), health_file=health)
    )
    result = []
    thread = threading.Thread(target=lambda: result.append(worker.run()), daemon=True)
    thread.start()
    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
    thread.join(60)
    assert not thread.is_alive(), "the worker kept running after its pool thread died"
    assert result == [EXIT_CRASHED]
    state = json.loads(health.read_text())
    assert state["healthy"] is False and state["stopped"] is True and state["crashed"]


@pytest.mark.process
def test_sigterm_during_start_up_exits_0_promptly_with_a_log_line_and_a_final_health_state(broker, tmp_path):
    """Issue 12 item 15: while the worker waits for NATS at start-up."""
    from django_platformkit.devservices import free_port

    health = tmp_path / "health.json"
    log = tmp_path / "worker.log"
    env = worker_env(broker, NATS_URL=f"nats://127.0.0.1:{free_port()}")
    with open(log, "wb") as out:
        proc = manage(
            "runworker", "--no-jobs", "--health-file", str(health), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: "waiting for NATS server at" in log.read_text(), timeout=60, what="the worker waiting for NATS"
        )
        # While it waits, the health file says so, and is rewritten every second (a probe reads its age).
        wait_for(lambda: health.exists(), timeout=10, what="the health file during start-up")
        first = json.loads(health.read_text())
        assert (first["starting"], first["healthy"], first["stopped"]) == (True, False, False)
        wait_for(
            lambda: json.loads(health.read_text())["time"] > first["time"], timeout=10, what="the health file rewritten"
        )
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log.read_text()
    assert time.monotonic() - started < 5
    assert "during start-up" in log.read_text()
    state = json.loads(health.read_text())
    assert state["healthy"] is False and state["stopped"] is True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of a dead child counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.process
def test_processes_2_start_handle_and_stop_on_one_sigterm(broker, tmp_path):
    """``runworker --processes 2``: a relay+scheduler child and two consumer
    children; events are handled exactly once; one SIGTERM to the parent
    stops every child and the parent exits 0."""
    health = tmp_path / "health.json"
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = manage(
            "runworker",
            "--processes",
            "2",
            "--no-jobs",
            "--subscription",
            "testapp.record_order",
            "--health-file",
            str(health),
            env=worker_env(broker),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        state = wait_for(
            lambda: health.exists() and json.loads(health.read_text()), timeout=60, what="the supervisor's health file"
        )
        assert set(state["children"]) == {"relay", "consumer0", "consumer1"}
        children = wait_for(
            lambda: (
                (s := json.loads(health.read_text()))
                and all(c["up"] and c["healthy"] for c in s["children"].values())
                and s["children"]
            ),
            timeout=60,
            what="every child healthy",
        )
        with transaction.atomic():
            ids = [publish("testapp.order_placed", {"n": n}) for n in range(40)]
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.record_order").count() >= len(ids),
            timeout=60,
            what="40 events handled",
        )
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0, text
    assert sorted(
        Effect.objects.filter(subscription="testapp.record_order").values_list("event_id", flat=True)
    ) == sorted(ids)
    for child in children.values():
        assert not _alive(child["pid"]), f"child {child['pid']} outlived the supervisor"
    assert "supervisor stopped exit=0" in text
    final = json.loads(health.read_text())
    assert final["healthy"] is False and final["stopped"] is True


@pytest.mark.process
def test_processes_restarts_a_child_that_dies(broker, tmp_path):
    """A consumer child SIGKILLed (an OOM kill) is restarted by the
    supervisor, and events published afterwards are handled."""
    health = tmp_path / "health.json"
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = manage(
            "runworker",
            "--processes",
            "1",
            "--no-jobs",
            "--subscription",
            "testapp.record_order",
            "--health-file",
            str(health),
            env=worker_env(broker),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def consumer_state():
            if not health.exists():
                return None
            child = json.loads(health.read_text())["children"]["consumer0"]
            return child if child["up"] and child["healthy"] else None

        first = wait_for(consumer_state, timeout=60, what="the consumer child healthy")
        os.kill(first["pid"], signal.SIGKILL)
        second = wait_for(
            lambda: (s := consumer_state()) and s["pid"] != first["pid"] and s, timeout=60, what="the child restarted"
        )
        assert second["restarts"] == 1
        with transaction.atomic():
            event = publish("testapp.order_placed", {"n": 1})
        wait_for(
            lambda: Effect.objects.filter(subscription="testapp.record_order", event_id=event).exists(),
            timeout=60,
            what="an event after the restart",
        )
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 0, text
    assert "child died role=consumer0" in text and "restarting in 1s" in text


def test_creating_a_durable_over_retained_events_warns_how_many_will_run_once(broker, transport, run_worker, caplog):
    """A new subscription on a live event replays what the stream retains:
    the worker that creates its durable says so, with the count; a worker
    that finds the durable already there does not."""
    import logging

    from django_platformkit.outbox.relay import Relay

    with transaction.atomic():
        for n in range(3):
            publish("testapp.order_placed", {"n": n})
        publish("testapp.flaky", {"n": 99})  # not on the subscription's filter: not counted
    assert Relay(transport, lanes=1).drain().stored == 4
    subscriptions = _subscription("testapp.record_order")
    with caplog.at_level(logging.WARNING, logger="django_platformkit.runtime.worker"):
        run_worker(subscriptions=subscriptions, relay=False, scheduler=False)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and "new durable" in r.getMessage()]
    message = warning.getMessage()
    assert "subscription=testapp.record_order" in message
    assert "for 3 retained message(s)" in message
    assert "docs/guide/events.md" in message
    assert Effect.objects.filter(subscription="testapp.record_order").count() == 3

    caplog.clear()
    with transaction.atomic():
        publish("testapp.order_placed", {"n": 3})
    assert Relay(transport, lanes=1).drain().stored == 1
    with caplog.at_level(logging.WARNING, logger="django_platformkit.runtime.worker"):
        run_worker(subscriptions=subscriptions, relay=False, scheduler=False)
    assert not [r for r in caplog.records if "new durable" in r.getMessage()]


def test_a_lane_of_fast_handlers_fetches_its_next_unit_as_the_running_one_ends(broker, background_worker):
    """Early fetch: with fast handlers (one ORM insert, concurrency 1), the
    next unit is fetched on the running unit's lent credit, so the lane
    doesn't wait a fetch between units - and never holds more than one unit
    beyond the running one: num_ack_pending stays within two units, and
    every event is handled exactly once."""
    from django_platformkit import conf

    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": n}) for n in range(3000)]
    worker, seen = _ack_pending_while_draining(background_worker, "testapp.record_order", ids, timeout=120)
    (lane,) = worker.pool.lanes
    assert lane.early_fetches > 0, "every unit waited for its fetch after the one before ended"
    assert max(seen) <= 2 * conf.settings.CONSUMER_BATCH_SIZE, f"fetched more than one unit ahead: {seen}"


@pytest.mark.process
def test_runworker_with_skip_checks_serves_a_subscription_only_the_urlconf_imports(broker):
    """The system checks import the URLconf, so a ``@subscribe`` in a module
    only it imports (a views.py) used to be served only when the checks
    ran: ``--skip-checks`` dropped the subscription without a word.
    runworker imports the URLconf itself."""
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    url_only_command(broker, "runworker", "--skip-checks", "--burst", "--no-jobs", "--subscription", "testapp.url_only")
    assert list(Effect.objects.filter(subscription="testapp.url_only").values_list("event_id", flat=True)) == [event_id]


@pytest.mark.process
def test_a_django_connection_pool_smaller_than_the_worker_keeps_is_refused_and_a_big_enough_one_works(broker):
    # DATABASES OPTIONS {"pool": True} is 4 connections; runworker's 4 handler
    # threads and its relay keep one each, so a thread waited for ever
    # ("couldn't get a connection", logged as a database outage) and its events stalled.
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": n}) for n in range(50)]

    def burst(pool, *args):
        env = worker_env(broker, PLATFORMKIT_TEST_DB_POOL=json.dumps(pool))
        args = args or ("--burst", "--burst-timeout", "60")
        proc = manage("runworker", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out.decode() + err.decode()

    code, output = burst({"max_size": 4, "timeout": 5})
    assert code != 0
    assert "DATABASES['default']['OPTIONS']['pool'] allows 4 connections, but this worker keeps up to 9" in output
    assert "max_size >= 9" in output
    assert not Effect.objects.exists()
    # A running worker's jobs hold one more while they run: 1 thread + 2 lanes + 4
    # (the heartbeat, reconciliation, the control watch, a job's run).
    code, output = burst({"max_size": 4, "timeout": 5}, "--subscription", "testapp.record_order")
    assert code != 0 and "allows 4 connections, but this worker keeps up to 7" in output, output
    code, output = burst({"min_size": 1, "max_size": 9, "timeout": 5})
    assert code == 0, output
    assert "couldn't get a connection" not in output
    assert Effect.objects.filter(subscription="testapp.record_order", event_id__in=ids).count() == 50


@pytest.mark.process
def test_processes_with_a_connection_pool_too_small_for_a_child_is_refused_at_once_not_restarted(broker):
    """``runworker --processes 2`` with Django's default pool (4): each
    consumer child needs 7 (4 handler threads + the heartbeat + reconciliation + the control watch). The children
    died at start-up with a traceback, were restarted 1, 2, 4 and 8 s later,
    and the supervisor gave up after five deaths: 15 s of tracebacks for what
    the single process says in one line. Now the command says it before
    forking, as the single process does."""
    env = worker_env(broker, PLATFORMKIT_TEST_DB_POOL=json.dumps({"max_size": 4, "timeout": 5}))
    started = time.monotonic()
    code, output = run_to_exit("runworker", "--processes", "2", "--no-jobs", env=env)
    assert code == 1, output
    assert "CommandError: DATABASES['default']['OPTIONS']['pool'] allows 4 connections" in output, output
    assert "max_size >= 7" in output
    assert "child started" not in output and "Traceback" not in output, output
    assert time.monotonic() - started < 20


@pytest.mark.process
def test_processes_stops_at_once_when_a_child_is_refused_by_its_configuration(broker, transport):
    """A durable that drifted (another filter subject: the worker refuses to
    touch it, ConsumerDrift) made the consumer child die, be restarted with
    backoff and die again five times, each with a traceback, before the
    supervisor gave up. No restart can fix a configuration: the supervisor
    now stops at the first such exit, exit 1, the refusal logged once."""
    from django_platformkit import conf
    from django_platformkit.broker.streams import consumer_config

    transport.ensure_consumer(consumer_config("testapp.record_order", "testapp.slow"))
    try:
        started = time.monotonic()
        code, output = run_to_exit(
            "runworker",
            "--processes",
            "1",
            "--no-jobs",
            "--no-relay",
            "--subscription",
            "testapp.record_order",
            env=worker_env(broker),
        )
    finally:
        transport.connection.call(
            transport.connection.js.delete_consumer(conf.settings.STREAM, "testapp-record_order"), timeout=10
        )
    assert code == 1, output
    assert output.count("worker child refused to run role=consumer0") == 1, output
    assert "filter_subject" in output
    assert "a restart can't fix its configuration" in output
    assert "restarting in" not in output and "Traceback" not in output, output
    assert time.monotonic() - started < 20


def test_a_stopping_worker_hands_back_its_early_fetched_unit_at_once_not_after_the_running_one(
    broker, background_worker
):
    """Stopping NAKs at once what was fetched and not started (worker.py),
    then lets the in-flight unit finish. Early fetch makes a queued unit the
    usual state of a fast lane: when the running unit turns out slow (one
    6 s event among fast ones), the unit fetched on its lent credit must go
    back to the broker when the worker is told to stop - another worker
    takes it within seconds - not when the slow handler ends."""
    from django_platformkit.consume.subscriptions import Subscription
    from django_platformkit.wire import parse_delivery

    slow_started = threading.Event()

    def handler(event):
        if event.payload.get("sleep"):
            slow_started.set()
            time.sleep(event.payload["sleep"])
        Effect.objects.create(subscription="testapp.early_handback", event_id=event.id, payload=event.payload)

    sub = Subscription(name="testapp.early_handback", event="testapp.order_placed", handler=handler)
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": n}) for n in range(600)]
        ids.append(publish("testapp.order_placed", {"n": 600, "sleep": 6.0}))
        ids += [publish("testapp.order_placed", {"n": n}) for n in range(601, 1200)]
    first = background_worker(subscriptions=[sub])
    assert slow_started.wait(60), "the slow event never started"
    (lane,) = first.pool.lanes

    def queued_ids():
        with first.pool._cond:
            return [str(parse_delivery(d).id) for unit in lane.queue for d in unit.deliveries]

    early = wait_for(queued_ids, timeout=3, interval=0.01, what="a unit fetched early behind the slow one")
    first.stop()
    stopped = time.monotonic()
    background_worker(subscriptions=[sub])  # the deploy's new worker
    effects = Effect.objects.filter(subscription="testapp.early_handback")
    wait_for(
        lambda: effects.filter(event_id__in=early).count() == len(early),
        timeout=30,
        interval=0.05,
        what="the early-fetched unit handled by the new worker",
    )
    waited = time.monotonic() - stopped
    assert waited < 3.0, f"the early-fetched unit went back only after the slow handler ended ({waited:.1f} s)"
    wait_for(lambda: effects.count() >= len(ids), timeout=60, what="every event")
    assert sorted(effects.values_list("event_id", flat=True)) == sorted(ids), "not handled exactly once"
