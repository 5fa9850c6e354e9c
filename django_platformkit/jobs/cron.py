"""Cron expressions, behind an interface of ours: cronsim (Debian cron's
reading of an expression) is used only to list the naive wall-clock times a
five-field expression matches; which instants those are in a time zone -
across DST gaps and folds - is decided here, with Vixie cron's rule. Syntax
that cron implementations read differently is refused, never guessed.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo

from cronsim import CronSim, CronSimError

FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
_MONTHS = {
    name: n
    for n, name in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1
    )
}
_WEEKDAYS = {name: n for n, name in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
_NAMES = (None, None, None, _MONTHS, _WEEKDAYS)
#: One item of a list: ``*``, ``*/n``, ``a``, ``a-b`` or ``a-b/n``. Nothing
#: else: ``L``, ``W``, ``#``, ``?``, ``H`` and ``R`` mean different things (or
#: nothing) in different crons, and ``a/n`` is ``a-max/n`` in some and an
#: error in others.
_ITEM = re.compile(r"^(?:(?P<star>\*)|(?P<low>[0-9]+|[a-z]{3})(?:-(?P<high>[0-9]+|[a-z]{3}))?)(?:/(?P<step>[0-9]+))?$")
#: A zone's UTC offset never drops by more than this within this long; wall
#: times that far back can't map to a later instant (see ``_lookback``).
_OFFSET_WINDOW = timedelta(hours=26)
#: Where cron_problems looks for a first instant: a leap year's first day, so
#: a possible day (29 February too) comes within 8 years.
_ANY_START = datetime(2000, 1, 1)


def cron_problems(expression: object) -> list[str]:
    """What is wrong with a five-field cron expression (empty: nothing).

    Fields: minute 0-59, hour 0-23, day-of-month 1-31, month 1-12 or
    jan-dec, day-of-week 0-7 (0 and 7 are Sunday) or sun-sat; each a list of
    ``*``, ``*/n``, ``a``, ``a-b`` or ``a-b/n`` (Vixie cron's syntax, crontab(5)).
    Pure: no cronsim state is kept, no clock is read.
    """
    if not isinstance(expression, str):
        return [
            f"cron must be a string of five fields (minute hour day-of-month month day-of-week), got {expression!r}"
        ]
    fields = expression.split()
    if len(fields) != 5:
        return [
            f"cron {expression!r} has {len(fields)} field(s); write exactly five: minute hour day-of-month month "
            "day-of-week (no seconds or year field, no @daily-style aliases)"
        ]
    problems = []
    for index, text in enumerate(fields):
        problems += _field_problems(expression, index, text)
    if problems:
        return problems
    dom, dow = fields[2], fields[4]
    if _restricted(dom) and _restricted(dow) and (dom.startswith("*") or dow.startswith("*")):
        # Vixie cron (and cronsim, from 2.2) ANDs the two day fields when either
        # starts with '*'; croniter and others OR them whenever both are
        # restricted. Refuse the difference.
        return [
            f"cron {expression!r}: day-of-month {dom!r} and day-of-week {dow!r} are both restricted and one starts "
            "with '*'; crons disagree on whether a day must match both or either. Write the days out "
            "(e.g. '1-31/2' instead of '*/2') to mean either, or leave one of the two fields '*'"
        ]
    if _restricted(dom) and not _restricted(dow):
        # cronsim refuses a day of the month that no month it names has (and
        # would find no instant for one): say so in our words.
        try:
            next(CronSim(expression, _ANY_START))
        except (CronSimError, StopIteration):
            return [
                f"cron {expression!r} can never fire: no month it names has day {dom} "
                "(February has 29 days at most); pick a day that exists"
            ]
    return []


def _field_problems(expression: str, index: int, text: str) -> list[str]:
    name, (low_bound, high_bound), names = FIELD_NAMES[index], _BOUNDS[index], _NAMES[index]
    span = high_bound - low_bound + 1

    def value(token: str) -> int | None:
        if token.isdigit():
            number = int(token)
            return number if low_bound <= number <= high_bound else None
        return names.get(token) if names else None

    for item in text.split(","):
        match = _ITEM.match(item.lower())
        where = f"cron {expression!r}: {name} item {item!r}"
        if match is None:
            return [
                f"{where} is not plain cron syntax; use numbers{' or names' if names else ''}, '*', ranges 'a-b', "
                "steps '*/n' or 'a-b/n', and commas (no L, W, #, ?, H or R)"
            ]
        low, high, step = match["low"], match["high"], match["step"]
        numbers = [None if token is None else value(token) for token in (low, high)]
        for token, number in zip((low, high), numbers, strict=True):
            if token is not None and number is None:
                return [
                    f"{where}: {token!r} is out of range; {name} takes {low_bound}-{high_bound}{' or names' if names else ''}"
                ]
        low_number, high_number = numbers
        if low_number is not None and high_number is not None and low_number > high_number:
            return [
                f"{where}: the range runs backwards; write it as two ranges ('{low}-{high_bound},{low_bound}-{high}')"
            ]
        if step is not None:
            if match["star"] is None and high is None:
                return [f"{where}: 'a/n' means different things in different crons; write 'a-{high_bound}/n' or '*/n'"]
            if not 1 <= int(step) < span:
                return [
                    f"{where}: the step must be 1 to {span - 1}; a longer step fires only at the start of the "
                    "range, not 'every n' (use every=timedelta(...) for that)"
                ]
    return []


def _utcoffset(instant: datetime, zone: tzinfo) -> timedelta:
    # Only a zone that answers None (not a real time zone) leaves no offset.
    offset = instant.astimezone(zone).utcoffset()
    if offset is None:
        raise ValueError(f"time zone {zone!r} gives no UTC offset for {instant.isoformat()}; pass a zoneinfo.ZoneInfo")
    return offset


def _restricted(field: str) -> bool:
    return field not in ("*", "*/1")


@dataclass(frozen=True)
class CronSchedule:
    """The instants a valid five-field ``expression`` names in ``zone``.

    Vixie cron's DST rule (cron(8)): a fixed-time expression - neither the
    minute nor the hour field starts with ``*`` - fires once per matching
    wall-clock time: a time skipped by a spring-forward gap fires at the
    first valid instant after the gap, a time that occurs twice fires at its
    first occurrence. A wildcard expression follows the wall clock: skipped
    times don't fire, repeated times fire twice. So ``30 2 * * *`` runs once
    on both DST days, ``0 * * * *`` runs 23 and 25 times.
    """

    expression: str
    zone: tzinfo

    @property
    def fixed_time(self) -> bool:
        minute, hour = self.expression.split()[:2]
        return not minute.startswith("*") and not hour.startswith("*")

    def instants_after(self, after: datetime) -> Iterator[datetime]:
        """The instants (aware, UTC) strictly after ``after``, ascending, without end."""
        local = after.astimezone(self.zone)
        start = local.replace(tzinfo=None, second=0, microsecond=0) - self._lookback(after) - timedelta(minutes=1)
        walls = CronSim(self.expression, start)
        # A wall time's instants are never before first(wall), and first() never
        # decreases; so an instant below first(latest wall) is final and in order.
        pending: list[datetime] = []
        last: datetime | None = None
        while True:
            wall = next(walls)
            floor = self._first(wall)
            while pending and pending[0] < floor:
                instant = heapq.heappop(pending)
                if instant > after and instant != last:
                    last = instant
                    yield instant
            for instant in self._instants(wall):
                heapq.heappush(pending, instant)

    def _instants(self, wall: datetime) -> list[datetime]:
        earlier = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        later = wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        if earlier == later:
            return [earlier]
        if earlier > later:  # PEP 495: in a gap fold=0 uses the offset from before it
            return [self._gap_end(later, earlier)] if self.fixed_time else []
        return [earlier] if self.fixed_time else [earlier, later]

    def _first(self, wall: datetime) -> datetime:
        earlier = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        later = wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        return self._gap_end(later, earlier) if earlier > later else earlier

    def _gap_end(self, low: datetime, high: datetime) -> datetime:
        """The transition instant in ``(low, high]``: where the offset changes,
        found to the second (transitions fall on whole seconds)."""
        after_offset = high.astimezone(self.zone).utcoffset()
        low_s, high_s = int(low.timestamp()), int(high.timestamp())
        while high_s - low_s > 1:
            middle = (low_s + high_s) // 2
            if datetime.fromtimestamp(middle, UTC).astimezone(self.zone).utcoffset() == after_offset:
                high_s = middle
            else:
                low_s = middle
        return datetime.fromtimestamp(high_s, UTC)

    def _lookback(self, after: datetime) -> timedelta:
        """How far before ``after``'s wall time a wall time can lie and still
        map to a later instant: by how much the offset drops (a fall-back
        fold) in the window after ``after``. Zero where it never drops."""
        offset = _utcoffset(after, self.zone)
        lowest = offset
        probe, end = after, after + _OFFSET_WINDOW
        while probe <= end:
            lowest = min(lowest, _utcoffset(probe, self.zone))
            probe += timedelta(minutes=15)
        return offset - lowest
