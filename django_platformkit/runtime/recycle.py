"""Worker recycling (``runworker --processes N --max-handlings-per-process K
--max-memory-per-process MIB``, Celery's ``--max-tasks-per-child`` and
``--max-memory-per-child``): a long-running Django process grows, so a
consumer child past its limit stops fetching, lets what it holds finish
and ack - a delivery fetched and not started is handed back, never counted
as an attempt - and exits ``EXIT_RECYCLE``; its supervisor starts a fresh
one (at once after a steady life, after a back-off if it recycled quickly).
A child above its memory limit before it handled anything refuses to run
(``ConfigurationError``, naming its size): a fresh one would be the same, so
recycling it would only start children in a storm.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from django_platformkit.exceptions import ConfigurationError

logger = logging.getLogger(__name__)

#: Exit status of a child that recycled itself (sysexits.h's EX_TEMPFAIL):
#: not a crash, restart it at once.
EXIT_RECYCLE = 75
#: How often a worker with a recycle policy compares its counts and memory with it, seconds.
RECYCLE_CHECK_SECONDS = 0.1


def resident_mib() -> float:
    """This process's resident set size in MiB (Linux ``/proc/self/statm``; 0 where it can't be read)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def memory_limit_text(limit_mib: float, size_mib: float) -> str:
    """The refusal of a ``--max-memory-per-process`` that a fresh worker process is already above."""
    return (
        f"--max-memory-per-process {limit_mib:g}: a fresh worker process already uses {size_mib:.0f} MiB (resident), "
        f"so every child would recycle at once, in a storm. Give a limit well above it, e.g. "
        f"--max-memory-per-process {max(2 * size_mib, size_mib + 256):.0f}."
    )


@dataclass(frozen=True)
class RecyclePolicy:
    """When a consumer process replaces itself.

    Attributes:
        max_handlings: After this many handlings (every delivery its
            consumers settled: handled, skipped, retried, dead-lettered,
            malformed), or None.
        max_memory_mib: Above this resident set size in MiB, or None.
    """

    max_handlings: int | None = None
    max_memory_mib: float | None = None

    def reason(self, handlings: int) -> str | None:
        """Why the process should recycle now (``handlings``: its total so far), or None."""
        if self.max_handlings is not None and handlings >= self.max_handlings:
            return f"handlings={handlings} max_handlings_per_process={self.max_handlings}"
        if self.max_memory_mib is not None:
            rss = resident_mib()
            if rss > self.max_memory_mib:
                return f"rss_mib={rss:.0f} max_memory_per_process_mib={self.max_memory_mib:g}"
        return None

    def wait(self, stop: threading.Event, handlings: Callable[[], int]) -> bool:
        """Wait until ``stop`` is set or the process is due to recycle,
        looking every ``RECYCLE_CHECK_SECONDS``.

        Args:
            stop: The worker's stop event.
            handlings: The process's handlings so far.

        Returns:
            True when it is due (logged; the caller stops as SIGTERM stops,
            then exits ``EXIT_RECYCLE``), False when ``stop`` was set first.

        Raises:
            ConfigurationError: Above the memory limit before handling anything.
        """
        while not stop.wait(RECYCLE_CHECK_SECONDS):
            done = handlings()
            why = self.reason(done)
            if why is not None and done == 0 and self.max_memory_mib is not None:
                raise ConfigurationError(memory_limit_text(self.max_memory_mib, resident_mib()))
            if why is not None:
                logger.info("worker recycling %s: finishing in-flight handlers, then exit=%s", why, EXIT_RECYCLE)
                return True
        return False
