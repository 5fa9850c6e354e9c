"""A relay of a build that never refused an unsafe stream, for the
reconciliation scenarios: it relays what is pending into whatever stream
there is (an ``interest`` one an operator made by hand, say), once, and
exits. Run as ``python -m tests.chaos.oldrelay`` with the scenario's
environment; prints ``relayed=N``."""

from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django_platformkit.broker.transport import Transport
    from django_platformkit.outbox.relay import Relay

    transport = Transport()
    transport.connect()
    try:
        transport.stream_info()  # which stream: what the stamp records (no standing judged)
        stats = Relay(transport).drain()
    finally:
        transport.close()
    print(f"relayed={stats.stored}", flush=True)


if __name__ == "__main__":
    main()
