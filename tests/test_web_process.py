"""A web process never imports the broker client: importing the package,
``django.setup()`` (which imports every app's ``platformkit.py``) and the
modules ``publish()`` runs leave ``nats`` unimported. Only the worker's
transport imports it (DESIGN.md: the sync/async boundary is in one place)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import sys

def loaded():
    return sorted(m for m in sys.modules if m == "nats" or m.startswith("nats."))

import django_platformkit
print("package", loaded())
import django
django.setup()
print("setup", loaded())
from django_platformkit import EventType, ReceivedEvent, declare, job, publish, publish_many, replay, subscribe
import django_platformkit.outbox.events, django_platformkit.outbox.payload, django_platformkit.wire
import django_platformkit.consume.subscriptions, django_platformkit.operate.deadletters
print("publish", loaded())
import django_platformkit.consume.consumer, django_platformkit.consume.claim, django_platformkit.consume.handler, django_platformkit.consume.outcome
print("consumer", loaded())
import django_platformkit.broker.transport
print("transport", loaded()[:1])
"""


@pytest.mark.process
def test_importing_the_package_setting_django_up_and_publishing_never_import_nats():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL", "PLATFORMKIT_TEST_DB_NAME")}
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", PLATFORMKIT_TEST_SERVICES="none", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["package"] == "[]", result.stdout
    assert lines["setup"] == "[]", result.stdout
    assert lines["publish"] == "[]", result.stdout
    # The consumer takes its transport as a type only: its stages import no nats either.
    assert lines["consumer"] == "[]", result.stdout
    # The probe sees nats when it is there: the worker's transport imports it.
    assert lines["transport"] == "['nats']", result.stdout
