"""Shared fixtures: a broker namespace of its own per test (stream and subject
prefix), and helpers to run workers in-process or as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def broker(settings):
    """A fresh stream and subject prefix for this test; deleted afterwards.
    Yields the PLATFORMKIT dict in force."""
    from django_platformkit.transport import Transport

    token = uuid.uuid4().hex[:10]
    config = dict(settings.PLATFORMKIT, STREAM=f"T{token}", SUBJECT_PREFIX=f"t{token}")
    with override_settings(PLATFORMKIT=config):
        yield config
        transport = Transport(url=config["NATS_URL"])
        try:
            try:
                transport.connect()
            except Exception:
                return

            async def delete():
                try:
                    await transport._js.delete_stream(config["STREAM"])
                except Exception:
                    pass

            transport.call(delete(), timeout=10)
        finally:
            transport.close()


@pytest.fixture
def transport(broker):
    from django_platformkit.transport import Transport

    t = Transport()
    t.connect()
    t.ensure_stream()
    yield t
    t.close()


def worker_env(broker_config: dict, **extra: str) -> dict[str, str]:
    """Environment for a worker process that talks to this test's database and stream."""
    env = dict(os.environ)
    env.update(
        PLATFORMKIT_TEST_DB_NAME=connection.settings_dict["NAME"],
        PLATFORMKIT_TEST_STREAM=broker_config["STREAM"],
        PLATFORMKIT_TEST_PREFIX=broker_config["SUBJECT_PREFIX"],
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def manage(*args: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """Start ``tests/manage.py <args>`` as a real process."""
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "manage.py"), *args], env=env, cwd=ROOT, **kwargs)


@pytest.fixture
def run_worker(broker):
    """Run ``runworker --burst`` in this process (threads, real NATS, the
    test database) and return the Worker."""
    from django_platformkit.worker import Worker

    def run(timeout: float = 60, **kwargs):
        worker = Worker(burst=True, burst_timeout_seconds=timeout, **kwargs)
        code = worker.run()
        assert code == 0, f"worker exited {code}"
        return worker

    return run


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value {value!r})")
        time.sleep(interval)


@pytest.fixture
def background_worker(broker):
    """Start a non-burst Worker in a thread of this process; stopped at teardown."""
    import threading

    from django_platformkit.worker import Worker

    started = []

    def start(**kwargs):
        worker = Worker(scheduler=False, **kwargs)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop()
        thread.join(30)
