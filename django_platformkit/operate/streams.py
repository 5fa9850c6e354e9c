"""The operator's view of this project's stream, and the verbs on it that
need the project's declarations: which durables a declared subscription
owns, the stream judged for this database without recording anything, and
the pruning of durables nothing declared owns (a removed subscription's
durable keeps its backlog on the stream for ever: 1,497 pending seen).

The NATS calls are the broker's (``broker.upkeep``); ``manage.py stream``
renders what these return.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from django_platformkit import conf, identity
from django_platformkit.broker.standing import StreamStanding, standing_of
from django_platformkit.broker.upkeep import DurableReport, StreamReport, StreamUpkeep


def declared_durables() -> dict[str, str]:
    """durable name -> the declared subscription that owns it (every one this build registers, task queues too)."""
    from django_platformkit.consume.subscriptions import subscriptions

    return {s.durable: s.name for s in subscriptions()}


@dataclass(frozen=True)
class StreamView:
    """``report``: the stream as the broker holds it (None: no stream yet).
    ``standing``: judged for this database, nothing recorded. ``owners``:
    durable -> declared subscription. ``identity``/``instance``: this database's."""

    report: StreamReport | None
    standing: StreamStanding
    owners: dict[str, str]
    identity: str
    instance: str

    @property
    def unowned(self) -> list[DurableReport]:
        """Durables made by django_platformkit that no declared subscription owns: what ``prune`` deletes."""
        durables = self.report.durables if self.report else []
        return [d for d in durables if d.subscription is not None and d.name not in self.owners]

    @property
    def foreign(self) -> list[DurableReport]:
        """Consumers on the stream that another tool made: listed, never pruned."""
        return [d for d in (self.report.durables if self.report else []) if d.subscription is None]


def stream_view(upkeep: StreamUpkeep, *, using: str | None = None) -> StreamView:
    """The stream, its durables and this database's standing on it, read
    only (``stream info`` never renews a tenure nor records a contender).
    Raises ``BrokerUnavailable`` when NATS doesn't answer."""
    ours, instance = identity.database_identity(using), identity.database_instance(using)
    report = upkeep.report()
    if report is None:
        standing = StreamStanding(exists=False)
    else:
        standing = standing_of(report.config, url=conf.settings.NATS_URL, owner=ours, instance=instance)
    return StreamView(report, standing, declared_durables(), ours, instance)


def refuse_unless_ours(view: StreamView) -> None:
    """Refuse, as a worker refuses at start-up, a stream this database must
    not change: another project's database owns it, or a live copy of this
    database holds it. Every verb that changes the broker asks this first
    (``reset`` has its own rule: a gone database's stream may be deleted).

    Raises:
        ConfigurationError: With the workers' own text: whose it is, and the fix.
    """
    from django_platformkit.exceptions import ConfigurationError

    judgement = view.standing.judgement
    if judgement is not None and judgement.refused:
        raise ConfigurationError(judgement.text)


def update_stream(
    upkeep: StreamUpkeep, *, dry_run: bool = False, using: str | None = None
) -> tuple[list[str], list[str]]:
    """``stream update``: make what can change in place match this build
    (``StreamUpkeep.update``), refused for a stream not ours
    (``refuse_unless_ours``): grafting this project's subjects onto another
    project's stream left its owner logging drift for ever, and this project
    unable to make a stream for its own prefix. Returns ``(changed, left)``."""
    refuse_unless_ours(stream_view(upkeep, using=using))
    return upkeep.update(dry_run=dry_run)


def prune_durables(
    upkeep: StreamUpkeep, *, dry_run: bool = False, also: Sequence[str] = (), using: str | None = None
) -> list[DurableReport]:
    """Delete the durables no declared subscription owns (``StreamView.unowned``)
    and those named in ``also`` (a declared one that drifted: its filter
    changed, which the broker can't update); with ``dry_run``, only say
    which. Returns them (those deleted). A named durable of a
    ``backfill=False`` subscription is made again at once, from its first
    unacknowledged message (the worker would make it start at "now"). Raises ``ConfigurationError`` for a
    stream this database must not change (``refuse_unless_ours``), and for a name in ``also`` that is no
    django_platformkit durable of this stream."""
    from django_platformkit.exceptions import ConfigurationError

    view = stream_view(upkeep, using=using)
    refuse_unless_ours(view)
    ours = {d.name: d for d in (view.report.durables if view.report else []) if d.subscription is not None}
    unknown = sorted(set(also) - set(ours))
    if unknown:
        raise ConfigurationError(
            f"no durable {', '.join(unknown)} made by django_platformkit on the stream {conf.settings.STREAM!r} "
            "(`manage.py stream info` lists them)"
        )
    doomed = view.unowned + [ours[name] for name in dict.fromkeys(also) if name in view.owners]
    if dry_run or not doomed:
        return doomed
    gone = set(upkeep.delete_durables([d.name for d in doomed]))
    from django_platformkit.consume.subscriptions import get_subscription

    for d in doomed:
        if d.name in gone and d.name in also and d.name in view.owners:
            subscription = get_subscription(view.owners[d.name])
            if subscription is not None and not subscription.backfill:
                # Made again by a worker, it would start at "now": what it had not handled, and what is
                # relayed until then, would never run it. It goes on from its first unacknowledged message.
                upkeep.create_durable_from(subscription.consumer_config(), d.ack_floor + 1)
    return [d for d in doomed if d.name in gone]


def reset_stream(
    upkeep: StreamUpkeep, *, discard_unhandled: bool = False, using: str | None = None
) -> StreamReport | None:
    """Delete the stream with every message and durable (a development
    reset); return it as it was (None: there was none). Refused with a
    ``ConfigurationError``, nothing deleted, when the stream belongs to
    another database (or a live copy of this one holds it) and its durables
    still hold messages they have not handled - another project's events,
    which its outbox counts as sent - unless ``discard_unhandled``: a
    re-created development database's old stream, whose events nobody needs."""
    from django_platformkit.exceptions import ConfigurationError

    view = stream_view(upkeep, using=using)
    judgement = view.standing.judgement
    if view.report is not None and judgement is not None and judgement.refused and not discard_unhandled:
        held = [d for d in view.report.durables if d.pending or d.ack_pending]
        if held:
            tenure = view.standing.tenure
            whose = (
                f"belongs to another project's database ({tenure.identity}; this database is {view.identity})"
                if judgement.standing is identity.Standing.FOREIGN
                else f"is held by another live database instance ({tenure.instance}) with this database's "
                f"identity; this database is instance {view.instance}"
            )
            counts = ", ".join(f"{d.name} {d.pending + d.ack_pending:,}" for d in held)
            raise ConfigurationError(
                f"stream reset refused, nothing deleted: the stream {conf.settings.STREAM!r} {whose}, and its "
                f"durables hold messages they have not handled ({counts}): that database's events, lost with the "
                "stream. If it is another project's, give this project its own PLATFORMKIT['STREAM'] and "
                "PLATFORMKIT['SUBJECT_PREFIX']. If that database is gone for good (you re-created yours) and "
                "nobody needs its events, add --discard-unhandled."
            )
    return view.report if upkeep.delete_stream() else None
