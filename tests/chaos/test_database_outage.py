"""PostgreSQL itself goes away - stopped for 10 s mid-stream, then started
again on the same port and data - and ``runrelay`` and ``runworker`` ride it
out without being restarted: every row relayed, every event handled exactly
once, no dead letter, both processes still running afterwards.

The scenario runs on a PostgreSQL server of its own (the session's server,
and the machine's, are never stopped)."""

from __future__ import annotations

import subprocess
import sys
import time

import psycopg
import pytest

from django_platformkit.devservices import PostgresServer

from .harness import ROOT, Rig, scaled

# 900 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


@pytest.fixture
def own_postgres(tmp_path):
    """A migrated database on a PostgreSQL server only this scenario uses: ``(server, url)``."""
    server = PostgresServer().start()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE outage")
        url = server.url.rsplit("/", 1)[0] + "/outage"
        env = Rig("migrate", database_url=url, nats_urls="nats://127.0.0.1:1", workdir=tmp_path / "migrate").env()
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "manage.py"), "migrate", "-v0"], env=env, cwd=ROOT, check=True
        )
        yield server, url
    finally:
        server.cleanup()


def test_postgresql_stopped_for_ten_seconds_mid_stream_is_ridden_out_by_relay_and_worker(
    own_postgres, nats_server, tmp_path
):
    server, url = own_postgres
    events = scaled(3_000)
    rig = Rig("database_restart", database_url=url, nats_urls=nats_server.url, workdir=tmp_path / "database_restart")
    try:
        relay = rig.relay()
        # A worker with its own relay (the LISTEN connection) and scheduler too:
        # every loop that reads the database must survive the restart.
        worker = rig.worker(1, relay=True, jobs=["platformkit.outbox_purge"])
        for process in (relay, worker):
            process.wait_for_log("started")
        writers = rig.writers(2, events, seconds=20)
        time.sleep(5.0)
        server.stop()
        rig.fault("PostgreSQL stopped (fast shutdown)")
        time.sleep(10.0)
        server.start()  # same port, same data directory
        rig.fault("PostgreSQL started")
        rig.wait_for_writers(writers)
        events = rig.tally().events  # a writer whose commit was cut may have written a batch twice: count the outbox
        tally = rig.wait_until_settled(events, timeout=300)
        rig.report(tally)
        assert relay.running and worker.running, rig.logs()
        assert (relay.generation, worker.generation) == (1, 1)
        for process in (relay, worker):
            code, _ = process.terminate()
            assert code == 0, process.tail()
        rig.assert_exactly_once(tally)
        relay_log = relay.log_path.read_text()
        # One line when the outage starts, one when it ends - not one per retry.
        assert 1 <= relay_log.count("relay: database unavailable") <= 2, relay_log[-4000:]
        assert relay_log.count("relay: database back after") == 1, relay_log[-4000:]
    finally:
        rig.stop_all()
