"""Calling a subscription's handler inside its unit's transaction: the
tenant context, the tracing span, the handler timeout, and the rules for a
handler's ``transaction.on_commit()`` callbacks.

A handler that runs past ``HANDLER_TIMEOUT_SECONDS`` fails its attempt and
its work rolls back; one that swallows a database error fails too, rather
than committing nothing and being acked as handled. ``HandlerRunner`` also
knows, per thread, which run its handler is in and since when: what the
watchdog reads and the slow-run recorder counts (DESIGN.md "Attempts").
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

import psycopg
from django.db.transaction import TransactionManagementError

from django_platformkit import tracing
from django_platformkit.broker.port import KeepAlive
from django_platformkit.consume.attempts import record_failed_run, slow_runs
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.tenancy import set_config_tenant, tenant_context_factory
from django_platformkit.consume.units import Work
from django_platformkit.outbox.events import current_event
from django_platformkit.wire import Delivery, ReceivedEvent, task_path

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger(__name__)

#: Why an attempt failed whose handler closed the connection inside its transaction.
_CLOSED_BY_HANDLER = (
    "the handler closed the database connection inside its transaction (connection.close(), "
    "close_old_connections(), ...), so its work and claim can't commit: don't close the "
    "connection in a handler; the worker manages it"
)


class HandlerTimeout(Exception):
    """The handler ran past HANDLER_TIMEOUT_SECONDS: counted as a failed attempt."""


class HandlerRunner:
    """Runs one subscription's handler; safe to use from several threads at
    once (each with its own database connection): what it tracks is per thread.

    Args:
        subscription: Whose handler it runs.
        using: The database alias of the unit's transaction.
    """

    def __init__(self, subscription: Subscription, using: str) -> None:
        self.subscription = subscription
        self.using = using
        #: thread ident -> monotonic start of the handler running in it (the watchdog reads it).
        self.started: dict[int, float] = {}
        #: thread ident -> the run its handler is in (``record_stuck_runs``).
        self.running: dict[int, Work] = {}
        self._local = threading.local()  # .keep: (KeepAlive, {event id: Delivery}) of this thread's unit
        self._tenant_factory = tenant_context_factory()
        self.default_tenant_context = self._tenant_factory is set_config_tenant

    # -- the unit this thread runs --
    def attach(self, keep: KeepAlive | None, deliveries: Mapping[uuid.UUID, Delivery]) -> None:
        """This thread now runs a unit whose deliveries ``keep`` keeps alive."""
        self._local.keep = (keep, deliveries)

    def detach(self) -> None:
        """This thread's unit ended."""
        self._local.keep = None

    def forget_start(self) -> None:
        """No handler runs in this thread any more (a unit given up on)."""
        self.started.pop(threading.get_ident(), None)

    @property
    def oldest_start(self) -> float | None:
        """Monotonic start of the oldest handler running now, or None."""
        return min(self.started.values(), default=None)

    # -- one run --
    def run(self, work: Work, event: ReceivedEvent, timeout: float, wrapper: BaseDatabaseWrapper) -> None:
        """Run the handler for ``work`` (its claim already taken) inside the
        unit's transaction on ``wrapper``, in the event's tenant context, with
        ``publish()`` defaulting to the event's tenant.

        A first delivery's run is watched by the slow-run recorder: past
        ``RECORD_SLOW_RUN_AFTER_SECONDS`` it gets a ``running`` row, so a run
        that hangs or kills its worker still counts.

        Raises:
            HandlerTimeout: The handler ran past ``timeout`` seconds (its work rolls back).
            TransactionManagementError: The handler left the transaction
                unable to commit (a swallowed database error, a closed connection).
            BaseException: Whatever the handler raised.
        """
        ident = threading.get_ident()
        work.started_epoch = time.time()
        # The event it runs with is the outbox's (a trusted subscription): its
        # task labels the span, the log lines and the signals, never the message's.
        work.task = task_path(event.name, event.payload)
        if work.due_epoch is not None:
            work.latency_seconds = max(0.0, work.started_epoch - work.due_epoch)
        watched = work.delivery is not None and work.attempt_row is None
        if watched:
            work.running = True
            slow_runs.watch(work, self.subscription.name, self.using)
        self.running[ident] = work
        try:
            self._call(work, event, timeout, wrapper)
        finally:
            if watched:
                slow_runs.unwatch(work)
                with work.lock:  # waits for a row being written now
                    work.running = False
            self.started.pop(ident, None)
            self.running.pop(ident, None)

    def _call(self, work: Work, event: ReceivedEvent, timeout: float, wrapper: BaseDatabaseWrapper) -> None:
        started = self._starts(event, timeout)
        on_commit_mark = len(wrapper.run_on_commit)
        token = current_event.set(event)
        duration = 0.0
        try:
            try:
                if self.default_tenant_context and not tracing.enabled():
                    # The common case, with no context manager per run.
                    self.subscription.handler(event)
                else:
                    context = (
                        contextlib.nullcontext() if self.default_tenant_context else self._tenant_factory(event.tenant)
                    )
                    # Tracing off (no tracer provider): no generator context manager per run.
                    span = (
                        tracing.consumer_span(
                            subscription=self.subscription.name,
                            event_id=event.id,
                            name=event.name,
                            headers=event.headers,
                            attempt=event.attempt,
                            task=work.task,
                            task_priority=event.payload.get("priority", 0),
                        )
                        if tracing.enabled()
                        else contextlib.nullcontext()
                    )
                    with context, span:
                        self.subscription.handler(event)
            finally:
                duration = work.duration_seconds = time.monotonic() - started
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

    def _starts(self, event: ReceivedEvent, timeout: float) -> float:
        """The claim is in; the handler starts now (returned: monotonic
        seconds). From here its message's ack is extended for ``timeout``
        seconds only. Not before: while the worker waits for a database that
        went away, the ack keeps being extended, so an outage can't push
        healthy events past MAX_ATTEMPTS."""
        now = self.started[threading.get_ident()] = time.monotonic()
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None:
            delivery = keep[1].get(event.id)
            if delivery is not None:
                keep[0].started(delivery, timeout)
        return now

    def awaits_commit(self, work: Work, seconds: float) -> None:
        """``work``'s handler is done and its ack waits for the unit's commit:
        keep its ack alive ``seconds`` more."""
        keep = getattr(self._local, "keep", None)
        if keep is not None and keep[0] is not None and work.delivery is not None:
            keep[0].started(work.delivery, seconds)

    def record_stuck_runs(self, started_before: float, error: str) -> int:
        """Record each run whose handler started before ``started_before``
        (monotonic seconds) and is still in it as ``failed`` with ``error``
        and, as its traceback, the stack its thread is in now.

        Called by the watchdog just before it exits the process for a stuck
        handler, so the event's retries and dead letter say why the run ended
        and where it hung, not "never reported". A database error is logged,
        never raised (the process exits either way).

        Returns:
            How many runs it recorded.
        """
        frames = sys._current_frames()
        recorded = 0
        for ident, started in list(self.started.items()):
            work = self.running.get(ident)
            if started >= started_before or work is None:
                continue
            frame = frames.get(ident)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            if not work.lock.acquire(timeout=2.0):  # the slow-run recorder writing its row: wait for it
                continue
            try:
                record_failed_run(
                    subscription=self.subscription.name,
                    event_id=work.event.id,
                    attempt_row=work.attempt_row,
                    started_at=work.started_at,
                    error=error,
                    traceback=f"The stuck handler's thread, when the worker exited:\n{stack}",
                    using=self.using,
                )
                recorded += 1
            except Exception as exc:
                logger.error(
                    "stuck run not recorded subscription=%s event_id=%s error=%s",
                    self.subscription.name,
                    work.event.id,
                    exc,
                )
            finally:
                work.lock.release()
        return recorded
