"""The worker's threads, each guarded: an exception escaping one (SystemExit
too) is never a live process that no longer consumes - the crash callback
stops the worker, which exits non-zero so its supervisor starts a fresh one.
Each thread closes its database connections when it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connections


class Threads:
    """Starts and joins the worker's threads.

    Args:
        on_crash: Called with the thread's name and the exception that
            escaped it (from that thread).
    """

    def __init__(self, on_crash: Callable[[str, BaseException], None]) -> None:
        self.on_crash = on_crash
        self.started: list[threading.Thread] = []

    def spawn(self, name: str, target: Callable[[], object]) -> threading.Thread:
        """Run ``target`` in a daemon thread named ``name``; returns the thread."""
        thread = threading.Thread(target=self._guard, args=(name, target), name=name, daemon=True)
        thread.start()
        self.started.append(thread)
        return thread

    def join(self, *, but: threading.Thread | None = None) -> None:
        """Wait for every thread started here (except ``but``)."""
        for thread in self.started:
            if thread is not but:
                thread.join()

    def _guard(self, name: str, target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as exc:
            self.on_crash(name, exc)
        finally:
            connections.close_all()
