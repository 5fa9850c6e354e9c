"""Periodic jobs: once per slot across any number of workers and clocks.
(Placeholder registry; the scheduler lands with the jobs work.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any


_jobs: dict[str, Any] = {}


def job(*, every: timedelta | None = None, cron: str | None = None, timezone: str = "UTC", name: str | None = None) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def decorator(func: Callable[[], None]) -> Callable[[], None]:
        return func
    return decorator


class Scheduler:
    def __init__(self, *, using: str | None = None, clock: Any = None) -> None:
        self.using = using

    def run(self, stop: threading.Event) -> None:
        stop.wait()
