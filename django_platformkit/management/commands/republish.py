"""``manage.py republish``: put outbox rows already published in a window
back to pending, so the relay sends them again - for messages the broker
lost after the relay stamped them. A thin adapter over
``django_platformkit.republish()``.

    manage.py republish --since 2h [--until 30m] [--event NAME]... --reason "..." [--dry-run]
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.management.commands._base import (
    WHEN_EXAMPLES,
    Output,
    configure_logging,
    import_urlconf,
    point_in_time,
    positive,
    tables_migrated,
)
from django_platformkit.operate.republish import DEFAULT_BATCH_SIZE, republish


class Command(BaseCommand):
    help = (
        "Set outbox rows already published (relayed) in a window pending again, so the relay sends them "
        "again: for messages the broker lost (one replica whose store was lost, a stream deleted or purged by hand). "
        "Exactly once still holds: each subscription's claim skips an event it already handled, and a "
        "dead-lettered event keeps its terminal claim (it stays a dead letter). The re-send gets a fresh "
        "Nats-Msg-Id, as a replay's does, so the broker's duplicate window (DUPLICATE_WINDOW_SECONDS) can't drop "
        "it; where the broker still had the message, claims make the second copy harmless."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        # No argparse type= or required=: handle() checks every option, so
        # call_command(since=timedelta(hours=2), ...) is checked the same way.
        parser.add_argument(
            "--since",
            default=None,
            metavar="WHEN",
            help=f"Required. Rows published at or after WHEN: {WHEN_EXAMPLES} (UTC unless it has an offset).",
        )
        parser.add_argument(
            "--until",
            default=None,
            metavar="WHEN",
            help="Rows published before WHEN, given as --since is (default: now; a later time is read as now).",
        )
        parser.add_argument(
            "--event",
            dest="events",
            action="append",
            default=None,
            metavar="NAME",
            help="Only rows of this event (e.g. shop.order_placed); repeatable. Default: every event.",
        )
        parser.add_argument("--reason", default=None, help="Required. Why (it is logged with the window and count).")
        parser.add_argument("--dry-run", action="store_true", help="Count what would be republished; write nothing.")
        parser.add_argument(
            "--batch-size",
            default=DEFAULT_BATCH_SIZE,
            metavar="ROWS",
            help=f"Rows per transaction (default {DEFAULT_BATCH_SIZE}); a running relay waits on none of them.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        out = Output(self, options["verbosity"])
        since = point_in_time("--since", options["since"])
        if since is None:
            raise CommandError(
                f"republish needs --since WHEN, the start of the window: {WHEN_EXAMPLES}. "
                "--until WHEN (default now) ends it."
            )
        until = point_in_time("--until", options["until"])
        reason = str(options["reason"] or "").strip()
        if not reason:
            raise CommandError('republish needs --reason "...": say why these events are sent again (it is logged).')
        batch_size = positive("--batch-size", options["batch_size"], unit="rows", whole=True, example="1000")
        events = options["events"]
        if isinstance(events, str):
            events = [events]
        with tables_migrated():
            if events:
                import_urlconf()  # an event declared in a views module is known with --skip-checks too
                for name in events:
                    self._refuse_unknown_event(name)
            try:
                result = republish(
                    since=since,
                    until=until,
                    events=events or None,
                    reason=reason,
                    dry_run=options["dry_run"],
                    batch_size=batch_size,
                    progress=lambda done, batches: out.progress(f"... republished={done} batches={batches}"),
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        window = (
            f"published from {result.since.isoformat()} until {result.until.isoformat()}, "
            f"events: {', '.join(sorted(set(events))) if events else 'all'}"
        )
        if result.dry_run:
            out.result(
                "dry run,", f"nothing written: would republish {result.republished} row(s) ({window})", style="NOTICE"
            )
            return
        if result.skipped_locked:
            out.warning(
                f"{result.skipped_locked} row(s)",
                "of the window were in use by another transaction (a replay, a purge) and were left as they were; "
                "run the same command again to take them.",
            )
        out.result(
            f"republished={result.republished}",
            f"skipped_locked={result.skipped_locked} batches={result.batches} "
            f"({window}); the relay sends them on its next pass",
        )

    @staticmethod
    def _refuse_unknown_event(name: str) -> None:
        """A typo would otherwise read as "nothing to republish" - after a
        lost store. Known: every declared event, and any name the outbox
        still holds published rows of (an event removed from the code)."""
        from django_platformkit.models import OutboxEvent
        from django_platformkit.outbox.events import catalogue

        known = set(catalogue())
        if name in known or OutboxEvent.objects.published().filter(name=name).exists():
            return
        raise CommandError(
            f"unknown event {name!r}; declared: {', '.join(sorted(known))}. "
            "(An event removed from the code stays known while the outbox holds published rows of it.)"
        )
