"""``manage.py deadletters``: list/show/replay/discard against the real
database; --dry-run writes nothing, otherwise exactly the matching rows."""

import getpass
import io
import json
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone

from django_platformkit import publish
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter
from tests.conftest import tables

pytestmark = pytest.mark.django_db(transaction=True)


def operator(username, *, active=True, permitted=True):
    """A Django user as ``--actor`` names one: active, holding the permission
    the admin's Replay and Discard need (unless told otherwise)."""
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user(username, is_active=active)
    if permitted:
        user.user_permissions.add(Permission.objects.get(codename="replay_deadletter"))
    return user


def run(*args, **options):
    out, err = io.StringIO(), io.StringIO()
    call_command("deadletters", *args, stdout=out, stderr=err, **options)
    return out.getvalue()


@pytest.fixture
def dead():
    """Three published events that dead-lettered: two on testapp.flaky (one of
    them two hours ago), one on testapp.record_order."""
    with transaction.atomic():
        old = publish("testapp.flaky", {"n": 1})
        new = publish("testapp.flaky", {"n": 2})
        other = publish("testapp.order_placed", {"n": 3})
    OutboxEvent.objects.update(published_at=timezone.now())
    for sub, event_id, name in (
        ("testapp.flaky", old, "testapp.flaky"),
        ("testapp.flaky", new, "testapp.flaky"),
        ("testapp.record_order", other, "testapp.order_placed"),
    ):
        assert record_dead_letter(
            subscription=sub,
            event_id=event_id,
            name=name,
            tenant=None,
            attempts=3,
            error=f"RuntimeError: boom {event_id}\nsecond line",
            traceback="Traceback (most recent call last):\n  boom",
        )
    DeadLetter.objects.filter(event_id=old).update(failed_at=timezone.now() - timedelta(hours=2))
    return {"old": old, "new": new, "other": other, "ids": {d.event_id: d.id for d in DeadLetter.objects.all()}}


def test_replay_dry_run_writes_nothing_and_says_what_it_would_replay(dead):
    before = tables()
    out = run("replay", "--subscription", "testapp.flaky", "--since", "1h", "--reason", "fixed the bug", "--dry-run")
    assert tables() == before
    assert f"would replay {dead['ids'][dead['new']]} subscription=testapp.flaky event_id={dead['new']}" in out
    assert "would replay 1 dead letter(s)" in out
    assert str(dead["old"]) not in out and str(dead["other"]) not in out


def test_replay_by_subscription_and_since_replays_exactly_the_matching_rows(dead):
    out = run("replay", "--subscription", "testapp.flaky", "--since", "1h", "--reason", "fixed the bug")
    assert f"replayed=1 refused=0 actor={getpass.getuser()}" in out
    assert set(DeadLetter.objects.values_list("event_id", flat=True)) == {dead["old"], dead["other"]}
    assert set(
        OutboxEvent.objects.filter(published_at__isnull=True, name="testapp.flaky").values_list("id", flat=True)
    ) == {dead["new"]}
    assert not HandledEvent.objects.filter(event_id=dead["new"]).exists()  # its terminal claim is gone
    assert HandledEvent.objects.filter(event_id__in=[dead["old"], dead["other"]]).count() == 2  # theirs stay
    (audit,) = OutboxEvent.objects.filter(name="platformkit.event_replayed")
    assert audit.payload == {
        "event_id": str(dead["new"]),
        "name": "testapp.flaky",
        "subscription": "testapp.flaky",
        "actor": getpass.getuser(),
        "reason": "fixed the bug",
    }


def test_replay_takes_dead_letter_ids_and_event_ids_and_an_actor(dead):
    operator("alice")
    out = run("replay", str(dead["ids"][dead["other"]]), str(dead["old"]), "--reason", "retry", "--actor", "alice")
    assert "replayed=2 refused=0 actor=alice" in out
    assert set(DeadLetter.objects.values_list("event_id", flat=True)) == {dead["new"]}
    actors = {e.payload["actor"] for e in OutboxEvent.objects.filter(name="platformkit.event_replayed")}
    assert actors == {"alice"}


def test_replay_refuses_without_a_selection_or_for_an_unknown_id(dead):
    before = tables()
    with pytest.raises(CommandError, match="name the dead letters"):
        run("replay", "--reason", "everything")
    with pytest.raises(CommandError, match="no dead letter matches 999999"):
        run("replay", "999999", "--reason", "x")
    assert tables() == before


def test_a_malformed_dead_letter_is_refused_and_the_others_still_replay(dead):
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_dead_letters (event_id, subscription, name, attempts, error, traceback, failed_at) "
            "VALUES (gen_random_uuid(), 'testapp.flaky', '(malformed)', 1, 'malformed message', '', now())"
        )
    with pytest.raises(CommandError, match="1 of 2 dead letter"):
        run("replay", "--subscription", "testapp.flaky", "--since", "1h", "--reason", "r")
    assert not DeadLetter.objects.filter(event_id=dead["new"]).exists()
    assert DeadLetter.objects.filter(name="(malformed)").exists()


def test_discard_deletes_the_dead_letter_and_keeps_its_terminal_claim(dead):
    before = tables()
    run("discard", str(dead["ids"][dead["old"]]), "--reason", "obsolete", "--dry-run")
    assert tables() == before
    out = run("discard", str(dead["ids"][dead["old"]]), "--reason", "obsolete")
    assert "discarded=1 refused=0" in out
    assert not DeadLetter.objects.filter(event_id=dead["old"]).exists()
    assert HandledEvent.objects.filter(event_id=dead["old"], subscription="testapp.flaky").exists()
    assert DeadLetter.objects.count() == 2


def test_list_shows_ids_event_ids_and_the_first_line_of_the_error(dead):
    out = run("list", "--subscription", "testapp.flaky")
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["ID", "FAILED"]
    assert str(dead["new"]) in lines[1] and str(dead["old"]) in lines[2]  # newest first
    assert "second line" not in out
    assert "2 dead letter(s)" in out
    rows = json.loads(run("list", "--format", "json", "--since", "1h"))
    assert {r["event_id"] for r in rows} == {str(dead["new"]), str(dead["other"])}
    assert all("second line" in r["error"] for r in rows)


def test_show_prints_the_error_traceback_and_payload(dead):
    out = run("show", str(dead["ids"][dead["new"]]))
    assert f"RuntimeError: boom {dead['new']}" in out
    assert "Traceback (most recent call last):" in out
    assert '"n": 2' in out
    assert run("show", str(dead["other"])).count("dead letter ") == 1


def test_show_prints_a_run_that_never_reported_as_running_with_no_finish(dead):
    from django_platformkit.models import Attempt

    Attempt.objects.create(
        subscription="testapp.flaky", event_id=dead["new"], attempt=1, outcome="failed", finished_at=timezone.now()
    )
    Attempt.objects.create(subscription="testapp.flaky", event_id=dead["new"], attempt=2, worker="host:42")
    failed, never_reported = [line.split() for line in run("show", str(dead["new"])).splitlines() if "    #" in line]
    assert failed[:2] == ["#1", "failed"] and failed[failed.index("finished") + 1] != "-"
    assert never_reported[:2] == ["#2", "running"] and never_reported[-2:] == ["-", "host:42"]  # finished -


@pytest.mark.process
@pytest.mark.parametrize(
    "args, marker",
    [
        (["purgeoutbox", "--older-than", "1h"], "outbox="),
        (["purgeoutbox", "--older-than", "1h", "--dry-run"], "outbox="),
        (["runworker", "--burst", "--no-jobs", "--subscription", "testapp.record_order"], "relayed="),
        (["runrelay", "--once"], "relayed="),
    ],
)
def test_operator_commands_print_their_result_once(args, marker, broker):
    """stdout carries the result; the log (stderr) doesn't repeat it."""
    import subprocess
    import sys

    from tests.conftest import ROOT, worker_env

    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
    OutboxEvent.objects.update(published_at=timezone.now() - timedelta(hours=2)) if args[0] == "purgeoutbox" else None
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "manage.py"), *args],
        env=worker_env(broker),
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, err
    assert (out + err).count(marker) == 1, (out, err)
    assert marker in out


@pytest.mark.parametrize("action", ["list", "replay", "discard"])
def test_an_unknown_subscription_is_an_error_naming_the_known_ones_not_no_dead_letters(dead, action):
    before = tables()
    extra = [] if action == "list" else ["--reason", "typo"]
    with pytest.raises(CommandError) as raised:
        run(action, "--subscription", "testapp.flaki", *extra)
    message = str(raised.value)
    assert "unknown subscription 'testapp.flaki'" in message
    assert "testapp.flaky" in message and "platformkit.relay" in message
    assert tables() == before


def test_a_subscription_gone_from_the_code_stays_listable_while_it_has_dead_letters(dead):
    DeadLetter.objects.filter(event_id=dead["other"]).update(subscription="retired.old_handler")
    out = run("list", "--subscription", "retired.old_handler")
    assert str(dead["other"]) in out
    assert str(dead["new"]) not in out


def test_a_dry_run_refuses_what_the_replay_would_refuse_and_says_why(dead):
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO platformkit_dead_letters (event_id, subscription, name, attempts, error, traceback, failed_at) "
            "VALUES (gen_random_uuid(), 'testapp.flaky', '(malformed)', 1, 'malformed message', '', now())"
        )
    before = tables()
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError, match="1 of 2 dead letter"):
        call_command(
            "deadletters",
            *("replay", "--subscription", "testapp.flaky", "--since", "1h", "--reason", "r", "--dry-run"),
            stdout=out,
            stderr=err,
        )
    assert "would refuse" in err.getvalue() and "malformed message" in err.getvalue()
    assert f"event_id={dead['new']}" in out.getvalue()
    assert "would replay 1 dead letter(s), refuse 1" in out.getvalue()
    assert tables() == before


def test_a_dead_letter_of_a_subscription_this_build_lacks_is_not_replayed(dead):
    DeadLetter.objects.filter(event_id=dead["other"]).update(subscription="retired.old_handler")
    before = tables()
    err = io.StringIO()
    with pytest.raises(CommandError, match="1 of 1 dead letter"):
        call_command(
            "deadletters",
            *("replay", "--subscription", "retired.old_handler", "--reason", "r"),
            stdout=io.StringIO(),
            stderr=err,
        )
    assert "declares no subscription 'retired.old_handler'" in err.getvalue()
    assert tables() == before  # the dead letter stays: the operator still sees the event
    assert str(dead["other"]) in run("list", "--subscription", "retired.old_handler")


@pytest.mark.parametrize("limit", ["-1", "many"])
def test_a_limit_that_is_not_a_row_count_is_an_argument_error(dead, limit):
    with pytest.raises(CommandError, match="not a row count"):
        run("list", "--limit", limit)


@pytest.mark.parametrize("dry_run", [False, True])
def test_without_a_name_for_the_os_user_replay_says_to_pass_actor_not_a_traceback(dead, monkeypatch, dry_run):
    # A container run under a user id of its own: no USER/LOGNAME and no
    # passwd entry, so getpass.getuser() raises (KeyError before Python 3.13).
    import pwd

    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)

    def unknown_uid(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", unknown_uid)
    before = tables()
    args = ["replay", str(dead["ids"][dead["new"]]), "--reason", "fixed"] + (["--dry-run"] if dry_run else [])
    with pytest.raises(CommandError, match="pass --actor NAME"):
        run(*args)
    assert tables() == before
    # With --actor it works.
    operator("alice")
    out = run(*args, "--actor", "alice")
    assert ("would replay 1" in out) if dry_run else ("replayed=1 refused=0 actor=alice" in out)


@pytest.mark.process
@pytest.mark.parametrize("verb", ["replay", "discard"])
def test_with_skip_checks_a_subscription_only_the_urlconf_imports_is_known(broker, verb):
    """With ``--skip-checks`` nothing imported the URLconf: a subscription
    declared in a views.py read as removed (replay refused it) or unknown
    (a discard by --subscription). The command imports it."""

    from tests.conftest import url_only_command

    if verb == "replay":
        with transaction.atomic():
            event_id = publish("testapp.order_placed", {"n": 1})
        OutboxEvent.objects.update(published_at=timezone.now())
        assert record_dead_letter(
            subscription="testapp.url_only",
            event_id=event_id,
            name="testapp.order_placed",
            tenant=None,
            attempts=3,
            error="RuntimeError: boom",
            traceback="",
        )
    operator("ops")
    output = url_only_command(
        broker,
        *("deadletters", "--skip-checks", verb, "--subscription", "testapp.url_only"),
        *("--reason", "fixed", "--actor", "ops"),
    )
    if verb == "replay":
        assert "replayed=1 refused=0 actor=ops" in output
        assert not DeadLetter.objects.filter(subscription="testapp.url_only").exists()
    else:
        assert "nothing to discard: no dead letter matches" in output


@pytest.mark.parametrize("option, bad", [("--limit", "-1"), ("--limit", "many"), ("--since", "0d"), ("--since", "1y")])
def test_call_command_refuses_a_bad_limit_or_age_with_the_command_lines_words(dead, option, bad):
    """call_command() hands keyword values to handle() unparsed: a --limit of
    -1 dropped the last row and a --since of text crashed in the query."""
    with pytest.raises(CommandError) as from_the_command_line:
        run("list", option, bad)
    with pytest.raises(CommandError) as from_keywords:
        run("list", **{option[2:]: bad})
    assert str(from_keywords.value) == str(from_the_command_line.value)
    assert str(from_keywords.value).startswith(f"Error: argument {option}: ")


def test_call_command_refuses_a_negative_since_and_limit_and_takes_typed_good_ones(dead):
    before = tables()
    with pytest.raises(CommandError, match="is not an age such as"):
        call_command("deadletters", "replay", since=timedelta(hours=-1), reason="r", stdout=io.StringIO())
    with pytest.raises(CommandError, match="not a row count"):
        run("list", limit=-1)
    assert tables() == before
    shown = run("list", limit=1, since="1h")
    assert "1 of 2 dead letter(s)" in shown and str(dead["old"]) not in shown  # two within the hour, one shown
    assert str(dead["old"]) not in run("list", since=timedelta(hours=1))


def _history():
    from django.contrib.admin.models import LogEntry

    return {
        (e.content_type.model, e.object_id, e.action_flag): (e.user.username, e.get_change_message())
        for e in LogEntry.objects.all()
    }


def test_an_actor_that_is_a_user_gets_the_admin_history_the_admins_own_action_writes(dead):
    """The admin's Replay/Discard leave a LogEntry on the dead letter and the
    outbox row; the command left none, so the History pages missed what an
    operator did from a shell."""
    from django.contrib.admin.models import CHANGE, DELETION

    operator("olga")
    replayed, discarded = dead["ids"][dead["new"]], dead["ids"][dead["other"]]
    assert "replayed=1 refused=0 actor=olga" in run("replay", str(replayed), "--reason", "fixed", "--actor", "olga")
    assert "discarded=1 refused=0 actor=olga" in run(
        "discard", str(discarded), "--reason", "cancelled", "--actor", "olga"
    )
    assert _history() == {
        ("deadletter", str(replayed), CHANGE): (
            "olga",
            f"Replayed for subscription testapp.flaky (event {dead['new']}). Reason: fixed",
        ),
        ("outboxevent", str(dead["new"]), CHANGE): (
            "olga",
            f"Replayed for subscription testapp.flaky (event {dead['new']}). Reason: fixed",
        ),
        ("deadletter", str(discarded), DELETION): (
            "olga",
            f"Discarded for subscription testapp.record_order (event {dead['other']}). Reason: cancelled",
        ),
        ("outboxevent", str(dead["other"]), CHANGE): (
            "olga",
            f"Discarded for subscription testapp.record_order (event {dead['other']}). Reason: cancelled",
        ),
    }


@pytest.mark.parametrize("verb", ["replay", "discard"])
@pytest.mark.parametrize(
    ("actor", "why"),
    [
        ("pager-bot", "no such user"),  # accepted before, with no LogEntry: any name acted
        ("ivan", "the user is inactive"),
        ("nora", "lacks the permission 'django_platformkit.replay_deadletter'"),
    ],
)
def test_an_actor_who_is_not_an_active_user_holding_the_permission_is_refused_and_nothing_is_written(
    dead, verb, actor, why
):
    """The admin's Replay and Discard need an active user with the
    permission; the command wrote the admin's LogEntry as any user - one
    without the permission, an inactive one - and took an unknown name."""
    from django.contrib.admin.models import LogEntry

    operator("ivan", active=False)
    operator("nora", permitted=False)
    before = tables()
    for dry_run in ([], ["--dry-run"]):
        with pytest.raises(CommandError) as refused:
            run(verb, str(dead["ids"][dead["new"]]), "--reason", "fixed", "--actor", actor, *dry_run)
        assert str(refused.value).startswith(f"deadletters {verb} --actor {actor}: refused, nothing written: ")
        assert why in str(refused.value)
    assert tables() == before
    assert not LogEntry.objects.exists()


def test_a_dry_run_and_a_refused_replay_write_no_admin_history(dead):
    operator("olga")
    run("discard", str(dead["ids"][dead["other"]]), "--reason", "r", "--actor", "olga", "--dry-run")
    DeadLetter.objects.filter(event_id=dead["old"]).update(subscription="retired.old_handler")
    with pytest.raises(CommandError, match="1 of 1 dead letter"):
        run("replay", str(dead["ids"][dead["old"]]), "--reason", "r", "--actor", "olga")
    assert _history() == {}
    assert not OutboxEvent.objects.filter(name="platformkit.event_replayed").exists()


def test_list_and_show_print_control_characters_escaped_not_as_terminal_escapes():
    """A handler's error often quotes input (a payload value in a
    ValueError): its escape sequences reached the operator's terminal as they
    were - colours, a cleared screen, a carriage return that overwrites what
    the line said. They are printed escaped (\\x1b, \\x0d)."""
    with transaction.atomic():
        event_id = publish("testapp.flaky", {"n": 1})
    hostile = "RuntimeError: bad \x1b[2J\x1b[31mred\x07 \x9b6n\rfine"
    assert record_dead_letter(
        subscription="testapp.flaky",
        event_id=event_id,
        name="testapp.flaky",
        tenant=None,
        attempts=3,
        error=hostile + "\nsecond line",
        traceback="Traceback (most recent call last):\n  " + hostile,
    )
    listed, shown = run("list"), run("show", str(event_id))
    for out in (listed, shown):
        assert not any(c in out for c in "\x1b\x07\x9b\r"), out
    assert "RuntimeError: bad \\x1b[2J\\x1b[31mred\\x07 \\x9b6n\\x0dfine" in listed
    assert "  error         RuntimeError: bad \\x1b[2J\\x1b[31mred\\x07 \\x9b6n\\x0dfine\nsecond line" in shown
    assert "    " + "  RuntimeError: bad \\x1b[2J" in shown


def _malformed_dead_letter(body: bytes) -> tuple[DeadLetter, int]:
    """``body`` published on testapp.flaky's subject as another service
    would, and recorded by the real consumer as a ``(malformed)`` dead
    letter (over the in-memory broker): the letter and its stream sequence."""
    from django_platformkit.broker.memory import InMemoryTransport
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.testing import consumer_spec, run_worker_burst
    from django_platformkit.wire import subject_for

    sub = get_subscription("testapp.flaky")
    assert sub is not None
    transport = InMemoryTransport()
    transport.ensure_stream()
    transport.ensure_consumer(consumer_spec(sub))
    ack = transport.publish_raw(subject_for("testapp.flaky", None), body)
    assert run_worker_burst(transport, subscriptions=[sub]).malformed == 1
    return DeadLetter.objects.get(name="(malformed)"), ack.seq


def test_a_malformed_dead_letter_recorded_before_its_place_had_a_column_still_says_where_the_whole_message_is():
    """Migration 0013 stores a malformed message's stream sequence in the
    dead letter; a letter written before it had the number only in its
    error text. The migration's backfill reads it from there, once, so
    ``show`` names the ``nats stream get`` for old letters as for new."""
    import importlib

    from django_platformkit import conf
    from django_platformkit.outbox.deadletters import MALFORMED_NAME, malformed_id

    migration = importlib.import_module("django_platformkit.migrations.0013_dead_letter_stream_seq")
    event_id = malformed_id(conf.settings.STREAM, 9)
    assert record_dead_letter(
        subscription="testapp.flaky",
        event_id=event_id,
        name=MALFORMED_NAME,
        tenant=None,
        attempts=1,
        error="malformed message on subject=pktest._.testapp.flaky stream_seq=9: not JSON",
        traceback="{not json",
    )
    letter = DeadLetter.objects.get(event_id=event_id)
    assert letter.stream_seq is None  # as a letter from before 0013 reads
    assert "nats stream get" not in run("show", str(letter.id))

    with connection.cursor() as cursor:
        cursor.execute(migration.BACKFILL)
    letter.refresh_from_db()
    assert letter.stream_seq == 9
    assert f"whole message `nats stream get {conf.settings.STREAM} 9`" in run("show", str(letter.id))


#: 40,000 lines of 22 bytes (~880 KB, under NATS's default max_payload),
#: each with a terminal escape sequence: the record keeps its first 4000 bytes.
BIG_BODY = b"".join(b"line %06d \x1b[31mred\x07\n" % n for n in range(40_000))


def test_a_large_malformed_body_is_shown_as_an_excerpt_saying_what_is_left_out_and_how_to_see_it():
    """A malformed message's body can be up to the server's max_payload, and
    any bytes: ``show`` printed the whole record, and a body of short lines
    scrolled thousands of lines past the operator. It prints the first 20
    lines (or 1000 characters), how much of the record it left out, the
    option that prints it all, and where the whole message is."""
    from django_platformkit import conf

    letter, seq = _malformed_dead_letter(BIG_BODY)
    assert len(letter.traceback) == 4000  # ASCII: a character per byte
    out = run("show", str(letter.id))
    assert "line 000000 \\x1b[31mred\\x07" in out and "line 000019 " in out
    assert "line 000020 " not in out
    # 20 lines of 22 characters, less the 20th's newline: 439 shown.
    assert (
        f"... 3561 more characters of the record not shown (`deadletters show {letter.id} --full` prints all 4000)"
        in out
    )
    assert f"whole message `nats stream get {conf.settings.STREAM} {seq}`" in out
    assert not any(c in out for c in "\x1b\x07\r")
    assert len(out.splitlines()) < 40, out

    one_line = b"x" * 500_000  # no newline at all: the character bound
    DeadLetter.objects.all().delete()
    letter, _ = _malformed_dead_letter(one_line)
    out = run("show", str(letter.id))
    assert "    " + "x" * 1000 + "\n" in out and "x" * 1001 not in out
    assert "... 3000 more characters of the record not shown" in out


def test_show_full_prints_a_malformed_messages_whole_record_still_escaped():
    letter, _ = _malformed_dead_letter(BIG_BODY)
    out = run("show", str(letter.id), "--full")
    assert "line 000180 \\x1b[31mred\\x07" in out  # the last whole line of 4000 bytes (181 x 22 = 3982)
    assert "    line 000181 \\x1b[31mr\n" in out  # and the cut one
    assert "not shown" not in out
    assert not any(c in out for c in "\x1b\x07\r")
    assert run("show", str(letter.event_id), full=True) == out  # by event id, and through call_command's keyword


def test_a_binary_malformed_body_reaches_the_terminal_escaped_and_bounded():
    letter, _ = _malformed_dead_letter(bytes(range(256)) * 4096)  # 1 MiB of every byte value
    for args in ((), ("--full",)):
        out = run("show", str(letter.id), *args)
        # Newline and tab are all it prints as they are (as for errors and tracebacks).
        assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F for c in out), args
    assert len(run("show", str(letter.id)).splitlines()) < 40
