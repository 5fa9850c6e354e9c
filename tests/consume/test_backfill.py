"""``subscribe(..., backfill=False)``: a new durable starts with the events
published from its creation on; its ``backfill=True`` twin runs the retained
ones too; once the durable exists, ``backfill`` changes nothing. Real NATS
and PostgreSQL."""

from __future__ import annotations

import pytest
from django.db import transaction

from django_platformkit import declare, publish, subscribe
from django_platformkit.broker.streams import consumer_config, consumer_differences
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.outbox.relay import Relay
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def _twins():
    declare("testapp.backfilled")
    for name, backfill in (("testapp.from_now", False), ("testapp.from_retained", True)):

        def handler(event, name=name):
            Effect.objects.create(subscription=name, event_id=event.id)

        subscribe("testapp.backfilled", name=name, backfill=backfill)(handler)
    return [get_subscription("testapp.from_now"), get_subscription("testapp.from_retained")]


def handled(name: str) -> set:
    return set(Effect.objects.filter(subscription=name).values_list("event_id", flat=True))


def test_events_before_the_durable_existed_run_only_for_the_backfill_twin(transport, registries, run_worker, caplog):
    twins = _twins()
    with transaction.atomic():
        before = {publish("testapp.backfilled", {"n": n}) for n in range(3)}
    Relay(transport).drain()  # in the stream before either durable exists
    with caplog.at_level("INFO", logger="django_platformkit.runtime.startup"):
        run_worker(subscriptions=twins, relay=False)
    assert handled("testapp.from_now") == set()
    assert handled("testapp.from_retained") == before
    assert "will run the handler for 3 retained message(s)" in caplog.text  # the twin that backfills is warned about
    assert "testapp.from_now" in caplog.text and "backfill=False" in caplog.text
    with transaction.atomic():
        after = publish("testapp.backfilled", {"n": "after"})
    run_worker(subscriptions=twins)
    assert handled("testapp.from_now") == {after}
    assert handled("testapp.from_retained") == before | {after}


def test_once_the_durable_exists_backfill_changes_nothing_and_is_no_drift(transport, registries):
    twins = _twins()
    transport.ensure_consumer(twins[0].consumer_config())  # created with deliver_policy new
    twins[0].backfill = True  # a later build flips it
    info = transport.ensure_consumer(twins[0].consumer_config())  # no ConsumerDrift
    policy = info.config.deliver_policy
    assert str(getattr(policy, "value", policy)) == "new"  # as created: it has started
    want, have = consumer_config("a.b", "a.b", backfill=True), consumer_config("a.b", "a.b", backfill=False)
    assert consumer_differences(want, have) == ({}, {})
