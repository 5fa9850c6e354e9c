"""The example project works from a fresh clone: its own tests pass, and the
demo, with no DATABASE_URL / NATS_URL, starts throwaway servers, pushes
orders through the real view and worker, reports every count as expected
and deletes the servers afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import django
import pytest

from .conftest import ROOT

MANAGE = ROOT / "example_project" / "manage.py"


def run_manage(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != "DJANGO_SETTINGS_MODULE"}  # the suite's; manage.py sets its own
    return subprocess.run(
        [sys.executable, str(MANAGE), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.process
def test_the_shop_apps_own_tests_pass_against_real_postgresql():
    # A database name of its own on the suite's server, so Django's test
    # runner creates and drops test_example_project, never the suite's.
    url = urlsplit(os.environ["DATABASE_URL"])
    env = dict(os.environ, DATABASE_URL=urlunsplit(url._replace(path="/example_project")))
    result = run_manage("test", "shop", "--noinput", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"Ran [1-9]\d* tests", result.stderr), result.stderr


@pytest.mark.process
def test_the_demo_on_an_empty_machine_places_relays_and_handles_every_order_once():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL")}
    result = run_manage("demo", "--orders", "20", env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"PostgreSQL\s+\S+\s+postgres://\S+\s+throwaway", out), out
    assert re.search(r"NATS\s+\S+\s+nats://\S+\s+throwaway", out), out
    tasks = django.VERSION >= (6, 0)  # send_receipt: a django.tasks task per order
    assert f"relayed={40 if tasks else 20} duplicates=0" in out, out
    assert re.search(rf"handled={60 if tasks else 40} skipped=0 retried=0 dead_lettered=0", out), out
    assert "MISMATCH" not in out
    assert ("20 send_receipt tasks ran once each" in out) == tasks, out
    assert (
        "OK: 20 orders, each published once, relayed once and handled exactly once by each of 2 subscriptions" in out
    ), out
    assert "stopped and deleted the throwaway servers" in out, out
