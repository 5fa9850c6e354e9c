"""``manage.py republish`` / ``republish()``: rows the relay stamped go back
to pending for the relay to send again after the broker lost them; every
subscription still handles each event once and a dead letter stays one."""

from __future__ import annotations

import io
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.models import Count

from django_platformkit import publish, republish
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS, record_dead_letter
from django_platformkit.outbox.relay import Relay
from tests.conftest import tables
from tests.testapp.models import Attempt, Effect

pytestmark = pytest.mark.django_db(transaction=True)

SUBS = ["testapp.record_order", "testapp.count_order", "testapp.flaky"]


def run(*args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    call_command("republish", *args, stdout=out, stderr=err, **kwargs)
    return out.getvalue() + err.getvalue()


def add_event(*, published_minutes_ago: float | None, name: str = "testapp.order_placed") -> uuid.UUID:
    """One outbox row stamped that many minutes ago by the database clock (None: pending)."""
    event_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, published_at) "
            "VALUES (%s, %s, '{}', '{}', now() - interval '1 day', now() - make_interval(secs => %s * 60))",
            [event_id, name, published_minutes_ago],
        )
    return event_id


def pending_ids() -> set[uuid.UUID]:
    """Pending rows, less the operator verbs' audit events (a discard publishes one)."""
    rows = OutboxEvent.objects.pending().exclude(name__in=["platformkit.event_discarded", "platformkit.event_replayed"])
    return set(rows.values_list("id", flat=True))


def delete_stream(transport, broker) -> None:
    """What losing a one-replica server's store amounts to: the stream, its
    messages and its durables are gone; the next worker re-creates them empty."""

    async def delete():
        await transport.connection.js.delete_stream(broker["STREAM"])

    transport.connection.call(delete(), timeout=10)


def test_after_the_stream_is_lost_republish_gets_every_event_handled_once_and_a_dead_letter_stays(
    transport, broker, run_worker
):
    from django_platformkit.consume.subscriptions import subscriptions

    subs = [s for s in subscriptions() if s.name in SUBS]
    with transaction.atomic():
        handled = [publish("testapp.order_placed", {"n": i}) for i in range(10)]
        dead = publish("testapp.flaky", {"always_fail": True})
    run_worker(subscriptions=subs)
    assert DeadLetter.objects.filter(event_id=dead, subscription="testapp.flaky").exists()
    flaky_runs = Attempt.objects.filter(subscription="testapp.flaky", event_id=dead).count()
    assert flaky_runs == 3
    # Relayed, then lost before any subscription handled them.
    with transaction.atomic():
        lost = [publish("testapp.order_placed", {"n": 100 + i}) for i in range(7)]
    assert Relay(transport).drain().stored == 7
    assert not pending_ids()
    delete_stream(transport, broker)

    out = run("--since", "1h", "--reason", "NATS store lost on nats-1")
    assert "republished=18 skipped_locked=0 batches=1" in out
    assert pending_ids() == {*handled, dead, *lost}

    run_worker(subscriptions=subs)
    assert not pending_ids()
    for sub in ("testapp.record_order", "testapp.count_order"):
        effects = dict(
            Effect.objects.filter(subscription=sub)
            .values("event_id")
            .annotate(n=Count("id"))
            .values_list("event_id", "n")
        )
        assert effects == dict.fromkeys([*handled, *lost], 1), sub
        assert set(HandledEvent.objects.filter(subscription=sub).values_list("event_id", flat=True)) == {
            *handled,
            *lost,
        }
    # The dead letter stays one: its terminal claim skipped the re-send.
    assert Attempt.objects.filter(subscription="testapp.flaky", event_id=dead).count() == flaky_runs
    assert list(DeadLetter.objects.values_list("event_id", "subscription")) == [(dead, "testapp.flaky")]


def test_after_a_stream_purge_within_the_duplicate_window_the_re_send_is_stored_not_dropped(
    transport, broker, run_worker
):
    """A purged stream still remembers the ids it no longer holds: the
    re-send needs a fresh Nats-Msg-Id, or it would be dropped and lost."""
    from django_platformkit.consume.subscriptions import subscriptions

    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(3)]
    Relay(transport).drain()

    async def purge():
        await transport.connection.js.purge_stream(broker["STREAM"])

    transport.connection.call(purge(), timeout=10)
    assert transport.stream_info().state.messages == 0
    assert run("--since", "1h", "--reason", "stream purged by hand").startswith("republished=3 ")
    stats = Relay(transport).drain()
    assert stats.stored == 3 and stats.duplicates == 0
    assert transport.stream_info().state.messages == 3
    run_worker(subscriptions=[s for s in subscriptions() if s.name == "testapp.record_order"])
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted(ids)


def test_when_the_broker_still_had_the_messages_each_is_delivered_twice_and_handled_once(transport, run_worker):
    from django_platformkit.consume.subscriptions import subscriptions

    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(3)]
    Relay(transport).drain()
    run("--since", "1h", "--reason", "a false alarm")
    assert {r.headers.get("platformkit_replay") for r in OutboxEvent.objects.all()} == {1}
    assert Relay(transport).drain().stored == 3
    assert transport.stream_info().state.messages == 6
    run_worker(subscriptions=[s for s in subscriptions() if s.name == "testapp.record_order"])
    assert sorted(Effect.objects.values_list("event_id", flat=True)) == sorted(ids)


def test_each_republish_gives_the_row_a_new_message_id_after_a_replay_too():
    row = add_event(published_minutes_ago=5)
    OutboxEvent.objects.filter(id=row).update(headers={"platformkit_replay": 2, "traceparent": "00-x"})
    run("--since", "1h", "--reason", "r")
    assert OutboxEvent.objects.get(id=row).headers == {"platformkit_replay": 3, "traceparent": "00-x"}


def test_a_dry_run_writes_nothing_and_says_what_it_would_republish():
    add_event(published_minutes_ago=10)
    add_event(published_minutes_ago=20)
    add_event(published_minutes_ago=None)
    before = tables()
    out = run("--since", "1h", "--reason", "checking", "--dry-run")
    assert tables() == before
    assert "dry run, nothing written: would republish 2 row(s) (published from " in out
    assert "events: all" in out


def test_the_window_is_since_inclusive_until_exclusive_and_only_published_rows():
    three_h, ninety_m, thirty_m = (add_event(published_minutes_ago=m) for m in (180, 90, 30))
    never_sent = add_event(published_minutes_ago=None)
    assert "republished=1 " in run("--since", "2h", "--until", "1h", "--reason", "store lost between 1h and 2h ago")
    assert pending_ids() == {ninety_m, never_sent}

    at = OutboxEvent.objects.get(id=three_h).published_at
    assert republish(since=at, until=at + timedelta(microseconds=1), reason="r").republished == 1
    assert three_h in pending_ids()
    assert republish(since=at - timedelta(hours=1), until=at, reason="r").republished == 0  # until is exclusive


def test_an_iso_since_and_until_and_the_event_filter_select_exactly_the_matching_rows():
    order = add_event(published_minutes_ago=30)
    flaky = add_event(published_minutes_ago=30, name="testapp.flaky")
    slow = add_event(published_minutes_ago=30, name="testapp.slow")
    since = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    out = run("--since", since, "--event", "testapp.flaky", "--event", "testapp.slow", "--reason", "r")
    assert "republished=2 " in out and "events: testapp.flaky, testapp.slow" in out
    assert pending_ids() == {flaky, slow}
    # A naive ISO time is UTC.
    naive = (datetime.now(UTC) - timedelta(hours=1)).replace(tzinfo=None).isoformat()
    assert "republished=1 " in run("--since", naive, "--reason", "r")
    assert order in pending_ids()


def _one_refused_by_the_relay_one_sent():
    """Two rows published 5 minutes ago; the relay dead-lettered the first (the broker refused it)."""
    refused = add_event(published_minutes_ago=5)
    sent = add_event(published_minutes_ago=5)
    record_dead_letter(
        subscription=RELAY_DEAD_LETTERS,
        event_id=refused,
        name="testapp.order_placed",
        tenant=None,
        attempts=1,
        error="too big",
        traceback="",
    )
    return refused, sent


def test_a_row_the_relay_dead_lettered_is_left_to_replay():
    refused, sent = _one_refused_by_the_relay_one_sent()
    assert "would republish 1 row(s)" in run("--since", "1h", "--reason", "r", "--dry-run")
    run("--since", "1h", "--reason", "r")
    assert pending_ids() == {sent}


def test_a_row_the_relay_dead_lettered_stays_left_after_its_dead_letter_is_discarded():
    """Discarding the relay's dead letter accepts that the broker refused the
    row: it never reached the stream, so there is nothing the broker lost.
    Republished, it was re-sent, refused again, and the relay logged a
    "relay dead letter" ERROR and counted it dead-lettered without writing
    one (its terminal claim stayed)."""
    from django_platformkit.operate.deadletters import discard

    refused, sent = _one_refused_by_the_relay_one_sent()
    assert discard(refused, subscription=RELAY_DEAD_LETTERS, actor="ops", reason="too big, accepted")
    assert "would republish 1 row(s)" in run("--since", "1h", "--reason", "r", "--dry-run")
    assert "republished=1 " in run("--since", "1h", "--reason", "r")
    assert pending_ids() == {sent}


def test_it_works_in_batches_prints_progress_and_logs_the_reason_window_and_count(caplog):
    ids = {add_event(published_minutes_ago=m) for m in range(1, 6)}
    with caplog.at_level(logging.INFO, logger="django_platformkit"):
        out = run("--since", "1h", "--reason", "store lost", "--batch-size", "2")
    assert "... republished=2 batches=1" in out and "... republished=4 batches=2" in out
    assert "republished=5 skipped_locked=0 batches=3" in out
    assert pending_ids() == ids
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("republished ")]
    assert "rows=5 " in line and "reason=store lost" in line and "since=" in line and "until=" in line


def test_a_row_locked_by_another_transaction_is_skipped_not_waited_on():
    locked = add_event(published_minutes_ago=5)
    free = add_event(published_minutes_ago=5)
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    with psycopg.connect(**params) as other:
        other.execute("SELECT 1 FROM platformkit_outbox WHERE id = %s FOR UPDATE", [locked])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")  # waiting would fail the test, not hang it
        started = time.monotonic()
        try:
            out = run("--since", "1h", "--reason", "r")
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        assert time.monotonic() - started < 2
        assert "republished=1 skipped_locked=1" in out and "run the same command again" in out
        other.rollback()
    assert pending_ids() == {free}
    assert "republished=1 " in run("--since", "1h", "--reason", "r")
    assert pending_ids() == {free, locked}


def _other_connection():
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    return psycopg.connect(**params)


@pytest.mark.parametrize(
    ("other_does", "then", "taken", "held_pending"),
    [
        # A concurrent republish (or replay) took the row: it is pending, nothing is left to do.
        ("UPDATE platformkit_outbox SET published_at = NULL WHERE id = %s", "commit", False, True),
        # A concurrent purge deleted it: nothing to take.
        ("DELETE FROM platformkit_outbox WHERE id = %s", "commit", False, False),
        # Held, then let go unchanged: taken before the run ends.
        ("SELECT 1 FROM platformkit_outbox WHERE id = %s FOR UPDATE", "rollback", True, True),
    ],
)
def test_skipped_locked_counts_only_rows_still_left_when_the_run_ends(other_does, then, taken, held_pending):
    """Two overlapping republishes, or one beside purgeoutbox, skip each
    other's rows. Those were counted skipped_locked with "run the same command
    again to take them", though the other run had set them pending (a re-run
    re-sends them once more for nothing) or purge had deleted them."""
    held = add_event(published_minutes_ago=5)
    free = add_event(published_minutes_ago=4)
    with _other_connection() as other:
        other.execute(other_does, [held])
        calls = []

        def progress(done, batches):
            calls.append(batches)
            if len(calls) == 1:  # the held row's batch is done: the other transaction ends
                getattr(other, then)()

        result = republish(since=timedelta(hours=1), reason="r", batch_size=1, progress=progress)
    assert calls, "the held row's batch was the last: the test proves nothing"
    assert result.skipped_locked == 0, result
    assert result.republished == (2 if taken else 1), result
    assert pending_ids() == ({free, held} if held_pending else {free})


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (["--reason", "r"], {}, "republish needs --since WHEN"),
        (["--since", "yesterday", "--reason", "r"], {}, "--since 'yesterday': give an age such as 30m"),
        (["--since", "0h", "--reason", "r"], {}, "'0h' is not an age"),
        (["--since", "1h", "--until", "nope", "--reason", "r"], {}, "--until 'nope': give an age"),
        (["--since", "1h", "--until", "2h", "--reason", "r"], {}, "the window is empty"),
        (["--since", "2999-01-01T00:00:00Z", "--reason", "r"], {}, "the window is empty"),
        (["--since", "1h"], {}, 'republish needs --reason "..."'),
        (["--since", "1h", "--reason", "  "], {}, 'republish needs --reason "..."'),
        (["--since", "1h", "--reason", "r", "--event", "testapp.nope"], {}, "unknown event 'testapp.nope'; declared: "),
        (["--since", "1h", "--reason", "r", "--batch-size", "0"], {}, "--batch-size 0: give a whole number of rows"),
        ([], {"since": timedelta(0), "reason": "r"}, "--since datetime.timedelta(0): give an age"),
        ([], {"since": timedelta(hours=1), "reason": "r", "batch_size": -5}, "--batch-size -5"),
        ([], {"since": timedelta(hours=1), "reason": "r", "event": "testapp.nope"}, "unknown event 'testapp.nope'"),
    ],
)
def test_bad_options_are_refused_with_what_to_pass_and_write_nothing(args, kwargs, message):
    add_event(published_minutes_ago=5)
    before = tables()
    with pytest.raises(CommandError) as raised:
        run(*args, **kwargs)
    assert message in str(raised.value)
    assert tables() == before


def test_call_command_takes_a_timedelta_and_a_datetime():
    row = add_event(published_minutes_ago=30)
    assert "republished=1 " in run(since=datetime.now(UTC) - timedelta(hours=1), until=timedelta(minutes=1), reason="r")
    assert pending_ids() == {row}


def test_an_event_removed_from_the_code_stays_known_while_the_outbox_holds_published_rows_of_it():
    gone = add_event(published_minutes_ago=5, name="legacy.removed_event")
    assert "republished=1 " in run("--since", "1h", "--event", "legacy.removed_event", "--reason", "r")
    assert pending_ids() == {gone}


def test_republish_refuses_what_cannot_mean_anything():
    for kwargs, message in (
        ({"since": timedelta(hours=1), "reason": ""}, "needs a reason"),
        ({"since": datetime(2026, 1, 1), "reason": "r"}, "since must be an aware datetime"),
        ({"since": timedelta(hours=-1), "reason": "r"}, "since must be a positive timedelta"),
        ({"since": timedelta(hours=1), "events": "testapp.flaky", "reason": "r"}, "events must be a non-empty list"),
        ({"since": timedelta(hours=1), "events": [], "reason": "r"}, "events must be a non-empty list"),
        ({"since": timedelta(hours=1), "batch_size": 0, "reason": "r"}, "batch_size must be an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            republish(**kwargs)
