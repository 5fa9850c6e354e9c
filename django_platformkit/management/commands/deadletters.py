"""``manage.py deadletters``: the operator's shell for dead letters - list,
show, replay, discard. A thin adapter over ``operate.deadletters.replay()``
and ``discard()``: the same audit event, the same refusals, the same
one-transaction-per-event guarantee as the admin's actions.

    manage.py deadletters list [--subscription S] [--since 1h] [--format table|json]
    manage.py deadletters show ID [--full]
    manage.py deadletters replay ID... --reason "..." [--dry-run]
    manage.py deadletters replay --subscription S --since 1h --reason "..."   (every match)
    manage.py deadletters discard ID... --reason "..."

ID: the dead letter's id as ``list`` shows it, or an event id (UUID: every
dead letter of that event).
"""

from __future__ import annotations

import argparse
import getpass
import json
import uuid
from datetime import UTC
from typing import Any

from django.apps import apps as django_apps
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_platformkit import conf
from django_platformkit.exceptions import ReplayRefused
from django_platformkit.management.commands._base import (
    Output,
    accept_verbosity,
    age,
    checked_actor,
    configure_logging,
    import_urlconf,
    parsed,
    tables_migrated,
)
from django_platformkit.management.commands._terminal import excerpt, first_line, printable
from django_platformkit.models import Attempt, DeadLetter, OutboxEvent
from django_platformkit.operate.audit import REPLAY_PERMISSION, log_dead_letter_action
from django_platformkit.operate.deadletters import BatchLog, discard, replay, replay_blocker
from django_platformkit.outbox.deadletters import MALFORMED_BODY_BYTES, MALFORMED_NAME

#: Past this many rows a long replay/discard reports its progress every PROGRESS_EVERY rows.
PROGRESS_EVERY = 100
ERROR_WIDTH = 60
#: ``show`` prints this much of a malformed message's recorded body unless
#: ``--full``: whichever bound comes first. Escaped, a control character
#: takes four columns, so the excerpt stays within a screen or two.
BODY_EXCERPT_CHARS = 1000
BODY_EXCERPT_LINES = 20


def _limit(text: str | int) -> int:
    """``--limit``: a whole number, 0 or more (0: every row); text, or an
    int from ``call_command``."""
    try:
        value = int(text) if isinstance(text, str | int) and not isinstance(text, bool) else -1
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a row count: give 0 (every row) or a positive whole number")
    return value


def _dead_letter_ids(text: str) -> tuple[str, Any]:
    """``42`` -> ("id", 42); a UUID -> ("event", UUID); anything else: an argparse error."""
    import argparse

    if text.isdigit():
        return ("id", int(text))
    try:
        return ("event", uuid.UUID(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a dead letter id (a number, as `deadletters list` shows) nor an event id (a UUID)"
        ) from None


def _os_user(verb: str) -> str:
    """The OS user's name, the default actor. A container started with a
    user id of its own often has no name for it (no ``USER``/``LOGNAME``, no
    passwd entry): getpass then raises, which would end the command in a
    traceback instead of saying to pass ``--actor``."""
    import os

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        raise CommandError(
            f"deadletters {verb}: can't tell who is acting (user id {os.getuid()} has no name here: no USER or "
            "LOGNAME and no passwd entry, as in many containers); pass --actor NAME."
        ) from None


def _when(moment: Any) -> str:
    """To the second, in UTC: relay lag and retries are read in seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


class Command(BaseCommand):
    help = "List, show, replay or discard dead letters (the events a subscription gave up on)."

    def add_arguments(self, parser: CommandParser) -> None:
        commands = parser.add_subparsers(dest="action", required=True, metavar="list|show|replay|discard")

        def selection(p: CommandParser, *, ids: bool) -> None:
            accept_verbosity(p)  # `deadletters list -v 0`: the subcommand's own -v
            if ids:
                p.add_argument(
                    "ids",
                    nargs="*",
                    type=_dead_letter_ids,
                    metavar="ID",
                    help="Dead letter id (as `list` shows) or event id (UUID). None: every match of --subscription/--since.",
                )
            p.add_argument(
                "--subscription",
                default=None,
                metavar="NAME",
                help="Only this subscription's dead letters (e.g. shop.send_receipt, or platformkit.relay).",
            )
            p.add_argument(
                "--since",
                type=age,
                default=None,
                metavar="AGE",
                help="Only dead letters that failed within AGE: 30m, 12h, 7d, 2w.",
            )

        # Subparsers don't inherit BaseCommand's --verbosity etc.; the parent parser keeps them.
        listing = commands.add_parser("list", help="Dead letters, newest first.")
        selection(listing, ids=False)
        listing.add_argument(
            "--format",
            choices=("table", "json"),
            default="table",
            help="table (default) or json (full errors, for scripts).",
        )
        listing.add_argument(
            "--limit", type=_limit, default=200, metavar="N", help="At most N rows (default 200; 0 = all)."
        )

        show = commands.add_parser(
            "show",
            help="One dead letter: error, traceback, attempts, payload; a malformed message's body as an excerpt.",
        )
        accept_verbosity(show).add_argument(
            "id", type=_dead_letter_ids, metavar="ID", help="Dead letter id (as `list` shows) or event id (UUID)."
        )
        show.add_argument(
            "--full",
            action="store_true",
            help=f"Print a malformed message's whole recorded body (at most its first {MALFORMED_BODY_BYTES} "
            f"bytes), not just its first {BODY_EXCERPT_CHARS} characters or {BODY_EXCERPT_LINES} lines. The "
            "whole message stays in the stream until it ages out: `show` prints the `nats stream get` that "
            "fetches it.",
        )

        for verb, what in (
            ("replay", "Send the events again to the subscriptions that gave up on them."),
            (
                "discard",
                "Accept the failures: delete the dead letters; their terminal claims stay, nothing runs them again.",
            ),
        ):
            p = commands.add_parser(verb, help=what)
            selection(p, ids=True)
            p.add_argument("--reason", required=True, help="Why (kept in the audit event and the log).")
            p.add_argument(
                "--actor",
                default=None,
                metavar="USERNAME",
                help="The Django user acting: an active user who holds the permission the admin's action needs "
                f"({REPLAY_PERMISSION}), else the command refuses and writes nothing. The admin's History gets "
                "the same LogEntry as the admin's own action writes. Without --actor, the OS user is recorded in the "
                "audit event and the log, with no LogEntry.",
            )
            p.add_argument("--dry-run", action="store_true", help="Say what would be done; write nothing.")

    # -- selection --
    def _matching(self, options: dict[str, Any]) -> list[DeadLetter]:
        rows = DeadLetter.objects.all()
        ids = options.get("ids") or []
        if ids:
            by_id = [v for k, v in ids if k == "id"]
            by_event = [v for k, v in ids if k == "event"]
            from django.db.models import Q

            rows = rows.filter(Q(id__in=by_id) | Q(event_id__in=by_event))
        elif options["action"] in ("replay", "discard") and not (options["subscription"] or options["since"]):
            raise CommandError(
                f"deadletters {options['action']}: name the dead letters (IDs), or select them with --subscription and/or --since "
                "(every match is acted on)."
            )
        if options["subscription"]:
            self._refuse_unknown_subscription(options["subscription"])
            rows = rows.filter(subscription=options["subscription"])
        if options["since"]:
            rows = rows.filter(failed_at__gte=timezone.now() - options["since"])
        found = list(rows.order_by("-failed_at", "-id"))
        if ids:
            missing = [str(v) for k, v in ids if not any((d.id if k == "id" else d.event_id) == v for d in found)]
            if missing:
                raise CommandError(
                    f"no dead letter matches {', '.join(missing)} (with the filters given); `deadletters list` shows what there is."
                )
        return found

    @staticmethod
    def _refuse_unknown_subscription(name: str) -> None:
        """A typo would otherwise read as "no dead letters". Known: every
        subscription in code, the relay's own, and any name the table still
        holds (a subscription removed from code keeps its dead letters)."""
        from django_platformkit.consume.subscriptions import subscriptions
        from django_platformkit.outbox.deadletters import RELAY_DEAD_LETTERS

        import_urlconf()  # a views-declared subscription is known with --skip-checks too
        known = {s.name for s in subscriptions()} | {RELAY_DEAD_LETTERS}
        if name in known:
            return
        in_table = set(DeadLetter.objects.values_list("subscription", flat=True).distinct())
        if name in in_table:
            return
        raise CommandError(
            f"unknown subscription {name!r}; known: {', '.join(sorted(known | in_table))}. "
            "(A subscription removed from the code stays known while it has dead letters.)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        self.out = Output(self, options["verbosity"])
        # Checked here too: call_command() hands its values over unparsed
        # (a --limit of -1 dropped the last row, a --since of "1h" crashed).
        for option, read in (("--limit", _limit), ("--since", age)):
            key = option[2:]
            if key in options:
                options[key] = parsed(option, options[key], read)
        with tables_migrated():
            getattr(self, f"_{options['action']}")(options)

    # -- list / show --
    def _list(self, options: dict[str, Any]) -> None:
        rows = self._matching(options)
        total = len(rows)
        if options["limit"]:
            rows = rows[: options["limit"]]
        if options["format"] == "json":
            self.out.data(
                json.dumps(
                    [
                        {
                            "id": d.id,
                            "event_id": str(d.event_id),
                            "subscription": d.subscription,
                            "name": d.name,
                            "tenant": d.tenant,
                            "attempts": d.attempts,
                            "failed_at": d.failed_at.isoformat(),
                            "error": d.error,
                        }
                        for d in rows
                    ],
                    indent=2,
                )
            )
            return
        if not rows:
            self.out.result("no dead letters", style="NOTICE")
            return
        header = ("ID", "FAILED AT (UTC)", "SUBSCRIPTION", "EVENT ID", "NAME", "TENANT", "ATT", "ERROR")
        table = [header] + [
            (
                str(d.id),
                _when(d.failed_at),
                d.subscription,
                str(d.event_id),
                d.name,
                d.tenant or "-",
                str(d.attempts),
                first_line(d.error, ERROR_WIDTH),
            )
            for d in rows
        ]
        widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
        for r in table:
            self.out.data("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        shown = f"{len(rows)} of {total}" if total > len(rows) else str(total)
        self.out.line(f"{shown} dead letter(s); `deadletters show ID` for the full error")

    def _show(self, options: dict[str, Any]) -> None:
        kind, value = options["id"]
        rows = list(
            DeadLetter.objects.filter(**({"id": value} if kind == "id" else {"event_id": value})).order_by("id")
        )
        if not rows:
            raise CommandError(f"no dead letter {value}; `deadletters list` shows what there is.")
        outbox = OutboxEvent.objects.filter(id=rows[0].event_id).first()
        for d in rows:
            w = self.out.data
            w(f"dead letter {d.id}")
            w(f"  subscription  {d.subscription}")
            w(f"  event         {d.name} {d.event_id}" + (f" tenant={d.tenant}" if d.tenant else ""))
            w(f"  failed at     {_when(d.failed_at)} UTC after {d.attempts} attempt(s)")
            w(f"  error         {printable(d.error)}")
            attempts = list(Attempt.objects.for_event(d.event_id, d.subscription).order_by("attempt"))
            if attempts:
                w("  attempts")
                for a in attempts:
                    w(
                        f"    #{a.attempt} {a.outcome:<11} started {_when(a.started_at)} finished {_when(a.finished_at)} {a.worker} {first_line(a.error, 80)}"
                    )
            if d.name == MALFORMED_NAME:
                # Its "traceback" is the body as received: any bytes, so a
                # bounded excerpt unless asked for all of it.
                self._show_body(d, full=options.get("full", False))
            elif d.traceback:
                w("  traceback")
                for line in printable(d.traceback.rstrip()).split("\n"):
                    w(f"    {line}")
        if outbox is not None:
            self.out.data(f"payload (outbox row, created {_when(outbox.created_at)} UTC)")
            self.out.data(json.dumps(outbox.payload, indent=2, sort_keys=True))
        else:
            self.out.data("payload: no outbox row (malformed message, or purged) - nothing to replay")

    def _show_body(self, d: DeadLetter, *, full: bool) -> None:
        """A malformed message's recorded body, escaped: the first
        ``BODY_EXCERPT_CHARS`` characters or ``BODY_EXCERPT_LINES`` lines and
        how many characters are left out, or with ``full`` the whole record;
        then where the whole message is, when its place in the stream was recorded."""
        w = self.out.data
        record = d.traceback
        if not record:
            w("  body          (empty)")
            return
        shown = record if full else excerpt(record, chars=BODY_EXCERPT_CHARS, lines=BODY_EXCERPT_LINES)
        w(f"  body          as received (the record keeps at most its first {MALFORMED_BODY_BYTES} bytes)")
        for line in printable(shown.rstrip("\n")).split("\n"):
            w(f"    {line}")
        left_out = len(record) - len(shown)
        if left_out:
            w(
                f"    ... {left_out} more characters of the record not shown "
                f"(`deadletters show {d.id} --full` prints all {len(record)})"
            )
        if d.stream_seq is not None:
            stream = conf.settings.STREAM
            w(f"  whole message `nats stream get {stream} {d.stream_seq}` (until it ages out of the stream)")

    # -- replay / discard --
    def _replay(self, options: dict[str, Any]) -> None:
        self._act(options, "replay")

    def _discard(self, options: dict[str, Any]) -> None:
        self._act(options, "discard")

    def _act(self, options: dict[str, Any], verb: str) -> None:
        actor = options["actor"] or _os_user(verb)
        reason = options["reason"].strip()
        if not reason:
            raise CommandError(f"deadletters {verb}: --reason must say why (it is kept in the audit record).")
        # Checked before anything is read or written: the admin's action needs the permission, so does this.
        admin_installed = django_apps.is_installed("django.contrib.admin")  # the LogEntry's table
        history_user = None
        if options["actor"]:
            history_user = checked_actor(f"deadletters {verb}", options["actor"])
        if verb == "replay":
            # replay_blocker() refuses a subscription this build lacks: with
            # --skip-checks a views-declared one must not look removed.
            import_urlconf()
        rows = self._matching(options)
        past = {"replay": "replayed", "discard": "discarded"}[verb]
        if not rows:
            self.out.result(f"nothing to {verb}:", "no dead letter matches", style="NOTICE")
            return
        if options["dry_run"]:
            # The same refusals as the real run (and the admin's Replay): a dry
            # run never promises what the replay would then refuse.
            blocked = 0
            for d in rows:
                why = replay_blocker(d.event_id, d.name, d.subscription) if verb == "replay" else None
                if why:
                    blocked += 1
                    self.out.warning("would refuse", f"{d.id}: {why}")
                    continue
                self.out.data(f"would {verb} {d.id} subscription={d.subscription} event_id={d.event_id} name={d.name}")
            self.out.result(
                "dry run,",
                f"nothing written: would {verb} {len(rows) - blocked} dead letter(s), refuse {blocked}",
                style="NOTICE",
            )
            if blocked:
                raise CommandError(f"{blocked} of {len(rows)} dead letter(s) would not be {past} (see above).")
            return
        done, refused = 0, []
        log = BatchLog(verb, actor=actor, reason=reason)
        for n, d in enumerate(rows, 1):
            try:
                if verb == "replay":
                    why = replay_blocker(d.event_id, d.name, d.subscription)
                    if why:
                        raise ReplayRefused(why)
                    replay(d.event_id, subscription=d.subscription, actor=actor, reason=reason)
                    ok = True
                else:
                    ok = discard(d.event_id, subscription=d.subscription, actor=actor, reason=reason)
            except ReplayRefused as exc:
                refused.append(f"{d.id}: {exc}")
                continue
            if ok:
                done += 1
                log.done()
                if history_user is not None and admin_installed:
                    log_dead_letter_action(history_user, d, verb, reason)
            self.out.detail(f"{past} {d.id} subscription={d.subscription} event_id={d.event_id}")
            if options["verbosity"] < 2 and len(rows) > PROGRESS_EVERY and n % PROGRESS_EVERY == 0:
                self.out.progress(f"... {n}/{len(rows)}")
        log.close()
        for line in refused:
            self.out.warning("refused", line)
        self.out.result(
            f"{past}={done}", f"refused={len(refused)} actor={actor}", style="WARNING" if refused else "SUCCESS"
        )
        if refused:
            raise CommandError(f"{len(refused)} of {len(rows)} dead letter(s) could not be {past} (see above).")
