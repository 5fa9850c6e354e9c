"""``manage.py cancel``: stop an event (or a task) from running before its
handler starts. A thin adapter over ``django_platformkit.cancel()``.

    manage.py cancel EVENT_ID [--subscription NAME] --actor USERNAME --reason "..."
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
from django_platformkit.operate.cancel import cancel


class Command(BaseCommand):
    help = (
        "Cancel an event that has not been handled yet (pending, deferred, waiting for a retry, or fetched by a "
        "worker): from the cancel's commit on no handler of the subscription (or of every subscription of the "
        "event) starts it. A handler running now may finish: the command waits for it and then says the cancel "
        "came too late. Writes terminal claims with the outcome 'cancelled' and publishes the audit event "
        "platformkit.event_cancelled; a cancelled task's result reads FAILED with "
        "django_platformkit.exceptions.Cancelled. Running it again changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("event_id", metavar="EVENT_ID", help="The event's id (a task's result id).")
        parser.add_argument(
            "--subscription",
            default=None,
            metavar="NAME",
            help="Cancel for this subscription only (default: every subscription of the event).",
        )
        parser.add_argument(
            "--actor",
            required=True,
            metavar="USERNAME",
            help="Required. The Django user who cancels: an active user holding the permission the admin's Cancel "
            "needs (django_platformkit.replay_deadletter), as for deadletters --actor; else refused, nothing written.",
        )
        parser.add_argument("--reason", required=True, metavar="TEXT", help="Required. Why (kept in the audit event).")

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        blank = [f"--{o} {m}" for o, m in (("actor", "USERNAME"), ("reason", "TEXT")) if not (options[o] or "").strip()]
        if blank:
            # cancel() refuses too, but in its own words ("cancel() needs an actor ..."), not the command's options.
            raise CommandError(
                f"cancel: give {' and '.join(blank)}: who cancels the event and why (both are kept in the audit "
                "event platformkit.event_cancelled); nothing was written."
            )
        import_urlconf()  # a subscription declared in a views module is known with --skip-checks too
        with tables_migrated():
            # Checked before anything is written, as every command with --actor checks it.
            checked_actor("cancel", options["actor"].strip())
            try:
                result = cancel(
                    options["event_id"],
                    subscription=options["subscription"],
                    actor=options["actor"] or "",
                    reason=options["reason"] or "",
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
        out = Output(self, options["verbosity"])
        for name in result.cancelled:
            out.result("cancelled", f"event={result.event_id} subscription={name}")
        for name in result.already_cancelled:
            out.result("already cancelled", f"event={result.event_id} subscription={name}", style="NOTICE")
        for name in result.too_late:
            out.result(
                "too late",
                f"event={result.event_id} subscription={name}: it was handled (or dead-lettered) first",
                style="WARNING",
            )
        if result.too_late and not result.cancelled and not result.already_cancelled:
            raise CommandError(
                f"nothing cancelled: every subscription of event {result.event_id} had handled or dead-lettered it "
                f"first. A dead letter is closed with `manage.py deadletters discard {result.event_id} --reason TEXT`."
            )
