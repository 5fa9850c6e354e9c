"""The trust model (DESIGN.md "Trust model"): a handler runs only for an
event this project's outbox holds, with the payload the outbox holds; a
subscription opts in to other services' events with ``external=True``. Any
bytes on our subjects end as a ``(malformed)`` dead letter and the consumer
goes on."""

import json
import uuid

import pytest
from django.db import transaction

from django_platformkit import publish
from django_platformkit.consume.claim import NOT_IN_OUTBOX
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import subject_for
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def envelope(event_id, name, data, tenant=None):
    body = {
        "specversion": "1.0",
        "id": str(event_id),
        "source": "/" + name.split(".")[0],
        "type": name,
        "subject": str(event_id),
        "time": "2026-01-01T00:00:00Z",
        "datacontenttype": "application/json",
        "data": data,
    }
    if tenant is not None:
        body["tenantid"] = tenant
    return json.dumps(body).encode()


def recording(name, event="testapp.order_placed", **kwargs):
    seen = []
    return seen, Subscription(name=name, event=event, handler=seen.append, **kwargs)


def consume_all(transport, sub, expected_settled, timeout=15):
    consumer = Consumer(sub, transport)
    consumer.ensure()
    outcomes = []
    wait_for(
        lambda: (
            outcomes.extend(consumer.handle(transport.fetch(sub.durable, 50, timeout=0.5)))
            or len(outcomes) >= expected_settled
        ),
        timeout=timeout,
        what=f"{expected_settled} settled deliveries",
    )
    return outcomes


def test_a_forged_message_with_an_id_the_outbox_never_had_does_not_run(transport):
    seen, sub = recording("testapp.trusting")
    forged_id = uuid.uuid4()
    transport.publish_raw(
        subject_for("testapp.order_placed", "acme"),
        envelope(forged_id, "testapp.order_placed", {"amount": "99999.00"}, "acme"),
    )
    consume_all(transport, sub, 1)
    assert seen == []
    dead = DeadLetter.objects.get()
    assert (dead.subscription, dead.name) == (sub.name, "(malformed)")
    assert dead.event_id != forged_id  # keyed by its stream position: a forged id never takes a real event's slot
    assert f"claimed_id={forged_id} " in dead.error
    assert dead.error.endswith(NOT_IN_OUTBOX)
    assert not HandledEvent.objects.exists()  # no claim: nothing was handled


def test_a_same_id_copy_with_another_payload_runs_with_the_outbox_payload(transport):
    seen, sub = recording("testapp.trusting")
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"amount": "10.00"}, tenant="acme")
    # Sent before the relay, with the real message id: the broker then drops the real one as a duplicate.
    transport.publish_raw(
        subject_for("testapp.order_placed", "acme"),
        envelope(event_id, "testapp.order_placed", {"amount": "99999.00"}, "acme"),
        headers={"Nats-Msg-Id": str(event_id)},
    )
    Relay(transport).drain()
    assert consume_all(transport, sub, 1) == ["handled"]
    assert [(e.id, e.payload, e.tenant) for e in seen] == [(event_id, {"amount": "10.00"}, "acme")]
    assert seen[0].occurred_at == OutboxEvent.objects.get(id=event_id).created_at  # not the forged copy's time
    assert not DeadLetter.objects.exists()


def test_an_external_subscription_runs_other_services_events_with_their_body_and_checks_the_schema(transport):
    seen, sub = recording("testapp.from_elsewhere", event="testapp.with_schema", external=True)
    good, bad = uuid.uuid4(), uuid.uuid4()
    subject = subject_for("testapp.with_schema", None)
    transport.publish_raw(subject, envelope(good, "testapp.with_schema", {"sku": "A1", "qty": 2}))
    transport.publish_raw(subject, envelope(bad, "testapp.with_schema", {"qty": 0}))
    assert sorted(consume_all(transport, sub, 2)) == ["handled", "malformed"]
    assert [(e.id, e.payload) for e in seen] == [(good, {"sku": "A1", "qty": 2})]
    dead = DeadLetter.objects.get()
    assert f"claimed_id={bad} " in dead.error and "fails the schema of 'testapp.with_schema'" in dead.error


@pytest.mark.parametrize("external", [False, True])
def test_any_bytes_on_our_subjects_end_as_malformed_dead_letters_and_the_consumer_goes_on(transport, external):
    seen, sub = recording("testapp.sturdy", external=external)
    subject = subject_for("testapp.order_placed", None)
    transport.publish_raw(subject, b"[" * 200_000)  # RecursionError in json.loads
    transport.publish_raw(subject, b"\xff\xfe{not utf-8")
    transport.publish_raw(subject, b'{"specversion": "1.0", "junk": "' + b"x" * 600_000 + b'"}')
    transport.publish_raw(
        subject, b'{"id": "' + str(uuid.uuid4()).encode() + b'", "specversion": "1.0", "data": {"a\x00": 1}}'
    )
    with transaction.atomic():
        good = publish("testapp.order_placed", {"n": 1})
    Relay(transport).drain()
    outcomes = consume_all(transport, sub, 5)
    assert outcomes == ["malformed"] * 4 + ["handled"]
    assert [e.id for e in seen] == [good]
    assert DeadLetter.objects.filter(name="(malformed)", subscription=sub.name).count() == 4
    nested = DeadLetter.objects.filter(error__contains="RecursionError").get()
    assert "cannot decode" in nested.error


def test_while_the_identity_is_contested_a_message_not_in_this_outbox_is_handed_back_not_terminated(
    transport, monkeypatch
):
    """A staging copy of this database (same identity) tried the stream: a
    message this outbox doesn't know may be the copy's, or written after the
    copy was made. Terminated, it would be gone from the shared durable for
    whichever database it belongs to; handed back, nothing is lost - and once
    the contest is over it is recorded as malformed as before."""
    import threading

    from django_platformkit.consume import outcome
    from django_platformkit.wire import HandlingOutcome

    monkeypatch.setattr(outcome, "CONTESTED_REDELIVERY_SECONDS", 1.0)  # 30 s in life: one look at the stream

    seen, sub = recording("testapp.trusting")
    stranger = uuid.uuid4()
    transport.publish_raw(
        subject_for("testapp.order_placed", None), envelope(stranger, "testapp.order_placed", {"n": 1})
    )
    contested = threading.Event()
    contested.set()
    consumer = Consumer(sub, transport, contested=contested)
    consumer.ensure()
    (delivery,) = wait_for(lambda: transport.fetch(sub.durable, 10, timeout=0.5), what="the delivery")
    assert consumer.handle([delivery]) == [HandlingOutcome.HANDED_BACK]
    assert seen == [] and not DeadLetter.objects.exists()
    assert transport.consumer_info(sub.durable).num_ack_pending == 1  # naked with a delay: not termed
    contested.clear()  # the copy stopped trying
    (again,) = wait_for(lambda: transport.fetch(sub.durable, 10, timeout=0.5), what="the redelivery")
    assert consumer.handle([again]) == [HandlingOutcome.MALFORMED]
    assert DeadLetter.objects.get().error.endswith(NOT_IN_OUTBOX)
