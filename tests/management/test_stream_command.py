"""``manage.py stream info|prune|reset|update|reconcile|takeover`` against a
real NATS: what the broker holds beside what this build wants, pruning only
the durables no declared subscription owns (a busy one only with ``--yes``),
a reset only with ``--yes`` (and ``--discard-unhandled`` while durables hold
unhandled messages), limits lifted in place, a reconciliation pass by hand,
and a takeover only by the operator's word - no routine step needs the
``nats`` CLI."""

from __future__ import annotations

import io
import threading
import time

import pytest
from django.core.management import CommandError, call_command

from django_platformkit import identity
from django_platformkit.broker.streams import consumer_config
from django_platformkit.broker.transport import Transport
from django_platformkit.consume.subscriptions import subscriptions

pytestmark = pytest.mark.django_db(transaction=True)


def stream(*args) -> str:
    out = io.StringIO()
    call_command("stream", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def ours(broker):
    """The stream made by this database, with a durable for every declared
    subscription, one for a removed subscription (with a backlog), and a
    consumer another tool made."""
    t = Transport()
    t.connect()
    t.ensure_stream(owner=identity.database_identity(), instance=identity.database_instance())
    for sub in subscriptions():
        t.ensure_consumer(sub.consumer_config())
    t.ensure_consumer(consumer_config("retired.old_handler", "testapp.order_placed"))
    t.publish_raw(f"{broker['SUBJECT_PREFIX']}._.testapp.order_placed", b"{}")

    async def foreign():
        from nats.js import api

        await t.connection.js.add_consumer(
            broker["STREAM"], api.ConsumerConfig(durable_name="someone-elses", ack_policy=api.AckPolicy.EXPLICIT)
        )

    t.connection.call(foreign(), timeout=10)
    yield t
    t.close()


def durables(t: Transport) -> set[str]:
    report = t.upkeep.report()
    return {d.name for d in report.durables} if report else set()


def test_info_shows_the_stream_beside_what_this_build_wants_and_who_owns_each_durable(ours, broker):
    out = stream("info")
    assert f"stream {broker['STREAM']} on " in out
    assert "max_msgs              unlimited" in out and "retention             limits" in out
    assert f"owner: database {identity.database_identity()}" in out
    assert f"held by instance {identity.database_instance()}" in out
    assert "standing: workers of this database may use it" in out
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.startswith("  ") and line.split()}
    assert "testapp.record_order" in lines["testapp-record_order"]
    assert "retired.old_handler is not declared; `stream prune` deletes it" in lines["retired-old_handler"]
    assert "1" in lines["retired-old_handler"].split()[1]  # its backlog: one pending
    assert "not made by django_platformkit: never pruned" in lines["someone-elses"]


def test_info_names_a_limit_that_could_discard_unhandled_events_and_its_fix(ours, broker):
    async def limit():
        config = (await ours.connection.js.stream_info(broker["STREAM"])).config
        config.max_msgs = 300
        await ours.connection.js.update_stream(config)

    ours.connection.call(limit(), timeout=10)
    out = stream("info")
    assert "max_msgs              300" in out and "<- differs" in out
    assert "REFUSED: " in out and "max_msgs=300" in out and "`manage.py stream update`" in out
    # ... which lifts it, in place: the messages stay.
    assert "changed max_msgs: 300 -> unlimited" in stream("update")
    assert "standing: workers of this database may use it" in stream("info")
    assert ours.upkeep.report().messages == 1


def test_prune_deletes_only_durables_no_declared_subscription_owns(ours):
    declared = {s.durable for s in subscriptions()}
    before = durables(ours)
    assert before == declared | {"retired-old_handler", "someone-elses"}
    dry = stream("prune", "--dry-run")
    assert "would delete retired-old_handler (subscription retired.old_handler, pending 1" in dry
    assert "not idle: refused without --yes" in dry
    assert "someone-elses" not in dry and durables(ours) == before
    with pytest.raises(CommandError) as refused:
        stream("prune")  # its backlog would go with it
    assert "stream prune refused, nothing deleted: 1 durable(s) to delete are not idle: " in str(refused.value)
    assert "retired-old_handler (pending 1, ack pending 0" in str(refused.value) and "--yes" in str(refused.value)
    assert durables(ours) == before
    assert "deleted retired-old_handler" in stream("prune", "--yes")
    assert durables(ours) == declared | {"someone-elses"}
    assert "nothing to prune" in stream("prune")


def test_reset_is_refused_without_yes_and_deletes_the_stream_with_it(ours, broker):
    with pytest.raises(CommandError, match="pass --yes"):
        stream("reset")
    assert ours.upkeep.report() is not None
    with pytest.raises(CommandError) as refused:
        stream("reset", "--yes")  # its durables have not read its one message
    text = str(refused.value)
    assert text.startswith(
        f"stream reset refused, nothing deleted: the durables of this project's stream {broker['STREAM']!r} "
        "have not handled "
    )
    assert " message(s) between them (" in text
    assert "retired-old_handler 1" in text and "testapp-record_order 1" in text
    assert "reconciliation sends every event a subscription has not handled again" in text
    assert "--discard-unhandled" in text
    out = stream("reset", "--yes", "--discard-unhandled")
    assert f"deleted the stream {broker['STREAM']!r} with 1 message(s)" in out
    assert "reconciliation sends the events this outbox holds" in out
    assert ours.upkeep.report() is None
    assert "none on" in stream("info")


def test_prune_deletes_a_declared_durable_only_when_named_after_its_filter_drifted(ours):
    with pytest.raises(CommandError, match="no durable nobody-here made by django_platformkit"):
        stream("prune", "--durable", "nobody-here")
    with pytest.raises(CommandError, match="no durable someone-elses made by django_platformkit"):
        stream("prune", "--durable", "someone-elses")  # another tool's consumer: never
    out = stream("prune", "--durable", "testapp-flaky", "--yes")
    assert "deleted retired-old_handler" in out and "deleted testapp-flaky (subscription testapp.flaky" in out
    assert "testapp-flaky" not in durables(ours) and "someone-elses" in durables(ours)


def test_reset_refuses_another_databases_stream_while_its_durables_hold_unhandled_events(broker):
    # Another project's stream (another identity) with a durable that has not read its one message:
    # `stream reset --yes` deleted it, and that project's relayed events with it.
    import uuid

    theirs = str(uuid.uuid4())
    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=theirs, instance="1:1")
        t.ensure_consumer(consumer_config("testapp.record_order", "testapp.order_placed"))
        t.publish_raw(f"{broker['SUBJECT_PREFIX']}._.testapp.order_placed", b"{}")
        with pytest.raises(CommandError) as refused:
            stream("reset", "--yes")
        text = str(refused.value)
        assert text.startswith(f"stream reset refused, nothing deleted: the stream {broker['STREAM']!r} belongs")
        assert theirs in text and "testapp-record_order 1" in text and "--discard-unhandled" in text
        assert t.upkeep.report() is not None
        assert "deleted the stream" in stream("reset", "--yes", "--discard-unhandled")
        assert t.upkeep.report() is None

        # Its durables drained (a re-created development database's old stream): --yes is enough.
        t.ensure_stream(owner=theirs, instance="1:1")
        t.ensure_consumer(consumer_config("testapp.record_order", "testapp.order_placed"))
        assert "deleted the stream" in stream("reset", "--yes")
    finally:
        t.close()


def test_prune_durable_of_a_backfill_false_subscription_resumes_where_it_stood_losing_nothing(
    transport, registries, run_worker
):
    # A backfill=False durable made again by the worker starts at "now": the events it had not handled,
    # and those relayed before the worker made it again, never ran its handler.
    from django.db import transaction

    from django_platformkit import declare, publish, subscribe
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.outbox.relay import Relay
    from tests.testapp.models import Effect

    declare("testapp.resumed")

    @subscribe("testapp.resumed", name="testapp.from_now", backfill=False)
    def from_now(event):
        Effect.objects.create(subscription="testapp.from_now", event_id=event.id)

    sub = get_subscription("testapp.from_now")
    transport.ensure_consumer(sub.consumer_config())  # it exists: "from now" has begun
    with transaction.atomic():
        first = publish("testapp.resumed", {"n": 1})
    run_worker(subscriptions=[sub])
    with transaction.atomic():
        waiting = {publish("testapp.resumed", {"n": n}) for n in (2, 3)}
    Relay(transport).drain()  # in the stream, not handled yet
    assert "deleted testapp-from_now (subscription testapp.from_now, pending 2" in stream(
        "prune", "--durable", sub.durable, "--yes"
    )
    with transaction.atomic():
        meanwhile = publish("testapp.resumed", {"n": 4})
    Relay(transport).drain()  # before a worker makes the durable again
    run_worker(subscriptions=[sub])
    handled = list(Effect.objects.filter(subscription="testapp.from_now").values_list("event_id", flat=True))
    assert sorted(handled) == sorted({first, meanwhile} | waiting)  # each once
    info = transport.ensure_consumer(sub.consumer_config())  # no drift: it has started, from where it stood
    assert str(getattr(info.config.deliver_policy, "value", info.config.deliver_policy)) == "by_start_sequence"
    # A later change the broker makes in place keeps where it started (the broker refuses to change that).
    info = transport.ensure_consumer(consumer_config("testapp.from_now", "testapp.resumed", max_ack_pending=77))
    assert info.config.max_ack_pending == 77


def test_reconcile_by_hand_says_what_it_would_send_again_then_sends_it(ours, broker):
    from django.db import transaction

    from django_platformkit import publish
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.outbox.relay import Relay
    from django_platformkit.runtime.startup import StartUp

    start_up = StartUp(ours, using="default", stop_event=threading.Event(), connect_timeout_seconds=5)
    start_up.connect_and_ensure_stream(give_up=True)
    ours.upkeep.delete_durables(["testapp-record_order", "testapp-count_order"])
    for name in ("testapp.record_order", "testapp.count_order"):
        start_up.ensure_durable(get_subscription(name))  # made (again) by a worker: their beginnings recorded
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": n}) for n in range(4)]
    Relay(ours).drain()
    ours.upkeep.delete_stream()  # lost with every message
    start_up.connect_and_ensure_stream(give_up=True)
    dry = stream("reconcile", "--dry-run")
    assert (
        "testapp.record_order: would send again 4: 4 stream_replaced (the stream it was stored in was reset or lost)"
        in dry
    )
    assert "testapp.count_order: would send again 4" in dry and str(ids[0]) in dry
    assert "dry run, nothing sent: 8 re-send(s) would be made, each to its subscription only" in dry
    assert ours.stream_info().state.messages == 0
    out = stream("reconcile")
    assert "testapp.record_order: sent again 4" in out and "8 re-send(s) made" in out
    assert ours.stream_info().state.messages == 4  # one message per event, for both
    assert "testapp.record_order: nothing lost" in stream("reconcile")


def test_reconcile_says_why_it_does_nothing_in_one_line(broker, settings):
    import uuid

    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=str(uuid.uuid4()), instance="1:1")
        with pytest.raises(CommandError, match="nothing reconciled: .* belongs to another project's database"):
            stream("reconcile")
    finally:
        t.close()
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "NATS_URL": "nats://127.0.0.1:1"}
    with pytest.raises(CommandError) as down:
        stream("reconcile", "--dry-run")
    assert "\n" not in str(down.value) and "127.0.0.1:1" in str(down.value)


def test_takeover_moves_the_stream_only_by_the_operators_word_and_says_which_side_is_which(ours, broker):
    from django_platformkit import identity

    ours_id, here = identity.database_identity(), identity.database_instance()
    with pytest.raises(CommandError, match="Pass --yes"):
        stream("takeover")
    assert f"this database instance ({here}) holds the stream" in stream("takeover", "--yes")
    # The stream held by another instance of this database (the old server), alive a moment ago,
    # with a backlog in its durables: refused, naming both sides and the counts.
    old = identity.Tenure(ours_id, "999:1", time.time())
    ours.upkeep.record_holder(old)
    with pytest.raises(CommandError) as refused:
        stream("takeover", "--yes")
    text = str(refused.value)
    assert "held by database instance 999:1; this database is instance " + here in text
    assert "Its workers said they were alive" in text and "testapp-record_order 1 pending" in text
    assert "--force" in text
    assert identity.Tenure.read(ours.stream_info().config.description, None).instance == "999:1"
    out = stream("takeover", "--yes", "--force")
    assert f"held by instance {here} (this database) from now on, instead of 999:1" in out
    assert identity.Tenure.read(ours.stream_info().config.description, None).instance == here


def test_takeover_never_crosses_projects(broker):
    import uuid

    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=str(uuid.uuid4()), instance="1:1")
        with pytest.raises(CommandError, match="belongs to another project's database .* never between projects"):
            stream("takeover", "--yes", "--force")
    finally:
        t.close()


@pytest.mark.process
def test_update_refuses_another_projects_stream_as_the_workers_do_and_changes_nothing(broker):
    """`stream update` grafted this project's subjects onto another project's
    stream and exited 0 (its owner then logged drift for ever); now it is
    refused with the workers' own words, whatever it would have changed."""
    import uuid

    from tests.conftest import run_to_exit, worker_env

    theirs = str(uuid.uuid4())
    t = Transport()
    t.connect()
    try:
        t.ensure_stream(owner=theirs, instance="1:1")

        async def narrow():
            # What update would change: a limit that discards, and this project's subjects replaced.
            js = t.connection.js
            config = (await js.stream_info(broker["STREAM"])).config
            config.max_msgs = 300
            config.subjects = ["someone.else.>"]
            await js.update_stream(config)

        t.connection.call(narrow(), timeout=10)
        for args in (("stream", "update"), ("stream", "update", "--dry-run"), ("stream", "prune")):
            code, output = run_to_exit(*args, env=worker_env(broker), timeout=120)
            assert code == 1 and "Traceback" not in output, output
            assert "belongs to another project" in output or theirs in output, output
        held = t.upkeep.report().config
        assert held.max_msgs == 300 and held.subjects == ["someone.else.>"]
    finally:
        t.close()
