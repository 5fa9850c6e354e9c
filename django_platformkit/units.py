"""A unit of work: the deliveries one transaction handles, and the two
signals that end a unit early.

Shared by the consumer's stages (``consumer``, ``claim``, ``handler``,
``settling``): each takes the ``_Work`` of a delivery, and none imports
another stage for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

from .wire import Delivery, ReceivedEvent

#: A unit of work commits at most this many messages per transaction: after a
#: failure the unit is redone with a savepoint per message, and past 64
#: subtransactions with writes PostgreSQL's per-backend subxid cache
#: overflows and every other session's snapshots get slower.
MAX_SAVEPOINTS_PER_TRANSACTION = 50


class _Redo(Exception):
    """Leave the unit's transaction (rolling everything back) to redo it
    without the message whose handler failed."""


class _Stopping(Exception):
    """The database is away and the worker is stopping: hand the unit back."""


@dataclass
class _Work:
    """One delivery on its way through handle()."""

    delivery: Delivery
    event: ReceivedEvent
    attempt_row: int | None = None  # our ``running`` Attempt row (redeliveries, slow first runs)
    started_epoch: float | None = None  # time.time() when the handler started; see started_at
    outcome: str = ""
    error: BaseException | None = None
    tb: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)  # handler end vs the slow-run recorder
    running: bool = False  # the handler is in its run now (the recorder may write its row)

    @property
    def started_at(self) -> datetime | None:
        """When the handler started (aware, UTC), or None before it did: made
        from ``started_epoch`` only when a row needs it, not per run."""
        return None if self.started_epoch is None else datetime.fromtimestamp(self.started_epoch, UTC)
