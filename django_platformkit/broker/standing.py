"""Whether this project may use its stream: limits that could discard events
nobody has handled, and which database instance holds it (``identity.judge``).

Pure and without ``nats``, so the NATS transport, the in-memory twin, the
overview and ``manage.py stream info`` judge a stream alike. A stream whose
``max_msgs``, ``max_bytes`` or ``max_msgs_per_subject`` is set, whose
``max_age`` is shorter than ``RETENTION_DAYS``, or whose retention is not
``limits``, throws messages away before every subscription read them (1,000
events with no worker running: ``max_msgs=300`` kept 300; ``max_age`` 15 s
aged out 300 of 300 before a worker started); the relay and the worker refuse
it at start-up, naming the limit and its fix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django_platformkit import conf
from django_platformkit.identity import Judgement, Standing, Tenure, judge

#: JetStream's "no limit" for the numeric limits.
UNLIMITED = -1


@dataclass(frozen=True)
class StreamProblem:
    """One setting of the stream that could discard unhandled events:
    the ``setting`` as JetStream names it, its ``value``, what it does and
    the ``fix``."""

    setting: str
    value: str
    effect: str
    fix: str

    def __str__(self) -> str:
        return f"{self.setting}={self.value}: {self.effect} Fix: {self.fix}"


#: A max age this much shorter than ``RETENTION_DAYS`` is not yet a problem (JetStream rounds it).
MAX_AGE_TOLERANCE_SECONDS = 1.0


@dataclass(frozen=True)
class StreamLimits:
    """The settings of a stream that decide whether it could discard events
    nobody has handled, as JetStream names them.

    Attributes:
        retention: ``limits``, ``interest`` or ``workqueue``.
        max_msgs: Messages the stream keeps; None, 0 or ``UNLIMITED``: no limit.
        max_bytes: Bytes the stream keeps; None, 0 or ``UNLIMITED``: no limit.
        max_msgs_per_subject: Messages kept per subject; None, 0 or ``UNLIMITED``: no limit.
        max_age_seconds: How long a message is kept; None or 0: no limit.
    """

    retention: str = "limits"
    max_msgs: int | None = UNLIMITED
    max_bytes: int | None = UNLIMITED
    max_msgs_per_subject: int | None = UNLIMITED
    max_age_seconds: float | None = None

    @classmethod
    def of(cls, config: Any) -> StreamLimits:
        """The limits of a stream config as the broker returns it
        (``nats.js.api.StreamConfig``, or the in-memory twin's)."""
        retention = getattr(config, "retention", None)
        return cls(
            retention=str(getattr(retention, "value", retention) or "limits"),
            max_msgs=config.max_msgs,
            max_bytes=config.max_bytes,
            max_msgs_per_subject=config.max_msgs_per_subject,
            max_age_seconds=config.max_age,
        )

    def problems(self) -> list[StreamProblem]:
        """What these limits could discard, in the order of the attributes
        (the numeric limits, the max age, the retention); [] for a safe stream."""
        update = "`manage.py stream update` sets it back to unlimited (the workers never change it themselves)."
        problems = []
        for setting, value, what in (
            ("max_msgs", self.max_msgs, "messages"),
            ("max_bytes", self.max_bytes, "bytes"),
            (
                "max_msgs_per_subject",
                self.max_msgs_per_subject,
                "messages per subject (every tenant's event is one subject)",
            ),
        ):
            if value is not None and int(value) > 0:
                problems.append(
                    StreamProblem(
                        setting,
                        str(value),
                        f"past {value} {what} the stream discards its oldest messages, handled or not.",
                        update,
                    )
                )
        retained = float(conf.settings.RETENTION_DAYS) * 86400.0
        max_age_seconds, retention = self.max_age_seconds, self.retention
        if max_age_seconds and float(max_age_seconds) < retained - MAX_AGE_TOLERANCE_SECONDS:
            age = format(float(max_age_seconds), ".15g")
            problems.append(
                StreamProblem(
                    "max_age",
                    age,
                    f"messages older than {age} s are discarded, handled or not, while the outbox keeps its events "
                    f"for RETENTION_DAYS ({retained:.0f} s): a subscription that falls that far behind "
                    "(a worker stopped, a backlog) loses them.",
                    "`manage.py stream update` lengthens it to RETENTION_DAYS (the workers never change it themselves).",
                )
            )
        if retention and retention != "limits":
            effect = {
                "interest": "the stream drops a message that no durable is interested in when it arrives, and once "
                "every durable acked it, so a subscription added later never sees it.",
                "workqueue": "the first subscription's ack deletes a message for every other subscription.",
            }.get(retention, "messages may go before every subscription handled them.")
            problems.append(
                StreamProblem(
                    "retention",
                    retention,
                    effect,
                    "JetStream can't change a stream's retention, and its durables can't drain: no worker consumes a "
                    "refused stream. `manage.py stream reset --yes --discard-unhandled` deletes it, a worker makes it "
                    "again with limits retention, and the workers' reconciliation sends every event the outbox holds "
                    "that a subscription has not handled again.",
                )
            )
        return problems


def unsafe_stream_text(stream: str, url: str, problems: Sequence[StreamProblem]) -> str:
    """The ``ConfigurationError`` text for a stream with ``problems``."""
    listed = "; ".join(str(p) for p in problems)
    return (
        f"the stream {stream!r} on {conf.redact_url(url)} could discard events no subscription has handled, so "
        f"nothing is relayed into it or consumed from it: {listed}"
    )


@dataclass(frozen=True)
class StreamStanding:
    """How this project's stream stands, as the broker holds it now.

    ``exists``: False when there is no stream yet (a worker makes it).
    ``judgement``: this database instance's standing (``identity.judge``).
    ``problems``: limits that could discard unhandled events.
    ``max_age_seconds``: the stream's real max age (None: unlimited or no stream).
    ``tenure``: what the stream records about who holds it.
    """

    exists: bool
    judgement: Judgement | None = None
    problems: tuple[StreamProblem, ...] = ()
    max_age_seconds: float | None = None
    tenure: Tenure = field(default_factory=lambda: Tenure(None))
    text_unsafe: str = ""

    @property
    def standing(self) -> Standing | None:
        return self.judgement.standing if self.judgement is not None else None

    @property
    def refused(self) -> bool:
        """Whether a relay or worker must not use the stream."""
        return bool(self.problems) or (self.judgement is not None and self.judgement.refused)

    @property
    def contested(self) -> bool:
        return self.standing is Standing.CONTESTED

    @property
    def text(self) -> str:
        """Every refusal and contest, with its fix ("" when all is well)."""
        parts = [self.text_unsafe] if self.problems else []
        if self.judgement is not None and self.judgement.text:
            parts.append(self.judgement.text)
        return " ".join(parts)


def judge_stream(
    limits: StreamLimits,
    *,
    name: str,
    url: str,
    recorded: Tenure,
    owner: str | None,
    instance: str | None,
    now: float,
) -> StreamStanding:
    """The standing of the stream ``name`` on ``url`` with ``limits``,
    which records ``recorded`` (``Tenure.read`` of its description and
    metadata), for ``owner``/``instance`` at ``now`` (``owner`` None: its
    limits only). Pure: the tenure its judgement asks to record
    (``standing.judgement.tenure``) is the caller's to write;
    ``standing.tenure`` is ``recorded``."""
    problems = limits.problems()
    judgement = None
    if owner is not None:
        judgement = judge(recorded, owner, instance, now=now, stream=name, url=url)
    max_age_seconds = limits.max_age_seconds
    return StreamStanding(
        exists=True,
        judgement=judgement,
        problems=tuple(problems),
        max_age_seconds=float(max_age_seconds) if max_age_seconds else None,
        tenure=recorded,
        text_unsafe=unsafe_stream_text(name, url, problems) if problems else "",
    )


def standing_of(
    config: Any, *, url: str, owner: str | None, instance: str | None, now: float | None = None
) -> StreamStanding:
    """``judge_stream`` for a stream config as the broker returns it
    (``nats.js.api.StreamConfig``, or the in-memory twin's): its name,
    limits (``StreamLimits.of``) and recorded tenure read off ``config``."""
    return judge_stream(
        StreamLimits.of(config),
        name=str(config.name),
        url=url,
        recorded=Tenure.read(config.description, getattr(config, "metadata", None)),
        owner=owner,
        instance=instance,
        now=time.time() if now is None else now,
    )
