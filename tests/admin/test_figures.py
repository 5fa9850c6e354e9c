"""What the overview's figures give the console about the stream and the
workers (``admin.figures.collect``), against real PostgreSQL and NATS: the
stream's limits that could discard unhandled events and a live copy of this
database, each with its fix, and every worker's state from its heartbeat row."""

from __future__ import annotations

import pytest

from django_platformkit import identity
from django_platformkit.admin import figures as overview
from django_platformkit.broker.transport import Transport
from django_platformkit.models import WorkerState
from django_platformkit.runtime.heartbeat import Heartbeat

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def held(broker):
    """The stream, made and held by this database; a transport on it."""
    t = Transport()
    t.connect()
    t.ensure_stream(owner=identity.database_identity(), instance=identity.database_instance())
    yield t
    t.close()


def test_a_healthy_stream_has_no_problem_and_no_conflict(held):
    result = overview.collect()
    assert result.broker_ok and result.stream_standing is not None and result.stream_standing.exists
    assert (result.stream_problems, result.identity_conflict) == ([], "")


def test_a_limit_that_could_discard_unhandled_events_is_listed_with_its_fix(held, broker):
    async def limit():
        config = (await held.connection.js.stream_info(broker["STREAM"])).config
        config.max_bytes = 200_000
        await held.connection.js.update_stream(config)

    held.connection.call(limit(), timeout=10)
    (problem,) = overview.collect().stream_problems
    assert problem.startswith("max_bytes=200000: ") and "manage.py stream update" in problem


def test_a_copy_of_this_database_that_tried_the_stream_is_an_identity_conflict_with_the_fix(held):
    ours = identity.database_identity()
    with pytest.raises(Exception, match="held by another database instance"):
        held.ensure_stream(owner=ours, instance="999:1")  # a staging copy's worker, refused
    conflict = overview.collect().identity_conflict
    assert "999:1" in conflict and "UPDATE platformkit_identity SET database_id = gen_random_uuid()" in conflict


def test_each_worker_says_what_it_is_doing(held):
    waiting = Heartbeat(["testapp.record_order"], worker="host-a:1")
    waiting.state = lambda: (WorkerState.WAITING_FOR_BROKER, "NATS server at nats://n1:4222: connection refused")
    waiting.beat()
    refused = Heartbeat([], worker="host-b:2")
    refused.beat()
    refused.refusal = "the stream 'S' ... max_msgs=300 ... Fix: `manage.py stream update`"
    refused.stopped()
    workers = {w.worker: w for w in overview.collect().workers}
    assert (workers["host-a:1"].beat, workers["host-a:1"].alive) == (WorkerState.WAITING_FOR_BROKER, True)
    assert workers["host-a:1"].waiting_for_broker
    assert "connection refused" in workers["host-a:1"].detail
    assert (workers["host-b:2"].beat, workers["host-b:2"].alive) == (WorkerState.REFUSED, False)
    assert "manage.py stream update" in workers["host-b:2"].detail
