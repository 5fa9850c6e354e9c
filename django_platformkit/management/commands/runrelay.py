"""``manage.py runrelay``: the relay alone (pending outbox rows -> JetStream)."""

import threading

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import BrokerUnavailable, ConfigurationError

from ...relay import Relay
from ...transport import Transport
from ._base import configure_logging


class Command(BaseCommand):
    help = "Relay pending outbox rows to NATS JetStream. Several relays may run at once (SKIP LOCKED)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Relay what is pending now, print the count and exit.")
        parser.add_argument("--connect-timeout", type=float, default=30.0, metavar="SECONDS", help="With --once: fail if NATS can't be reached within SECONDS (default 30).")

    def handle(self, *args, **options):
        import signal

        configure_logging(options["verbosity"])
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        signal.signal(signal.SIGINT, lambda *a: stop.set())
        transport = Transport(name="django_platformkit relay")
        try:
            if not transport.connect_until(stop, give_up_after_seconds=options["connect_timeout"] if options["once"] else None):
                return
            transport.ensure_stream()
            relay = Relay(transport)
            if options["once"]:
                stats = relay.drain()
                self.stdout.write(f"relayed={stats.stored} duplicates={stats.duplicates} dead_lettered={stats.dead_lettered} left_pending={stats.temporary}")
                if stats.temporary:
                    raise SystemExit(1)
                return
            relay.run(stop)
        except (BrokerUnavailable, ConfigurationError) as exc:
            raise CommandError(str(exc)) from None
        finally:
            transport.close()
