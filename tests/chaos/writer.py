"""A writer process for the fault-injection suite: publishes ``--count``
``testapp.order_placed`` events in transactions of 1 to ``--max-batch``
events, paced to take about ``--seconds``, the way request handlers would.

Run as ``python -m tests.chaos.writer`` with DATABASE_URL pointing at the
scenario's database. Prints ``published=N`` and exits 0 when done.
"""

from __future__ import annotations

import argparse
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--writer", type=int, required=True, help="this writer's number (in every payload)")
    parser.add_argument("--count", type=int, required=True, help="events to publish")
    parser.add_argument("--seconds", type=float, default=0.0, help="spread the events over about this long")
    parser.add_argument("--max-batch", type=int, default=20, help="most events per transaction")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.db import InterfaceError, OperationalError, connection, transaction

    from django_platformkit import publish

    rng = random.Random(args.writer)
    started = time.monotonic()
    published = 0
    while published < args.count:
        size = min(rng.randint(1, args.max_batch), args.count - published)
        try:
            with transaction.atomic():
                for i in range(size):
                    tenant = rng.choice([None, "acme", "globex"])
                    publish("testapp.order_placed", {"writer": args.writer, "n": published + i}, tenant=tenant)
        except (OperationalError, InterfaceError):
            # A scenario terminated our session: the transaction rolled back
            # (or, if the commit itself was cut, may have landed: the suite
            # counts what the outbox holds). Reconnect and write it again, as
            # a client retrying a failed request would.
            connection.close()
            time.sleep(0.1)
            continue
        published += size
        # Pace: stay on the straight line from 0 to --count over --seconds.
        ahead = published / args.count * args.seconds - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)
    print(f"published={published}", flush=True)


if __name__ == "__main__":
    main()
