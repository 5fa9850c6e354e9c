"""``manage.py runrelay``: the relay alone (pending outbox rows -> JetStream)."""

import threading

from django.core.management.base import BaseCommand

from ...relay import Relay
from ...transport import Transport
from ._base import configure_logging


class Command(BaseCommand):
    help = "Relay pending outbox rows to NATS JetStream. Several relays may run at once (SKIP LOCKED)."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="Relay what is pending now, print the count and exit.")

    def handle(self, *args, **options):
        import signal

        configure_logging(options["verbosity"])
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *a: stop.set())
        signal.signal(signal.SIGINT, lambda *a: stop.set())
        transport = Transport(name="django_platformkit relay")
        if not transport.connect_until(stop):
            return
        try:
            transport.ensure_stream()
            relay = Relay(transport)
            if options["once"]:
                stats = relay.drain()
                self.stdout.write(f"relayed={stats.stored} duplicates={stats.duplicates} dead_lettered={stats.dead_lettered} left_pending={stats.temporary}")
                if stats.temporary:
                    raise SystemExit(1)
                return
            relay.run(stop)
        finally:
            transport.close()
