"""A unit of work: the deliveries one transaction handles, each as a
``Work`` on its way through the consumer, how fetched deliveries are cut
into units (``cut``: a redelivery is always a unit of its own, so a poison
message can't count against its neighbours), and the two signals that end
a unit early (``Redo``, ``Stopping``).

Shared by the consumer's collaborators (``claim``, ``handler``,
``outcome``, ``waiting``): each takes the ``Work`` of a delivery, and none
imports another for it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from django_platformkit.wire import (
    TARGET_HEADER,
    Delivery,
    HandlingOutcome,
    MalformedMessage,
    ReceivedEvent,
    meant_for,
    parse_delivery,
    task_path,
)

if TYPE_CHECKING:
    from django_platformkit.consume.attempts import Exhausted
    from django_platformkit.consume.subscriptions import Subscription

#: A transaction holds at most this many savepoints: a unit (up to
#: ``CONSUMER_BATCH_SIZE`` deliveries, one transaction) that is redone with a
#: savepoint per message after a failure commits in chunks of this size, since
#: past 64 subtransactions with writes PostgreSQL's per-backend subxid cache
#: overflows and every other session's snapshots get slower.
MAX_SAVEPOINTS_PER_TRANSACTION = 50


class UnitWrites:
    """Rows the handlers of one unit leave to be written together, by one
    statement per kind just before the unit commits, instead of one round
    trip each (the task queues' results: ``tasks.results``). Only where a
    handler's failure rolls the whole unit back (no savepoint per message):
    what a failed handler left can't outlive it, and a unit redone with
    savepoints writes at once (``unit_writes()`` is then None)."""

    def __init__(self, using: str) -> None:
        self.using = using  # the unit's database alias: a write elsewhere can't wait for its commit
        self._rows: dict[Callable[[Any, list[Any]], None], list[Any]] = {}

    def add(self, write: Callable[[Any, list[Any]], None], row: Any) -> None:
        """Leave ``row`` for ``write(cursor, rows)``, called once per unit with every row added for it."""
        self._rows.setdefault(write, []).append(row)

    def flush(self, cursor: Any) -> None:
        """Write what the unit's handlers left, on the unit's cursor (inside its transaction)."""
        rows, self._rows = self._rows, {}
        for write, items in rows.items():
            write(cursor, items)


_unit_writes = threading.local()


def unit_writes(using: str) -> UnitWrites | None:
    """The deferred writes of the unit this thread's handler runs in on
    database ``using``, or None: write at once (a unit redone with a
    savepoint per message, another database, or no unit at all)."""
    writes: UnitWrites | None = getattr(_unit_writes, "current", None)
    return writes if writes is not None and writes.using == using else None


@contextlib.contextmanager
def unit_writes_scope(writes: UnitWrites | None) -> Iterator[None]:
    """This thread's ``unit_writes`` while the claim's transaction runs its
    handlers; cleared after, however the unit ended (a unit that raised must
    never leave its writes to whatever runs next in the thread)."""
    _unit_writes.current = writes
    try:
        yield
    finally:
        _unit_writes.current = None


class Redo(Exception):
    """Leave the unit's transaction (rolling everything back) to redo it
    without the message whose handler failed."""


class Stopping(Exception):
    """The database is away and the worker is stopping: hand the unit back."""


@dataclass
class Work:
    """One delivery on its way through ``Consumer.handle()``: its event, the
    ``running`` attempt row that counts its run (a redelivery's, or a slow
    first run's), and its outcome.
    ``delivery`` is None for ``Consumer.run_event()`` (no broker).

    ``outcome`` is first what the unit decided and then, once the unit's
    ``Outcome.conclude`` carried it out, what became of the delivery:
    ``FAILED`` becomes ``RETRIED`` or ``DEAD_LETTERED``, ``NOT_IN_OUTBOX``
    becomes ``MALFORMED`` or ``HANDED_BACK``; ``HANDED_BACK`` (naked after
    ``redeliver_in_seconds``) and ``DEAD_LETTERED`` (a redelivery out of
    attempts: ``exhausted`` says why) are carried out there too.
    """

    delivery: Delivery | None
    event: ReceivedEvent
    attempt_row: int | None = None
    started_epoch: float | None = None  # time.time() when the handler started; see started_at
    due_epoch: float | None = None  # time.time() since when the event was due (commit or run_after)
    history_decides: bool = False  # the handler may have run before (``may_have_run``): a unit of its own
    outcome: HandlingOutcome | None = None
    redeliver_in_seconds: float | None = None  # a hand-back's nak delay (None: at once)
    exhausted: Exhausted | None = None  # a redelivery out of attempts: what its dead letter says
    error: BaseException | None = None
    tb: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)  # handler end vs the slow-run recorder
    running: bool = False  # the handler is in its run now (the recorder may write its row)
    duration_seconds: float = 0.0  # how long its handler's last run took (0.0: it didn't run)
    latency_seconds: float | None = None  # from due (``due_epoch``) to its handler's start; None: unknown
    #: The ``django.tasks`` task it carries (``wire.task_path``), else "": its
    #: message's, then the event's its handler ran with (``HandlerRunner.run``);
    #: for the log lines, spans and signals.
    task: str = field(init=False)

    def __post_init__(self) -> None:
        self.task = task_path(self.event.name, self.event.payload)

    @property
    def message(self) -> Delivery:
        """The broker's delivery (every work but ``Consumer.run_event()``'s has one)."""
        if self.delivery is None:
            raise RuntimeError(f"event {self.event.id} was run without a broker: it has no delivery to answer")
        return self.delivery

    @property
    def started_at(self) -> datetime | None:
        """When the handler started (aware, UTC), or None before it did: made
        from ``started_epoch`` only when a row needs it, not per run."""
        return None if self.started_epoch is None else datetime.fromtimestamp(self.started_epoch, UTC)


def may_have_run(delivery: Delivery) -> bool:
    """Whether the handler may have run for this delivery's event before, so
    its run history decides (a unit of its own, ``attempt`` from the recorded
    runs): a redelivery, or a reconciliation's re-send - the broker's first
    delivery of a new message for an event whose earlier runs may have failed."""
    return delivery.attempt > 1 or TARGET_HEADER in delivery.headers


class Refused(NamedTuple):
    """A delivery no unit takes: a targeted re-send for other subscriptions
    (``reason`` None) or a message that can't be decoded (``reason`` says why)."""

    delivery: Delivery
    reason: str | None


def cut(deliveries: Sequence[Delivery], subscription: Subscription) -> tuple[list[list[Work]], list[Refused]]:
    """Cut fetched deliveries into units, in order: consecutive first
    deliveries together (``batch=True``) or one each, and a delivery whose
    handler may have run before (``may_have_run``) always alone.

    Returns:
        The units, and the deliveries no unit takes, in their order.
    """
    units: list[list[Work]] = []
    refused: list[Refused] = []
    chunk: list[Work] = []
    for delivery in deliveries:
        alone = may_have_run(delivery)
        event, reason = _decode(delivery, subscription)
        if not meant_for(delivery.headers, subscription.name):  # before its decoding's verdict: not ours to judge
            refused.append(Refused(delivery, None))
            continue
        if event is None:
            refused.append(Refused(delivery, reason))
            continue
        work = Work(delivery, event, history_decides=alone)
        if alone:
            # Never inside a batch: a poison message that killed the worker
            # must not count against the neighbours it was fetched with.
            if chunk:
                units.append(chunk)
                chunk = []
            units.append([work])
            continue
        chunk.append(work)
        if not subscription.batch:
            units.append(chunk)
            chunk = []
    if chunk:
        units.append(chunk)
    return units, refused


def _decode(delivery: Delivery, subscription: Subscription) -> tuple[ReceivedEvent | None, str]:
    """The delivery's event, or None and why it can't be one (an external
    subscription's event must also pass its declared schema)."""
    from django_platformkit.outbox.events import catalogue

    try:
        event = parse_delivery(delivery)
        validator = getattr(catalogue().get(subscription.event), "validator", None) if subscription.external else None
        error = None if validator is None else next(iter(validator.iter_errors(event.payload)), None)
        if error is not None:
            return None, f"external event fails the schema of {subscription.event!r}: {error.message}"
        return event, ""
    except MalformedMessage as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"cannot decode ({type(exc).__name__}: {str(exc)[:200]})"
