"""Worker recycling (``runworker --processes N --max-handlings-per-process
K``): consumer children replace themselves mid-backlog and nothing is lost,
run twice, or counted as an extra attempt. Real processes, PostgreSQL and NATS."""

from __future__ import annotations

import signal
import subprocess

import pytest
from django.db import transaction

from django_platformkit import declare, publish
from django_platformkit.models import HandledEvent
from django_platformkit.runtime.recycle import EXIT_RECYCLE, RecyclePolicy
from django_platformkit.runtime.supervisor import _Child
from tests.conftest import manage, wait_for, worker_env
from tests.testapp.models import Effect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

EVENTS = 400


def test_two_recycling_consumer_processes_handle_every_event_once_at_its_first_attempt(broker, registries, tmp_path):
    recycled = declare("testapp.recycled")
    with transaction.atomic():
        for n in range(EVENTS):
            publish(recycled, {"n": n, "sleep": 0.002})
    log = tmp_path / "supervisor.log"
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1")
    with log.open("w") as out:
        supervisor = manage(
            "runworker",
            "--processes",
            "2",
            "--max-handlings-per-process",
            "50",
            "--subscription",
            "testapp.recycled",
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            wait_for(
                lambda: HandledEvent.objects.filter(subscription="testapp.recycled").count() >= EVENTS,
                timeout=240,
                interval=0.5,
                what="every event handled",
            )
        finally:
            supervisor.send_signal(signal.SIGTERM)
            assert supervisor.wait(60) == 0, log.read_text()[-3000:]
    effects = list(Effect.objects.filter(subscription="testapp.recycled"))
    assert len(effects) == EVENTS  # each handled exactly once: no effect twice
    assert len({e.event_id for e in effects}) == EVENTS
    assert {e.payload["attempt"] for e in effects} == {1}  # a hand-back is no attempt
    assert len({e.payload["pid"] for e in effects}) >= 3, "consumer children were replaced"
    text = log.read_text()
    assert "child recycled role=consumer" in text
    assert "child died" not in text  # a recycle is no crash: no backoff


def test_a_sigterm_while_a_child_recycles_lets_its_in_flight_handler_finish(broker, tmp_path):
    """The child's stop began with its recycle, not a signal: the supervisor's
    SIGTERM then is its first request, not the "second request" that abandons
    in-flight handlers and exits 1 (a race the suite met at random)."""
    with transaction.atomic():
        ids = [publish("testapp.slow", {"sleep": 3}) for _ in range(3)]
    log = tmp_path / "supervisor.log"
    env = worker_env(broker, PLATFORMKIT_TEST_ACK_WAIT="10", PLATFORMKIT_TEST_HANDLER_TIMEOUT="8")
    with log.open("w") as out:
        supervisor = manage(
            "runworker",
            "--processes",
            "1",
            "--max-handlings-per-process",
            "1",
            "--subscription",
            "testapp.slow",
            "--no-jobs",
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            # The first event handled: the child recycles while the second one runs (3 s).
            wait_for(lambda: "worker recycling" in log.read_text(), timeout=120, interval=0.05, what="a recycle")
        finally:
            supervisor.send_signal(signal.SIGTERM)
            code = supervisor.wait(60)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "second request" not in text
    handled = set(Effect.objects.filter(subscription="testapp.slow").values_list("event_id", flat=True))
    assert set(ids[:2]) <= handled, text[-3000:]  # the one in flight at the SIGTERM finished


def test_a_recycle_policy_says_why_once_a_limit_is_passed():
    assert RecyclePolicy(max_handlings=50).reason(49) is None
    assert "handlings=50" in (RecyclePolicy(max_handlings=50).reason(50) or "")
    assert "rss_mib=" in (RecyclePolicy(max_memory_mib=1).reason(0) or "")  # any Python process is above 1 MiB
    assert RecyclePolicy(max_memory_mib=1_000_000).reason(10**9) is None
    assert EXIT_RECYCLE not in (0, 1, 3, 78)  # none of the statuses that mean stopped, crashed, stuck or refused
    child = _Child("consumer0", {})
    assert child.recycles == 0 and child.deaths == []
