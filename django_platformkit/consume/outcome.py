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
delivery to ``Outcome.refuse`` and every unit to ``Outcome.conclude``.
There each delivery goes one way: judged (``_judge``: an ``Ending`` value,
its rows and its ``Verdict``, nothing written yet), its rows written
(``_write``: one call into ``attempts``, one into ``outbox.deadletters``,
a failed run waited out through an outage), then told and answered
(``_settle``: log lines, counts, signals, and the one place the broker
hears it).

Why one module: a verdict and the rows that make it safe are one decision -
a term only after its dead letter (or malformed record) is written, a nak
only after its failed run is recorded, neither when the write failed - and
the counts follow the verdicts. Split apart, two objects would again share
the counts and each answer the broker; hence past ~450 lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum

from django.db import DatabaseError, connections

from django_platformkit import conf, signals
from django_platformkit._text import storable_text as clean_text
from django_platformkit.broker.port import Broker, KeepAlive
from django_platformkit.consume.attempts import RunEnd, end_run
from django_platformkit.consume.claim import NOT_IN_OUTBOX
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.consume.units import Refused, Stopping, Work
from django_platformkit.consume.waiting import DatabaseWait
from django_platformkit.exceptions import is_permanent
from django_platformkit.outbox.deadletters import malformed_id, record_dead_letter, record_malformed
from django_platformkit.wire import Delivery, HandlingOutcome

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


@dataclass(frozen=True)
class Letter:
    """A dead letter to write before its term: an outbox event's
    (``record_dead_letter``) or, with ``reason``, a malformed message's
    (``record_malformed``)."""

    attempts: int
    error: str
    traceback: str = ""
    exception: BaseException | None = None  # the failure itself (the log line, the signal)
    reason: str | None = None  # a malformed message's: why it can't be run


@dataclass
class Ending:
    """One delivery's conclusion, judged before anything is written: the
    rows it writes (its run's end, its dead letter), then what the broker
    hears - ``verdict``, which a write that fails turns into another."""

    delivery: Delivery
    verdict: Verdict
    work: Work | None = None  # None: a refused delivery
    run: RunEnd | None = None
    letter: Letter | None = None
    letter_id: uuid.UUID | None = None  # a malformed message's dead-letter key, once written


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
        if reason is None:
            ending = Ending(delivery, Verdict(HandlingOutcome.ELSEWHERE, Answer.ACK))
        else:
            ending = self._malformed(delivery, reason)
        self._write(ending)
        self._settle([ending], keep)
        return ending.verdict.outcome

    def conclude(self, unit: list[Work], keep: KeepAlive | None) -> None:
        """Carry out what the unit decided for each of its works (see
        ``Work``), after its transaction: ack the handled and skipped ones
        together, then judge the rest (nak or term), write their rows, and
        answer; each ``Work.outcome`` then says what became of its delivery."""
        # Acked first, and only now, after the commit: a crash before this
        # line means redeliveries that find the claims and skip.
        acked = [work for work in unit if work.outcome in ACKED]
        self._settle(
            [Ending(w.message, Verdict(w.outcome or HandlingOutcome.HANDLED, Answer.ACK), w) for w in acked], keep
        )
        endings = [
            self._judge(work)
            for work in unit
            if work.outcome not in ACKED or (work.outcome == HandlingOutcome.SKIPPED and work.attempt_row is not None)
        ]
        for ending in endings:
            self._write(ending)
        self._settle(endings, keep)

    # -- judge: what to write, and the verdict once it is written --
    def _judge(self, work: Work) -> Ending:
        """A work the unit didn't handle (or a skipped one whose run had
        started): its ending, nothing written yet. A failed run is recorded,
        then retried after its backoff (nak) or, at ``max_attempts`` or for
        a failure a retry can't help, dead-lettered (term); a run that was
        handed back, or skipped, is marked interrupted (not counted)."""
        sub = self.subscription
        event = work.event
        outcome = work.outcome
        end = RunEnd(sub.name, event.id, work.attempt_row, work.started_at)
        if outcome == HandlingOutcome.SKIPPED:  # handled elsewhere meanwhile: this run never started
            return Ending(work.message, Verdict(HandlingOutcome.SKIPPED), work, end)
        if outcome == HandlingOutcome.HANDED_BACK:  # stopping, paused, or raced: no run recorded
            return Ending(work.message, self._handed_back(work), work, end)
        if outcome == HandlingOutcome.DEAD_LETTERED and work.exhausted is not None:
            spent = work.exhausted  # a redelivery out of attempts: dead-lettered without running
            letter = Letter(spent.attempts, spent.error, spent.traceback)
            return Ending(work.message, Verdict(HandlingOutcome.DEAD_LETTERED, Answer.TERM), work, letter=letter)
        if outcome == HandlingOutcome.NOT_IN_OUTBOX:
            if not self.contested.is_set():
                return replace(self._malformed(work.message, NOT_IN_OUTBOX), work=work, run=end)
            return Ending(work.message, self._contested(work), work, end)
        if outcome == HandlingOutcome.FAILED and work.error is not None:
            error = work.error
            message, tb = clean_text(f"{type(error).__name__}: {error}"), clean_text(work.tb)
            failed = end._replace(error=message, traceback=tb)
            # A PermanentFailure (or a mark_permanent() error) says a retry can't help: dead-letter it now.
            if event.attempt < sub.max_attempts and not is_permanent(error):  # its backoff: ``_write``
                return Ending(work.message, Verdict(HandlingOutcome.RETRIED, Answer.NAK), work, failed)
            letter = Letter(event.attempt, message, tb, exception=error)
            return Ending(work.message, Verdict(HandlingOutcome.DEAD_LETTERED, Answer.TERM), work, failed, letter)
        return Ending(work.message, UNANSWERED, work)

    @staticmethod
    def _handed_back(work: Work) -> Verdict:
        """The worker is stopping, the subscription is paused, or another
        worker is starting this run: nak, at once or after
        ``work.redeliver_in_seconds`` (not counted: no run recorded)."""
        return Verdict(HandlingOutcome.HANDED_BACK, Answer.NAK, work.redeliver_in_seconds)

    def _contested(self, work: Work) -> Verdict:
        """A message the outbox doesn't hold while this database's identity
        is contested. A live copy of this database (a staging restore) shares
        the stream's durables while it is refused, and a message of the
        copy's, or of events written after the copy was made, must not be
        terminated in the shared durable on the word of an outbox that may be
        the wrong one: it comes back after ``CONTESTED_REDELIVERY_SECONDS``
        (not an attempt), for whichever database holds it, or for a settled standing."""
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

    @staticmethod
    def _malformed(delivery: Delivery, reason: str) -> Ending:
        """A message that can't be run (undecodable, or unknown to the
        outbox): recorded as a ``(malformed)`` dead letter, then termed."""
        body_id = None
        with contextlib.suppress(Exception):
            body_id = uuid.UUID(str(json.loads(delivery.data).get("id")))
        claimed = f" claimed_id={body_id}" if body_id is not None else ""
        error = f"malformed message{claimed} on subject={delivery.subject} stream_seq={delivery.stream_seq}: {reason}"
        letter = Letter(delivery.attempt, error, reason=reason)
        return Ending(delivery, Verdict(HandlingOutcome.MALFORMED, Answer.TERM), letter=letter)

    # -- write: the rows that make the verdict safe --
    def _write(self, ending: Ending) -> None:
        """Write the ending's rows, in order: its run's end (a failed run
        waited out through an outage), then its dead letter. A nak only
        after its failed run is recorded, a term only after its dead letter;
        a write that fails leaves the message to the broker (``UNANSWERED``)."""
        sub = self.subscription
        work = ending.work
        run = ending.run
        recorded = False
        if work is not None and run is not None and run.failed:
            failed = run
            try:
                self.wait.until_answers([work], lambda: end_run(failed, using=self.using), 30.0, None)
                recorded = True
                run = None
            except Stopping:
                # Stopping, the database away: handed back (``_handed_back``), its run interrupted.
                ending.verdict = Verdict(HandlingOutcome.HANDED_BACK, Answer.NAK, work.redeliver_in_seconds)
                ending.letter = None
                run = failed.interrupted()
            except DatabaseError as exc:
                logger.error(
                    "failed run not recorded, will retry subscription=%s event_id=%s error=%s",
                    sub.name,
                    work.event.id,
                    exc,
                )
                connections[self.using].close()
                ending.verdict = UNANSWERED
                return
        if work is not None and run is not None:
            try:
                end_run(run, using=self.using)  # interrupted: doesn't count
            except DatabaseError as exc:
                logger.warning(
                    "attempt not marked interrupted subscription=%s event_id=%s error=%s", sub.name, work.event.id, exc
                )
        if work is not None and recorded:
            if ending.verdict.outcome == HandlingOutcome.RETRIED:  # recorded: naked after its backoff
                ending.verdict = replace(ending.verdict, delay_seconds=sub.delay_after(work.event.attempt))
            signals.event_failed.send_robust(
                sender=sub,
                subscription=sub.name,
                event=work.event,
                error=work.error,
                attempt=work.event.attempt,
                will_retry=ending.verdict.outcome == HandlingOutcome.RETRIED,
                duration_seconds=work.duration_seconds,
                delivery_latency_seconds=work.latency_seconds,
            )
        letter = ending.letter
        if letter is None:
            return
        delivery = ending.delivery
        try:
            if letter.reason is not None:
                logger.error(
                    "malformed message terminated subscription=%s subject=%s stream_seq=%s reason=%s",
                    sub.name,
                    delivery.subject,
                    delivery.stream_seq,
                    letter.reason,
                )
                ending.letter_id = malformed_id(conf.settings.STREAM, delivery.stream_seq)
                record_malformed(
                    subscription=sub.name,
                    event_id=ending.letter_id,
                    stream_seq=delivery.stream_seq,
                    attempts=letter.attempts,
                    error=letter.error,
                    body=delivery.data,
                    using=self.using,
                )
            elif work is not None and not record_dead_letter(
                subscription=sub.name,
                event_id=work.event.id,
                name=work.event.name,
                tenant=work.event.tenant,
                attempts=letter.attempts,
                error=letter.error,
                traceback=letter.traceback,
                using=self.using,
            ):
                logger.info("already claimed, no dead letter subscription=%s event_id=%s", sub.name, work.event.id)
                ending.verdict = Verdict(HandlingOutcome.SKIPPED, Answer.TERM)
        except DatabaseError as exc:
            if letter.reason is not None:
                logger.error(
                    "malformed message not recorded, will retry subscription=%s stream_seq=%s error=%s",
                    sub.name,
                    delivery.stream_seq,
                    exc,
                )
            else:
                # Not acked: the broker redelivers after the ack wait, and the redelivery
                # (counted runs at max_attempts) records it without running the handler.
                logger.error(
                    "dead letter not recorded, will retry subscription=%s event_id=%s error=%s",
                    sub.name,
                    work.event.id if work is not None else None,
                    exc,
                )
            connections[self.using].close()
            ending.verdict = UNANSWERED

    # -- answer: the log lines, counts and signals of each verdict, then the broker --
    def _settle(self, endings: list[Ending], keep: KeepAlive | None) -> None:
        """Tell what became of each ending (its log line, count and signal),
        then the broker - the one place it is told, the acks in one call -
        and end the deliveries' keep-alive. A broker call that fails is
        logged, never raised: the message comes back after the ack wait
        (and is acked, or judged, again)."""
        sub = self.subscription
        acks = [ending.delivery for ending in endings if ending.verdict.answer == Answer.ACK]
        for ending in endings:
            work = ending.work
            letter = ending.letter
            outcome = ending.verdict.outcome
            answer = ending.verdict.answer
            if work is not None:
                work.outcome = outcome
            if outcome in ACKED and answer == Answer.ACK and work is not None:
                event = work.event
                self.counts[outcome] += 1
                if signals.event_handled.receivers:  # once per handling: skip building the call
                    signals.event_handled.send_robust(
                        sender=sub,
                        subscription=sub.name,
                        event=event,
                        outcome=outcome,
                        duration_seconds=work.duration_seconds,
                        delivery_latency_seconds=work.latency_seconds,
                    )
                logger.debug("%s subscription=%s event_id=%s attempt=%s", outcome, sub.name, event.id, event.attempt)
            elif outcome == HandlingOutcome.RETRIED and work is not None and ending.run is not None:
                event = work.event
                logger.warning(
                    "handler failed, retrying subscription=%s%s event_id=%s attempt=%s/%s retry_in=%ss error=%s",
                    sub.name,
                    f" task={work.task}" if work.task else "",
                    event.id,
                    event.attempt,
                    sub.max_attempts,
                    ending.verdict.delay_seconds,
                    ending.run.error,
                )
                self.counts[outcome] += 1
            elif outcome == HandlingOutcome.DEAD_LETTERED and work is not None and letter is not None:
                event = work.event
                logger.error(
                    "dead letter subscription=%s%s event_id=%s name=%s attempts=%s error=%s%s",
                    sub.name,
                    f" task={work.task}" if work.task else "",
                    event.id,
                    event.name,
                    letter.attempts,
                    letter.error,
                    "" if letter.exception is not None else "\n" + letter.traceback,
                    exc_info=letter.exception,  # error trackers (Sentry's logging integration) see the exception itself
                )
                self.counts[outcome] += 1
                signals.event_dead_lettered.send_robust(
                    sender=sub,
                    subscription=sub.name,
                    event_id=event.id,
                    name=event.name,
                    tenant=event.tenant,
                    attempts=letter.attempts,
                    error=letter.error.splitlines()[0] if letter.error else "",
                    exception=letter.exception,
                    task=work.task,
                )
            elif outcome == HandlingOutcome.MALFORMED and letter is not None:
                self.counts[outcome] += 1
                signals.event_malformed.send_robust(
                    sender=sub,
                    subscription=sub.name,
                    subject=ending.delivery.subject,
                    stream_seq=ending.delivery.stream_seq,
                    reason=letter.reason,
                    event_id=ending.letter_id,
                )
        for ending in endings:
            answer = ending.verdict.answer
            if answer is None or (answer == Answer.ACK and ending.delivery is not acks[0]):
                continue  # nothing to say, or acked with the first
            try:
                if answer == Answer.ACK:
                    self.broker.ack_many(acks)
                elif answer == Answer.NAK:
                    self.broker.nak(ending.delivery, ending.verdict.delay_seconds)
                else:
                    self.broker.term(ending.delivery)
            except Exception as exc:
                logger.warning(
                    "%s failed subscription=%s event_id=%s stream_seq=%s error=%s",
                    answer,
                    sub.name,
                    ending.work.event.id if ending.work is not None else None,
                    ending.delivery.stream_seq,
                    exc,
                )
        if keep is not None:
            for ending in endings:
                with contextlib.suppress(Exception):  # it only stops a keep-alive
                    keep.settled(ending.delivery)
