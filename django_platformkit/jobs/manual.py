"""A run of a periodic job asked for by hand (``jobs.controls.request_run``),
in a run thread of its own: under the job's advisory lock, so never beside
a slot's run or another manual run on any worker; the request is taken in
the same breath (one worker runs it), recorded as manual with its actor,
and the slot ledger never sees it, so the schedule's slots stay as they
were. A slot that falls due while a manual run holds the lock is skipped,
as during any long run: a job never runs twice at once.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db import connections

from django_platformkit.jobs.controls import claim_run, finish_run
from django_platformkit.jobs.slots import JobRunner, SlotRun, run_job
from django_platformkit.outage import database_unavailable

logger = logging.getLogger(__name__)


def run_by_hand(slots: SlotRun, runner: JobRunner) -> None:
    """Take the job's lock and, if the run asked for is still there, run
    it; never raises (a failure is logged and recorded on the job's
    controls). A run of the job going on elsewhere keeps the request for a
    later tick."""
    spec = runner.spec
    try:
        with slots.locked(runner) as connection:
            if connection is None:
                logger.debug("run asked for waits: the job runs now name=%s", spec.name)
                return
            claimed = claim_run(connection, spec.name)
            if claimed is None:
                return  # another worker took it
            started_at, actor, reason = claimed
            logger.info("job run by hand started name=%s actor=%s reason=%s", spec.name, actor, reason)
            error, duration = run_job(spec, slot=None, manual_by=actor)
            _record(connection, runner, started_at, error, duration)
    except Exception:
        logger.exception("job run by hand failed before the job ran name=%s", spec.name)
        runner.close_connection()
    finally:
        connections.close_all()


def _record(connection: Any, runner: JobRunner, started_at: datetime, error: str, duration: float) -> None:
    import psycopg

    name = runner.spec.name
    try:
        recorded = finish_run(connection, name, started_at, error)
    except psycopg.Error as exc:
        if not database_unavailable(exc):
            logger.error("job run by hand: outcome not recorded name=%s error=%s", name, exc)
            return
        recorded = False
    if not recorded:
        logger.error(
            "job run by hand lost its database session during the run name=%s duration=%.3fs: its outcome is not "
            "recorded",
            name,
            duration,
        )
        runner.close_connection()
    elif not error:
        logger.info("job run by hand finished name=%s duration=%.3fs", name, duration)
