"""Where a worker's run stands, shared by its parts: whether it still starts,
whether it stops, and with which exit code. The parts read this one object
(the clock side, the reconciliation, the health file, the watchdog) instead
of asking the worker back through callbacks, so what "starting" means is
decided here once. (Not ``models.WorkerState``: that is what the heartbeat
row says, derived from this by ``ClockSide.state``.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: Exit status when a worker thread or the event loop died, or the stream was refused while running.
EXIT_CRASHED = 1


class RunState:
    """The run of one worker process.

    ``stop`` is set when the worker stops (a signal, a crash, a refusal, a
    drained burst); ``exit_code`` is the code it will exit with; ``crashed``
    names the thread that crashed, if one did. ``on_stop(wake)`` registers
    what must be woken at once when the run ends early (``end``): a pool
    thread waiting for a unit.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.exit_code = 0
        self.crashed: str | None = None
        self._running = threading.Event()
        self._wake: list[Callable[[], None]] = []

    @property
    def starting(self) -> bool:
        """Whether the worker still starts (no unit can be in flight yet: a signal may end it at once)."""
        return not self._running.is_set()

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def started(self) -> None:
        """Start-up is over (or is being abandoned): from here a signal stops gracefully."""
        self._running.set()

    def on_stop(self, wake: Callable[[], None]) -> None:
        self._wake.append(wake)

    def end(self, exit_code: int, *, crashed: str | None = None) -> None:
        """End the run early with ``exit_code`` (``crashed``: the thread that
        died): set ``stop`` and wake what waits for work."""
        if crashed is not None:
            self.crashed = crashed
        self.exit_code = exit_code
        self.stop.set()
        for wake in self._wake:
            wake()
