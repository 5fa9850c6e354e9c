"""``_cron`` against two other cron implementations over every DST change of
several zones for years: cronsim and croniter as test oracles, and the rule
itself - Vixie cron's, cron(8) - written out minute by minute as the judge.

Vixie cron's rule (what ``_cron.CronSchedule`` implements): a *fixed-time*
expression (neither the minute nor the hour field starts with ``*``) fires
once per matching wall-clock time - a time skipped by a spring-forward gap
fires at the first valid instant after the gap, a time that occurs twice
fires at its first occurrence only; a *wildcard* expression follows the wall
clock - skipped times don't fire, repeated times fire twice.

Where an oracle disagrees with ours, ours must follow the rule, and the
disagreement must be one of the documented ones:

- **cronsim** agrees everywhere except for two known differences, both on
  the Chatham Islands, whose changes fall at :45 rather than on the hour, and
  both under a wildcard-hour expression with minutes in :45-:59 (``45 */2 * * *``,
  ``40-50 */2 * * *``); in both cronsim misses a run the rule has:
  1. the fall-back (03:45 +13:45 -> 02:45 +12:45: 02:45-03:44 happens
     twice): the wall clock passes 02:45 twice, Vixie cron runs both passes,
     cronsim only the first;
  2. the spring-forward (02:45 +12:45 -> 03:45 +13:45: 02:45-03:44 never
     happens): 02:45 is skipped by both, but cronsim also skips 04:45, the
     next matching wall time, which exists and Vixie cron runs.
  ``KNOWN_CRONSIM`` lists them, and the test fails if one goes away or a new
  one appears.
- **croniter** (with an aware start) differs in three kinds of way, none of
  them Vixie cron's: (1) on a fall-back it runs a *fixed-time* expression's
  repeated wall time twice (02:30 on the last Sunday of October in Berlin);
  (2) on a spring-forward it runs a *wildcard* expression's skipped wall time
  at the end of the gap (``45 */2 * * *`` at 03:00 in Berlin); (3) like
  cronsim, it misses the second pass of Chatham's :45 fall-back
  (``_croniter_difference`` classifies; anything else fails).

That is why ``_cron`` asks a cron library (cronsim) only for naive wall-clock
times and decides DST itself; the oracles here read aware times, so their DST
handling is their own. The day fields (OR when both are restricted and
neither starts with '*', Vixie's rule, which cronsim follows from 2.2: the
floor in pyproject.toml) are checked day by day at the end.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from cronsim import CronSim

from django_platformkit.jobs.cron import CronSchedule

pytestmark = pytest.mark.unit

#: Zone -> years: every DST change in them is checked. Lord Howe moves by 30
#: minutes, Chatham at :45 with a :45 offset, Sao Paulo (DST until 2019) at
#: midnight; Berlin and New York are the common case.
ZONES = {
    "Europe/Berlin": (2024, 2030),
    "America/New_York": (2024, 2030),
    "Australia/Lord_Howe": (2024, 2030),
    "Pacific/Chatham": (2024, 2030),
    "America/Sao_Paulo": (2015, 2019),
}
FIXED_TIME = [
    "30 2 * * *",
    "0 3 * * *",
    "45 2 * * *",
    "0 0 * * *",
    "59 1 * * *",
    "50 2,3 * * *",
    "0 2 * * 0",
    "15 1-3 * * *",
    "0 23 * * *",
]
WILDCARD = ["0 * * * *", "*/15 * * * *", "*/30 1-3 * * *", "45 */2 * * *", "40-50 */2 * * *"]
#: Where each window starts, from the change: long before it, and inside the
#: stretch a gap or a fold disturbs (the look-back of ``instants_after``).
STARTS_MINUTES = (-240, -20, 20)
WINDOW = timedelta(hours=7)

#: (zone, expression): where cronsim differs from the rule (see the module docstring).
#: (zone, expression, kind of change): where cronsim misses an instant the
#: rule has. Both are Chatham's, whose changes fall at :45 (see the docstring).
KNOWN_CRONSIM = {
    ("Pacific/Chatham", "45 */2 * * *", "fall-back"),
    ("Pacific/Chatham", "40-50 */2 * * *", "fall-back"),
    ("Pacific/Chatham", "45 */2 * * *", "spring-forward"),
    ("Pacific/Chatham", "40-50 */2 * * *", "spring-forward"),
}


def transitions(zone: ZoneInfo, first_year: int, last_year: int) -> list[datetime]:
    """Every instant (UTC, to the second) at which ``zone``'s offset changes."""
    found = []
    probe, end = datetime(first_year, 1, 1, tzinfo=UTC), datetime(last_year + 1, 1, 1, tzinfo=UTC)
    offset = probe.astimezone(zone).utcoffset()
    while probe < end:
        step = probe + timedelta(hours=1)
        if step.astimezone(zone).utcoffset() != offset:
            low, high = probe, step
            while high - low > timedelta(seconds=1):
                middle = low + (high - low) / 2
                low, high = (low, middle) if middle.astimezone(zone).utcoffset() != offset else (middle, high)
            found.append(high.replace(microsecond=0))
            offset = step.astimezone(zone).utcoffset()
        probe = step
    return found


def _fields(expression: str) -> tuple[set[int], ...]:
    expanded, _ = croniter.expand(expression)
    minutes, hours, days, months, weekdays = (set() if field == ["*"] else set(field) for field in expanded)
    return minutes, hours, days, months, {0 if day == 7 else day for day in weekdays}


def _matches(fields: tuple[set[int], ...], wall: datetime) -> bool:
    # Only the AND form of the day fields: every expression here leaves one '*'.
    values = (wall.minute, wall.hour, wall.day, wall.month, wall.isoweekday() % 7)
    return all(not allowed or value in allowed for allowed, value in zip(fields, values, strict=True))


def vixie(expression: str, zone: ZoneInfo, after: datetime, before: datetime) -> list[datetime]:
    """The rule, minute by minute: the instants in ``(after, before)``."""
    fields = _fields(expression)
    minute, hour = expression.split()[:2]
    instants: set[datetime] = set()
    if minute.startswith("*") or hour.startswith("*"):
        # Wildcard: every real minute whose wall-clock time matches.
        t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
        while t < before:
            if _matches(fields, t.astimezone(zone)):
                instants.add(t)
            t += timedelta(minutes=1)
    else:
        # Fixed time: every matching wall-clock time once.
        wall = (after.astimezone(zone) - timedelta(hours=2)).replace(tzinfo=None, second=0, microsecond=0)
        last = (before.astimezone(zone) + timedelta(hours=2)).replace(tzinfo=None)
        while wall < last:
            if _matches(fields, wall):
                earlier = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
                later = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
                if earlier <= later:  # exists once, or twice: the first occurrence
                    instants.add(earlier)
                else:  # skipped by a gap: the first real minute after it
                    t = later.replace(second=0) + timedelta(minutes=1)
                    while t.astimezone(zone).replace(tzinfo=None) <= wall:
                        t += timedelta(minutes=1)
                    instants.add(t)
            wall += timedelta(minutes=1)
    return sorted(i for i in instants if after < i < before)


def ours(expression: str, zone: ZoneInfo, after: datetime, before: datetime) -> list[datetime]:
    return list(_ours(expression, zone, after, before))


@functools.cache  # the two oracle tests ask for the same windows
def _ours(expression: str, zone: ZoneInfo, after: datetime, before: datetime) -> tuple[datetime, ...]:
    found: list[datetime] = []
    for instant in CronSchedule(expression, zone).instants_after(after):
        if instant >= before:
            return tuple(found)
        found.append(instant)
    raise AssertionError("unreachable: instants_after has no end")  # pragma: no cover


def _until(instants: Iterator[datetime], after: datetime, before: datetime) -> list[datetime]:
    found = []
    for instant in instants:
        instant = instant.astimezone(UTC)
        if instant >= before:
            return found
        if instant > after:
            found.append(instant)
    return found  # pragma: no cover


def by_cronsim(expression: str, zone: ZoneInfo, after: datetime, before: datetime) -> list[datetime]:
    return _until(iter(CronSim(expression, after.astimezone(zone))), after, before)


def by_croniter(expression: str, zone: ZoneInfo, after: datetime, before: datetime) -> list[datetime]:
    walls = croniter(expression, after.astimezone(zone))
    return _until(iter(lambda: walls.get_next(datetime), None), after, before)


def _sequences() -> Iterator[tuple[str, ZoneInfo, datetime, str, datetime, datetime]]:
    for name, (first, last) in ZONES.items():
        zone = ZoneInfo(name)
        for change in transitions(zone, first, last):
            for expression in FIXED_TIME + WILDCARD:
                for minutes in STARTS_MINUTES:
                    after = change + timedelta(minutes=minutes, seconds=17 if minutes else 0)
                    yield name, zone, change, expression, after, after + WINDOW


def _direction(zone: ZoneInfo, change: datetime) -> str:
    before, after = ((change + timedelta(seconds=s)).astimezone(zone).utcoffset() for s in (-1, 0))
    return "fall-back" if after < before else "spring-forward"


def _local(instants: list[datetime], zone: ZoneInfo) -> list[str]:
    return [i.astimezone(zone).isoformat() for i in instants]


def test_every_dst_change_of_the_zones_is_found():
    counts = {name: len(transitions(ZoneInfo(name), *years)) for name, years in ZONES.items()}
    # Two changes a year; Sao Paulo's last one was February 2019 (DST abolished).
    assert counts == {
        "Europe/Berlin": 14,
        "America/New_York": 14,
        "Australia/Lord_Howe": 14,
        "Pacific/Chatham": 14,
        "America/Sao_Paulo": 9,
    }


def test_ours_follows_vixie_crons_rule_and_cronsim_agrees_except_the_two_chatham_differences():
    checked, cronsim_differs = 0, set()
    for name, zone, change, expression, after, before in _sequences():
        expected = vixie(expression, zone, after, before)
        got = ours(expression, zone, after, before)
        assert got == expected, (name, change, expression, after, _local(got, zone), _local(expected, zone))
        oracle = by_cronsim(expression, zone, after, before)
        if oracle != got:
            # The documented kind: cronsim misses an instant the rule (and ours) has; never the reverse.
            assert set(oracle) < set(got), (name, change, expression, _local(oracle, zone), _local(got, zone))
            cronsim_differs.add((name, expression, _direction(zone, change)))
        checked += 1
    assert checked > 2500
    assert cronsim_differs == KNOWN_CRONSIM


def _croniter_difference(
    expression: str, zone: ZoneInfo, change: datetime, got: list[datetime], oracle: list[datetime]
) -> str:
    """Which documented kind of difference this is (see the module docstring), or 'other'."""
    minute, hour = expression.split()[:2]
    fixed = not minute.startswith("*") and not hour.startswith("*")
    extra, missing = set(oracle) - set(got), set(got) - set(oracle)
    direction = _direction(zone, change)
    if fixed and direction == "fall-back" and not missing and all(i.astimezone(zone).fold == 1 for i in extra):
        return "fixed time run twice on a fall-back"
    if not fixed and direction == "spring-forward" and not missing and extra == {change}:
        return "skipped wildcard time run at the gap's end"
    if not fixed and direction == "fall-back" and not extra and all(i.astimezone(zone).fold == 1 for i in missing):
        return "second pass of a :45 fall-back missed"
    return "other"


def test_croniter_agrees_except_the_three_documented_kinds_of_difference():
    agreed, kinds = 0, set()
    for name, zone, change, expression, after, before in _sequences():
        if after > change:
            continue  # the windows that start before the change are enough for this oracle
        got, oracle = ours(expression, zone, after, before), by_croniter(expression, zone, after, before)
        if got == oracle:
            agreed += 1
            continue
        kind = _croniter_difference(expression, zone, change, got, oracle)
        assert kind != "other", (name, change, expression, _local(got, zone), _local(oracle, zone))
        if kind == "second pass of a :45 fall-back missed":
            assert name == "Pacific/Chatham", (name, change, expression)
        kinds.add(kind)
    assert agreed > 1000
    # Each documented difference is real, so this test can tell it from agreement.
    assert kinds == {
        "fixed time run twice on a fall-back",
        "skipped wildcard time run at the gap's end",
        "second pass of a :45 fall-back missed",
    }


@pytest.mark.parametrize(
    ("name", "expression", "start", "hours", "expected_local"),
    [
        # Spring forward in Berlin: 02:30 doesn't exist; fixed time fires at 03:00, wildcard skips.
        ("Europe/Berlin", "30 2 * * *", "2026-03-29T00:00", 3, ["2026-03-29T03:00:00+02:00"]),
        (
            "Europe/Berlin",
            "30 * * * *",
            "2026-03-29T01:00",
            2,
            ["2026-03-29T01:30:00+01:00", "2026-03-29T03:30:00+02:00"],
        ),
        # Fall back in Berlin: 02:30 happens twice; fixed once, wildcard twice.
        ("Europe/Berlin", "30 2 * * *", "2026-10-25T00:00", 4, ["2026-10-25T02:30:00+02:00"]),
        (
            "Europe/Berlin",
            "30 * * * *",
            "2026-10-25T01:45",
            2,
            ["2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00"],
        ),
        # Chatham's fall back repeats 02:45-03:44: the second 02:45 runs under a wildcard hour.
        (
            "Pacific/Chatham",
            "45 */2 * * *",
            "2026-04-05T01:00",
            3,
            ["2026-04-05T02:45:00+13:45", "2026-04-05T02:45:00+12:45"],
        ),
    ],
)
def test_the_rule_on_named_days(name, expression, start, hours, expected_local):
    zone = ZoneInfo(name)
    after = datetime.fromisoformat(start).replace(tzinfo=zone).astimezone(UTC)
    got = ours(expression, zone, after, after + timedelta(hours=hours))
    assert _local(got, zone) == expected_local


#: The day fields at noon: both restricted and neither starting with '*' means
#: either day matches (OR); a '*' at the start of either means both (AND).
DAY_FIELDS = [
    "0 12 1-31 * 1",  # OR: every day (cronsim before 2.2 read it as AND: Mondays only)
    "0 12 13 * 5",  # OR: every 13th and every Friday
    "0 12 1,15 * mon-fri",  # OR
    "0 12 */1 * 1",  # AND: Mondays
    "0 12 */10 * sat,sun",  # AND: weekend days among the 1st, 11th, 21st and 31st
    "0 12 * * 1",
    "0 12 1-7 * *",
    "0 12 29 2 *",  # only in leap years
]


def _day_matches(expression: str, day: datetime) -> bool:
    dom, month, dow = expression.split()[2:]
    _, _, days, months, weekdays = _fields(expression)
    dom_ok, dow_ok = not days or day.day in days, not weekdays or day.isoweekday() % 7 in weekdays
    either = dom != "*" and dow != "*" and not dom.startswith("*") and not dow.startswith("*")
    return (not months or day.month in months) and ((dom_ok or dow_ok) if either else (dom_ok and dow_ok))


@pytest.mark.parametrize("expression", DAY_FIELDS)
def test_the_day_fields_follow_vixie_crons_and_or_rule(expression):
    after = datetime(2027, 12, 31, 13, tzinfo=UTC)
    expected, day = [], after.replace(hour=12) + timedelta(days=1)
    while day < after + timedelta(days=800):  # 2028, a leap year, and 2029
        if _day_matches(expression, day):
            expected.append(day)
        day += timedelta(days=1)
    assert ours(expression, ZoneInfo("UTC"), after, after + timedelta(days=800)) == expected
