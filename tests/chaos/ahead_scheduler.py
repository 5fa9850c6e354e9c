"""A scheduler process whose clock runs ``--ahead-seconds`` ahead of the real
one (a worker with a wrong system clock), for the fault-injection suite. It
runs the named jobs for ``--seconds`` and exits 0.

Run as ``python -m tests.chaos.ahead_scheduler`` with DATABASE_URL pointing at
the scenario's database and PLATFORMKIT_TEST_JOBS=1."""

from __future__ import annotations

import argparse
import os
import threading
from datetime import UTC, datetime, timedelta


class AheadClock:
    """This machine's clock, shifted: what a worker with a wrong clock reads."""

    def __init__(self, ahead: timedelta) -> None:
        self.ahead = ahead

    def now(self) -> datetime:
        return datetime.now(UTC) + self.ahead

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        return stop.wait(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", action="append", required=True)
    parser.add_argument("--ahead-seconds", type=float, default=86400.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django_platformkit.jobs.scheduler import Scheduler

    stop = threading.Event()
    threading.Timer(args.seconds, stop.set).start()
    Scheduler(jobs=args.job, clock=AheadClock(timedelta(seconds=args.ahead_seconds))).run(stop)
    print("ahead scheduler done", flush=True)


if __name__ == "__main__":
    main()
