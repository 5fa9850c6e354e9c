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
from django_platformkit.runtime.streamwatch import StreamWatch
from tests.broker.test_standing import UNSAFE_LIMITS
from tests.conftest import run_to_exit, wait_for, worker_env

pytestmark = pytest.mark.django_db(transaction=True)


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
    watch = StreamWatch(memory, refuse=refusals.append, stop=stop, every_seconds=0.05)
    watch.owner, watch.instance = ours, "1:1"
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
