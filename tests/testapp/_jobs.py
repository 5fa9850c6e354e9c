"""Periodic jobs for the worker processes tests/jobs/test_scheduler.py starts. Imported
only when PLATFORMKIT_TEST_JOBS is set, so other tests' workers never run
them. Each run is one row in the test's runs table (created by the test)."""

import os
import time
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from django_platformkit.jobs.specs import current_slot, job

RUNS_TABLE = "pk_test_job_runs"
#: The runs table as the tests that start these jobs make it (``seen``: the job's own
#: clock; ``slot`` NULL for a run asked for by hand, which has no slot).
RUNS_TABLE_DDL = (
    f"CREATE TABLE {RUNS_TABLE} (job text NOT NULL, slot timestamptz, pid int NOT NULL, "
    "at timestamptz NOT NULL DEFAULT clock_timestamp(), seen timestamptz)"
)


def record(name: str) -> int:
    """Note this run (job, slot, pid, and ``timezone.now()``: the job's own
    clock); return how many runs the job has had."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {RUNS_TABLE} (job, slot, pid, seen) VALUES (%s, %s, %s, %s)",
            [name, current_slot(), os.getpid(), timezone.now()],
        )
        cursor.execute(f"SELECT count(*) FROM {RUNS_TABLE} WHERE job = %s", [name])
        return cursor.fetchone()[0]


@job(every=timedelta(seconds=1), name="testapp.every_second")
def every_second():
    record("testapp.every_second")


@job(every=timedelta(seconds=1), name="testapp.hangs_first")
def hangs_first():
    # The first run hangs (the test kills its worker); later runs are quick.
    if record("testapp.hangs_first") == 1:
        time.sleep(120)


@job(every=timedelta(seconds=1), name="testapp.always_fails")
def always_fails():
    record("testapp.always_fails")
    raise RuntimeError("the report server refused the upload")


@job(cron="0 3 * * *", name="testapp.nightly")
def nightly():
    # Its slot is 03:00: a test's runs of it are the ones asked for by hand.
    record("testapp.nightly")


@job(cron="0 3 * * *", name="testapp.nightly_fails")
def nightly_fails():
    record("testapp.nightly_fails")
    raise RuntimeError("report server down")
