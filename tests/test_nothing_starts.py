"""Importing the test settings and setting Django up starts no server and
opens no connection: the unit tests (this folder, ``-m unit``) run on a
machine with no PostgreSQL and no NATS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import os, sys
import django
django.setup()
from django.conf import settings
import tests.conftest  # the fixtures module too: defining fixtures starts nothing
children = []
for task in os.listdir(f"/proc/{os.getpid()}/task"):
    with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
        children += f.read().split()
print("children", len(children))
print("db", settings.DATABASES["default"]["PORT"])
print("nats", settings.PLATFORMKIT["NATS_URL"])
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts child processes through /proc (Linux)")
def test_django_setup_with_the_test_settings_starts_no_server_and_points_at_closed_ports():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL", "PLATFORMKIT_TEST_DB_NAME")}
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", PLATFORMKIT_TEST_SERVICES="none", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["children"] == "0", result.stdout  # no postgres, no nats-server
    assert lines["db"] == "1", result.stdout
    assert lines["nats"] == "nats://127.0.0.1:1", result.stdout


def test_a_test_that_needs_servers_is_told_how_to_run_when_services_are_disabled(monkeypatch):
    from tests.services import ServicesDisabled, ensure_services

    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("PLATFORMKIT_TEST_SERVICES", "none")
    with pytest.raises(ServicesDisabled, match="run only `-m unit` tests"):
        ensure_services()
