"""``manage.py runworker``: relay + every subscription's consumer + the scheduler.

With ``--processes N`` (or ``auto``: one per usable core): a small
supervisor (this process) runs the relay and the scheduler in one child and
the consumers in N more (see ``django_platformkit.runtime.supervisor``),
serves one ``/metrics`` for them all with ``--metrics-port``, and with
``--burst`` lets every consumer child drain, then exits.
"""

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError, ConsumerDrift
from django_platformkit.management.commands._base import (
    add_metrics_options,
    command_version,
    configure_logging,
    import_urlconf,
    positive,
    result_printed_once,
    serve_tree_metrics,
    start_metrics,
    tcp_port,
)


def processes_wanted(value: Any) -> int | None:
    """``--processes``: a whole number above 0, or ``auto`` (one consumer
    process per usable core); None (not given) as it is. Anything else is a
    ``CommandError`` that says what to write."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        from django_platformkit.runtime.supervisor import usable_cores

        return usable_cores()
    try:
        return int(positive("--processes", value, unit="processes", whole=True, example="auto"))
    except CommandError:
        raise CommandError(
            f"--processes {value}: --processes takes a whole number above 0 or auto, e.g. --processes auto "
            "(one consumer process per usable core)."
        ) from None


class Command(BaseCommand):
    get_version = command_version  # --version: this release's, not only Django's
    help = (
        "Run the relay, every subscription's durable consumer and the job scheduler in one process "
        "(or, with --processes N or --processes auto, the relay and scheduler in one child and the consumers in N "
        "more, or one per usable core). "
        "SIGTERM/SIGINT finish in-flight handlers, ack them and exit 0."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--burst",
            action="store_true",
            help="Drain the outbox and every consumer (nothing pending, awaiting ack or retry), run no jobs, then exit 0 "
            "(with --processes: every consumer process drains and exits, the relay process relays until they have).",
        )
        parser.add_argument(
            "--burst-timeout",
            type=float,
            default=None,
            metavar="SECONDS",
            help="With --burst: give up and exit 1 if not drained after SECONDS (default: wait).",
        )
        parser.add_argument(
            "--connect-timeout",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="With --burst: fail if NATS can't be reached within SECONDS (default 30; without --burst the worker waits for NATS).",
        )
        parser.add_argument(
            "--no-relay", action="store_true", help="Don't run the relay (run it elsewhere with runrelay)."
        )
        parser.add_argument("--no-jobs", action="store_true", help="Don't run periodic jobs in this process.")
        parser.add_argument(
            "--no-consumers", action="store_true", help="Don't consume (run only the relay and/or the scheduler)."
        )
        parser.add_argument(
            "--job",
            action="append",
            default=None,
            metavar="NAME",
            help="Run only this periodic job (repeatable; default: all).",
        )
        parser.add_argument(
            "--subscription",
            action="append",
            default=None,
            metavar="NAME",
            help="Run only this subscription's consumer (repeatable; default: all).",
        )
        add_metrics_options(parser)
        parser.add_argument(
            "--queue",
            action="append",
            default=None,
            metavar="NAME",
            help="Run only this django.tasks queue's tasks (repeatable; with --subscription, both; default: every subscription and queue).",
        )
        parser.add_argument(
            "--health-file",
            default=None,
            metavar="PATH",
            help="Rewrite PATH every second with JSON liveness and counts (for probes).",
        )
        parser.add_argument(
            "--processes",
            default=None,
            metavar="N|auto",
            help="Run the relay and scheduler in one child process and the consumers in N child processes under this one "
            "(uses the cores: one Python process uses one); auto: one consumer process per usable core, the "
            "recommendation for production. One SIGTERM/SIGINT stops them all; a child that dies is restarted with "
            "backoff, and the supervisor exits 1 if one keeps dying. With --metrics-port this process serves one "
            "/metrics for them all; with --burst every consumer process drains, then all exit. A concurrency=1 "
            "subscription keeps its order only within one process: see the ordering docs.",
        )
        parser.add_argument(
            "--max-handlings-per-process",
            default=None,
            metavar="K",
            help="With --processes: replace a consumer process after K handlings (Celery's --max-tasks-per-child). "
            "It stops fetching, finishes and acks what it holds, hands back what it fetched and did not start "
            "(not an attempt), exits, and a fresh one starts at once. Default: never.",
        )
        parser.add_argument(
            "--max-memory-per-process",
            default=None,
            metavar="MIB",
            help="With --processes: replace a consumer process, as --max-handlings-per-process does, once its "
            "resident memory exceeds MIB mebibytes (Celery's --max-memory-per-child). Default: never.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        configure_logging(options["verbosity"])
        from django_platformkit.runtime.worker import Worker

        burst_timeout = positive(
            "--burst-timeout", options["burst_timeout"], omitted="leave it out to wait until drained"
        )
        connect_timeout = positive("--connect-timeout", options["connect_timeout"], omitted="the default is 30")
        tcp_port("--metrics-port", options["metrics_port"])
        processes = processes_wanted(options["processes"])
        max_handlings = positive(
            "--max-handlings-per-process",
            options.get("max_handlings_per_process"),
            unit="handlings",
            whole=True,
            example="1000",
        )
        max_memory = positive(
            "--max-memory-per-process", options.get("max_memory_per_process"), unit="MiB", example="512"
        )
        if (max_handlings is not None or max_memory is not None) and processes is None:
            raise CommandError(
                "--max-handlings-per-process and --max-memory-per-process replace consumer processes, which only "
                "--processes N has: add --processes 1 (or more)."
            )

        if options["health_file"]:
            import os

            folder = os.path.dirname(os.path.abspath(options["health_file"]))
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise CommandError(
                    f"--health-file {options['health_file']}: the folder {folder} doesn't exist or isn't writable."
                )
        from django_platformkit.consume.subscriptions import subscriptions

        import_urlconf()
        subs = subscriptions()
        if options["subscription"]:
            known = {s.name: s for s in subs}
            missing = sorted(set(options["subscription"]) - set(known))
            if missing:
                raise CommandError(
                    f"unknown subscription(s) {', '.join(missing)}; known: {', '.join(sorted(known)) or '(none)'}"
                )
            subs = [known[n] for n in options["subscription"]]
        if options["queue"]:
            from django_platformkit.tasks.registry import queue_subscriptions

            try:
                queued = queue_subscriptions(options["queue"])
            except ConfigurationError as exc:
                raise CommandError(str(exc)) from None
            picked = subs if options["subscription"] else []
            subs = picked + [s for s in queued if s not in picked]
        if options["job"]:
            from django_platformkit.jobs.specs import jobs

            missing = sorted(set(options["job"]) - {j.name for j in jobs()})
            if missing:
                raise CommandError(
                    f"unknown job(s) {', '.join(missing)}; known: {', '.join(j.name for j in jobs()) or '(none)'}"
                )
        self._refuse_what_does_nothing(options, subs)
        if processes is not None and options["no_consumers"]:
            raise CommandError("--processes N runs N consumer processes; drop --no-consumers (or --processes).")
        from django_platformkit.runtime.options import WorkerOptions
        from django_platformkit.runtime.recycle import RecyclePolicy

        wanted = WorkerOptions(
            relay=not options["no_relay"],
            consumers=not options["no_consumers"],
            scheduler=not options["no_jobs"],
            burst=options["burst"],
            subscriptions=subs,
            jobs=options["job"],
            health_file=options["health_file"],
            burst_timeout_seconds=burst_timeout,
            connect_timeout_seconds=connect_timeout,
            recycle=RecyclePolicy(max_handlings, max_memory)
            if max_handlings is not None or max_memory is not None
            else None,
        )
        if processes is not None:
            from django_platformkit.runtime.supervisor import Supervisor

            supervisor = Supervisor(wanted, processes=processes)
            try:
                supervisor.refuse_what_no_child_could_run()
            except ConfigurationError as exc:
                raise CommandError(str(exc)) from None
            if options["metrics_port"] is not None:
                supervisor.metrics = serve_tree_metrics(
                    options["metrics_port"], host=options["metrics_host"], subscriptions=subs
                )
            supervisor.install_signal_handlers()
            try:
                code = supervisor.run()
            finally:
                if supervisor.metrics is not None:  # run() closes it too; this covers a run that raised
                    supervisor.metrics.close()
            if options["burst"] and options["verbosity"] >= 1:
                self.stdout.write(f"exit={code} processes={processes}")
            if code:
                raise SystemExit(code)
            return
        try:
            worker = Worker(wanted)
        except ConfigurationError as exc:  # a subscription's rate limit it can't read (the checks say so too)
            raise CommandError(str(exc)) from None
        if options["metrics_port"] is not None:
            start_metrics(
                options["metrics_port"], host=options["metrics_host"], transport=worker.transport, subscriptions=subs
            )
        worker.install_signal_handlers()
        try:
            with result_printed_once(
                "django_platformkit.runtime.worker",
                *(["worker stopped "] if options["burst"] and options["verbosity"] >= 1 else []),
            ):
                code = worker.run()
        except (ConsumerDrift, BrokerUnavailable, ConfigurationError) as exc:
            raise CommandError(str(exc)) from None
        if options["burst"] and options["verbosity"] >= 1:
            counts = worker.counts()
            self.stdout.write(f"exit={code} " + " ".join(f"{k}={v}" for k, v in counts.items()))
        if code:
            raise SystemExit(code)

    @staticmethod
    def _refuse_what_does_nothing(options: dict[str, Any], subs: list[Any]) -> None:
        """Refuse an option that another one cancels (it was ignored without a
        word) and a worker left with nothing to run (it ran, or burst and exited
        0, doing nothing: a probe saw a healthy worker)."""
        if options["burst_timeout"] is not None and not options["burst"]:
            raise CommandError("--burst-timeout only limits --burst: add --burst, or drop --burst-timeout.")
        if options["job"] and (options["no_jobs"] or options["burst"]):
            other = "--no-jobs runs no jobs" if options["no_jobs"] else "--burst runs no jobs"
            raise CommandError(f"--job picks the jobs to run, but {other}: drop one of the two.")
        if (options["subscription"] or options["queue"]) and options["no_consumers"]:
            raise CommandError(
                "--subscription and --queue pick the consumers to run, but --no-consumers runs none: drop one of them."
            )
        relay = not options["no_relay"]
        consumers = not options["no_consumers"] and bool(subs)
        scheduler = not options["no_jobs"] and not options["burst"]
        if not (relay or consumers or scheduler):
            left_out = ["--no-relay"]
            left_out.append("--no-consumers" if options["no_consumers"] else "no subscription or task queue declared")
            left_out.append("--burst (which runs no jobs)" if options["burst"] else "--no-jobs")
            raise CommandError(
                f"nothing to run: {', '.join(left_out)}. Drop one of them (the relay alone is `runrelay`)."
            )
