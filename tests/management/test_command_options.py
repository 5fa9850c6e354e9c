"""A command's number option that can't mean anything - a negative or zero
timeout, no processes, a port out of range - is a ``CommandError`` saying what
to pass, before the command connects to anything."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

pytestmark = pytest.mark.unit

PROCESSES_REFUSED = (
    "--processes {value}: --processes takes a whole number above 0 or auto, e.g. --processes auto "
    "(one consumer process per usable core)."
)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["runworker", "--burst", "--burst-timeout", "-5"],
            "--burst-timeout -5.0: give a number of seconds above 0 (e.g. --burst-timeout 30); "
            "leave it out to wait until drained.",
        ),
        (
            ["runworker", "--burst", "--burst-timeout", "0"],
            "--burst-timeout 0.0: give a number of seconds above 0 (e.g. --burst-timeout 30); "
            "leave it out to wait until drained.",
        ),
        (
            ["runworker", "--burst", "--connect-timeout", "-1"],
            "--connect-timeout -1.0: give a number of seconds above 0 (e.g. --connect-timeout 30); the default is 30.",
        ),
        (
            ["runworker", "--connect-timeout", "nan"],
            "--connect-timeout nan: give a number of seconds above 0 (e.g. --connect-timeout 30); the default is 30.",
        ),
        (
            ["runworker", "--processes", "0"],
            PROCESSES_REFUSED.format(value="0"),
        ),
        (
            ["runworker", "--processes", "-2"],
            PROCESSES_REFUSED.format(value="-2"),
        ),
        (["runworker", "--processes", "two"], PROCESSES_REFUSED.format(value="two")),
        (["runworker", "--processes", "autp"], PROCESSES_REFUSED.format(value="autp")),
        (["runworker", "--processes", "2", "--metrics-port", "-1"], "--metrics-port -1: not a TCP port (0-65535)."),
        (
            ["runrelay", "--once", "--connect-timeout", "0"],
            "--connect-timeout 0.0: give a number of seconds above 0 (e.g. --connect-timeout 30); the default is 30.",
        ),
        (["runrelay", "--once", "--metrics-port", "70000"], "--metrics-port 70000: not a TCP port (0-65535)."),
    ],
)
def test_a_negative_or_zero_number_option_is_a_command_error_saying_what_to_pass(args, message):
    with pytest.raises(CommandError) as refused:
        call_command(*args)
    assert str(refused.value) == message


def test_the_refusal_holds_for_options_passed_as_keywords_too():
    # call_command's keyword options skip argparse's type=: handle() checks them.
    with pytest.raises(CommandError, match=r"^--burst-timeout -5: give a number of seconds above 0"):
        call_command("runworker", burst=True, burst_timeout=-5)
    with pytest.raises(CommandError, match=r"^--processes 1.5: --processes takes a whole number above 0 or auto"):
        call_command("runworker", processes=1.5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["purgeoutbox", "--batch-size", "-1"], "'-1' is not a number of rows >= 1"),
        (["purgeoutbox", "--older-than=-3h"], "'-3h' is not an age such as 30m, 12h, 7d or 2w"),
        (["purgeoutbox", "--older-than", "999999999999w"], "'999999999999w' reaches back before the year 1"),
        (["purgeoutbox", "--older-than", "110000w"], "'110000w' reaches back before the year 1"),
        (["deadletters", "list", "--limit", "-1"], "'-1' is not a row count"),
        (["deadletters", "list", "--since", "0h"], "'0h' is not an age such as 30m, 12h, 7d or 2w"),
    ],
)
def test_the_other_commands_number_options_refuse_negatives_while_parsing(args, message):
    with pytest.raises(CommandError) as refused:
        call_command(*args)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--no-relay", "--no-consumers", "--no-jobs"],
            "nothing to run: --no-relay, --no-consumers, --no-jobs. Drop one of them (the relay alone is `runrelay`).",
        ),
        (
            ["--no-relay", "--no-consumers", "--burst"],
            "nothing to run: --no-relay, --no-consumers, --burst (which runs no jobs). Drop one of them "
            "(the relay alone is `runrelay`).",
        ),
        (["--burst-timeout", "30"], "--burst-timeout only limits --burst: add --burst, or drop --burst-timeout."),
        (
            ["--no-jobs", "--job", "platformkit.outbox_purge"],
            "--job picks the jobs to run, but --no-jobs runs no jobs: drop one of the two.",
        ),
        (
            ["--burst", "--job", "platformkit.outbox_purge"],
            "--job picks the jobs to run, but --burst runs no jobs: drop one of the two.",
        ),
        (
            ["--no-consumers", "--subscription", "testapp.count_order"],
            "--subscription and --queue pick the consumers to run, but --no-consumers runs none: drop one of them.",
        ),
    ],
)
@pytest.mark.timeout(60)  # without the refusal, the first ran a worker that does nothing until stopped
def test_runworker_refuses_options_that_leave_nothing_to_run_or_cancel_each_other(args, message):
    # Each ran before: a worker that did nothing (or burst and exited 0), or an option ignored without a word.
    with pytest.raises(CommandError) as refused:
        call_command("runworker", *args)
    assert str(refused.value) == message


@pytest.mark.process
@pytest.mark.parametrize(
    "args",
    [
        ["deadletters", "list"],
        ["cancel", "00000000-0000-7000-8000-000000000000", "--actor", "ops", "--reason", "why"],
        ["purgeoutbox", "--dry-run"],
        ["pause", "--list"],
        ["pause", "testapp.record_order", "--actor", "ops", "--reason", "why"],
        ["resume", "testapp.record_order", "--actor", "ops"],
        ["jobs", "list"],
        ["jobs", "disable", "platformkit.outbox_purge", "--actor", "ops", "--reason", "why"],
    ],
)
def test_an_operator_command_with_the_database_down_says_so_in_one_line(args):
    # A real connection refused (nothing listens on port 1): these printed a traceback of psycopg's.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        DATABASE_URL="postgresql://postgres@127.0.0.1:1/pk_nowhere",
        NATS_URL="nats://127.0.0.1:1",
        PYTHONPATH=str(root),
    )
    done = subprocess.run(
        [sys.executable, str(root / "tests" / "manage.py"), *args],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("CommandError: the database is unavailable (connection failed: "), done.stderr
    assert done.stderr.strip().endswith(
        "run the command again once it answers (check DATABASES, or PGHOST/PGPORT where they are left out)."
    )
