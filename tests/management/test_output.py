"""What the operator commands print, by Django's conventions: ``-v 0``
leaves errors and the data asked for only (a result line, a progress line,
a summary are gone), ``-v`` works after a subcommand, outcome words are in
``self.style``'s colours and ``--no-color`` removes them, a long purge says
how far it has got, and a replay of many rows logs one INFO line per batch
(each row on stdout at ``-v 2`` only). Real PostgreSQL."""

from __future__ import annotations

import io
import logging

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.operate.purge import purge
from django_platformkit.outbox.deadletters import record_dead_letter

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args: str, **options) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command(*args, stdout=out, stderr=err, **options)
    return out.getvalue(), err.getvalue()


def dead_letters(n: int) -> None:
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(n)]
    OutboxEvent.objects.filter(pk__in=ids).update(published_at=timezone.now())
    for event_id in ids:
        record_dead_letter(
            subscription="testapp.record_order",
            event_id=event_id,
            name="testapp.order_placed",
            tenant=None,
            attempts=3,
            error="RuntimeError: down",
            traceback="",
        )


@pytest.fixture
def operator(transactional_db) -> User:
    user = User.objects.create_user("olga", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="replay_deadletter"))
    return user


def test_v0_after_a_subcommand_is_accepted_and_leaves_only_the_data(broker):
    dead_letters(2)
    out, err = run("deadletters", "list", "-v", "0")
    assert out.count("testapp.record_order") == 2 and "dead letter(s)" not in out and err == ""
    out, _ = run("deadletters", "list", "-v", "1")
    assert "2 dead letter(s); `deadletters show ID`" in out
    out, err = run(
        "deadletters", "discard", "--subscription", "testapp.record_order", "--reason", "refunded", "-v", "0"
    )
    assert (out, err) == ("", "")
    assert not DeadLetter.objects.exists()


def test_v0_silences_purgeoutbox_stream_cancel_and_pause(transport, operator):
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {})
    assert run("purgeoutbox", "--older-than", "1d", verbosity=0) == ("", "")
    assert run("stream", "update", "-v", "0") == ("", "")
    assert run("cancel", str(event_id), "--actor", "olga", "--reason", "r", verbosity=0) == ("", "")
    assert run("pause", "testapp.record_order", "--actor", "olga", "--reason", "r", verbosity=0) == ("", "")
    assert run("resume", "testapp.record_order", "--actor", "olga", verbosity=0) == ("", "")
    out, _ = run("purgeoutbox", "--older-than", "1d")
    assert out.startswith("deleted outbox=0 ")


def test_outcome_words_are_coloured_and_no_color_removes_it(broker, operator):
    out, _ = run("pause", "testapp.record_order", "--actor", "olga", "--reason", "r", force_color=True)
    assert out.startswith("\x1b[") and "paused\x1b[0m testapp.record_order" in out
    out, _ = run("resume", "testapp.record_order", "--actor", "olga", no_color=True)
    assert "\x1b[" not in out and out.startswith("resumed testapp.record_order")


def test_a_long_purge_says_how_far_it_has_got(broker, caplog):
    with connection.cursor() as cursor:  # 20,000 published rows nobody subscribes to, two days old
        cursor.execute(
            "INSERT INTO platformkit_outbox (id, name, payload, headers, created_at, published_at) "
            "SELECT gen_random_uuid(), 'testapp.with_schema', '{}'::jsonb, '{}'::jsonb, now() - interval '2 days', "
            "now() - interval '2 days' FROM generate_series(1, 20000)"
        )
    with caplog.at_level(logging.INFO, logger="django_platformkit.operate.purge"):
        result = purge(older_than=timezone.timedelta(days=1), batch_size=1000, progress_every_seconds=0)
    assert result.outbox_deleted == 20000
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("purge running")]
    assert len(lines) >= 20 and "phase=outbox deleted=20000 batches=21" in lines[20], lines[-3:]


def test_a_replay_of_many_logs_one_info_line_per_batch_and_each_row_only_at_v2(broker, caplog):
    dead_letters(150)
    with caplog.at_level(logging.DEBUG, logger="django_platformkit.operate.deadletters"):
        out, _ = run("deadletters", "replay", "--subscription", "testapp.record_order", "--reason", "fixed")
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == [
        "replayed dead letters n=100 total=100 actor=" + info[0].split("actor=")[1],
        "replayed dead letters n=50 total=150 actor=" + info[1].split("actor=")[1],
    ]
    assert (
        sum(1 for r in caplog.records if r.levelno == logging.DEBUG and r.getMessage().startswith("replayed event_id="))
        == 150
    )
    assert "replayed=150 refused=0" in out and "subscription=testapp.record_order event_id=" not in out
    dead_letters(3)
    out, _ = run("deadletters", "replay", "--subscription", "testapp.record_order", "--reason", "fixed", "-v", "2")
    assert out.count("subscription=testapp.record_order event_id=") == 3
