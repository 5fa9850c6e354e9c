"""The operator's view of this project's stream, and the verbs on it that
need the project's declarations: which durables a declared subscription
owns, the stream judged for this database without recording anything, the
pruning of durables nothing declared owns (a removed subscription's durable
keeps its backlog on the stream for ever: 1,497 pending seen), the reset,
and the takeover by another instance of this database.

A verb that can drop messages nobody read asks first: ``prune`` refuses a
durable that is busy (pending, unacknowledged, or active within twice the
ack wait - settings that lack an app deleted two live durables), ``reset``
a stream whose durables hold unhandled messages, ``takeover`` a stream whose
holder is live or whose durables hold them; each refusal names the counts
and the flag that goes ahead. The NATS calls are the broker's
(``broker.upkeep``); ``manage.py stream`` renders what these return.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

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


def busy(durable: DurableReport, now: datetime | None = None) -> str:
    """Why deleting ``durable`` could drop messages nobody read ("" when it is
    idle): its pending and unacknowledged counts, or activity within twice
    the ack wait (a worker of another build may be reading it)."""
    now = now or datetime.now(UTC)
    recent = 2 * float(conf.settings.ACK_WAIT_SECONDS)
    active = durable.last_active is not None and (now - durable.last_active).total_seconds() < recent
    if not (durable.pending or durable.ack_pending or active):
        return ""
    seen = f", last active {(now - durable.last_active).total_seconds():.0f} s ago" if durable.last_active else ""
    return f"pending {durable.pending:,}, ack pending {durable.ack_pending:,}{seen}"


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
    upkeep: StreamUpkeep,
    *,
    dry_run: bool = False,
    also: Sequence[str] = (),
    yes: bool = False,
    using: str | None = None,
) -> list[DurableReport]:
    """Delete the durables no declared subscription owns (``StreamView.unowned``)
    and those named in ``also`` (a declared one that drifted: its filter
    changed, which the broker can't update); with ``dry_run``, only say
    which. Returns them (those deleted). A named durable of a
    ``backfill=False`` subscription is made again at once, from its first
    unacknowledged message (the worker would make it start at "now").

    Raises:
        ConfigurationError: Nothing deleted: for a stream this database must
            not change (``refuse_unless_ours``), for a name in ``also`` that is no django_platformkit
            durable of this stream, and - without ``yes`` - when a durable to
            delete is busy (``busy()``): settings that lack an app (a
            management container missing one, an old build) see its live
            durables as unowned. The text names each busy durable's counts."""
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
    held = {d.name: why for d in doomed if (why := busy(d))}
    if held and not yes:
        listed = "; ".join(f"{name} ({why})" for name, why in held.items())
        raise ConfigurationError(
            f"stream prune refused, nothing deleted: {len(held)} durable(s) to delete are not idle: {listed}. "
            "Deleting a durable drops what it has not read, and one a worker still reads comes back at once. "
            "Settings that lack an app (a management container missing one, an older build) see a live "
            "subscription's durable as unowned: run prune with the settings the workers run. If these "
            "subscriptions are gone for good, add --yes."
        )
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
    ``ConfigurationError``, nothing deleted, unless ``discard_unhandled``,
    when its durables still hold messages they have not handled: of this
    database's own stream (saying how many: its outbox still holds them, and
    the workers' reconciliation sends them again once a worker made the
    stream again), and of a stream another database owns (or another
    instance of this one holds) - that database's events, which its outbox
    counts as sent: for a re-created development database's old stream,
    whose events nobody needs."""
    from django_platformkit.exceptions import ConfigurationError

    view = stream_view(upkeep, using=using)
    judgement = view.standing.judgement
    held = [d for d in view.report.durables if d.pending or d.ack_pending] if view.report is not None else []
    if held and not discard_unhandled and (judgement is None or not judgement.refused):
        counts = ", ".join(f"{d.name} {d.pending + d.ack_pending:,}" for d in held)
        total = sum(d.pending + d.ack_pending for d in held)
        raise ConfigurationError(
            f"stream reset refused, nothing deleted: the durables of this project's stream {conf.settings.STREAM!r} "
            f"have not handled {total:,} message(s) between them ({counts}). The outbox still holds their events "
            f"(RETENTION_DAYS): after a reset a worker makes the stream again and the workers' reconciliation "
            "sends every event a subscription has not handled again, so they are late, not lost. To reset "
            "anyway, add --discard-unhandled."
        )
    if held and not discard_unhandled and judgement is not None and judgement.refused:
        tenure = view.standing.tenure
        whose = (
            f"belongs to another project's database ({tenure.identity}; this database is {view.identity})"
            if judgement.standing is identity.Standing.FOREIGN
            else f"is held by another database instance ({tenure.instance}) with this database's "
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


@dataclass(frozen=True)
class Takeover:
    """What ``take_over`` did: the tenure it replaced (``before``) and the one
    it recorded (``after``; None: this instance held the stream already)."""

    before: identity.Tenure
    after: identity.Tenure | None


def take_over(upkeep: StreamUpkeep, *, force: bool = False, using: str | None = None) -> Takeover:
    """Make this database instance the stream's holder: the one way a stream
    changes hands (``identity.judge`` never hands it over by itself), for a
    database restored or upgraded onto a new server.

    Raises:
        ConfigurationError: Nothing changed: there is no stream; it belongs to
            another project's database; or - without ``force`` - its holder
            was seen within ``identity.LIVE_SECONDS`` (its workers run) or its
            durables hold messages nobody has handled (the holder's outbox
            relayed them; this one may not hold them). Each says which
            instance holds it and which this database is."""
    from django_platformkit.exceptions import ConfigurationError

    view = stream_view(upkeep, using=using)
    stream = conf.settings.STREAM
    if view.report is None:
        raise ConfigurationError(
            f"there is no stream {stream!r} to take over: a worker makes it, held by this database"
        )
    judgement = view.standing.judgement
    tenure = view.standing.tenure
    if judgement is not None and judgement.standing is identity.Standing.FOREIGN:
        raise ConfigurationError(
            f"stream takeover refused, nothing changed: the stream {stream!r} belongs to another project's database "
            f"({tenure.identity}; this database is {view.identity}). A takeover moves a stream between instances of "
            "one database, never between projects: give this project its own PLATFORMKIT['STREAM'] and "
            "PLATFORMKIT['SUBJECT_PREFIX']."
        )
    if tenure.instance == view.instance:
        return Takeover(tenure, None)
    now = time.time()
    ago = now - (tenure.seen or 0)
    live = tenure.instance is not None and ago < identity.LIVE_SECONDS
    held = [d for d in view.report.durables if d.subscription is not None and (d.pending or d.ack_pending)]
    if (live or held) and not force:
        why = []
        if live:
            why.append(f"its workers said they were alive {ago:.0f} s ago")
        if held:
            counts = ", ".join(f"{d.name} {d.pending:,} pending / {d.ack_pending:,} unacknowledged" for d in held)
            why.append(
                f"its durables hold messages nobody has handled yet ({counts}): that instance's outbox relayed "
                "them, and this one may not hold them"
            )
        raise ConfigurationError(
            f"stream takeover refused, nothing changed: the stream {stream!r} is held by database instance "
            f"{tenure.instance}; this database is instance {view.instance}, with the same identity. "
            f"{' and '.join(why).capitalize()}. Stop instance {tenure.instance}'s workers and let its durables "
            "drain (`manage.py stream info`), then run takeover again; or add --force."
        )
    after = identity.takeover_tenure(tenure, view.identity, view.instance, now)
    upkeep.record_holder(after)
    return Takeover(tenure, after)
