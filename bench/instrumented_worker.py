"""``manage.py runworker`` with counters, for bench/profile_trickle.py:
names each thread in the OS (``/proc/<pid>/task/<tid>/comm``: "relay",
"consumer-0", "nats", ...) so its CPU can be read per thread, and counts
relay passes (rows per pass), consumer units (deliveries per unit) and the
NATS connection's messages. ``SIGUSR1`` writes the counters as JSON to
``BENCH_STATS_FILE``. A diagnostic: nothing in the package changes; the
names it wraps are the internal ones listed in ``WRAPPED``.

    python bench/instrumented_worker.py runworker -v 0
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
from pathlib import Path

#: The internal names this diagnostic wraps (to fix after a package re-layout).
WRAPPED = (
    "django_platformkit.outbox.relay.Relay.relay_batch",
    "django_platformkit.consume.consumer.Consumer.handle",
    "django_platformkit.broker.transport.Transport.connect",
)

_libc = ctypes.CDLL(None)
_PR_SET_NAME = 15


def _name_os_threads() -> None:
    original = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(self: threading.Thread) -> None:
        name = self.name.removeprefix("platformkit-")[:15].encode()
        _libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        original(self)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]


def _count() -> None:
    from django_platformkit.broker.transport import Transport
    from django_platformkit.consume.consumer import Consumer
    from django_platformkit.outbox.relay import Relay

    stats = {"relay_passes": 0, "relay_rows": 0, "relay_empty": 0, "units": 0, "deliveries": 0}
    transports: list[Transport] = []
    lock = threading.Lock()

    relay_batch = Relay.relay_batch

    def counted_batch(self, *args, **kwargs):
        result = relay_batch(self, *args, **kwargs)
        with lock:
            stats["relay_passes"] += 1
            stats["relay_rows"] += result.selected
            stats["relay_empty"] += not result.selected
        return result

    handle = Consumer.handle

    def counted_handle(self, deliveries, *args, **kwargs):
        with lock:
            stats["units"] += 1
            stats["deliveries"] += len(deliveries)
        return handle(self, deliveries, *args, **kwargs)

    connect = Transport.connect

    def remembered_connect(self, *args, **kwargs):
        transports.append(self)
        return connect(self, *args, **kwargs)

    Relay.relay_batch = counted_batch
    Consumer.handle = counted_handle
    Transport.connect = remembered_connect

    def dump(signum, frame) -> None:
        out = dict(stats)
        for key in ("in_msgs", "out_msgs", "in_bytes", "out_bytes", "flush_queue"):
            out[f"nats_{key}"] = 0
        for transport in transports:
            nc = transport.connection.nc
            if nc is not None:
                for key in ("in_msgs", "out_msgs", "in_bytes", "out_bytes"):
                    out[f"nats_{key}"] += int(nc.stats.get(key, 0))
        out["threads"] = {t.native_id: t.name for t in threading.enumerate()}
        Path(os.environ["BENCH_STATS_FILE"]).write_text(json.dumps(out))

    signal.signal(signal.SIGUSR1, dump)


def main() -> None:
    # Last: a PYTHONPATH entry holding another tree's django_platformkit (an A/B) wins over this one.
    sys.path.append(str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    _name_os_threads()
    import django

    django.setup()
    _count()
    from django.core.management import execute_from_command_line

    execute_from_command_line(["manage.py", *sys.argv[1:]])


if __name__ == "__main__":
    main()
