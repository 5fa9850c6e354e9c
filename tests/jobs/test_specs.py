"""Declarations and runtime live apart (``jobs/specs.py`` / ``jobs/scheduler.py``):
a web process that declares jobs never loads the scheduler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import sys
import django
django.setup()
import django_platformkit.jobs.specs  # what apps.ready() and the admin import
print("scheduler loaded", "django_platformkit.jobs.scheduler" in sys.modules)
from django_platformkit.jobs.scheduler import Scheduler
print("after import", "django_platformkit.jobs.scheduler" in sys.modules)
"""


@pytest.mark.process
def test_setting_django_up_with_jobs_declared_does_not_load_the_scheduler():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL", "PLATFORMKIT_TEST_DB_NAME")}
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", PLATFORMKIT_TEST_SERVICES="none", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["scheduler loaded False", "after import True"], result.stdout
