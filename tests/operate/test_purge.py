"""Purge never eats evidence: pending rows, rows in use, dead-lettered rows and
the claims that still guard a row stay; old published rows and spent claims
go, in bounded batches, by the database's clock."""

from __future__ import annotations

import re
import time
import uuid
from datetime import timedelta
from io import StringIO

import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from django_platformkit.broker.streams import stream_config
from django_platformkit.jobs.specs import PURGE_JOB, jobs
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.operate.purge import purge

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def own_stream_namespace(broker):
    """A stream name of this test's own (``broker``): the purge reads the
    stream's real max age from NATS, and a stream another test made must not
    decide this one's retention. No stream exists until a test makes one."""


def add_event(*, published_days_ago: float | None, created_days_ago: float = 10.0) -> uuid.UUID:
    """One outbox row, backdated by the database clock; ``None``: pending."""
    event_id = uuid.uuid4()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, published_at) "
            "VALUES (%s, 'testapp.order_placed', '{}', '{}', now() - make_interval(days => %s), "
            "now() - make_interval(secs => %s * 86400))",
            [event_id, int(created_days_ago), published_days_ago],
        )
    return event_id


def add_claim(subscription: str, event_id: uuid.UUID, *, days_ago: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_handled (subscription, event_id, handled_at) VALUES (%s, %s, now() - make_interval(secs => %s * 86400))",
            [subscription, event_id, days_ago],
        )


def add_dead_letter(subscription: str, event_id: uuid.UUID, *, days_ago: float = 9.0) -> None:
    """A dead letter and its terminal claim, as the consumer writes them."""
    DeadLetter.objects.create(
        event_id=event_id, subscription=subscription, name="testapp.order_placed", attempts=5, error="boom"
    )
    add_claim(subscription, event_id, days_ago=days_ago)


def subscribers_of(event: str) -> list[str]:
    from django_platformkit.consume.subscriptions import subscriptions

    return [s.name for s in subscriptions() if s.event == event]


def outbox_ids() -> set[uuid.UUID]:
    return set(OutboxEvent.objects.values_list("id", flat=True))


def test_old_published_rows_go_and_pending_recent_and_dead_lettered_rows_stay():
    old = {add_event(published_days_ago=days) for days in (8, 10, 30)}
    pending = add_event(published_days_ago=None, created_days_ago=30)
    recent = add_event(published_days_ago=6.9)
    dead_lettered = add_event(published_days_ago=20)
    add_dead_letter("testapp.record_order", dead_lettered)
    refused_by_broker = add_event(published_days_ago=20)
    add_dead_letter("platformkit.relay", refused_by_broker)

    result = purge(older_than=timedelta(days=7))

    assert result.outbox_deleted == 3 and not result.dry_run
    assert outbox_ids() == {pending, recent, dead_lettered, refused_by_broker}
    assert not outbox_ids() & old
    assert DeadLetter.objects.count() == 2
    assert HandledEvent.objects.count() == 2  # the terminal claims stay with their dead letters


def test_a_row_locked_by_a_relay_is_skipped_not_waited_on():
    locked = add_event(published_days_ago=10)
    free = add_event(published_days_ago=10)
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    with psycopg.connect(**params) as relay:
        relay.execute("SELECT 1 FROM platformkit_outbox WHERE id = %s FOR UPDATE", [locked])
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '5s'")  # waiting would fail the test, not hang it
        started = time.monotonic()
        try:
            result = purge(older_than=timedelta(days=7))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("RESET lock_timeout")
        assert time.monotonic() - started < 2
        assert result.outbox_deleted == 1 and result.skipped_locked == 1
        assert outbox_ids() == {locked}
        relay.rollback()
    assert purge(older_than=timedelta(days=7)).outbox_deleted == 1
    assert not outbox_ids() and free not in outbox_ids()


def test_fifty_thousand_old_rows_go_in_bounded_batches():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, published_at) "
            "SELECT gen_random_uuid(), 'testapp.order_placed', '{}', '{}', now() - interval '40 days', "
            "now() - interval '30 days' + n * interval '1 millisecond' FROM generate_series(1, 50000) AS n"
        )
        cursor.execute(
            "INSERT INTO platformkit_handled (subscription, event_id, handled_at) "
            "SELECT 'testapp.record_order', id, published_at FROM platformkit_outbox"
        )
    keep = add_event(published_days_ago=1)
    statements = []

    def count_batches(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    started = time.monotonic()
    with connection.execute_wrapper(count_batches):
        result = purge(older_than=timedelta(days=7), batch_size=2000)
    elapsed = time.monotonic() - started
    assert (result.outbox_deleted, result.claims_deleted) == (50000, 50000)
    assert outbox_ids() == {keep} and HandledEvent.objects.count() == 0
    # 25 full batches and a short one for each table (and one empty page of
    # attempt history): no transaction held more than 2000 rows.
    assert result.batches == 26 + 26 + 1
    assert sum("DELETE FROM platformkit_outbox" in sql for sql in statements) == 26
    assert elapsed < 60


def test_claims_go_when_old_their_row_gone_and_not_the_terminal_claim_of_a_dead_letter():
    published_old = add_event(published_days_ago=10)  # purged in this run: its claim goes too
    published_recent = add_event(published_days_ago=1)
    pending = add_event(published_days_ago=None)
    gone_long_ago = uuid.uuid4()
    gone_recently = uuid.uuid4()
    dead_without_row = uuid.uuid4()  # an operator deleted the row; the dead letter still stands
    add_claim("testapp.record_order", published_old, days_ago=9)
    add_claim("testapp.record_order", published_recent, days_ago=9)  # its row is still there
    add_claim("testapp.record_order", pending, days_ago=9)  # replayed: pending again
    add_claim("testapp.record_order", gone_long_ago, days_ago=9)
    add_claim("testapp.record_order", gone_recently, days_ago=2)  # the stream may still redeliver it
    add_dead_letter("testapp.count_order", dead_without_row, days_ago=9)
    add_claim("testapp.record_order", dead_without_row, days_ago=9)  # another subscription's plain claim

    dry = purge(older_than=timedelta(days=7), dry_run=True)
    result = purge(older_than=timedelta(days=7))

    assert (dry.outbox_deleted, dry.claims_deleted) == (result.outbox_deleted, result.claims_deleted) == (1, 3)
    left = set(HandledEvent.objects.values_list("subscription", "event_id"))
    assert left == {
        ("testapp.record_order", published_recent),
        ("testapp.record_order", pending),
        ("testapp.record_order", gone_recently),
        ("testapp.count_order", dead_without_row),
    }


def test_a_dry_run_counts_and_deletes_nothing():
    for days in (8, 9, 10):
        add_claim("testapp.record_order", add_event(published_days_ago=days), days_ago=days)
    add_event(published_days_ago=None)
    before = (outbox_ids(), HandledEvent.objects.count())
    out = StringIO()
    call_command("purgeoutbox", "--older-than", "7d", "--dry-run", stdout=out)
    assert out.getvalue().startswith("dry run, nothing deleted: would delete outbox=3 claims=3 (published before ")
    assert (outbox_ids(), HandledEvent.objects.count()) == before


def test_purgeoutbox_takes_an_age_in_hours_and_prints_what_it_did():
    old = add_event(published_days_ago=0.75)  # 18 hours
    young = add_event(published_days_ago=0.25)  # 6 hours
    for subscription in subscribers_of("testapp.order_placed"):
        add_claim(subscription, old, days_ago=0.7)  # handled by every subscription: nothing needs the row now
    out = StringIO()
    call_command("purgeoutbox", "--older-than", "12h", "--batch-size", "10", stdout=out)
    assert out.getvalue().startswith(
        "deleted outbox=1 claims=0 attempts=0 skipped_locked=0 batches=3 (published before "
    )
    assert outbox_ids() == {young} and old not in outbox_ids()
    for bad in ("12", "0d", "1y", "-3h"):
        with pytest.raises(CommandError, match="is not an age such as 30m, 12h, 7d or 2w"):
            call_command("purgeoutbox", f"--older-than={bad}")
    with pytest.raises(CommandError, match="is not a number of rows"):
        call_command("purgeoutbox", "--batch-size", "0")


def test_the_default_age_is_the_retention_and_the_cutoff_is_the_database_clock(settings):
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, RETENTION_DAYS=3)
    stays, goes = add_event(published_days_ago=2.9), add_event(published_days_ago=3.1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        database_now = cursor.fetchone()[0]
    result = purge()
    assert outbox_ids() == {stays} and goes not in outbox_ids()
    assert abs(result.cutoff - (database_now - timedelta(days=3))) < timedelta(seconds=5)
    # A message can't outlive the claim that guards it.
    assert stream_config().max_age == 3 * 86400


def test_the_hourly_purge_job_uses_the_retention(settings):
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, RETENTION_DAYS=1)
    spec = next(spec for spec in jobs() if spec.name == PURGE_JOB)
    assert spec.every == timedelta(hours=1)
    stays, goes = add_event(published_days_ago=0.5), add_event(published_days_ago=2)
    spec.func()
    assert outbox_ids() == {stays} and goes not in outbox_ids()


def test_purge_works_with_server_side_cursors_disabled():
    add_event(published_days_ago=10)
    connection.settings_dict["DISABLE_SERVER_SIDE_CURSORS"] = True
    try:
        assert purge(older_than=timedelta(days=7)).outbox_deleted == 1
    finally:
        connection.settings_dict.pop("DISABLE_SERVER_SIDE_CURSORS")


def test_purge_refuses_a_bad_age_or_batch_size():
    with pytest.raises(ValueError, match="older_than must be a positive timedelta"):
        purge(older_than=timedelta(0))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        purge(older_than=timedelta(days=1), batch_size=0)


# --- what the stream can still deliver stays guarded ---------------------------


def add_attempt(subscription: str, event_id: uuid.UUID) -> None:
    from django_platformkit.models import Attempt

    Attempt.objects.create(subscription=subscription, event_id=event_id, attempt=1, outcome="failed", error="boom")


def test_a_short_purge_keeps_claims_and_rows_the_stream_can_still_deliver():
    subscribers = subscribers_of("testapp.order_placed")
    assert len(subscribers) >= 2
    handled_by_all, handled_by_some, retrying = (add_event(published_days_ago=1 / 24) for _ in range(3))
    for subscription in subscribers:
        add_claim(subscription, handled_by_all, days_ago=0.5 / 24)
        add_claim(subscription, retrying, days_ago=0.5 / 24)
    add_claim(subscribers[0], handled_by_some, days_ago=0.5 / 24)
    add_attempt("otherdeploy.audit", retrying)  # a retry in flight in a subscription this build doesn't have
    gone_row_claim = uuid.uuid4()
    add_claim(subscribers[0], gone_row_claim, days_ago=3)  # its row is gone; the stream keeps the message 7 days

    dry = purge(older_than=timedelta(seconds=1), dry_run=True)
    result = purge(older_than=timedelta(seconds=1))

    assert (dry.outbox_deleted, result.outbox_deleted) == (1, 1)
    assert outbox_ids() == {handled_by_some, retrying}
    # Every claim stays: all of them are younger than RETENTION_DAYS (the stream's max age).
    assert result.claims_deleted == dry.claims_deleted == 0
    assert HandledEvent.objects.filter(event_id=gone_row_claim).exists()
    assert HandledEvent.objects.filter(event_id=handled_by_all).count() == len(subscribers)


def test_attempt_history_goes_with_the_claims_not_before():
    from django_platformkit.models import Attempt

    event_id = add_event(published_days_ago=10)
    for subscription in subscribers_of("testapp.order_placed"):
        add_claim(subscription, event_id, days_ago=9)
    add_attempt(subscribers_of("testapp.order_placed")[0], event_id)
    Attempt.objects.update(started_at=timezone_now() - timedelta(days=9))
    young = uuid.uuid4()
    add_claim("testapp.record_order", young, days_ago=1)
    add_attempt("testapp.record_order", young)
    result = purge()
    assert result.outbox_deleted == 1 and result.attempts_deleted == 1
    assert list(Attempt.objects.values_list("event_id", flat=True)) == [young]


def timezone_now():
    from django.utils import timezone

    return timezone.now()


def test_purge_older_than_one_second_then_a_durable_re_created_handles_nothing_twice(transport, run_worker):
    from django.db import transaction

    from django_platformkit import publish
    from django_platformkit.consume.subscriptions import subscriptions
    from tests.testapp.models import Effect

    subscribers = [
        s
        for s in subscriptions()
        if s.event == "testapp.order_placed" and s.name in ("testapp.record_order", "testapp.count_order")
    ]
    with transaction.atomic():
        for n in range(50):
            publish("testapp.order_placed", {"n": n})
    run_worker(subscriptions=subscribers)
    before = sorted(Effect.objects.values_list("subscription", "event_id"))
    assert len(before) == 50 * len(subscribers)
    time.sleep(1.2)
    call_command("purgeoutbox", "--older-than", "1s", stdout=StringIO())
    # The README's advice after drift: delete the durable; the worker makes it again (deliver all).
    for subscription in subscribers:
        transport.connection.call(
            transport.connection.js.delete_consumer(transport_stream(), subscription.durable), timeout=10
        )
    run_worker(subscriptions=subscribers)
    assert sorted(Effect.objects.values_list("subscription", "event_id")) == before


def test_a_lowered_retention_days_purges_nothing_the_stream_can_still_deliver(transport, run_worker, settings):
    """Issue 27: RETENTION_DAYS lowered on an existing stream is only a
    drift warning - the stream keeps its longer max age - and the purge went
    by the setting: a re-created durable met the purged rows and claims, and
    50 of 50 events became "(malformed) ... purged" dead letters."""
    from django.db import transaction

    from django_platformkit import publish
    from django_platformkit.consume.subscriptions import subscriptions
    from tests.testapp.models import Effect

    subscribers = [s for s in subscriptions() if s.name in ("testapp.record_order", "testapp.count_order")]
    with transaction.atomic():
        for n in range(50):
            publish("testapp.order_placed", {"n": n})
    run_worker(subscriptions=subscribers)  # the stream: max age 7 days (RETENTION_DAYS)
    before = sorted(Effect.objects.values_list("subscription", "event_id"))
    assert len(before) == 50 * len(subscribers)
    with connection.cursor() as cursor:  # two days pass
        cursor.execute(
            "UPDATE platformkit_outbox SET created_at = created_at - interval '2 days', "
            "published_at = published_at - interval '2 days'"
        )
        cursor.execute("UPDATE platformkit_handled SET handled_at = handled_at - interval '2 days'")
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, RETENTION_DAYS=1)
    out = StringIO()
    call_command("purgeoutbox", stdout=out)
    assert out.getvalue().startswith("deleted outbox=0 claims=0 ")
    assert OutboxEvent.objects.count() == 50
    for subscription in subscribers:  # re-created: it delivers every retained message again
        transport.upkeep.delete_durables([subscription.durable])
    run_worker(subscriptions=subscribers)
    assert not DeadLetter.objects.exists(), list(DeadLetter.objects.values_list("name", "error")[:3])
    assert sorted(Effect.objects.values_list("subscription", "event_id")) == before


def test_without_an_answer_from_nats_the_purge_deletes_nothing(settings):
    from django_platformkit.devservices import free_port

    goes = add_event(published_days_ago=30)
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, NATS_URL=f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(CommandError, match=r"^nothing was deleted: .* can't read the stream's max age now"):
        call_command("purgeoutbox", stdout=StringIO())
    jobs_purge = next(spec for spec in jobs() if spec.name == PURGE_JOB)
    jobs_purge.func()  # the hourly job skips, with a WARNING: next hour tries again
    assert goes in outbox_ids()
    # A caller that knows the stream's max age needs no broker.
    assert purge(stream_max_age=timedelta(days=7)).outbox_deleted == 1


def transport_stream() -> str:
    from django_platformkit import conf

    return conf.settings.STREAM


@pytest.mark.process
def test_purgeoutbox_with_skip_checks_keeps_a_row_only_a_urlconf_subscription_still_needs(broker):
    """With ``--skip-checks`` nothing imported the URLconf, so a subscription
    declared in a module only it imports (a views.py) wasn't among the
    guards and its unhandled rows were purged. purgeoutbox imports it."""

    from tests.conftest import url_only_command

    needed = add_event(published_days_ago=0.75)
    for subscription in subscribers_of("testapp.order_placed"):  # this process: no testapp.url_only
        add_claim(subscription, needed, days_ago=0.7)

    def purge_in_a_process() -> str:
        return url_only_command(broker, "purgeoutbox", "--skip-checks", "--older-than", "12h")

    assert "deleted outbox=0 " in purge_in_a_process()
    assert needed in outbox_ids()
    add_claim("testapp.url_only", needed, days_ago=0.7)  # now every subscription has handled it
    assert "deleted outbox=1 " in purge_in_a_process()
    assert needed not in outbox_ids()


@pytest.mark.parametrize(
    "option, bad",
    [
        ("--older-than", "0d"),
        ("--older-than", "12"),
        ("--older-than", "-3h"),
        ("--older-than", "99999999w"),
        ("--batch-size", "0"),
        ("--batch-size", "-5"),
        ("--batch-size", "ten"),
    ],
)
def test_call_command_refuses_a_bad_age_or_batch_size_with_the_command_lines_words(option, bad):
    """call_command() hands keyword values to handle() unparsed (no argparse
    ``type=``): a bad one must be refused there, in the same words, before
    anything is deleted."""
    gone_if_run = add_event(published_days_ago=10)
    with pytest.raises(CommandError) as from_the_command_line:
        call_command("purgeoutbox", f"{option}={bad}", stdout=StringIO())
    with pytest.raises(CommandError) as from_keywords:
        call_command("purgeoutbox", **{option[2:].replace("-", "_"): bad}, stdout=StringIO())
    assert str(from_keywords.value) == str(from_the_command_line.value)
    assert str(from_keywords.value).startswith(f"Error: argument {option}: ")
    assert gone_if_run in outbox_ids()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"older_than": timedelta(0)}, "0:00:00 is not an age such as 30m, 12h, 7d or 2w"),
        ({"older_than": timedelta(days=-1)}, "-1 day, 0:00:00 is not an age"),
        ({"batch_size": 0}, "0 is not a number of rows >= 1"),
        ({"batch_size": True}, "True is not a number of rows >= 1"),
    ],
)
def test_call_command_refuses_a_typed_value_the_command_line_could_not_give(options, message):
    gone_if_run = add_event(published_days_ago=10)
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("purgeoutbox", **options, stdout=StringIO())
    assert gone_if_run in outbox_ids()


def test_call_command_takes_an_age_and_a_batch_size_as_text_or_typed():
    for options in ({"older_than": "12h", "batch_size": "10"}, {"older_than": timedelta(hours=12), "batch_size": 10}):
        old = add_event(published_days_ago=10)
        out = StringIO()
        call_command("purgeoutbox", **options, stdout=out)
        assert out.getvalue().startswith("deleted outbox=1 "), out.getvalue()
        assert old not in outbox_ids()
