"""A relay process for the 1-vs-2-process measurement: sets up, says
``ready``, waits for ``go`` on stdin, drains the outbox once and prints
``{"stored": N, "started": t, "finished": t, "cpu_seconds": s}``
(time.time(); this process's CPU time while draining), so process start-up
is outside the measured span."""

import json
import os
import resource
import sys
import time


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.db import connection

    from django_platformkit.broker.transport import Transport
    from django_platformkit.outbox.relay import Relay

    transport = Transport(name="bench relay")
    transport.connect()
    transport.ensure_stream()
    relay = Relay(transport)
    connection.ensure_connection()
    print("ready", flush=True)
    sys.stdin.readline()
    cpu_before = _cpu_seconds()
    started = time.time()
    stats = relay.drain()
    finished = time.time()
    cpu = _cpu_seconds() - cpu_before
    print(
        json.dumps(
            {
                "stored": stats.stored,
                "temporary": stats.temporary,
                "started": started,
                "finished": finished,
                "cpu_seconds": cpu,
            }
        ),
        flush=True,
    )
    transport.close()


if __name__ == "__main__":
    main()
