"""``manage.py purgeoutbox``: delete published outbox rows and spent claims
older than the retention (the longer of ``RETENTION_DAYS`` and the stream's
real max age, read from NATS), in bounded batches; never evidence."""

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.exceptions import BrokerUnavailable
from django_platformkit.management.commands._base import (
    Output,
    age,
    configure_logging,
    import_urlconf,
    parsed,
    result_printed_once,
    tables_migrated,
)
from django_platformkit.operate.purge import DEFAULT_BATCH_SIZE, purge


def rows(text: str | int) -> int:
    """``--batch-size``: a whole number of rows, 1 or more (text, or an int
    from ``call_command``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of rows >= 1")
        return text
    if not isinstance(text, str) or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of rows >= 1")
    return int(text)


class Command(BaseCommand):
    help = (
        "Delete published outbox rows older than the retention, and claims that no longer guard a row. "
        "The retention is the longer of RETENTION_DAYS and the stream's real max age, read from NATS (without "
        "an answer nothing is deleted). Pending rows, rows a dead letter describes and dead letters are kept; so "
        "is, within the retention, whatever the stream can still deliver: every claim, and rows not yet handled "
        "by every subscription or with a retry in flight."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=age,
            default=None,
            metavar="AGE",
            help="Age measured from published_at: 30m, 12h, 7d, 2w (default: the retention). Claims are kept for the "
            "retention whatever this says.",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count what would be deleted; delete nothing.")
        parser.add_argument(
            "--batch-size",
            type=rows,
            default=DEFAULT_BATCH_SIZE,
            metavar="ROWS",
            help=f"Rows per transaction (default {DEFAULT_BATCH_SIZE}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        # Checked here too: call_command() hands its values over unparsed.
        batch_size = parsed("--batch-size", options["batch_size"], rows)
        older_than = parsed("--older-than", options["older_than"], age)
        # The rows a subscription hasn't handled yet are kept: a views-declared
        # one missing from the registry (--skip-checks) would lose its rows.
        import_urlconf()
        with tables_migrated(), result_printed_once("django_platformkit.operate.purge", "purged ", "purge dry run "):
            try:
                result = purge(
                    older_than=older_than, dry_run=options["dry_run"], batch_size=batch_size or DEFAULT_BATCH_SIZE
                )
            except BrokerUnavailable as exc:
                raise CommandError(
                    f"nothing was deleted: the purge keeps whatever the stream can still deliver, and it can't read "
                    f"the stream's max age now ({exc}). Run it again when NATS answers."
                ) from None
        out = Output(self, options["verbosity"])
        if result.dry_run:
            out.result(
                "dry run,",
                f"nothing deleted: would delete outbox={result.outbox_deleted} claims={result.claims_deleted} "
                f"(published before {result.cutoff.isoformat()})",
                style="NOTICE",
            )
        else:
            out.result(
                "deleted",
                f"outbox={result.outbox_deleted} claims={result.claims_deleted} attempts={result.attempts_deleted} "
                f"skipped_locked={result.skipped_locked} "
                f"batches={result.batches} (published before {result.cutoff.isoformat()})",
            )
