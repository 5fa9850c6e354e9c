"""The scheduler and the heartbeat start before the broker is reached and
never wait for it: a worker started while NATS is down runs its jobs (they
need only PostgreSQL), is listed as waiting for the broker, and logs the
wait as one line, then one a minute - not an ERROR every ~3 s."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from django.db import connection

from django_platformkit.devservices import free_port
from django_platformkit.models import WorkerHeartbeat, WorkerState
from tests.conftest import manage, wait_for, worker_env
from tests.testapp._jobs import RUNS_TABLE, RUNS_TABLE_DDL

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def runs(django_db_blocker):
    """The table the test app's jobs record their runs in."""
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(RUNS_TABLE_DDL)
    yield
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {RUNS_TABLE}")


def job_runs() -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {RUNS_TABLE} WHERE job = 'testapp.every_second'")
        return cursor.fetchone()[0]


@pytest.mark.process
def test_a_worker_started_with_nats_down_runs_its_jobs_beats_and_logs_the_wait_once(broker, runs, tmp_path):
    """Issue 27: 0 runs of an every-second job in 30 s, no heartbeat (the
    worker invisible on the overview) and an ERROR every ~3 s, until NATS answered."""
    port = free_port()
    env = worker_env(broker, NATS_URL=f"nats://127.0.0.1:{port}", PLATFORMKIT_TEST_JOBS="1")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = manage("runworker", "--job", "testapp.every_second", env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: job_runs() >= 5, timeout=60, what="five runs of the every-second job with NATS down")
        row = wait_for(lambda: WorkerHeartbeat.objects.filter(stopped_at=None).first(), timeout=10, what="a heartbeat")
        assert row.state == WorkerState.WAITING_FOR_BROKER
        assert f"NATS server at nats://127.0.0.1:{port}" in row.detail
        time.sleep(5)  # a few more retries: still one line
        text = log.read_text()
        waiting = [line for line in text.splitlines() if "waiting for NATS server at" in line]
        assert len(waiting) == 1, text
        assert "jobs and the heartbeat run meanwhile" in waiting[0]
        assert "nats unreachable" not in text and "Traceback" not in text
        row.refresh_from_db()
        assert row.last_seen > row.started_at  # it beats on
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log.read_text()
    row.refresh_from_db()
    assert row.stopped_at is not None and row.state == WorkerState.WAITING_FOR_BROKER


def test_the_waiting_log_is_one_line_then_one_a_minute_with_the_time_waited(caplog):
    import logging

    from django_platformkit._retry import WaitingLog

    now = [100.0]
    log = logging.getLogger("django_platformkit.tests.waiting")
    waiting = WaitingLog(log, "NATS server at nats://h:4222", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger=log.name)
    for _ in range(20 * 60):  # twenty minutes of a retry every second
        waiting.failed("connection refused", meanwhile="jobs run")
        now[0] += 1.0
    waiting.done()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + 19 + 1, lines
    assert lines[0] == "waiting for NATS server at nats://h:4222 error=connection refused; jobs run"
    assert lines[1] == "still waiting for NATS server at nats://h:4222 waited=60s error=connection refused"
    assert lines[-1] == "NATS server at nats://h:4222 reached after waited=1200s"
