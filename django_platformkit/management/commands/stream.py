"""``manage.py stream``: this project's stream as the broker holds it, and
the operator's verbs on it - no routine step needs the ``nats`` CLI.

    manage.py stream info                 the stream and its durables beside what this build wants
    manage.py stream prune [--dry-run] [--durable NAME] [--yes]   delete the durables no declared subscription owns
    manage.py stream reset --yes [--discard-unhandled]   delete the stream and every message it holds (a development reset)
    manage.py stream update [--dry-run]   lift limits that could discard unhandled events; set what can change in place
    manage.py stream reconcile [--dry-run]   send again what the stream no longer holds for a subscription
    manage.py stream takeover --yes [--force]   make this database instance the stream's holder
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit import conf
from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError, DatabaseUnavailable
from django_platformkit.management.commands._base import (
    Output,
    accept_verbosity,
    configure_logging,
    import_urlconf,
    tables_migrated,
)


def _seconds(value: Any) -> str:
    seconds = float(value or 0)
    if not seconds:
        return "unlimited"
    if seconds % 86400 == 0:
        return f"{seconds / 86400:g}d"
    return f"{seconds:g}s"


def _limit(value: Any) -> str:
    return "unlimited" if value is None or int(value) <= 0 else str(value)


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else "never"


class Command(BaseCommand):
    help = (
        "This project's stream as the broker holds it, and the operator's verbs on it: info, prune (durables no "
        "declared subscription owns), reset (delete the stream: a development reset), update (lift limits that "
        "could discard unhandled events)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", required=True, metavar="info|prune|reset|update|reconcile|takeover")
        info = verbs.add_parser(
            "info",
            help="The stream and every durable as the broker holds them beside what this build wants: limits that "
            "could discard unread events, the owning database, each durable's pending / ack pending / last active, "
            "durables no declared subscription owns.",
        )
        accept_verbosity(info)
        prune = verbs.add_parser(
            "prune",
            help="Delete the durables no declared subscription owns (a removed subscription's, with its backlog). "
            "Run it once every deployment runs this build: an older one still consuming would lose its durable.",
        )
        accept_verbosity(prune).add_argument(
            "--dry-run", action="store_true", help="Say which durables would go; delete nothing."
        )
        prune.add_argument(
            "--durable",
            action="append",
            default=[],
            metavar="NAME",
            help="Also delete this durable of a declared subscription (repeatable): one whose filter changed, which "
            "the broker can't update (the worker refuses it as drift). Once it is drained: the worker makes it "
            "again, and its claims skip what was handled (a backfill=False subscription's is made again at once, "
            "from its first unacknowledged message, not from now).",
        )
        prune.add_argument(
            "--yes",
            action="store_true",
            help="Delete durables that are not idle too (pending or unacknowledged messages, or active within twice "
            "ACK_WAIT_SECONDS): what they have not read is dropped. Refused without it, naming their counts.",
        )
        reset = verbs.add_parser(
            "reset",
            help="Delete the stream with every message it holds and every durable (a development reset after "
            "re-creating the database); a worker or relay makes it again. Pending outbox rows are relayed then, and "
            "the workers' reconciliation sends the published events a subscription had not handled again.",
        )
        accept_verbosity(reset).add_argument("--yes", action="store_true", help="Really delete it (required).")
        reset.add_argument(
            "--discard-unhandled",
            action="store_true",
            help="Delete it even while its durables hold messages they have not handled (refused without it, "
            "naming the counts). This project's own stream: reconciliation sends those events again from the "
            "outbox. A stream another database owns (or another instance of this one holds): that database's "
            "events are lost - for a re-created development database's old stream.",
        )
        update = verbs.add_parser(
            "update",
            help="Make what can change in place match this build, losing nothing: max_msgs, max_bytes and "
            "max_msgs_per_subject lifted, the duplicate window and replicas set, missing subjects added, a "
            "shorter max age lengthened. Never shortens the max age; says what it leaves and why.",
        )
        accept_verbosity(update).add_argument(
            "--dry-run", action="store_true", help="Say what would change; change nothing."
        )
        reconcile = verbs.add_parser(
            "reconcile",
            help="One reconciliation pass, as the workers run every RECONCILE_INTERVAL_SECONDS: each event a "
            "subscription is owed, has not handled and whose message the stream no longer holds for it (a limit or "
            "max_age, a durable made again, a stream reset or lost) is sent again to that subscription only.",
        )
        accept_verbosity(reconcile).add_argument(
            "--dry-run",
            action="store_true",
            help="Say what would be sent again, per subscription and cause; send nothing.",
        )
        takeover = verbs.add_parser(
            "takeover",
            help="Make this database instance the holder of the stream its identity owns: the one way a stream "
            "changes hands (a database restored or upgraded onto a new server). Run it with the new database's "
            "settings once the old one's workers are stopped and its durables drained.",
        )
        accept_verbosity(takeover).add_argument("--yes", action="store_true", help="Really take it over (required).")
        takeover.add_argument(
            "--force",
            action="store_true",
            help="Take it over even while the holder's workers are alive or its durables hold messages nobody has "
            "handled (they are then handled, or refused as unknown, by this database's workers).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        self.out = Output(self, options["verbosity"])
        from django_platformkit.broker.transport import Transport

        import_urlconf()  # a subscription declared where only the URLconf imports it still owns its durable
        transport = Transport(name="django_platformkit stream")
        try:
            transport.connect()
            with tables_migrated():
                getattr(self, f"_{options['verb']}")(transport, options)
        except (BrokerUnavailable, ConfigurationError, DatabaseUnavailable) as exc:
            raise CommandError(transport.redact(str(exc))) from None
        finally:
            transport.close()

    # -- verbs --
    def _info(self, transport: Any, options: dict[str, Any]) -> None:
        from django_platformkit.operate.streams import stream_view

        view = stream_view(transport.upkeep)
        w = self.out.data
        where = conf.redact_url(conf.settings.NATS_URL)
        report = view.report
        if report is None:
            w(f"stream {conf.settings.STREAM}: none on {where} yet (a worker or relay makes it)")
            return
        have, want = report.config, report.want
        leader = f", leader {report.leader}" if report.leader else ""
        w(f"stream {have.name} on {where} (replicas {have.num_replicas or 1}{leader})")
        w(f"  messages {report.messages:,} ({report.bytes:,} bytes), sequences {report.first_seq}..{report.last_seq}")
        w(f"  {'setting':<22}{'the broker holds':<30}this build wants")
        rows = [
            ("subjects", have.subjects, want.subjects),
            ("retention", getattr(have.retention, "value", have.retention), "limits"),
            ("max_age", _seconds(have.max_age), f"{_seconds(want.max_age)} (RETENTION_DAYS)"),
            ("duplicate_window", _seconds(have.duplicate_window), _seconds(want.duplicate_window)),
            ("replicas", have.num_replicas or 1, want.num_replicas),
            ("max_msgs", _limit(have.max_msgs), "unlimited"),
            ("max_bytes", _limit(have.max_bytes), "unlimited"),
            ("max_msgs_per_subject", _limit(have.max_msgs_per_subject), "unlimited"),
            ("storage", getattr(have.storage, "value", have.storage), "file"),
        ]
        for name, held, wanted in rows:
            mark = "" if str(held) == str(wanted).split(" ")[0] else "   <- differs"
            w(f"  {name:<22}{held!s:<30}{wanted}{mark}")
        standing, tenure = view.standing, view.standing.tenure
        w(f"owner: database {tenure.identity or '(none recorded)'} (this database: {view.identity})")
        if tenure.instance:
            w(f"  held by instance {tenure.instance} (this database: {view.instance})")
        if tenure.contender:
            w(f"  last tried by instance {tenure.contender}")
        if standing.text:
            w(f"{'REFUSED' if standing.refused else 'CONTESTED'}: {standing.text}")
        else:
            w("standing: workers of this database may use it")
        w(f"durables ({len(report.durables)}):")
        w(f"  {'name':<40}{'pending':>10}{'ack pending':>13}  {'last active':<22}owner")
        for d in report.durables:
            if d.subscription is None:
                owner = "(not made by django_platformkit: never pruned)"
            elif d.name in view.owners:
                owner = view.owners[d.name]
            else:
                owner = f"(none: {d.subscription} is not declared; `stream prune` deletes it)"
            w(f"  {d.name:<40}{d.pending:>10,}{d.ack_pending:>13,}  {_when(d.last_active):<22}{owner}")
        missing = sorted(set(view.owners) - {d.name for d in report.durables})
        for name in missing:
            w(f"  {name:<40}{'-':>10}{'-':>13}  {'-':<22}{view.owners[name]} (no durable yet: a worker makes it)")

    def _prune(self, transport: Any, options: dict[str, Any]) -> None:
        from django_platformkit.operate.streams import busy, prune_durables

        dry_run = options["dry_run"]
        doomed = prune_durables(transport.upkeep, dry_run=dry_run, also=options["durable"], yes=options["yes"])
        for d in doomed:
            refused = " - not idle: refused without --yes" if dry_run and busy(d) and not options["yes"] else ""
            self.out.result(
                "would delete" if dry_run else "deleted",
                f"{d.name} (subscription {d.subscription}, pending {d.pending:,}, ack pending {d.ack_pending:,})"
                f"{refused}",
                style="NOTICE" if dry_run else "SUCCESS",
            )
        if not doomed:
            self.out.result("nothing to prune:", "every durable belongs to a declared subscription", style="NOTICE")
        elif dry_run:
            self.out.result("dry run,", f"nothing deleted: would delete {len(doomed)} durable(s)", style="NOTICE")

    def _reset(self, transport: Any, options: dict[str, Any]) -> None:
        stream = conf.settings.STREAM
        if not options["yes"]:
            raise CommandError(
                f"stream reset deletes the stream {stream!r} and every message it holds, handled or not, and every "
                "durable: pass --yes to do it (a development reset, after re-creating the database)."
            )
        from django_platformkit.operate.streams import reset_stream

        report = reset_stream(transport.upkeep, discard_unhandled=options["discard_unhandled"])
        if report is None:
            self.out.result("no stream", f"{stream!r}: nothing to delete", style="NOTICE")
            return
        held = f"{report.messages:,} message(s), {len(report.durables)} durable(s)"
        self.out.result(
            "deleted",
            f"the stream {stream!r} with {held}; a worker or relay makes it again, and the workers' "
            "reconciliation sends the events this outbox holds that a subscription had not handled again "
            "(`manage.py stream reconcile --dry-run` lists them)",
        )

    def _update(self, transport: Any, options: dict[str, Any]) -> None:
        from django_platformkit.operate.streams import update_stream

        changed, left = update_stream(transport.upkeep, dry_run=options["dry_run"])
        verb = "would change" if options["dry_run"] else "changed"
        for line in changed:
            self.out.result(verb, line, style="NOTICE" if options["dry_run"] else "SUCCESS")
        for line in left:
            self.out.result("left", line, style="WARNING")
        if not changed:
            self.out.result("nothing to change", "in place", style="NOTICE")

    def _reconcile(self, transport: Any, options: dict[str, Any]) -> None:
        from django_platformkit import identity
        from django_platformkit.operate.reconcile import CAUSE_TEXT, reconcile

        dry_run = options["dry_run"]
        report = reconcile(
            transport, owner=identity.database_identity(), instance=identity.database_instance(), dry_run=dry_run
        )
        if report.note:
            raise CommandError(f"nothing reconciled: {report.note}")
        verb = "would send again" if dry_run else "sent again"
        for result in report.subscriptions.values():
            if result.resent:
                causes = ", ".join(f"{n:,} {cause} ({CAUSE_TEXT[cause]})" for cause, n in sorted(result.resent.items()))
                examples = ", ".join(str(e) for e in result.examples)
                self.out.result(
                    f"{result.name}: {verb}",
                    f"{sum(result.resent.values()):,}: {causes}; e.g. {examples}",
                    style="WARNING",
                )
            elif result.note:
                self.out.result(f"{result.name}:", result.note, style="NOTICE")
            else:
                self.out.result(f"{result.name}:", "nothing lost")
        if report.failed:
            raise CommandError(f"reconciliation cut short (run it again): {report.failed}")
        self.out.line(
            f"{'dry run, nothing sent: ' if dry_run else ''}{report.resent:,} re-send(s) "
            f"{'would be ' if dry_run else ''}made, each to its subscription only"
        )

    def _takeover(self, transport: Any, options: dict[str, Any]) -> None:
        from django_platformkit.operate.streams import take_over

        stream = conf.settings.STREAM
        if not options["yes"]:
            raise CommandError(
                f"stream takeover makes this database instance the holder of the stream {stream!r}: the other "
                "instance's workers are refused from then on. Pass --yes to do it (after stopping them)."
            )
        done = take_over(transport.upkeep, force=options["force"])
        if done.after is None:
            self.out.result(
                "nothing to do:", f"this database instance ({done.before.instance}) holds the stream {stream!r} already"
            )
            return
        self.out.result(
            "took over",
            f"the stream {stream!r}: held by instance {done.after.instance} (this database) from now on, "
            f"instead of {done.before.instance or '(none recorded)'}",
        )
