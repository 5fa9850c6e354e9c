"""``manage.py jobs``: the periodic jobs and their switches. A thin adapter
over ``jobs.controls`` (the same as the admin jobs list's actions).

    manage.py jobs list [--format table|json]
    manage.py jobs run NAME... --actor USERNAME --reason "..." [--wait SECONDS]
    manage.py jobs disable NAME... --actor USERNAME --reason "..."
    manage.py jobs enable NAME... --actor USERNAME --reason "..."
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections

from django_platformkit import conf
from django_platformkit.admin.jobfigures import JobFigures, job_figures
from django_platformkit.admin.queries import Timed
from django_platformkit.jobs.controls import JobChange, disable, enable, request_run
from django_platformkit.management.commands._base import (
    Output,
    accept_verbosity,
    checked_actor,
    configure_logging,
    import_urlconf,
    positive,
    tables_migrated,
)
from django_platformkit.models.controls import JobControl

#: How often ``run --wait`` looks at the run's record.
WAIT_LOOK_SECONDS = 0.5
VERBS = {"run": request_run, "disable": disable, "enable": enable}


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else "-"


def _state(job: JobFigures) -> str:
    if job.disabled and job.control is not None:
        return f"disabled by {job.control.disabled_by}"
    if job.running:
        return "running"
    if job.overdue:
        return f"overdue since {_when(job.missed_slot)}"
    if not job.declared:
        return "no longer declared"
    return "on time" if job.last_slot else "not run yet"


class Command(BaseCommand):
    help = (
        "The periodic jobs: list them with their state, run one by hand now (one extra run on the next scheduler "
        "tick of one worker, recorded with its actor; the schedule's slots stay as they were), disable one (its "
        "slots are skipped, shown as disabled, never overdue) or enable it again (from its next slot)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        verbs = parser.add_subparsers(dest="verb", required=True, metavar="list|run|disable|enable")
        listing = accept_verbosity(verbs.add_parser("list", help="Every job: schedule, state, last and next slot."))
        listing.add_argument("--format", choices=("table", "json"), default="table", help="table (default) or json.")
        for verb, text in (
            ("run", "Run jobs once now, by hand (a disabled job too)."),
            ("disable", "Skip the jobs' slots until they are enabled."),
            ("enable", "Run the jobs from their next slots again."),
        ):
            p = accept_verbosity(verbs.add_parser(verb, help=text))
            p.add_argument("names", nargs="+", metavar="NAME", help="A declared job's name (as `jobs list` shows).")
            p.add_argument(
                "--actor",
                default=None,
                metavar="USERNAME",
                help="Required. The Django user acting: active, with the permission the admin's actions need "
                "(django_platformkit.replay_deadletter), else nothing is written. The admin's history gets a LogEntry.",
            )
            p.add_argument("--reason", default=None, metavar="TEXT", help="Required. Why (kept in the log).")
            if verb == "run":
                p.add_argument(
                    "--wait",
                    default=None,
                    metavar="SECONDS",
                    help="Wait up to SECONDS for the run to end and say how it ended (exit 1 if it failed or did not "
                    "end in time).",
                )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        out = Output(self, options["verbosity"])
        import_urlconf()  # a job declared in a views module is known with --skip-checks too
        with tables_migrated():
            if options["verb"] == "list":
                self._list(out, options)
            else:
                self._switch(out, options)

    def _list(self, out: Output, options: dict[str, Any]) -> None:
        alias = conf.settings.DATABASE_ALIAS
        connections[alias].ensure_connection()  # a database that can't answer is one line, not notes
        notes: list[str] = []
        rows = job_figures(Timed(alias, notes))
        for note in notes:
            out.warning("note:", note)
        if options["format"] == "json":
            out.data(
                json.dumps(
                    [
                        {
                            "name": j.name,
                            "schedule": j.schedule,
                            "state": _state(j),
                            "disabled": j.disabled,
                            "overdue": j.overdue,
                            "running": j.running,
                            "last_slot": j.last_slot.isoformat() if j.last_slot else None,
                            "next_slot": j.next_slot.isoformat() if j.next_slot else None,
                            "last_error": j.last_error,
                            "run_asked_by": j.control.run_requested_by or None if j.control else None,
                        }
                        for j in rows
                    ],
                    indent=2,
                )
            )
            return
        if not rows:
            out.result("no jobs", "are declared", style="NOTICE")
            return
        table = [("NAME", "SCHEDULE", "STATE", "LAST SLOT (UTC)", "NEXT SLOT (UTC)", "LAST ERROR")] + [
            (
                j.name,
                j.schedule,
                _state(j),
                _when(j.last_slot),
                _when(j.next_slot),
                (j.last_error.strip().splitlines() or ["-"])[0][:60],
            )
            for j in rows
        ]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
        for row in table:
            out.data("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])

    def _switch(self, out: Output, options: dict[str, Any]) -> None:
        verb = options["verb"]
        reason = str(options["reason"] or "").strip()
        if not reason:
            raise CommandError(f'jobs {verb}: give --reason "...": why (it is kept in the log); nothing was written.')
        wait = positive("--wait", options.get("wait"), example="60")
        user_id = checked_actor(f"jobs {verb}", options["actor"])
        try:
            changes = VERBS[verb](options["names"], actor=options["actor"], reason=reason)
        except ValueError as exc:
            raise CommandError(f"jobs {verb}: {exc}") from None
        self._log(user_id, changes, verb, reason)
        for change in changes:
            if change.changed:
                said = {
                    "run": ("asked", "a run: the next scheduler tick of one worker runs it"),
                    "disable": ("disabled", "its slots are skipped until it is enabled"),
                    "enable": ("enabled", "it runs from its next slot"),
                }[verb]
                out.result(said[0], f"{change.name} actor={options['actor']}: {said[1]}")
            else:
                already = {
                    "run": f"a run asked for by {change.by} at {_when(change.at)} has not started yet",
                    "disable": f"disabled already by {change.by} at {_when(change.at)}",
                    "enable": "not disabled",
                }[verb]
                out.result("unchanged", f"{change.name}: {already}", style="NOTICE")
        if verb == "run" and wait is not None:
            self._wait(out, {c.name: c.at for c in changes}, wait)

    def _log(self, user_id: Any, changes: list[JobChange], verb: str, reason: str) -> None:
        if user_id is None or not apps.is_installed("django.contrib.admin"):
            return
        from django_platformkit.models import JobState
        from django_platformkit.operate.audit import log_control

        past = {"run": "Asked for a run by hand", "disable": "Disabled", "enable": "Enabled"}[verb]
        for change in changes:
            if change.changed:
                log_control(user_id, JobState, change.name, f"{past}. Reason: {reason}")

    def _wait(self, out: Output, asked: dict[str, datetime | None], seconds: float) -> None:
        """Until each run asked for (``asked``: the job, when the database
        recorded the request) has ended, or ``seconds``."""
        deadline = time.monotonic() + seconds
        left = set(asked)
        failed = []
        while left:
            for control in JobControl.objects.filter(name__in=left, manual_finished_at__isnull=False):
                at = asked[control.name]
                if control.manual_started_at is None or (at is not None and control.manual_started_at < at):
                    continue
                left.discard(control.name)
                if control.manual_error:
                    failed.append(control.name)
                    out.result("failed", f"{control.name}: {control.manual_error.splitlines()[0]}", style="ERROR")
                else:
                    out.result("succeeded", f"{control.name} (run by {control.manual_by})")
            if left and time.monotonic() > deadline:
                raise CommandError(
                    f"jobs run: {', '.join(sorted(left))} did not end within {seconds:g} s; it stays asked for. Is a "
                    "worker with the scheduler running (runworker without --no-jobs)?"
                )
            if left:
                time.sleep(WAIT_LOOK_SECONDS)
        if failed:
            raise CommandError(f"jobs run: {', '.join(failed)} failed (its error is above; `jobs list` shows it too).")
