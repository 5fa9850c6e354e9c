"""Shared fixtures: the servers (started only for tests that need them), a
broker namespace of its own per test (stream and subject prefix), and helpers
to run workers in-process or as real processes.

Tests mirror the package (``tests/consume/test_claim.py`` for
``django_platformkit/consume/claim.py``) beside the scenario suites
(``chaos/``, ``test_security.py``, ``test_properties.py``, ...). Those marked
``unit`` (modules that set ``pytestmark = pytest.mark.unit``) start nothing;
any other test gets PostgreSQL and NATS through the session fixture
``platformkit_services``, started on first need. Shared fixtures and
helpers live here; test modules never import from one another.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def platformkit_services():
    """``(database_url, nats_url)`` of the suite's servers: the environment's,
    or throwaway ones started now, once per session (``tests/services.py``).
    Points ``settings.DATABASES['default']`` and ``PLATFORMKIT['NATS_URL']``
    at them, in place, before pytest-django creates the test database."""
    from django.conf import settings

    from django_platformkit import conf
    from django_platformkit.devservices import database_settings

    from .services import ensure_services

    database_url, nats_url = ensure_services()
    name = os.environ.get("PLATFORMKIT_TEST_DB_NAME")
    # The same dict object django.db.connections holds: updating it in place
    # is what makes a not-yet-opened connection use the new server.
    settings.DATABASES["default"].update(database_settings(database_url, **({"name": name} if name else {})))
    settings.PLATFORMKIT["NATS_URL"] = nats_url
    conf.settings.clear()
    return database_url, nats_url


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix, platformkit_services):
    """pytest-django's hook for changing DATABASES before it creates the test
    database: the servers start here for the first test that uses the DB."""


#: The test running now (``manage`` asks it for the ``process`` marker).
_CURRENT_TEST: list[pytest.Item] = []


#: The timeout of a test that starts real processes and names none itself:
#: interpreter start-ups, Django set-up and a worker's first connections on a
#: loaded two-core machine with other tests beside it (CI's second tier) take
#: tens of seconds before the test's own waits begin.
PROCESS_TEST_TIMEOUT_SECONDS = 180


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("process") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(PROCESS_TEST_TIMEOUT_SECONDS))


def pytest_runtest_setup(item: pytest.Item) -> None:
    _CURRENT_TEST[:] = [item]
    # One rule for every test that needs Django 6's tasks framework, so a
    # new one can't fail only in the Django 5.2 run.
    if item.get_closest_marker("django_tasks") is not None and importlib.util.find_spec("django.tasks") is None:
        pytest.skip("needs django.tasks (Django 6.0+)")


@pytest.fixture(autouse=True)
def _services_unless_unit(request):
    # A test that isn't marked unit may reach the broker or the database
    # without naming a fixture (a worker process, a check): start them.
    if request.node.get_closest_marker("unit") is None:
        request.getfixturevalue("platformkit_services")


@pytest.fixture
def broker(settings, platformkit_services):
    """A fresh stream and subject prefix for this test; deleted afterwards.
    Yields the PLATFORMKIT dict in force."""
    from django_platformkit.broker.transport import Transport

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
                    await transport.connection.js.delete_stream(config["STREAM"])
                except Exception:
                    pass

            transport.connection.call(delete(), timeout=10)
        finally:
            transport.close()


@pytest.fixture
def transport(broker):
    from django_platformkit.broker.transport import Transport

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


#: Every process ``manage`` started in the running test: ``pytest_runtest_teardown`` ends them.
_STARTED: list[subprocess.Popen] = []


def manage(*args: str, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """Start ``tests/manage.py <args>`` as a real process, in a process group
    of its own (a supervisor's children make groups of their own too)."""
    item = _CURRENT_TEST[0] if _CURRENT_TEST else None
    if item is not None and not any(item.get_closest_marker(m) for m in ("process", "chaos")):
        # CI's tiers select by this marker: an unmarked test would run its
        # processes in the fast tier, beside every other test on two cores.
        pytest.fail(f"{item.nodeid} starts a process: mark it @pytest.mark.process", pytrace=False)
    kwargs.setdefault("process_group", 0)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "manage.py"), *args], env=env, cwd=ROOT, **kwargs)
    _STARTED.append(proc)
    return proc


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A process a test left running (a failed assertion before its stop) would
    write heartbeats and take work in the next tests' database and stream, and
    fail them: it and its group are killed when the test ends, whatever its
    outcome, before any fixture's teardown (so before the database is flushed:
    a process killed after the flush could still write rows the next test's
    worker would take). Its children follow (they die with their parent)."""
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait(30)


@contextlib.contextmanager
def mirror_of_default(alias: str, **options: str) -> Iterator[str]:
    """Register ``alias`` as a second connection to the test database,
    ``options`` added to its ``OPTIONS`` (``options="-c ..."`` for the
    session), for a module-scoped fixture: it must exist before a test's
    ``django_db(databases=[...])`` is checked. A mirror of ``default``, so the
    test database is neither created for it nor flushed through it."""
    from django.db import connections

    config = copy.deepcopy(connections.settings["default"])
    config["OPTIONS"] = dict(config.get("OPTIONS") or {}, **options)
    config["TEST"] = dict(config.get("TEST") or {}, MIRROR="default")
    connections.settings[alias] = config
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]


def run_to_exit(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run ``tests/manage.py <args>`` as a real process until it exits:
    ``(exit status, stdout and stderr together)``. Killed if it runs past
    ``timeout`` seconds (``subprocess.TimeoutExpired`` is raised then)."""
    proc = manage(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, output


def url_only_command(broker_config: dict, *args: str) -> str:
    """Run ``tests/manage.py <args>`` as a real process in which
    ``testapp.url_only`` is declared only by a module the URLconf imports
    (``PLATFORMKIT_TEST_URL_ONLY``); assert it exited 0 and return its
    output (stdout and stderr)."""
    code, output = run_to_exit(*args, env=worker_env(broker_config, PLATFORMKIT_TEST_URL_ONLY="1"), timeout=120)
    assert code == 0, output
    return output


@pytest.fixture
def run_worker(broker):
    """Run ``runworker --burst`` in this process (threads, real NATS, the
    test database) and return the Worker."""
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker

    def run(timeout: float = 60, transport=None, **options):
        worker = Worker(WorkerOptions(burst=True, burst_timeout_seconds=timeout, **options), transport=transport)
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

    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker

    started = []

    def start(transport=None, **options):
        worker = Worker(WorkerOptions(**{"scheduler": False, **options}), transport=transport)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop()
        thread.join(30)


@pytest.fixture
def registries():
    """Whatever a test declares, subscribes or schedules is forgotten afterwards."""
    from django_platformkit.consume import subscriptions
    from django_platformkit.jobs import specs
    from django_platformkit.outbox import events

    kept = (events._catalogue, events._validators, subscriptions._subscriptions, specs._jobs)
    saved = [dict(registry) for registry in kept]
    yield
    for registry, before in zip(kept, saved):
        registry.clear()
        registry.update(before)


def tables() -> dict[str, list[tuple]]:
    """Every row an operator verb could touch (outbox, claims, dead letters), as comparable data."""
    with connection.cursor() as cursor:
        snapshot = {}
        for table in ("platformkit_outbox", "platformkit_handled", "platformkit_dead_letters"):
            cursor.execute(f"SELECT * FROM {table} ORDER BY 1, 2")
            snapshot[table] = cursor.fetchall()
    return snapshot


@contextlib.contextmanager
def tasks_registered(tasks_setting):
    """``TASKS = tasks_setting``, with its queues' subscriptions registered as
    AppConfig.ready() does, removed again afterwards."""
    from django.tasks import task_backends
    from django.test import override_settings

    from django_platformkit.consume import subscriptions as registry
    from django_platformkit.outbox import events
    from django_platformkit.tasks.registry import register_task_queues

    with override_settings(TASKS=tasks_setting):
        names = register_task_queues()
        try:
            yield task_backends["default"]
        finally:
            for name in names:
                registry._subscriptions.pop(name, None)
                events._catalogue.pop(name, None)


def lose_the_stream_and_reconcile(names, events: int):
    """What a lost NATS store and the next reconciliation pass leave: the
    durables of the subscriptions ``names`` made as a worker makes them (their
    beginnings recorded), ``events`` orders published and relayed, the stream
    deleted and made again, and one pass run. Returns its ``ReconcileReport``."""
    import threading

    from django.db import transaction

    from django_platformkit import identity, publish
    from django_platformkit.broker.transport import Transport
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.operate.reconcile import reconcile
    from django_platformkit.outbox.relay import Relay
    from django_platformkit.runtime.startup import StartUp

    subs = [get_subscription(name) for name in names]
    t = Transport()
    t.connect()
    try:
        start_up = StartUp(t, using="default", stop_event=threading.Event(), connect_timeout_seconds=5.0)
        start_up.connect_and_ensure_stream(give_up=True)
        for sub in subs:
            start_up.ensure_durable(sub)
        with transaction.atomic():
            for n in range(events):
                publish("testapp.order_placed", {"n": n})
        Relay(t).drain()
        t.upkeep.delete_stream()  # the broker lost it
        start_up.connect_and_ensure_stream(give_up=True)
        return reconcile(t, owner=identity.database_identity(), instance=identity.database_instance(), declared=subs)
    finally:
        t.close()
