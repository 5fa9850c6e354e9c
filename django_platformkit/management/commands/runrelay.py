"""``manage.py runrelay``: the relay alone (pending outbox rows -> JetStream)."""

import logging
import threading
import time

from django.core.management.base import BaseCommand, CommandError

from ... import conf
from ...exceptions import BrokerUnavailable, ConfigurationError, DatabaseUnavailable
from ...identity import database_identity
from ...outage import database_unavailable, is_database_error
from ...relay import Relay
from ...transport import Transport
from ._base import configure_logging, start_metrics

logger = logging.getLogger("django_platformkit.relay")


def ensure_stream_until(transport: Transport, stop: threading.Event, give_up_at: float | None) -> bool:
    """Create or check the stream, retrying while the broker can't answer
    (JetStream starting, a cluster electing its leader) - as the worker
    does. Returns False if ``stop`` was set first. Raises
    ``BrokerUnavailable`` past ``give_up_at`` (monotonic seconds), and
    ``ConfigurationError`` at once."""
    delay = 0.5
    while not stop.is_set():
        try:
            # The owner check needs the database: an outage there is waited out too.
            transport.ensure_stream(owner=database_identity())
            return True
        except (BrokerUnavailable, DatabaseUnavailable, TimeoutError) as exc:
            why = transport.redact(str(exc) or type(exc).__name__)
            if give_up_at is not None and time.monotonic() + delay > give_up_at:
                raise BrokerUnavailable(f"the stream {conf.settings.STREAM} is not available: {why}") from exc
            logger.error("stream %s not available error=%s; retrying in %.1fs", conf.settings.STREAM, why, delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)
    return False


class Command(BaseCommand):
    help = "Relay pending outbox rows to NATS JetStream. Several relays may run at once (SKIP LOCKED)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Relay what is pending now, print the count and exit.")
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            metavar="PORT",
            help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics (needs the metrics extra).",
        )
        parser.add_argument(
            "--connect-timeout",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="With --once: fail if NATS or its stream can't be reached within SECONDS (default 30).",
        )

    def handle(self, *args, **options):
        import signal

        configure_logging(options["verbosity"])
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        signal.signal(signal.SIGINT, lambda *a: stop.set())
        if options["metrics_port"] is not None:
            start_metrics(options["metrics_port"])
        transport = Transport(name="django_platformkit relay")
        give_up_at = time.monotonic() + options["connect_timeout"] if options["once"] else None
        try:
            if not transport.connect_until(
                stop, give_up_after_seconds=options["connect_timeout"] if options["once"] else None
            ):
                return
            if not ensure_stream_until(transport, stop, give_up_at):
                return
            relay = Relay(transport)
            if options["once"]:
                try:
                    stats = relay.drain()
                except Exception as exc:
                    if not is_database_error(exc):
                        raise
                    # A script's step: fail it with the reason, not a traceback; the rows stay pending.
                    what = "unavailable" if database_unavailable(exc) else "refusing the relay's queries"
                    raise CommandError(
                        f"the database is {what}, nothing was relayed (rows stay pending): {' '.join(str(exc).split())}"
                    ) from None
                self.stdout.write(
                    f"relayed={stats.stored} duplicates={stats.duplicates} dead_lettered={stats.dead_lettered} left_pending={stats.temporary}"
                )
                if stats.temporary:
                    raise SystemExit(1)
                return
            relay.run(stop)
        except (BrokerUnavailable, DatabaseUnavailable, ConfigurationError) as exc:
            raise CommandError(transport.redact(str(exc))) from None
        finally:
            transport.close()
