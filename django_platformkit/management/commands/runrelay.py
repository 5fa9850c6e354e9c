"""``manage.py runrelay``: the relay alone (pending outbox rows -> JetStream).

A thin adapter over ``Worker(WorkerOptions(consumers=False, scheduler=False))``: the same
start-up (connect, stream and its owner, waiting out what can't answer yet),
signals and exit codes as ``runworker --no-consumers --no-jobs``.
"""

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError, DatabaseUnavailable
from django_platformkit.management.commands._base import (
    Output,
    add_metrics_options,
    command_version,
    configure_logging,
    positive,
    start_metrics,
    tcp_port,
)
from django_platformkit.outage import database_unavailable, is_database_error


class Command(BaseCommand):
    get_version = command_version  # --version: this release's, not only Django's
    help = "Relay pending outbox rows to NATS JetStream. Several relays may run at once (SKIP LOCKED)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--once",
            action="store_true",
            help="Relay what is due now, print the counts (deferred=N: rows not due yet) and exit; exit 1 at once "
            "if the database can't be reached (without --once the relay waits for it).",
        )
        add_metrics_options(parser)
        parser.add_argument(
            "--connect-timeout",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="With --once: fail if NATS or its stream can't be reached within SECONDS (default 30); the database "
            "gets one connect attempt of at most SECONDS, not retries.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        connect_timeout = positive("--connect-timeout", options["connect_timeout"], omitted="the default is 30")
        tcp_port("--metrics-port", options["metrics_port"])
        from django_platformkit.broker.transport import Transport
        from django_platformkit.runtime.options import WorkerOptions
        from django_platformkit.runtime.worker import Worker

        worker = Worker(
            WorkerOptions(consumers=False, scheduler=False, connect_timeout_seconds=connect_timeout),
            transport=Transport(name="django_platformkit relay"),
        )
        worker.install_signal_handlers()
        if options["metrics_port"] is not None:
            start_metrics(options["metrics_port"], host=options["metrics_host"])
        try:
            if not options["once"]:
                code = worker.run()
                if code:
                    raise SystemExit(code)
                return
            try:
                stats = worker.relay_once()
            except Exception as exc:
                if not is_database_error(exc):
                    raise
                # A script's step: fail it with the reason, not a traceback; the rows stay pending.
                what = "unavailable" if database_unavailable(exc) else "refusing the relay's queries"
                raise CommandError(
                    f"the database is {what}, nothing was relayed (rows stay pending): {' '.join(str(exc).split())}"
                ) from None
            if stats is None:  # stopped during start-up
                return
            Output(self, options["verbosity"]).line(
                f"relayed={stats.stored} duplicates={stats.duplicates} dead_lettered={stats.dead_lettered} "
                f"left_pending={stats.temporary} deferred={stats.deferred}"
            )
            # Deferred rows aren't a failure: a later pass sends them when they are due.
            if stats.temporary:
                raise SystemExit(1)
        except (BrokerUnavailable, DatabaseUnavailable, ConfigurationError) as exc:
            raise CommandError(worker.transport.redact(str(exc))) from None
