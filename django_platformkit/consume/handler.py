"""Calling a subscription's handler inside its unit's transaction: the
tenant context, the tracing span, the handler timeout, and the rules for a
handler's ``transaction.on_commit()`` callbacks.

A handler that runs past ``HANDLER_TIMEOUT_SECONDS`` fails its attempt and
its work rolls back; one that swallows a database error fails too, rather
than committing nothing and being acked as handled. ``Consumer`` carries
these methods.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections
from django.db.transaction import TransactionManagementError

from django_platformkit import tracing
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import _Work
from django_platformkit.outbox.events import current_event
from django_platformkit.wire import ReceivedEvent

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

#: Why an attempt failed whose handler closed the connection inside its transaction.
_CLOSED_BY_HANDLER = (
    "the handler closed the database connection inside its transaction (connection.close(), "
    "close_old_connections(), ...), so its work and claim can't commit: don't close the "
    "connection in a handler; the worker manages it"
)


class HandlerTimeout(Exception):
    """The handler ran past HANDLER_TIMEOUT_SECONDS: counted as a failed attempt."""


class _Running:
    """``Consumer``'s handler call (see ``Consumer``)."""

    subscription: Subscription
    using: str
    handlers_started: dict[int, float]
    _local: threading.local
    _durations: dict[uuid.UUID, float]
    _tenant_factory: Callable[[str | None], Any]
    _default_tenant_context: bool

    if TYPE_CHECKING:
        handler_started: float | None

    def _call_handler(self, event: ReceivedEvent, timeout: float, wrapper: BaseDatabaseWrapper | None = None) -> None:
        """Run the handler inside its transaction (claim already taken): in
        the event's tenant context, with ``publish()`` defaulting to the
        event's tenant. Past ``timeout`` it raises ``HandlerTimeout``, so its
        work rolls back and the attempt counts as failed. ``wrapper``: the
        unit's Django connection (looked up when None)."""
        started = self._handler_starts(event, timeout)
        if wrapper is None:
            wrapper = connections[self.using]
        on_commit_mark = len(wrapper.run_on_commit)
        token = current_event.set(event)
        duration = 0.0
        try:
            try:
                if self._default_tenant_context and not tracing.enabled():
                    # The common case, with no context manager per run.
                    self.subscription.handler(event)
                else:
                    context = (
                        contextlib.nullcontext() if self._default_tenant_context else self._tenant_factory(event.tenant)
                    )
                    # Tracing off (no tracer provider): no generator context manager per run.
                    span = (
                        tracing.consumer_span(
                            subscription=self.subscription.name,
                            event_id=event.id,
                            name=event.name,
                            headers=event.headers,
                            attempt=event.attempt,
                        )
                        if tracing.enabled()
                        else contextlib.nullcontext()
                    )
                    with context, span:
                        self.subscription.handler(event)
            finally:
                duration = self._durations[event.id] = time.monotonic() - started
            if duration > timeout:
                raise HandlerTimeout(f"handler ran past HANDLER_TIMEOUT_SECONDS={timeout:g}; its work was rolled back")
            if wrapper.needs_rollback or (
                wrapper.connection is not None
                and wrapper.connection.pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR
            ):
                # An ORM error marks the transaction for rollback; a raw cursor's
                # error leaves it aborted in PostgreSQL. Either way the commit
                # would roll back without a word, claim included, and the event
                # would be acked as handled: fail the attempt instead.
                if getattr(wrapper, "closed_in_transaction", False):
                    raise TransactionManagementError(_CLOSED_BY_HANDLER)
                raise TransactionManagementError(
                    "the handler caught a database error and returned, so its transaction can only roll back: "
                    "let the error propagate, or wrap the statement that may fail in transaction.atomic()"
                )
        except BaseException as exc:
            # A failed attempt's callbacks must never run. Django drops them
            # itself only for savepoints it made; a unit's are ours.
            del wrapper.run_on_commit[on_commit_mark:]
            if not isinstance(exc, (HandlerTimeout, TransactionManagementError)) and getattr(
                wrapper, "closed_in_transaction", False
            ):
                # Closed by the handler, then a query: its "the connection is
                # closed" is no database outage (that would retry the event
                # forever, never an attempt) but the handler's doing.
                raise TransactionManagementError(_CLOSED_BY_HANDLER) from exc
            if not isinstance(exc, HandlerTimeout) and duration > timeout:
                # Past its timeout the session is ended by the server
                # (idle_in_transaction_session_timeout / statement_timeout):
                # say why, rather than "terminating connection".
                raise HandlerTimeout(
                    f"handler ran past HANDLER_TIMEOUT_SECONDS={timeout:g}; its work was rolled back ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        finally:
            current_event.reset(token)
        # The handler's transaction.on_commit() callbacks run after the commit,
        # when the event is handled for good: one that raises is logged
        # (Django's robust=True) instead of failing an attempt that
        # succeeded - or, in a batch, skipping every later message's callbacks.
        # django-stubs types the entries as (sids, func); Django stores (sids, func, robust).
        if len(wrapper.run_on_commit) > on_commit_mark:
            wrapper.run_on_commit[on_commit_mark:] = [
                (sids, func, True)  # type: ignore[misc]
                for sids, func, *_ in wrapper.run_on_commit[on_commit_mark:]
            ]

    def _handler_starts(self, event: ReceivedEvent, timeout: float) -> float:
        """The claim is in; the handler starts now (returned: monotonic
        seconds). From here its message's ack is extended for ``timeout``
        seconds only. Not before: while the worker waits for a database that
        went away, the ack keeps being extended, so an outage can't push
        healthy events past MAX_ATTEMPTS."""
        now = self.handlers_started[threading.get_ident()] = time.monotonic()
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None:
            delivery = keep[1].get(event.id)
            if delivery is not None:
                keep[0].started(delivery, timeout)
        return now

    def _awaits_commit(self, work: _Work, seconds: float) -> None:
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None and work.delivery is not None:
            keep[0].started(work.delivery, seconds)
