"""Periodic jobs, declared: ``@job``, ``JobSpec`` and the slot arithmetic
every worker must agree on (``every`` aligned to the Unix epoch, ``cron`` in
the job's time zone), so any number of workers compute the same slots.
Declaring touches no database and reads no clock; running each job once per
slot - the clock, the advisory lock and the slot ledger - is ``scheduler.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import re
import zoneinfo
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django_platformkit.exceptions import ConfigurationError
from django_platformkit.jobs.cron import CronSchedule, cron_problems
from django_platformkit.names import SUBSCRIPTION_NAME_PART, default_name

logger = logging.getLogger(__name__)

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: The built-in hourly purge (``operate.purge.purge`` with ``RETENTION_DAYS``).
PURGE_JOB = "platformkit.outbox_purge"
_JOB_NAME = re.compile(rf"^{SUBSCRIPTION_NAME_PART}(\.{SUBSCRIPTION_NAME_PART})*$")
# Slots further back than this are never searched for (prev_slot); the
# longest gap a valid five-field expression has is 29 February to 29
# February across a skipped leap year (2096 -> 2104).
_LONGEST_GAP = timedelta(days=366 * 8 + 2)

_current_slot: contextvars.ContextVar[datetime | None] = contextvars.ContextVar("platformkit_job_slot", default=None)


def current_slot() -> datetime | None:
    """Inside a running job: the slot (aware datetime, UTC) being run; else None."""
    return _current_slot.get()


@contextlib.contextmanager
def in_slot(slot: datetime) -> Iterator[None]:
    """While the scheduler runs a job for ``slot``: what ``current_slot()`` returns."""
    token = _current_slot.set(slot)
    try:
        yield
    finally:
        _current_slot.reset(token)


# --- declarations ------------------------------------------------------------


def validate_schedule(*, every: Any, cron: Any, timezone: Any) -> list[str]:
    """The problems with a schedule, each a sentence saying what to change;
    empty when it is fine. Pure: no database, no network, no clock.

    Exactly one of ``every`` (a ``timedelta`` of at least one second) or
    ``cron`` (five fields, see ``jobs.cron.cron_problems``); ``timezone`` an IANA
    name known to ``zoneinfo``, and only with ``cron`` (``every`` slots are
    aligned to the Unix epoch, so a zone would change nothing).
    """
    if every is None and cron is None:
        return ["give a schedule: every=timedelta(...) or cron='m h dom mon dow' (exactly one)"]
    if every is not None and cron is not None:
        return ["give every= or cron=, not both"]
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, timedelta) or every < timedelta(seconds=1):
            return [f"every must be a datetime.timedelta of at least one second, got {every!r}"]
        if timezone != "UTC":
            return [
                f"timezone={timezone!r} applies to cron only: every= slots are multiples of the interval "
                "since the Unix epoch (UTC); use cron=... with timezone=... for local times"
            ]
        return []
    problems = cron_problems(cron)
    problem = _zone_problem(timezone)
    return problems + ([problem] if problem else [])


def _zone_problem(timezone: Any) -> str | None:
    try:
        if not isinstance(timezone, str):
            raise ValueError
        zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        return (
            f"timezone {timezone!r} is not a time zone zoneinfo knows; use an IANA name such as 'Europe/Paris' or 'UTC'"
        )
    return None


@dataclass(frozen=True)
class JobSpec:
    """A declared periodic job.

    ``name``: the lock and ledger key. ``func``: ``func() -> None``.
    ``every``: a ``timedelta`` or None; ``cron``: five fields or None;
    ``timezone``: IANA name the cron fields are read in. ``grace``: how old
    the newest missed slot may be for a catch-up run when a worker starts
    (None: one interval). ``declared_in``: dotted path of ``func``. Slots
    are aware UTC datetimes.
    """

    name: str
    func: Callable[[], None]
    every: timedelta | None = None
    cron: str | None = None
    timezone: str = "UTC"
    declared_in: str = ""
    grace: timedelta | None = None
    _cron_schedule: CronSchedule | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cron is not None:
            object.__setattr__(self, "_cron_schedule", CronSchedule(self.cron, zoneinfo.ZoneInfo(self.timezone)))

    @property
    def schedule_text(self) -> str:
        """``"every 0:05:00"`` or ``"cron */5 * * * * (Europe/Paris)"``."""
        if self.every is not None:
            return f"every {self.every}"
        return f"cron {self.cron} ({self.timezone})"

    def slots_after(self, after: datetime) -> Iterator[datetime]:
        """Every slot strictly after ``after`` (aware), ascending, without end."""
        require_aware(after)
        if self._cron_schedule is not None:
            yield from self._cron_schedule.instants_after(after)
            return
        assert self.every is not None
        slot = EPOCH + ((after - EPOCH) // self.every) * self.every
        while True:
            slot += self.every
            yield slot

    def next_slot(self, after: datetime) -> datetime:
        """The first slot strictly after ``after`` (aware)."""
        return next(self.slots_after(after))

    def prev_slot(self, at: datetime) -> datetime:
        """The newest slot at or before ``at`` (aware)."""
        require_aware(at)
        if self.every is not None:
            return EPOCH + ((at - EPOCH) // self.every) * self.every
        window = timedelta(hours=2)
        while True:
            newest = None
            for slot in self.slots_after(at - window):
                if slot > at:
                    break
                newest = slot
            if newest is not None:
                return newest
            if window >= _LONGEST_GAP:  # pragma: no cover - validate_schedule refuses such expressions
                raise ConfigurationError(f"job {self.name!r}: cron {self.cron!r} has no slot in eight years")
            window = min(window * 12, _LONGEST_GAP)

    def slots_between(self, start: datetime, end: datetime) -> list[datetime]:
        """The slots ``s`` with ``start <= s < end`` (aware), ascending."""
        slots = []
        for slot in self.slots_after(start - timedelta(microseconds=1)):
            if slot >= end:
                break
            slots.append(slot)
        return slots

    def count_slots_between(self, after: datetime, before: datetime, *, at_most: int = 100_000) -> int:
        """How many slots ``s`` there are with ``after < s < before`` (aware),
        counting at most ``at_most`` of a cron schedule (an interval's are
        counted, not listed: an every-second job after a week away)."""
        if before <= after:
            return 0
        if self.every is not None:
            first = self.next_slot(after)
            return 0 if first >= before else (before - first - timedelta(microseconds=1)) // self.every + 1
        count = 0
        for slot in self.slots_after(after):
            if slot >= before or count >= at_most:
                break
            count += 1
        return count

    def grace_after(self, slot: datetime) -> timedelta:
        """How long after ``slot`` a worker that was not running may still
        catch it up: ``grace``, or the distance to the next slot."""
        return self.grace if self.grace is not None else self.next_slot(slot) - slot


def require_aware(moment: datetime) -> None:
    """Raise ``ValueError`` for a naive ``moment``: slots are instants, and a
    naive time would silently be read in this machine's zone."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"slots are computed from aware datetimes, got naive {moment!r}")


_jobs: dict[str, JobSpec] = {}


def job(
    *,
    every: timedelta | None = None,
    cron: str | None = None,
    timezone: str = "UTC",
    name: str | None = None,
    grace: timedelta | None = None,
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Decorator: run ``func() -> None`` once per slot across all workers.

    The slot is claimed under the job's advisory lock before the run, so a
    crash mid-run loses that slot (the next slot is the retry) and never
    doubles it. The function runs in a thread of its own with Django
    database access (autocommit); ``current_slot()`` says which slot.

    Args:
        every: A ``timedelta`` of at least 1 s; slots are its multiples since the Unix epoch.
        cron: Five cron fields, read in ``timezone``; DST follows Vixie cron
            (``jobs.cron.CronSchedule``). Exactly one of ``every`` and ``cron``.
        timezone: An IANA zone name for ``cron``.
        name: The job's name, which is its lock. Default ``"<app_label>.<function name>"``.
        grace: How old the newest missed slot may be for one catch-up run
            after no worker ran (default: one interval).

    Returns:
        The decorator; it returns the function unchanged.

    Raises:
        ConfigurationError: A bad schedule or name, or a name another job
            already uses; the message names the function and the fix.
    """

    def decorator(func: Callable[[], None]) -> Callable[[], None]:
        declared_in = f"{func.__module__}.{func.__qualname__}"
        if inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"@job ({declared_in}): jobs run in a thread of their own; an 'async def' job would "
                "never run. Make it a plain 'def' (call async code with asgiref's async_to_sync)."
            )
        problems = validate_schedule(every=every, cron=cron, timezone=timezone)
        if grace is not None and (not isinstance(grace, timedelta) or grace < timedelta(0)):
            problems.append(f"grace must be a datetime.timedelta >= 0, got {grace!r}")
        if problems:
            raise ConfigurationError(f"@job ({declared_in}): " + "; ".join(problems) + ".")
        job_name = name if name is not None else default_name(func)
        if not isinstance(job_name, str) or not _JOB_NAME.fullmatch(job_name) or len(job_name) > 200:
            raise ConfigurationError(
                f"@job ({declared_in}): name {job_name!r} is invalid; use dot-separated identifiers "
                "([A-Za-z_][A-Za-z0-9_]*), e.g. 'reports.send_daily'."
            )
        spec = JobSpec(
            name=job_name, func=func, every=every, cron=cron, timezone=timezone, declared_in=declared_in, grace=grace
        )
        existing = _jobs.get(job_name)
        if existing is not None and existing.declared_in != declared_in:
            raise ConfigurationError(
                f"two jobs are named {job_name!r}: {existing.declared_in} and {declared_in}. "
                "Pass name='...' to one of them."
            )
        _jobs[job_name] = spec
        return func

    return decorator


def jobs() -> list[JobSpec]:
    """Every registered job, sorted by name."""
    return [_jobs[k] for k in sorted(_jobs)]


def job_named(name: str) -> JobSpec:
    """The registered job called ``name``; raises ``ConfigurationError``
    listing the known names when there is none."""
    try:
        return _jobs[name]
    except KeyError:
        raise ConfigurationError(f"no job is named {name!r}; known: {', '.join(sorted(_jobs)) or '(none)'}") from None


@job(every=timedelta(hours=1), name=PURGE_JOB)
def outbox_purge() -> None:
    """Delete published outbox rows and claims older than the retention (``operate.purge.purge``).
    Skipped, with a WARNING, while NATS can't say the stream's max age: the next hour tries again."""
    from django_platformkit.exceptions import BrokerUnavailable
    from django_platformkit.operate.purge import purge

    try:
        purge()
    except BrokerUnavailable as exc:
        logger.warning("outbox purge skipped, nothing deleted: it needs the stream's max age from NATS error=%s", exc)
