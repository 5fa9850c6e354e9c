"""What becomes of each delivery of one subscription - ack, nak or term -
and the counts of it: the one place that answers the broker for a
delivery (DESIGN.md "Attempts", "Trust model").

Ack: handled, or a claim existed (a redelivery after a lost ack), after
the unit's commit. Nak: a retry after its backoff, or a hand-back (the
worker stops, the subscription is paused: no run, not an attempt). Term:
a dead letter and its terminal claim at ``max_attempts``, or a malformed
message recorded as such. Every failed run is recorded before its message
is naked, so a run that killed its worker still counts. A message the
outbox doesn't know is never termed while this database's identity is
contested (a live copy of it tried the stream): it may be the copy's.

The consumer decides each delivery's ``Work.outcome`` and hands a refused
delivery to ``Outcome.refuse`` and every unit to ``Outcome.conclude``;
each delivery's ``Verdict`` is judged there, and ``Outcome._answer`` is the
one place the broker hears it.

Why one module: a verdict and the rows that make it safe are one decision -
a term only after its dead letter (or malformed record) is written, a nak
only after its failed run is recorded, neither when the write failed - and
the counts follow the verdicts. Split apart, two objects would again share
the counts and each answer the broker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from django.db import DatabaseError, connections

from django_platformkit import conf, signals
from django_platformkit._text import storable_text as clean_text
from django_platformkit.broker.port import Broker, KeepAlive
from django_platformkit.consume.attempts import history_text, mark_interrupted, record_failed_run
from django_platformkit.consume.claim import NOT_IN_OUTBOX
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import Refused, Stopping, Work
from django_platformkit.consume.waiting import DatabaseWait
from django_platformkit.exceptions import is_permanent
from django_platformkit.outage import close_old_connections_for
from django_platformkit.outbox.deadletters import malformed_id, record_dead_letter, record_malformed
from django_platformkit.wire import AttemptOutcome, Delivery, HandlingOutcome

logger = logging.getLogger(__name__)

#: While this database's identity is contested, a message its outbox doesn't
#: know comes back after this long (seconds): the running worker checks its
#: stream as often (``identity.RENEW_SECONDS``), so by then it knows more.
CONTESTED_REDELIVERY_SECONDS = 30.0
#: The least time between two log lines about such hand-backs (seconds).
CONTESTED_LOG_EVERY_SECONDS = 60.0
#: Acked after the unit's commit.
ACKED = (HandlingOutcome.HANDLED, HandlingOutcome.SKIPPED)
#: The outcomes counted (a consumer's ``counts``, the worker's totals and health file).
COUNTED = (
    HandlingOutcome.HANDLED,
    HandlingOutcome.SKIPPED,
    HandlingOutcome.RETRIED,
    HandlingOutcome.DEAD_LETTERED,
    HandlingOutcome.MALFORMED,
)


class Answer(StrEnum):
    """What the broker is told of a delivery."""

    #: Done: never delivered again.
    ACK = "ack"
    #: Deliver again, at once or after a delay (a retry, a hand-back).
    NAK = "nak"
    #: Never deliver again (a dead letter, a malformed message: their rows say why).
    TERM = "term"


@dataclass(frozen=True)
class Verdict:
    """What becomes of one delivery: its outcome and the broker's answer
    (None: nothing is said, the broker redelivers it after the ack wait)."""

    outcome: HandlingOutcome
    answer: Answer | None = None
    delay_seconds: float | None = None  # a nak's (None: at once)


#: The database was gone: no answer, the broker redelivers after the ack wait.
UNANSWERED = Verdict(HandlingOutcome.UNACKED)


class Outcome:
    """What becomes of each delivery of one subscription: its verdict (ack,
    nak or term), the rows and signals that go with it, the broker call,
    and the counts.

    Args:
        subscription: Whose deliveries it answers for.
        broker: Acks, naks and terms them.
        using: The database alias of the attempt rows and dead letters.
        wait: Waits out the database to record a failed run.
        contested: Set while this database's identity is contested (the worker's ``StreamWatch``).
    """

    def __init__(
        self,
        subscription: Subscription,
        broker: Broker,
        using: str,
        wait: DatabaseWait,
        contested: threading.Event | None = None,
    ) -> None:
        self.subscription = subscription
        self.broker = broker
        self.using = using
        self.wait = wait
        self.contested = contested or threading.Event()
        #: Totals by outcome (``handled``, ``skipped``, ``retried``, ``dead_lettered``, ``malformed``).
        self.counts: Counter[HandlingOutcome] = Counter(dict.fromkeys(COUNTED, 0))
        self._handed_back_contested = 0
        self._contested_logged = float("-inf")

    # -- the two ways in --
    def refuse(self, refused: Refused, keep: KeepAlive | None) -> HandlingOutcome:
        """A delivery no unit takes: a re-send for other subscriptions is
        acked (``ELSEWHERE``: never run or counted), a message that can't be
        decoded termed (``MALFORMED``, or ``UNACKED`` while its record can't
        be written)."""
        delivery, reason = refused
        verdict = (
            Verdict(HandlingOutcome.ELSEWHERE, Answer.ACK) if reason is None else self._malformed(delivery, reason)
        )
        self._answer([(delivery, verdict, None)])
        self._end_keep_alive(keep, [delivery])
        return verdict.outcome

    def conclude(self, unit: list[Work], keep: KeepAlive | None) -> None:
        """Carry out what the unit decided for each of its works (see
        ``Work``), after its transaction: ack the handled and skipped ones
        together, then judge the rest (nak or term, the rows first); each
        ``Work.outcome`` then says what became of its delivery."""
        sub = self.subscription
        acks: list[tuple[Delivery, Verdict, uuid.UUID | None]] = []
        for work in unit:
            if work.outcome not in ACKED:
                continue
            event = work.event
            self.counts[work.outcome] += 1
            if signals.event_handled.receivers:  # once per handling: skip building the call
                signals.event_handled.send_robust(
                    sender=sub,
                    subscription=sub.name,
                    event=event,
                    outcome=work.outcome,
                    duration_seconds=work.duration_seconds,
                    delivery_latency_seconds=work.latency_seconds,
                )
            logger.debug("%s subscription=%s event_id=%s attempt=%s", work.outcome, sub.name, event.id, event.attempt)
            acks.append((work.message, Verdict(work.outcome, Answer.ACK), event.id))
        # Acked only now, after the commit: a crash before this line means
        # redeliveries that find the claims and skip.
        self._answer(acks)
        judged = []
        for work in unit:
            if work.outcome == HandlingOutcome.SKIPPED and work.attempt_row is not None:
                self._mark_interrupted(work)  # handled elsewhere meanwhile: this run never started
            elif work.outcome not in ACKED:
                verdict = self._judge(work)
                work.outcome = verdict.outcome
                judged.append((work.message, verdict, work.event.id))
        self._answer(judged)
        self._end_keep_alive(keep, [work.message for work in unit])

    def _judge(self, work: Work) -> Verdict:
        """The verdict on a work the unit didn't handle, its rows written first."""
        if work.outcome == HandlingOutcome.NOT_IN_OUTBOX:
            return self._not_in_outbox(work, NOT_IN_OUTBOX)
        if work.outcome == HandlingOutcome.FAILED:
            return self._failed(work)
        if work.outcome == HandlingOutcome.HANDED_BACK:
            return self._hand_back(work)
        if work.outcome == HandlingOutcome.DEAD_LETTERED:
            return self._dead_letter_without_running(work)
        return UNANSWERED

    def _answer(self, verdicts: Sequence[tuple[Delivery, Verdict, uuid.UUID | None]]) -> None:
        """Tell the broker each verdict (the acks in one call): the one place
        it is told. A failure is logged, never raised: the message comes back
        after the ack wait (and is acked, or judged, again)."""
        acks = [delivery for delivery, verdict, _ in verdicts if verdict.answer == Answer.ACK]
        for delivery, verdict, event_id in verdicts:
            answer = verdict.answer
            if answer is None or (answer == Answer.ACK and delivery is not acks[0]):
                continue  # nothing to say, or acked with the first
            try:
                if answer == Answer.ACK:
                    self.broker.ack_many(acks)
                elif answer == Answer.NAK:
                    self.broker.nak(delivery, verdict.delay_seconds)
                else:
                    self.broker.term(delivery)
            except Exception as exc:
                logger.warning(
                    "%s failed subscription=%s event_id=%s stream_seq=%s error=%s",
                    answer,
                    self.subscription.name,
                    event_id,
                    delivery.stream_seq,
                    exc,
                )

    @staticmethod
    def _end_keep_alive(keep: KeepAlive | None, deliveries: list[Delivery]) -> None:
        """The deliveries are answered (or left to the broker): their keep-alive ends."""
        if keep is None:
            return
        for delivery in deliveries:
            with contextlib.suppress(Exception):  # it only stops a keep-alive
                keep.settled(delivery)

    # -- nak --
    def _failed(self, work: Work) -> Verdict:
        """Record the failed run, then retry the message after its backoff
        (nak) or, at ``max_attempts``, dead-letter it (term)."""
        sub = self.subscription
        event, error = work.event, work.error
        message = clean_text(f"{type(error).__name__}: {error}")
        tb = clean_text(work.tb)
        try:
            self.wait.until_answers([work], lambda: self._record_failed_run(work, message, tb), 30.0, None)
        except Stopping:
            return self._hand_back(work)
        except DatabaseError as exc:
            logger.error(
                "failed run not recorded, will retry subscription=%s event_id=%s error=%s", sub.name, event.id, exc
            )
            connections[self.using].close()
            return UNANSWERED
        # A PermanentFailure (or a mark_permanent() error) says a retry can't help: dead-letter it now.
        will_retry = event.attempt < sub.max_attempts and not is_permanent(error)
        signals.event_failed.send_robust(
            sender=sub,
            subscription=sub.name,
            event=event,
            error=error,
            attempt=event.attempt,
            will_retry=will_retry,
            duration_seconds=work.duration_seconds,
            delivery_latency_seconds=work.latency_seconds,
        )
        if not will_retry:
            return self._dead_letter(work, attempts=event.attempt, error=message, tb=tb, exception=error)
        delay = sub.delay_after(event.attempt)
        task = work.task  # names what failed in the log line
        logger.warning(
            "handler failed, retrying subscription=%s%s event_id=%s attempt=%s/%s retry_in=%ss error=%s",
            sub.name,
            f" task={task}" if task else "",
            event.id,
            event.attempt,
            sub.max_attempts,
            delay,
            message,
        )
        self.counts[HandlingOutcome.RETRIED] += 1
        return Verdict(HandlingOutcome.RETRIED, Answer.NAK, delay)

    def _record_failed_run(self, work: Work, message: str, tb: str) -> None:
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

    def _mark_interrupted(self, work: Work) -> None:
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

    def _not_in_outbox(self, work: Work, reason: str) -> Verdict:
        """A message the outbox doesn't hold: recorded as malformed and
        terminated - unless this database's identity is contested. A live
        copy of this database (a staging restore) shares the stream's
        durables while it is refused, and a message of the copy's, or of
        events written after the copy was made, must not be terminated in the
        shared durable on the word of an outbox that may be the wrong one: it
        comes back after ``CONTESTED_REDELIVERY_SECONDS`` (not an attempt),
        for whichever database holds it, or for a settled standing."""
        self._mark_interrupted(work)
        if not self.contested.is_set():
            return self._malformed(work.message, reason)
        self._handed_back_contested += 1
        now = time.monotonic()
        if now - self._contested_logged >= CONTESTED_LOG_EVERY_SECONDS:
            self._contested_logged = now
            logger.warning(
                "not in this outbox and this database's identity is contested: handed back, not terminated "
                "subscription=%s event_id=%s handed_back=%s retry_in=%.0fs",
                self.subscription.name,
                work.event.id,
                self._handed_back_contested,
                CONTESTED_REDELIVERY_SECONDS,
            )
        return Verdict(HandlingOutcome.HANDED_BACK, Answer.NAK, CONTESTED_REDELIVERY_SECONDS)

    def _hand_back(self, work: Work) -> Verdict:
        """The worker is stopping, the subscription is paused, or another
        worker is starting this run: nak, at once or after
        ``work.redeliver_in_seconds`` (not counted: no run recorded)."""
        self._mark_interrupted(work)
        return Verdict(HandlingOutcome.HANDED_BACK, Answer.NAK, work.redeliver_in_seconds)

    # -- term --
    def _dead_letter_without_running(self, work: Work) -> Verdict:
        """A redelivery whose counted runs (``work.runs``) reached ``max_attempts``: dead-letter it with the last real error."""
        sub = self.subscription
        runs = work.runs
        counted = [r for r in runs if r.counts]
        last_failed = next((r for r in reversed(runs) if r.outcome == AttemptOutcome.FAILED and r.error), None)
        why = (
            f"dead-lettered without running again: the handler already started {len(counted)} times for this event "
            f"(max_attempts={sub.max_attempts}); history: {history_text(runs)}"
        )
        error = f"{last_failed.error}\n{why}" if last_failed else why
        return self._dead_letter(
            work,
            attempts=len(counted),
            error=error,
            tb=last_failed.traceback if last_failed else "",
        )

    def _dead_letter(
        self,
        work: Work,
        *,
        attempts: int,
        error: str,
        tb: str,
        exception: BaseException | None = None,
    ) -> Verdict:
        """Write the dead letter and its terminal claim, then term the message
        (``SKIPPED`` when a claim was there first: no dead letter)."""
        sub, event = self.subscription, work.event
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
            return UNANSWERED
        if written:
            task = work.task  # names what failed in the log line and the signal
            logger.error(
                "dead letter subscription=%s%s event_id=%s name=%s attempts=%s error=%s%s",
                sub.name,
                f" task={task}" if task else "",
                event.id,
                event.name,
                attempts,
                error,
                "" if exception is not None else "\n" + tb,
                exc_info=exception,  # error trackers (Sentry's logging integration) see the exception itself
            )
            self.counts[HandlingOutcome.DEAD_LETTERED] += 1
            signals.event_dead_lettered.send_robust(
                sender=sub,
                subscription=sub.name,
                event_id=event.id,
                name=event.name,
                tenant=event.tenant,
                attempts=attempts,
                error=error.splitlines()[0] if error else "",
                exception=exception,
                task=task,
            )
        else:
            logger.info("already claimed, no dead letter subscription=%s event_id=%s", sub.name, event.id)
        return Verdict(HandlingOutcome.DEAD_LETTERED if written else HandlingOutcome.SKIPPED, Answer.TERM)

    def _malformed(self, delivery: Delivery, reason: str) -> Verdict:
        """Record a message that can't be run as a ``(malformed)`` dead letter, then term it."""
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
                stream_seq=delivery.stream_seq,
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
            return UNANSWERED
        self.counts[HandlingOutcome.MALFORMED] += 1
        signals.event_malformed.send_robust(
            sender=sub,
            subscription=sub.name,
            subject=delivery.subject,
            stream_seq=delivery.stream_seq,
            reason=reason,
            event_id=event_id,
        )
        return Verdict(HandlingOutcome.MALFORMED, Answer.TERM)
