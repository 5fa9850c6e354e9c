"""The in-memory broker's JetStream semantics, on its own: no database, no NATS."""

from __future__ import annotations

import pytest

from django_platformkit.broker.memory import InMemoryTransport
from django_platformkit.broker.memory_stream import ConsumerSpec, subject_matches
from django_platformkit.exceptions import ConsumerDrift
from django_platformkit.wire import OutgoingMessage, PublishOutcome, subject_for

pytestmark = pytest.mark.unit


def broker(*, ack_wait: float = 30.0, max_ack_pending: int | None = None, **options) -> InMemoryTransport:
    transport = InMemoryTransport(**options)
    transport.ensure_stream()
    transport.ensure_consumer(
        ConsumerSpec(
            "d", subject_for("testapp.flaky", None).replace(".flaky", ".*"), ack_wait, max_ack_pending=max_ack_pending
        )
    )
    return transport


def send(transport: InMemoryTransport, *ids: str, event: str = "testapp.flaky") -> None:
    subject = subject_for(event, None)
    results = transport.publish_start([OutgoingMessage(subject, b"{}", i) for i in ids]).results()
    assert [r.outcome for r in results] == [PublishOutcome.STORED] * len(ids)


def seqs(deliveries) -> list[tuple[int, int]]:
    return [(d.stream_seq, d.attempt) for d in deliveries]


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.d", False),
        ("a.*.c", "a.b.c.d", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.b", "a.b", True),
        ("a.b", "a", False),
    ],
)
def test_subjects_match_as_nats_wildcards_do(pattern, subject, matches):
    assert subject_matches(pattern, subject) is matches


def test_a_durable_delivers_every_retained_message_of_its_subject_from_the_first():
    transport = InMemoryTransport()
    transport.ensure_stream()
    send(transport, "1")
    send(transport, "2", event="testapp.order_placed")
    spec = ConsumerSpec("late", subject_for("testapp.flaky", None).replace("._.", ".*."), 30.0)
    transport.ensure_consumer(spec)  # created after the message was stored: deliver all
    assert seqs(transport.fetch("late", 10, timeout=0)) == [(1, 1)]


def test_an_unacked_delivery_comes_back_after_the_ack_wait_with_its_count_raised():
    transport = broker(ack_wait=30.0, auto_advance=False)
    send(transport, "1")
    (first,) = transport.fetch("d", 10, timeout=0)
    transport.clock.advance(29.9)
    assert transport.fetch("d", 10, timeout=0) == []
    assert transport.consumer_info("d").num_ack_pending == 1
    transport.clock.advance(0.1)
    (again,) = transport.fetch("d", 10, timeout=0)
    assert (again.stream_seq, again.attempt) == (1, 2)
    assert transport.consumer_info("d").num_redelivered == 1
    transport.ack(first)  # by stream sequence: the earlier delivery's ack settles the message
    info = transport.consumer_info("d")
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    transport.ack(again)  # settled already: nothing happens
    transport.clock.advance(60)
    assert transport.fetch("d", 10, timeout=0) == []


def test_a_nak_with_a_delay_comes_back_when_the_delay_passed_and_before_new_messages():
    transport = broker(auto_advance=False)
    send(transport, "1")
    (first,) = transport.fetch("d", 10, timeout=0)
    transport.nak(first, 5.0)
    send(transport, "2")
    assert seqs(transport.fetch("d", 1, timeout=0)) == [(2, 1)]
    send(transport, "3")
    transport.clock.advance(5.0)
    assert seqs(transport.fetch("d", 10, timeout=0)) == [(1, 2), (3, 1)]


def test_auto_advance_jumps_to_the_next_retry_only_when_nothing_is_in_flight():
    transport = broker()
    send(transport, "1", "2")
    one, two = transport.fetch("d", 10, timeout=0)
    transport.nak(one, 7.0)
    assert transport.fetch("d", 10, timeout=0) == []  # two is still in flight: time stands still
    assert transport.clock.now() == 0.0
    transport.ack(two)
    assert seqs(transport.fetch("d", 10, timeout=0)) == [(1, 2)]
    assert transport.clock.now() == 7.0


def test_a_termed_message_is_never_delivered_again():
    transport = broker()
    send(transport, "1")
    (first,) = transport.fetch("d", 10, timeout=0)
    transport.term(first)
    transport.clock.advance(3600)
    assert transport.fetch("d", 10, timeout=0) == []
    assert transport.consumer_info("d").num_ack_pending == 0


def test_max_ack_pending_holds_back_new_messages_but_not_redeliveries():
    transport = broker(max_ack_pending=2, auto_advance=False)
    send(transport, "1", "2", "3")
    one, _two = transport.fetch("d", 10, timeout=0)
    assert transport.fetch("d", 10, timeout=0) == []
    transport.nak(one)  # parked, still ack pending
    assert seqs(transport.fetch("d", 10, timeout=0)) == [(1, 2)]
    assert transport.consumer_info("d").num_pending == 1


def test_a_message_over_max_payload_is_refused_for_good_and_one_without_a_stream_for_now():
    transport = InMemoryTransport(max_payload=100)
    subject = subject_for("testapp.flaky", None)
    (no_stream,) = transport.publish_start([OutgoingMessage(subject, b"{}", "1")]).results()
    assert (no_stream.outcome, no_stream.no_stream) == (PublishOutcome.TEMPORARY, True)
    transport.ensure_stream()
    (big,) = transport.publish_start([OutgoingMessage(subject, b"x" * 100, "2")]).results()
    assert big.outcome is PublishOutcome.PERMANENT
    assert "max_payload" in big.error


def test_changing_a_durables_filter_is_drift_the_broker_cannot_apply():
    transport = broker()
    with pytest.raises(ConsumerDrift, match="can't change a durable's filter"):
        transport.ensure_consumer(ConsumerSpec("d", "other.>", 30.0))
