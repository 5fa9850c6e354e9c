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
