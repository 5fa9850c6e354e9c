"""What a worker process is asked to run, as one typed value: ``runworker``
builds it once from its arguments, the supervisor derives each child's from
it (a child is forked, so the value itself crosses), and ``Worker`` takes it.
The options are written here only, never re-spelled as keyword dicts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.runtime.recycle import RecyclePolicy


@dataclass(frozen=True)
class WorkerOptions:
    """What one worker process runs, and how it ends.

    Attributes:
        relay: Run the relay.
        consumers: Run the subscriptions' consumers.
        scheduler: Run the periodic jobs (never with ``burst``: ``runs_scheduler``).
        burst: Drain the outbox and every consumer (nothing pending, nothing
            awaiting ack or retry), run no jobs, then return.
        subscriptions: Which subscriptions to consume (None: all registered).
        jobs: Which periodic jobs the scheduler runs (None: all).
        using: The database alias (None: ``DATABASE_ALIAS``).
        health_file: A JSON file rewritten every second with liveness and
            counts, and a final ``{"healthy": false, "stopped": true}``
            (under a supervisor: the supervisor's own; each child writes
            ``<health_file>.<role>``).
        burst_timeout_seconds: With ``burst``: fail (exit 1) if not drained by then.
        connect_timeout_seconds: With ``burst`` (and ``relay_once``), how
            long to keep trying to reach NATS before failing (a running
            worker waits for it forever).
        recycle: When a consumer process stops and exits ``EXIT_RECYCLE`` so
            a supervisor starts a fresh one (``recycle.py``), or None.
        burst_waits_for_relay: With ``burst`` and no relay: another process
            relays, so drained also means no row due in the outbox.
    """

    relay: bool = True
    consumers: bool = True
    scheduler: bool = True
    burst: bool = False
    subscriptions: Sequence[Subscription] | None = None
    jobs: Sequence[str] | None = None
    using: str | None = None
    health_file: str | os.PathLike[str] | None = None
    burst_timeout_seconds: float | None = None
    connect_timeout_seconds: float = 30.0
    recycle: RecyclePolicy | None = None
    burst_waits_for_relay: bool = False

    def __post_init__(self) -> None:
        # Frozen all the way down: a caller's list can't change a running worker's choice.
        if self.subscriptions is not None:
            object.__setattr__(self, "subscriptions", tuple(self.subscriptions))
        if self.jobs is not None:
            object.__setattr__(self, "jobs", tuple(self.jobs))

    @property
    def runs_scheduler(self) -> bool:
        """Whether the scheduler runs: asked for, and not a burst (a burst runs no jobs)."""
        return self.scheduler and not self.burst

    @property
    def drain_waits_for_outbox(self) -> bool:
        """A burst is drained only once no row is due in the outbox: it relays, or another process does."""
        return self.relay or self.burst_waits_for_relay

    def relay_child(self) -> WorkerOptions:
        """The options of ``runworker --processes``'s relay and scheduler
        child: never a burst itself (it relays until every consumer child
        drained: a handler may publish), no consumers, never recycled."""
        return dataclasses.replace(
            self,
            scheduler=self.runs_scheduler,
            consumers=False,
            burst=False,
            subscriptions=None,
            health_file=None,
            recycle=None,
            burst_waits_for_relay=False,
        )

    def consumer_child(self) -> WorkerOptions:
        """The options of a ``runworker --processes`` consumer child: the
        consumers alone (with ``burst``: drained while the relay child
        relays, if there is one)."""
        return dataclasses.replace(
            self,
            relay=False,
            scheduler=False,
            consumers=True,
            jobs=None,
            health_file=None,
            burst_waits_for_relay=self.burst and self.relay,
        )

    def with_health_file(self, path: str | os.PathLike[str] | None) -> WorkerOptions:
        """These options writing their health file at ``path`` (None: none)."""
        return dataclasses.replace(self, health_file=path)
