"""Fixtures of the fault-injection suite: one PostgreSQL server for the
session (a database per scenario, cloned from a migrated template) and NATS
servers per scenario, all throwaway children of this process on loopback
ports, so a scenario can kill and restart them."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest

from django_platformkit.devservices import NatsServer, PostgresServer

pytest.register_assert_rewrite("tests.chaos.harness")  # its asserts explain themselves like a test's

from .harness import REPORTED, ROOT, Rig  # noqa: E402

TEMPLATE_DB = "chaos_template"


def _url(server: PostgresServer, database: str) -> str:
    return server.url.rsplit("/", 1)[0] + "/" + database


@pytest.fixture(scope="session")
def chaos_postgres():
    server = PostgresServer().start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
        env = Rig(
            "migrate",
            database_url=_url(server, TEMPLATE_DB),
            nats_urls="nats://127.0.0.1:1",
            workdir=server.root / "migrate",
        ).env()
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "manage.py"), "migrate", "-v0"], env=env, cwd=ROOT, check=True
        )
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def scenario_database(chaos_postgres):
    """A fresh, migrated database for one scenario; its URL."""
    name = f"chaos_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(chaos_postgres.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    yield _url(chaos_postgres, name)
    with psycopg.connect(chaos_postgres.url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def nats_server():
    server = NatsServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def make_rig(scenario_database, tmp_path, request):
    """``make_rig(name, nats_urls, **env)``: the scenario's rig; every process
    it started is stopped at teardown, and their logs are shown on failure."""
    rigs: list[Rig] = []

    def make(name: str, nats_urls: str, **settings_env: Any) -> Rig:
        rig = Rig(name, database_url=scenario_database, nats_urls=nats_urls, workdir=tmp_path / name, **settings_env)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.stop_all()


def pytest_terminal_summary(terminalreporter):
    if REPORTED:
        terminalreporter.section("chaos scenarios")
        for line in REPORTED:
            terminalreporter.write_line(line)
