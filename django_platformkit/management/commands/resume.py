"""``manage.py resume``: let every worker start a paused subscription's (or
task queue's) handlers again. A thin adapter over ``operate.pause.resume()``.

    manage.py resume NAME... --actor USERNAME [--reason "..."]
    manage.py resume --queue Q --actor USERNAME
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.management.commands._base import (
    Output,
    checked_actor,
    configure_logging,
    import_urlconf,
    tables_migrated,
)
from django_platformkit.management.commands.pause import log_changes, name_arguments, what, when
from django_platformkit.operate.pause import resume


class Command(BaseCommand):
    help = (
        "Resume paused subscriptions or task queues: within seconds every worker that serves them fetches and "
        "starts their waiting messages again, in stream order. Publishes platformkit.subscription_resumed."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        name_arguments(parser, "resume")
        parser.add_argument("--reason", default="", metavar="TEXT", help="Why (optional; kept in the log).")

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        out = Output(self, options["verbosity"])
        import_urlconf()
        reason = str(options["reason"] or "").strip()
        with tables_migrated():
            user_id = checked_actor("resume", options["actor"])
            try:
                changes = resume(options["names"], queues=options["queues"], actor=options["actor"], reason=reason)
            except ValueError as exc:
                raise CommandError(f"resume: {exc}") from None
            log_changes(user_id, changes, "resume", reason)
        for change in changes:
            if change.changed:
                out.result(
                    "resumed",
                    f"{what(change)} (paused by {change.paused_by} at {when(change.paused_at)}): its messages run again",
                )
            else:
                out.result("not paused", what(change), style="NOTICE")
