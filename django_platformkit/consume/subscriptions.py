"""Subscriptions: ``subscribe()``, ``Subscription`` and the registry, the
name grammar subscriptions share with jobs, and the tenant context a handler
runs in. Declarations only: nothing here talks to the broker, so importing
it (every app's ``platformkit.py`` does) never imports ``nats``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError, InvalidEventName
from django_platformkit.names import check_event_name, check_subscription_name, default_name
from django_platformkit.wire import ReceivedEvent, durable_name, filter_subject_for

if TYPE_CHECKING:
    from django_platformkit.broker.port import ConsumerConfig


@dataclass
class Subscription:
    """A handler subscribed to one event. ``name`` is the claim's namespace
    and, with ``.`` -> ``-``, the durable consumer's name."""

    name: str
    event: str
    handler: Callable[[ReceivedEvent], None]
    max_attempts_override: int | None = None
    backoff_seconds_override: tuple[float, ...] | None = None
    declared_in: str = ""
    batch: bool = True
    concurrency: int = 1
    #: Run for events other services published on a shared broker (the message body is trusted, its schema checked); default: only for events this project's outbox holds.
    external: bool = False
    #: The durable's ``max_ack_pending`` for this subscription, or None for the derived default.
    max_ack_pending_override: int | None = None
    #: A new durable starts with every retained event (True) or with the ones published from its creation on (False).
    backfill: bool = True
    #: At most this many handler starts per period across every worker together, or None (no limiter at all).
    rate_limit: conf.Rate | None = None
    #: Why ``rate_limit=`` as written is no rate ("" when it is one, or None): a
    #: system-check error (``platformkit.E011``), never an import traceback
    #: (every ``manage.py`` command imports the declarations); a worker refuses to run it.
    rate_limit_error: str = ""
    #: ``rate_limit=`` as written, for the check's message.
    rate_limit_given: object = None
    #: Not a ``subscribe()`` option: the claim also takes the transaction-scoped
    #: advisory lock ``(claim_lock_namespace, hashtext(event id))`` on each event
    #: it claims, held until the unit's transaction ends (the task queues set
    #: it: ``get_result()`` reads the lock as RUNNING; ``tasks.results``).
    claim_lock_namespace: int | None = None
    #: Not a ``subscribe()`` option: the subscriptions that share a
    #: ``priority_group`` (a task queue's priority bands, ``tasks.registry``)
    #: share one worker's ``concurrency`` slots and one rate limit, and a
    #: worker starts the lowest ``priority_rank`` (the highest band) with work
    #: first (``consume.bands``). None: a subscription of its own.
    priority_group: str | None = None
    priority_rank: int = 0

    @property
    def rate_limit_name(self) -> str:
        """Whose rate-limit row this subscription's handler starts take: its
        priority group's (the queue's), else its own name."""
        return self.priority_group or self.name

    def __hash__(self) -> int:
        # The signals' sender: Django's dispatcher hashes it once a receiver
        # is connected (an eq dataclass alone is unhashable and crashes the send).
        return hash(self.name)

    @property
    def durable(self) -> str:
        """The durable consumer name: the subscription name with ``.`` -> ``-``."""
        return durable_name(self.name)

    @property
    def filter_subject(self) -> str:
        """``<SUBJECT_PREFIX>.*.<module>.<event>``: this event, every tenant."""
        return filter_subject_for(self.event)

    @property
    def max_attempts(self) -> int:
        """Handler runs before a failing event is dead-lettered: the override, else ``MAX_ATTEMPTS``."""
        return self.max_attempts_override or conf.settings.MAX_ATTEMPTS

    @property
    def backoff_seconds(self) -> tuple[float, ...]:
        """Seconds before each retry (the last repeats): the override, else ``BACKOFF_SECONDS``."""
        return self.backoff_seconds_override or conf.settings.BACKOFF_SECONDS

    def delay_after(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1``: the ``attempt``-th
        backoff entry, the last one repeating."""
        delays = self.backoff_seconds
        return float(delays[min(attempt, len(delays)) - 1])

    def consumer_config(self) -> ConsumerConfig:
        """The durable's config this build wants (``broker.streams.consumer_config``)."""
        # Imported here: only a worker asks, and a web process never imports nats.
        from django_platformkit.broker.streams import consumer_config, max_ack_pending_for

        return consumer_config(
            self.name,
            self.event,
            max_ack_pending=max_ack_pending_for(self.concurrency, self.max_ack_pending_override),
            backfill=self.backfill,
        )


_subscriptions: dict[str, Subscription] = {}


def subscribe(
    event: Any,
    *,
    name: str | None = None,
    max_attempts: int | None = None,
    backoff_seconds: Sequence[float] | None = None,
    batch: bool = True,
    concurrency: int = 1,
    external: bool = False,
    max_ack_pending: int | None = None,
    backfill: bool = True,
    rate_limit: str | None = None,
) -> Callable[[Callable[[ReceivedEvent], None]], Callable[[ReceivedEvent], None]]:
    """Decorator: run ``handler(event: ReceivedEvent) -> None`` once per published ``event``.

    Handling is exactly once per (subscription, event): the handler runs in
    a transaction that also writes the claim, and a failing handler is
    retried after its backoff, then dead-lettered. Subscribing to an
    undeclared event is a system-check error (``platformkit.E001``), not an
    import error.

    Args:
        event: A declared event name or ``EventType``.
        name: The subscription's name: the claim's namespace and, with ``.``
            -> ``-``, the durable consumer's. Default ``"<app_label>.<function name>"``.
        max_attempts: Handler runs before a failing event is dead-lettered
            (default ``MAX_ATTEMPTS``).
        backoff_seconds: One delay in seconds per retry, the last repeating
            (default ``BACKOFF_SECONDS``).
        batch: Claim consecutive first deliveries in one statement and run
            their handlers in one transaction (the fast path). A failure
            rolls it back and the rest is redone with a savepoint per
            message, so each message still succeeds or fails alone (effects
            outside the database may then happen twice, as with any retry).
            False: each handler commits alone.
        concurrency: How many of a worker's consumer threads
            (``CONSUMER_THREADS`` bounds them) fetch and handle this
            subscription at once, each with its own connection, per worker
            process. Above 1 the subscription gives up stream order (each
            event is still handled exactly once).
        external: Also run for events other services published on a shared
            broker (the body is trusted and checked against the declared
            schema). By default a handler runs only for an event this
            project's outbox holds, with the outbox's payload (DESIGN.md "Trust model").
        max_ack_pending: This durable's cap on delivered, unacked messages
            (default derived: what can be in flight, plus room for parked retries).
        backfill: When this subscription's durable doesn't exist yet, start
            with every event the stream retains (True, up to
            ``RETENTION_DAYS``) or only with the events published from the
            durable's creation on (False: a new payment handler must not
            charge last week's orders). Once the durable exists it changes
            nothing.
        rate_limit: At most this many handler starts per period for this
            subscription, across every worker, process and machine together:
            ``"100/s"``, ``"30/m"``, ``"1000/h"``. Starts are spaced evenly,
            ``period / count`` apart (no burst above the rate in any window
            of the period's length); a shared row in PostgreSQL hands out
            the start times. None (the default): no limiter, no cost. A
            value that is no rate is a system-check error (``platformkit.E011``).

    Returns:
        The decorator; it returns the handler unchanged.

    Raises:
        ConfigurationError: A malformed name or option, a name another
            handler already uses, or a bare ``@subscribe`` without the event.
    """
    if callable(event) and not hasattr(event, "name"):
        # ``@subscribe`` without parentheses hands us the handler itself: the
        # decorator would be returned in its place and nothing registered.
        where = f" ({getattr(event, '__module__', '?')}.{getattr(event, '__qualname__', repr(event))})"
        raise ConfigurationError(
            f"@subscribe{where} needs the event it subscribes to: use @subscribe(EVENT_OR_NAME), "
            "e.g. @subscribe('shop.order_placed')."
        )
    event_name = getattr(event, "name", event)

    def decorator(func: Callable[[ReceivedEvent], None]) -> Callable[[ReceivedEvent], None]:
        where = f" ({func.__module__}.{func.__qualname__})"
        if inspect.iscoroutinefunction(func):
            raise ConfigurationError(
                f"@subscribe{where}: handlers run synchronously inside a database transaction; an "
                "'async def' handler would be marked handled without running. Make it a plain 'def' "
                "(call async code with asgiref's async_to_sync if you must)."
            )
        try:
            check_event_name(event_name)
        except InvalidEventName as exc:
            raise ConfigurationError(f"@subscribe{where}: {exc}") from None
        sub_name = check_subscription_name(name if name is not None else default_name(func), where)
        # The same validators as the settings these options override (conf.py),
        # with the option's name in the message instead of PLATFORMKIT['...'].
        delays = None
        try:
            if max_attempts is not None:
                conf.positive_int("max_attempts", max_attempts)
            if backoff_seconds is not None:
                delays = conf.backoff_seconds("backoff_seconds", backoff_seconds)
            conf.positive_int("concurrency", concurrency)
            if max_ack_pending is not None:
                conf.positive_int("max_ack_pending", max_ack_pending)
            conf.boolean("batch", batch)
            conf.boolean("external", external)
            conf.boolean("backfill", backfill)
        except ConfigurationError as exc:
            raise ConfigurationError(f"@subscribe{where}: " + _option_text(exc)) from None
        rate, rate_error = None, ""
        if rate_limit is not None:
            try:
                rate = conf.rate("rate_limit", rate_limit)
            except ConfigurationError as exc:
                rate_error = f"@subscribe{where}: " + _option_text(exc)
        subscription = Subscription(
            name=sub_name,
            event=event_name,
            handler=func,
            max_attempts_override=max_attempts,
            backoff_seconds_override=delays,
            declared_in=f"{func.__module__}.{func.__qualname__}",
            batch=batch,
            concurrency=concurrency,
            external=external,
            max_ack_pending_override=max_ack_pending,
            backfill=backfill,
            rate_limit=rate,
            rate_limit_error=rate_error,
            rate_limit_given=rate_limit,
        )
        existing = _subscriptions.get(sub_name)
        # Same function and event again is a re-import; one function stacked
        # under two @subscribe with the default name would silently lose one.
        if existing is not None and (existing.declared_in, existing.event) != (
            subscription.declared_in,
            subscription.event,
        ):
            raise ConfigurationError(
                f"two subscriptions are named {sub_name!r}: {existing.declared_in} ({existing.event}) and "
                f"{subscription.declared_in} ({subscription.event}). Pass name='...' to one of them."
            )
        _subscriptions[sub_name] = subscription
        return func

    return decorator


def _option_text(exc: ConfigurationError) -> str:
    """A setting validator's message with the option's name instead of ``PLATFORMKIT['...']``."""
    return re.sub(r"PLATFORMKIT\['(\w+)'\]", r"\1", str(exc))


def subscriptions() -> list[Subscription]:
    """Every registered subscription, sorted by name."""
    return [_subscriptions[k] for k in sorted(_subscriptions)]


def get_subscription(name: str) -> Subscription | None:
    """The registered subscription named ``name``, or None."""
    return _subscriptions.get(name)
