"""One behaviour suite for every broker (``broker.port.Broker``): the real
transport against NATS JetStream and the in-memory twin pass the same tests,
so code written against the port - the relay, the consumer, the worker, and
users' tests on ``InMemoryTransport`` - can't tell them apart where it
matters. The idea is River's driver test suite and pgqueuer's port
conformance test.

Time: the real broker's clock is the wall clock, the in-memory one's a
``ManualClock`` held still (``auto_advance=False``); ``side.elapse()`` moves
whichever it is, so each test reads the same on both.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from nats.js import api

from django_platformkit import conf
from django_platformkit.broker.memory import InMemoryTransport
from django_platformkit.broker.port import Broker
from django_platformkit.broker.streams import consumer_config
from django_platformkit.broker.transport import Transport
from django_platformkit.exceptions import ConfigurationError, ConsumerDrift, ConsumerNotFound
from django_platformkit.wire import TARGET_HEADER, OutgoingMessage, PublishOutcome, durable_name, subject_for


@dataclass
class Side:
    """One broker under test, how to let time pass on its clock, and how an
    operator would edit its stream (``nats stream edit``; a retention, which
    NATS can't change in place, by making the stream again)."""

    broker: Broker
    elapse: Callable[[float], None]
    edit: Callable[..., None]


@pytest.fixture(params=["nats", "memory"])
def side(request, broker) -> Iterator[Side]:
    """``broker``: this test's own stream and subject prefix (tests/conftest.py)."""
    if request.param == "nats":
        transport = Transport()
        transport.connect()
        tested = Side(transport, time.sleep, lambda **settings: edit_nats_stream(transport, settings))
    else:
        memory = InMemoryTransport(auto_advance=False)
        tested = Side(memory, memory.clock.advance, memory.edit_stream)
    try:
        yield tested
    finally:
        tested.broker.close()


def edit_nats_stream(transport: Transport, settings: dict) -> None:
    async def edit():
        js = transport.connection.js
        config = (await js.stream_info(conf.settings.STREAM)).config
        for key, value in settings.items():
            setattr(config, key, api.RetentionPolicy(value) if key == "retention" else value)
        if "retention" in settings:
            await js.delete_stream(config.name)
            await js.add_stream(config)
        else:
            await js.update_stream(config)

    transport.connection.call(edit(), timeout=10)


def durable(name: str = "testapp.port", event: str = "testapp.flaky", **changes) -> api.ConsumerConfig:
    want = consumer_config(name, event)
    for key, value in changes.items():
        setattr(want, key, value)
    return want


def send(b: Broker, *ids: str, event: str = "testapp.flaky", body: bytes = b"{}") -> list:
    subject = subject_for(event, None)
    return b.publish_start([OutgoingMessage(subject, body, i) for i in ids], timeout=10).results()


def fetch(b: Broker, name: str = "testapp.port", batch: int = 10, timeout: float = 2.0) -> list:
    return b.fetch(durable_name(name), batch, timeout=timeout)


def attempts(deliveries) -> list[tuple[str, int]]:
    return [(d.headers.get("Nats-Msg-Id", ""), d.attempt) for d in deliveries]


def test_the_stream_is_made_once_and_refused_to_another_owner(side):
    b = side.broker
    ours, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    b.ensure_stream(owner=ours)
    b.ensure_stream(owner=ours)  # again: nothing changes
    with pytest.raises(ConfigurationError, match=theirs):
        b.ensure_stream(owner=theirs)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_msgs", 300),
        ("max_bytes", 200_000),
        ("max_msgs_per_subject", 1),
        ("retention", "interest"),
        ("retention", "workqueue"),
    ],
)
def test_a_stream_whose_limits_could_discard_unhandled_events_is_refused_naming_the_limit_and_its_fix(
    side, setting, value
):
    b = side.broker
    ours = str(uuid.uuid4())
    b.ensure_stream(owner=ours, instance="1:1")
    side.edit(**{setting: value})
    with pytest.raises(ConfigurationError) as refused:
        b.ensure_stream(owner=ours, instance="1:1")
    text = str(refused.value)
    assert f"{setting}={value}" in text and "could discard events no subscription has handled" in text
    assert ("manage.py stream update" if setting != "retention" else "manage.py stream reset --yes") in text
    standing = b.stream_standing(owner=ours, instance="1:1")
    assert standing.refused and [p.setting for p in standing.problems] == [setting]


def test_a_live_copy_of_the_holder_is_refused_and_the_holder_learns_it_is_contested(side):
    b = side.broker
    ours = str(uuid.uuid4())
    b.ensure_stream(owner=ours, instance="42:1")  # production
    with pytest.raises(ConfigurationError, match="held by another database instance with this database's identity"):
        b.ensure_stream(owner=ours, instance="42:2")  # its staging copy (CREATE DATABASE ... TEMPLATE)
    held = b.stream_standing(owner=ours, instance="42:1")
    assert held.contested and not held.refused and "42:2" in held.text
    copy = b.stream_standing(owner=ours, instance="42:2")
    assert copy.refused and not copy.contested
    assert held.tenure.instance == "42:1" and held.tenure.contender == "42:2"


def test_the_standing_says_when_there_is_no_stream_and_reports_the_real_max_age(side):
    b = side.broker
    ours = str(uuid.uuid4())
    assert not b.stream_standing(owner=ours, instance="1:1").exists
    b.ensure_stream(owner=ours, instance="1:1")
    side.edit(max_age=7 * 86400.0)
    standing = b.stream_standing(owner=ours, instance="1:1")
    assert standing.exists and not standing.refused and standing.max_age_seconds == 7 * 86400.0


def test_a_publish_is_stored_in_order_and_a_resend_of_its_id_is_a_duplicate_not_a_copy(side):
    b = side.broker
    b.ensure_stream()
    first = send(b, "a", "b")
    assert [r.outcome for r in first] == [PublishOutcome.STORED] * 2
    assert first[0].seq < first[1].seq
    (again,) = send(b, "a")
    assert (again.outcome, again.duplicate, again.seq) == (PublishOutcome.STORED, True, first[0].seq)


def test_a_message_too_big_for_the_broker_is_refused_for_good(side):
    b = side.broker
    b.ensure_stream()
    (big,) = send(b, "big", body=b"x" * (b.max_payload + 1))
    assert big.outcome is PublishOutcome.PERMANENT


def test_a_new_durable_delivers_every_retained_message_of_its_event_from_the_first(side):
    b = side.broker
    b.ensure_stream()
    send(b, "1")
    send(b, "other", event="testapp.order_placed")
    send(b, "2")
    info = b.ensure_consumer(durable())
    assert info.num_pending == 2
    assert attempts(fetch(b)) == [("1", 1), ("2", 1)]


def test_an_acked_delivery_is_settled_and_never_comes_back(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable(ack_wait=1.0))
    send(b, "1")
    (delivery,) = fetch(b)
    assert b.consumer_info(durable_name("testapp.port")).num_ack_pending == 1
    b.ack_many([delivery])
    side.elapse(1.5)  # past the ack wait: nothing to redeliver
    assert fetch(b, timeout=0.5) == []
    assert b.consumer_info(durable_name("testapp.port")).num_ack_pending == 0


def test_an_unsettled_delivery_comes_back_after_the_ack_wait_with_its_count_raised(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable(ack_wait=1.0))
    send(b, "1")
    assert attempts(fetch(b)) == [("1", 1)]
    side.elapse(1.5)
    assert attempts(fetch(b)) == [("1", 2)]


def test_a_nak_hands_back_at_once_and_a_nak_with_a_delay_after_it(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable())
    send(b, "now", "later")
    now, later = fetch(b)
    b.nak(now)
    b.nak(later, 1.0)
    assert attempts(fetch(b)) == [("now", 2)]
    side.elapse(1.5)
    assert attempts(fetch(b)) == [("later", 2)]


def test_a_termed_message_is_never_delivered_again(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable(ack_wait=1.0))
    send(b, "poison")
    (delivery,) = fetch(b)
    b.term(delivery)
    side.elapse(1.5)
    assert fetch(b, timeout=0.5) == []


def test_a_durable_the_broker_cant_change_is_drift_and_stays_as_it_was(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable())
    with pytest.raises(ConsumerDrift):
        b.ensure_consumer(durable(filter_subject=subject_for("testapp.order_placed", None).replace("._.", ".*.")))
    assert b.consumer_info(durable_name("testapp.port")).num_pending == 0


def test_a_missing_durable_is_not_found_alone_and_none_among_several(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable())
    with pytest.raises(ConsumerNotFound):
        b.consumer_info("nobody-here")
    there, missing = b.consumer_infos([durable_name("testapp.port"), "nobody-here"], timeout=5)
    assert (there.num_pending, missing) == (0, None)


def test_a_pull_lane_fetches_only_within_its_credit_and_says_when_it_is_idle(side):
    b = side.broker
    b.ensure_stream()
    want = durable()
    b.ensure_consumer(want)
    send(b, *[str(n) for n in range(5)])
    credit = [2]
    units: list[list] = []
    got = threading.Event()

    def deliver(deliveries):
        credit[0] -= len(deliveries)
        units.append(deliveries)
        got.set()

    lane = b.pull_lane(want, credit=lambda: credit[0], deliver=deliver, batch_size=10)
    try:
        assert got.wait(10)
        time.sleep(0.5)  # it would fetch more now if it ignored the credit
        assert sum(len(u) for u in units) == 2
        assert lane.running()
        credit[0] = 10
        lane.wake()
        deadline = time.monotonic() + 10
        while sum(len(u) for u in units) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(d.headers["Nats-Msg-Id"] for u in units for d in u) == [str(n) for n in range(5)]
        assert lane.idle.wait(10), "the lane never said it found nothing more"
    finally:
        lane.stop()
    assert not lane.running()
    for unit in units:
        b.ack_many(unit)


def test_a_keep_alive_can_be_started_settled_and_stopped(side):
    b = side.broker
    b.ensure_stream()
    b.ensure_consumer(durable())
    send(b, "1")
    (delivery,) = fetch(b)
    keep = b.keep_alive([delivery], every_seconds=0.2)
    keep.started(delivery, 5.0)
    keep.settled(delivery)
    keep.stop()
    b.ack(delivery)


def test_what_reconciliation_reads_of_the_stream_its_durables_and_its_messages_is_alike(side):
    from tests.conftest import wait_for

    b = side.broker
    ours = str(uuid.uuid4())
    b.ensure_stream(owner=ours, instance="1:1")
    facts = b.stream_facts(owner=ours, instance="1:1")
    assert facts is not None and facts.created is not None and not facts.standing.refused
    assert (facts.first_seq, facts.last_seq) == (0, 0)
    send(b, "a", "b")
    targeted = OutgoingMessage(subject_for("testapp.flaky", None), b"{}", "c", targets=("x.y", "x.z"))
    pending = b.publish_start([targeted])
    assert [r.outcome for r in pending.results()] == [PublishOutcome.STORED]
    assert pending.stream_created == facts.created  # what the stamp records: which stream took it
    later = b.stream_facts(owner=ours, instance="1:1")
    assert (later.created, later.first_seq, later.last_seq) == (facts.created, 1, 3)
    assert b.durable_facts(["nobody-here"]) == [None]
    b.ensure_consumer(durable())
    (made,) = b.durable_facts([durable_name("testapp.port")])
    assert made.created is not None and (made.num_pending, made.settled_through) == (3, 0)
    deliveries = fetch(b)
    assert [d.headers.get(TARGET_HEADER) for d in deliveries] == [None, None, "x.y,x.z"]
    b.ack_many(deliveries[:2])

    def facts_of_port():
        return b.durable_facts([durable_name("testapp.port")])[0]

    wait_for(lambda: facts_of_port().settled_through == 2, what="the acks")  # one still in flight
    b.ack(deliveries[2])
    wait_for(lambda: facts_of_port().settled_through == 3, what="the last ack")
    held = b.messages_at([1, 3, 99])
    assert held[1] is not None and held[1].msg_id == "a" and held[1].targets == ()
    assert held[3] is not None and (held[3].msg_id, held[3].targets) == ("c", ("x.y", "x.z"))
    assert held[99] is None


def test_an_edit_of_the_stream_is_told_to_its_watchers_at_once(side):
    from tests.conftest import wait_for

    b = side.broker
    b.ensure_stream(owner=str(uuid.uuid4()), instance="1:1")
    told: list[str] = []
    assert b.watch_stream(told.append)
    side.edit(max_msgs=300)
    wait_for(lambda: "modify" in told, timeout=5, what="the stream-update advisory")
