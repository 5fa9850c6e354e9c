"""After a unit's transaction: what happens to a delivery that didn't
succeed - a retry after its backoff, a dead letter and a terminal claim at
``max_attempts``, a malformed message recorded and terminated, or a hand-back
when the worker stops (not an attempt: DESIGN.md "Attempts").

Every failed run is recorded before its message is naked, so a run that
killed its worker still counts. ``Consumer`` carries these methods.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import DatabaseError, connections

from django_platformkit import conf, signals
from django_platformkit._text import storable_text as clean_text
from django_platformkit.consume.attempts import history_text, mark_interrupted, record_failed_run
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import _Stopping, _Work
from django_platformkit.exceptions import PermanentFailure
from django_platformkit.operate.deadletters import malformed_id, record_dead_letter, record_malformed
from django_platformkit.outage import close_old_connections_for
from django_platformkit.wire import Delivery, ReceivedEvent

if TYPE_CHECKING:
    from django_platformkit.broker.transport import Transport

logger = logging.getLogger(__name__)
T = TypeVar("T")


class _Settling:
    """``Consumer``'s settling of what didn't succeed (see ``Consumer``)."""

    subscription: Subscription
    transport: Transport
    using: str
    counts: dict[str, int]
    _durations: dict[uuid.UUID, float]

    if TYPE_CHECKING:

        def _until_db_answers(self, unit: list[_Work], run: Callable[[], T], timeout: float, keep: Any) -> T: ...

    def _dead_letter_without_running(
        self, work: _Work, rows: Sequence[tuple[Any, ...]], counted: Sequence[tuple[Any, ...]]
    ) -> str:
        sub = self.subscription
        last_failed = next((r for r in reversed(rows) if r[1] == "failed" and r[2]), None)
        why = (
            f"dead-lettered without running again: the handler already started {len(counted)} times for this event "
            f"(max_attempts={sub.max_attempts}); history: {history_text(rows)}"
        )
        error = f"{last_failed[2]}\n{why}" if last_failed else why
        return self._dead_letter(
            work.delivery, work.event, attempts=len(counted), error=error, tb=last_failed[3] if last_failed else ""
        )

    def _failed(self, work: _Work) -> str:
        """After the unit's transaction: record the failed run, then retry
        the message after its backoff or, at ``max_attempts``, dead-letter it."""
        sub = self.subscription
        event, error = work.event, work.error
        message = clean_text(f"{type(error).__name__}: {error}")
        tb = clean_text(work.tb)
        try:
            self._until_db_answers([work], lambda: self._record_failed_run(work, message, tb), 30.0, None)
        except _Stopping:
            return self._hand_back(work)
        except DatabaseError as exc:
            logger.error(
                "failed run not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc
            )
            connections[self.using].close()
            return "unacked"
        # A PermanentFailure says a retry can't help: dead-letter it now.
        will_retry = event.attempt < sub.max_attempts and not isinstance(error, PermanentFailure)
        signals.event_failed.send_robust(
            sender=sub,
            subscription=sub.name,
            event=event,
            error=error,
            attempt=event.attempt,
            will_retry=will_retry,
            duration_seconds=self._durations.pop(event.id, 0.0),
        )
        if not will_retry:
            return self._dead_letter(
                work.delivery, event, attempts=event.attempt, error=message, tb=tb, exception=error
            )
        delay = sub.delay_after(event.attempt)
        logger.warning(
            "handler failed, retrying subscription=%s event_id=%s attempt=%s/%s retry_in=%ss error=%s",
            sub.name,
            event.id,
            event.attempt,
            sub.max_attempts,
            delay,
            message,
        )
        self._settle(lambda: self.transport.nak(work.delivery, delay), event, "nak")
        self.counts["retried"] += 1
        return "retried"

    def _record_failed_run(self, work: _Work, message: str, tb: str) -> None:
        close_old_connections_for(self.using)
        record_failed_run(
            subscription=self.subscription.name,
            event_id=work.event.id,
            attempt_row=work.attempt_row,
            started_at=work.started_at,
            error=message,
            traceback=tb,
            using=self.using,
        )

    def _mark_interrupted(self, work: _Work) -> None:
        if work.attempt_row is None:
            return
        try:
            mark_interrupted(work.attempt_row, using=self.using)
        except DatabaseError as exc:
            logger.warning(
                "attempt not marked interrupted subscription=%s event_id=%s error=%s",
                self.subscription.name,
                work.event.id,
                exc,
            )

    def _hand_back(self, work: _Work) -> str:
        """The worker is stopping: nak at once (not counted: no run recorded)."""
        self._mark_interrupted(work)
        self._settle(lambda: self.transport.nak(work.delivery), work.event, "nak")
        return "handed_back"

    def _settled(self, keep: Any, delivery: Delivery) -> None:
        if keep is not None:
            try:
                keep.settled(delivery)
            except Exception:  # it only stops a keep-alive
                pass

    def _send_handled(self, event: ReceivedEvent, outcome: str) -> None:
        sub = self.subscription
        if not signals.event_handled.receivers:  # once per handling: skip building the call
            self._durations.pop(event.id, None)
            return
        signals.event_handled.send_robust(
            sender=sub,
            subscription=sub.name,
            event=event,
            outcome=outcome,
            duration_seconds=self._durations.pop(event.id, 0.0),
        )

    def _settle(self, action: Callable[[], None], event: ReceivedEvent, what: str) -> None:
        try:
            action()
        except Exception as exc:
            logger.warning(
                "%s failed subscription=%s event_id=%s error=%s", what, self.subscription.name, event.id, exc
            )

    # -- giving up --
    def _dead_letter(
        self,
        delivery: Delivery,
        event: ReceivedEvent,
        *,
        attempts: int,
        error: str,
        tb: str,
        exception: BaseException | None = None,
    ) -> str:
        sub = self.subscription
        try:
            written = record_dead_letter(
                subscription=sub.name,
                event_id=event.id,
                name=event.name,
                tenant=event.tenant,
                attempts=attempts,
                error=error,
                traceback=tb,
                using=self.using,
            )
        except DatabaseError as exc:
            # Not acked: the broker redelivers after the ack wait, and the
            # redelivery (counted runs at max_attempts) records it without running the handler.
            logger.error(
                "dead letter not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc
            )
            connections[self.using].close()
            return "unacked"
        if written:
            logger.error(
                "dead letter subscription=%s event_id=%s name=%s attempts=%s error=%s%s",
                sub.name,
                event.id,
                event.name,
                attempts,
                error,
                "" if exception is not None else "\n" + tb,
                exc_info=exception,  # error trackers (Sentry's logging integration) see the exception itself
            )
            self.counts["dead_lettered"] += 1
            signals.event_dead_lettered.send_robust(
                sender=sub,
                subscription=sub.name,
                event_id=event.id,
                name=event.name,
                tenant=event.tenant,
                attempts=attempts,
                error=error.splitlines()[0] if error else "",
                exception=exception,
            )
        else:
            logger.info("already claimed, no dead letter subscription=%s event_id=%s", sub.name, event.id)
        self._settle(lambda: self.transport.term(delivery), event, "term")
        return "dead_lettered" if written else "skipped"

    def _malformed(self, delivery: Delivery, reason: str) -> str:
        sub = self.subscription
        body_id = None
        with contextlib.suppress(Exception):
            body_id = uuid.UUID(str(json.loads(delivery.data).get("id")))
        event_id = malformed_id(conf.settings.STREAM, delivery.stream_seq)
        claimed = f" claimed_id={body_id}" if body_id is not None else ""
        error = f"malformed message{claimed} on subject={delivery.subject} stream_seq={delivery.stream_seq}: {reason}"
        logger.error(
            "malformed message terminated subscription=%s subject=%s stream_seq=%s reason=%s",
            sub.name,
            delivery.subject,
            delivery.stream_seq,
            reason,
        )
        try:
            record_malformed(
                subscription=sub.name,
                event_id=event_id,
                attempts=delivery.attempt,
                error=error,
                body=delivery.data,
                using=self.using,
            )
        except DatabaseError as exc:
            logger.error(
                "malformed message not recorded, will retry subscription=%s stream_seq=%s error=%s",
                sub.name,
                delivery.stream_seq,
                exc,
            )
            connections[self.using].close()
            return "unacked"
        with contextlib.suppress(Exception):
            self.transport.term(delivery)
        self.counts["malformed"] += 1
        signals.event_malformed.send_robust(
            sender=sub,
            subscription=sub.name,
            subject=delivery.subject,
            stream_seq=delivery.stream_seq,
            reason=reason,
            event_id=event_id,
        )
        return "malformed"
