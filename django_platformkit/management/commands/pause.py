"""``manage.py pause``: stop every worker from starting a subscription's (or
a task queue's) handlers until ``manage.py resume``; its messages wait in
the stream. A thin adapter over ``operate.pause.pause()``.

    manage.py pause NAME... --actor USERNAME --reason "..."
    manage.py pause --queue Q --actor USERNAME --reason "..."
    manage.py pause --list
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.management.commands._base import (
    Output,
    checked_actor,
    configure_logging,
    import_urlconf,
    tables_migrated,
)
from django_platformkit.operate.pause import PauseChange, pause, paused, queue_name


def name_arguments(parser: CommandParser, verb: str) -> None:
    """The names ``pause`` and ``resume`` take: subscriptions and ``--queue``s, and ``--actor``."""
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"A subscription to {verb} (e.g. shop.send_receipt). A task queue's subscription stands for the queue.",
    )
    parser.add_argument(
        "--queue",
        dest="queues",
        action="append",
        default=[],
        metavar="Q",
        help=f"A django.tasks queue to {verb} (its TASKS QUEUES name, e.g. emails); repeatable.",
    )
    parser.add_argument(
        "--actor",
        default=None,
        metavar="USERNAME",
        help="Required. The Django user acting: active, with the permission the admin's Replay needs "
        "(django_platformkit.replay_deadletter), else nothing is written. The admin's history gets a LogEntry.",
    )


def when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"


def what(change: PauseChange) -> str:
    return f"queue {change.queue} ({change.name})" if change.queue is not None else change.name


def log_changes(user_id: Any, changes: list[PauseChange], verb: str, reason: str) -> None:
    """One ``LogEntry`` per pause or resume that changed something (``verb``: pause or resume)."""
    if user_id is None or not apps.is_installed("django.contrib.admin"):
        return
    from django.contrib.admin.models import ADDITION, DELETION

    from django_platformkit.models.controls import Pause
    from django_platformkit.operate.audit import log_control

    for change in changes:
        if change.changed:
            message = f"{'Paused' if verb == 'pause' else 'Resumed'} {what(change)}." + (
                f" Reason: {reason}" if reason else ""
            )
            log_control(user_id, Pause, change.name, message, flag=ADDITION if verb == "pause" else DELETION)


class Command(BaseCommand):
    help = (
        "Pause subscriptions or task queues: within seconds no worker starts their handlers (runs in flight "
        "finish); their messages wait in the stream - nothing is lost, no attempt is counted, nothing "
        "dead-letters for having waited - until `manage.py resume`. Kept in the database: a worker started "
        "later honours it too. Publishes platformkit.subscription_paused; the overview shows who paused, when "
        "and why."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        name_arguments(parser, "pause")
        parser.add_argument("--reason", default=None, metavar="TEXT", help="Required. Why (shown on the overview).")
        parser.add_argument("--list", action="store_true", help="List the pauses standing now; change nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        out = Output(self, options["verbosity"])
        import_urlconf()  # a subscription declared in a views module is known with --skip-checks too
        if options["list"]:
            with tables_migrated():
                standing = paused()
            for row in standing:
                queue = queue_name(row.name)
                label = f"queue {queue} ({row.name})" if queue is not None else row.name
                out.data(f"{label}  paused by {row.paused_by} at {when(row.paused_at)}: {row.reason}")
            if not standing:
                out.result("nothing", "is paused")
            return
        reason = str(options["reason"] or "").strip()
        if not reason:
            raise CommandError(
                'pause: give --reason "...": why it is paused (shown on the overview, kept in the log and the '
                "audit event); nothing was written."
            )
        with tables_migrated():
            user_id = checked_actor("pause", options["actor"])
            try:
                changes = pause(options["names"], queues=options["queues"], actor=options["actor"], reason=reason)
            except ValueError as exc:
                raise CommandError(f"pause: {exc}") from None
            log_changes(user_id, changes, "pause", reason)
        for change in changes:
            if change.changed:
                out.result("paused", f"{what(change)} actor={change.paused_by}: no worker starts its handlers")
            else:
                out.result(
                    "already paused",
                    f"{what(change)} by {change.paused_by} at {when(change.paused_at)}: {change.reason}",
                    style="NOTICE",
                )
