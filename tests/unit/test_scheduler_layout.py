"""Declarations and runtime live apart (``jobs.py`` / ``scheduler.py``): a web
process that declares jobs never loads the scheduler, and the names users
imported from ``django_platformkit.jobs`` before the split still resolve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import sys
import django
django.setup()
import django_platformkit.jobs  # what apps.ready() and the admin import
print("scheduler loaded", "django_platformkit.scheduler" in sys.modules)
from django_platformkit.jobs import Scheduler
print("after import", "django_platformkit.scheduler" in sys.modules)
"""


def test_setting_django_up_with_jobs_declared_does_not_load_the_scheduler():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "NATS_URL", "PLATFORMKIT_TEST_DB_NAME")}
    env.update(DJANGO_SETTINGS_MODULE="tests.settings", PLATFORMKIT_TEST_SERVICES="none", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["scheduler loaded False", "after import True"], result.stdout


@pytest.mark.parametrize(
    "name", ["Scheduler", "DatabaseClock", "SystemClock", "Clock", "SLOT_AHEAD_TOLERANCE_SECONDS", "STOP_GRACE_SECONDS"]
)
def test_the_runtime_names_stay_importable_from_jobs(name):
    from django_platformkit import jobs, scheduler

    assert getattr(jobs, name) is getattr(scheduler, name)


def test_an_unknown_name_on_jobs_is_still_an_attribute_error():
    from django_platformkit import jobs

    with pytest.raises(AttributeError, match="has no attribute 'Schedular'"):
        jobs.Schedular
