"""Start-up refuses a stream this database must not use - limits that could
discard events nobody handled, another project's, a live copy's - in the
relay and the worker alike, naming what and the fix, relaying nothing into
it; the refusal is on the worker's heartbeat row. A running worker that
finds its stream refused (``StreamWatch``) stops the same way."""

from __future__ import annotations

import threading

import pytest
from django.db import transaction

from django_platformkit import identity, publish
from django_platformkit.broker.memory import InMemoryTransport
from django_platformkit.broker.transport import Transport
from django_platformkit.models import OutboxEvent, WorkerHeartbeat, WorkerState
from django_platformkit.runtime.startup import StartUp
from django_platformkit.runtime.streamwatch import StreamWatch
from tests.broker.test_standing import UNSAFE_LIMITS
from tests.conftest import run_to_exit, wait_for, worker_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.process
@pytest.mark.parametrize(
    ("setting", "value", "fix"),
    UNSAFE_LIMITS,
)
def test_relay_and_worker_refuse_a_stream_whose_limits_could_discard_events_and_relay_nothing(
    broker, setting, value, fix
):
    from nats.js import api

    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=identity.database_identity(), instance=identity.database_instance())

        async def edit():
            js = t.connection.js
            config = (await js.stream_info(broker["STREAM"])).config
            if setting == "retention":
                config.retention = api.RetentionPolicy(value)
                await js.delete_stream(config.name)
                await js.add_stream(config)
            else:
                setattr(config, setting, value)
                if setting == "max_age":  # NATS refuses a duplicate window longer than the max age
                    config.duplicate_window = value
                await js.update_stream(config)

        t.connection.call(edit(), timeout=10)
        with transaction.atomic():
            for n in range(3):
                publish("testapp.order_placed", {"n": n})
        for args in (["runrelay"], ["runworker", "--no-jobs"], ["runrelay", "--once"], ["runworker", "--burst"]):
            code, output = run_to_exit(*args, env=worker_env(broker), timeout=90)
            assert code == 1, (args, output)
            assert f"{setting}={value}" in output and fix in output, (args, output)
            assert "could discard events no subscription has handled" in output
        assert t.stream_info().state.messages == 0  # nothing relayed into it
        assert OutboxEvent.objects.pending().count() == 3
    finally:
        t.close()
    refused = WorkerHeartbeat.objects.filter(state=WorkerState.REFUSED)
    assert refused.exists() and all(f"{setting}={value}" in row.detail for row in refused)
    assert all(row.stopped_at is not None for row in WorkerHeartbeat.objects.all())


def test_a_running_worker_that_finds_its_stream_refused_stops_the_way_start_up_refuses(broker):
    memory = InMemoryTransport()
    ours = identity.database_identity()
    memory.ensure_stream(owner=ours, instance="1:1")
    stop = threading.Event()
    refusals: list[str] = []
    start_up = StartUp(memory, using="default", stop_event=stop, connect_timeout_seconds=1.0)
    start_up.owner, start_up.instance = ours, "1:1"
    watch = StreamWatch(memory, start_up=start_up, refuse=refusals.append, stop=stop, every_seconds=0.05)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    try:
        memory.ensure_stream(owner=ours, instance="1:2")  # a copy... refused at its start, noted on the stream
    except Exception:
        pass
    wait_for(lambda: watch.contested.is_set(), timeout=5, what="the holder to learn it is contested")
    assert "1:2" in watch.contest
    memory.edit_stream(max_msgs=300)  # an operator's edit
    wait_for(lambda: refusals, timeout=5, what="the refusal")
    thread.join(5)
    assert not thread.is_alive() and "max_msgs=300" in refusals[0]


@pytest.mark.parametrize(
    "edit", [{"max_bytes": 200_000}, {"max_msgs_per_subject": 1}, {"max_age": 15.0, "duplicate_window": 15.0}]
)
def test_a_limit_edited_while_a_worker_runs_is_learnt_from_the_advisory_within_a_second(broker, edit):
    # The look every 30 s noticed `nats stream edit` 28-30 s later: 505 of 1,000 events discarded meanwhile.
    import time

    t = Transport()
    t.connect()
    stop = threading.Event()
    refusals: list[float] = []
    try:
        start_up = StartUp(t, using="default", stop_event=stop, connect_timeout_seconds=5.0)
        start_up.owner, start_up.instance = identity.database_identity(), identity.database_instance()
        t.ensure_stream(owner=start_up.owner, instance=start_up.instance)
        watch = StreamWatch(
            t, start_up=start_up, refuse=lambda text: refusals.append(time.monotonic()), stop=stop, every_seconds=3600
        )
        thread = threading.Thread(target=watch.run, daemon=True)
        thread.start()
        time.sleep(0.5)  # its first look is done; the next periodic one is an hour away

        async def operator_edits():
            config = (await t.connection.js.stream_info(broker["STREAM"])).config
            for key, value in edit.items():
                setattr(config, key, value)
            await t.connection.js.update_stream(config)
            return time.monotonic()

        edited_at = t.connection.call(operator_edits(), timeout=10)
        assert isinstance(edited_at, float)
        wait_for(lambda: refusals, timeout=5, what="the refusal")
        assert refusals[0] - edited_at < 1.0, refusals[0] - edited_at
        thread.join(5)
        assert not thread.is_alive()
    finally:
        stop.set()
        t.close()
