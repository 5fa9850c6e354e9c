"""Worker recycling (``runworker --processes N --max-handlings-per-process
K``): consumer children replace themselves mid-backlog and nothing is lost,
run twice, or counted as an extra attempt. Real processes, PostgreSQL and NATS."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from django.db import transaction

from django_platformkit import declare, publish
from django_platformkit.models import HandledEvent
from django_platformkit.runtime.recycle import EXIT_RECYCLE, RecyclePolicy
from django_platformkit.runtime.supervisor import _Child
from tests.conftest import manage, run_to_exit, wait_for, worker_env
from tests.testapp.models import Effect

# 300 s: children recycled and replaced in turn, each replacement a fresh
# interpreter start-up; the storm tests watch the supervisor for 20 s.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

EVENTS = 400


@pytest.mark.process
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


@pytest.mark.process
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


# --- a limit a fresh child already meets: refused, never a storm (issue 33) ---


def test_quick_recycles_are_restarted_after_a_doubling_back_off_and_a_steady_life_resets_it():
    from django_platformkit.runtime.supervisor import RECYCLE_STEADY_SECONDS, RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS

    child = _Child("consumer0", {})
    delays = []
    for n in range(8):
        child.started = 1000.0 + n
        delays.append(child.recycled(child.started + 1.0))
    assert delays[:3] == [RESTART_FIRST_SECONDS, 2 * RESTART_FIRST_SECONDS, 4 * RESTART_FIRST_SECONDS]
    assert max(delays) == RESTART_MAX_SECONDS and child.recycles == 8
    child.started = 5000.0
    assert (
        child.recycled(5000.0 + RECYCLE_STEADY_SECONDS) == 0.0
    )  # a steady life: at once, and the back-off starts over
    child.started = 6000.0
    assert child.recycled(6001.0) == RESTART_FIRST_SECONDS


def one_child(subscription: str, *options: str) -> tuple[str, ...]:
    """``runworker`` as a supervisor of one consumer child serving ``subscription`` (no jobs), with ``options``."""
    return ("runworker", "--processes", "1", "--no-jobs", "--subscription", subscription, *options)


def _children_started(text: str) -> int:
    return text.count("child started role=consumer")


@pytest.mark.process
@pytest.mark.parametrize(("value", "says"), [("0", "above 0"), ("1GB", "a number of MiB"), ("-5", "above 0")])
def test_a_memory_limit_that_is_no_size_is_refused_naming_the_form(broker, value, says):
    code, output = run_to_exit(
        "runworker", "--processes", "1", "--max-memory-per-process", value, env=worker_env(broker), timeout=60
    )
    assert code == 1 and "Traceback" not in output, output
    assert (
        f"--max-memory-per-process {value}: give a number of MiB above 0 (e.g. --max-memory-per-process 512)" in output
    )
    assert says in output and _children_started(output) == 0


@pytest.mark.process
def test_a_memory_limit_below_a_fresh_child_is_refused_at_start_naming_its_size_never_a_storm(broker, tmp_path):
    code, output = run_to_exit(
        "runworker", "--processes", "1", "--max-memory-per-process", "1", "--no-jobs", env=worker_env(broker)
    )
    assert code == 1 and "Traceback" not in output, output
    size = int(re.search(r"a fresh worker process already uses (\d+) MiB", output).group(1))
    assert size > 1 and _children_started(output) == 0, output
    # A limit between the supervisor's size and a child's once it runs (its threads, loop and connections):
    # the child meets it before it handled anything, refuses, naming its size, and nothing restarts it.
    env = worker_env(broker, PLATFORMKIT_TEST_FEATURES="1")
    args = one_child("testapp.recycled")
    log = tmp_path / "measure.log"
    with log.open("w") as out:
        proc = manage(*args, env=env, stdout=out, stderr=out)
    try:
        # The whole line: a read may catch it half written.
        child = wait_for(
            lambda: re.search(r"worker started pid=(\d+) relay=False", log.read_text()), timeout=60, what="a child"
        ).group(1)
        time.sleep(1.0)
        pages = int(Path(f"/proc/{child}/statm").read_text().split()[1])
        child_mib = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    log = tmp_path / "supervisor.log"
    with log.open("w") as out:
        proc = manage(*args, "--max-memory-per-process", f"{child_mib - 1:.1f}", env=env, stdout=out, stderr=out)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert _children_started(text) <= 1, text[-3000:]  # not a storm (34-49 children in 10 s were seen)
    assert code == 1 and "a fresh worker process already uses" in text, text[-3000:]


@pytest.mark.process
def test_a_child_that_recycles_at_every_handling_is_restarted_with_a_back_off_not_in_a_storm(broker, tmp_path):
    recycled = declare("testapp.recycled")
    with transaction.atomic():
        for n in range(100):
            publish(recycled, {"n": n})
    log = tmp_path / "supervisor.log"
    with log.open("w") as out:
        supervisor = manage(
            *one_child("testapp.recycled", "--max-handlings-per-process", "1"),
            env=worker_env(broker, PLATFORMKIT_TEST_FEATURES="1"),
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
        try:
            wait_for(lambda: "child recycled" in log.read_text(), timeout=120, what="the first recycle")
            before = _children_started(log.read_text())
            time.sleep(20)
            during = _children_started(log.read_text()) - before
        finally:
            supervisor.send_signal(signal.SIGTERM)
            assert supervisor.wait(60) == 0, log.read_text()[-3000:]
    text = log.read_text()
    # From the first recycle: lives of a second or more, each followed by 1, 2, 4, 8 s of back-off: five starts
    # at most in 20 s (a storm started one per life).
    assert 1 <= during <= 5, text[-4000:]
    assert "starting a fresh one in" in text


@pytest.mark.process
def test_the_metrics_folder_of_a_killed_supervisor_is_removed_by_the_next_start_of_the_tree(broker, tmp_path):
    from django_platformkit.devservices import free_port

    def start(log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            return manage(
                *one_child("testapp.recycled", "--no-relay", "--metrics-port", str(free_port())),
                env=worker_env(broker, PLATFORMKIT_TEST_FEATURES="1"),
                stdout=out,
                stderr=out,
            )

    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start(first_log)
    try:
        text = wait_for(
            lambda: "child started role=consumer0" in first_log.read_text() and first_log.read_text(),
            timeout=60,
            what="the first tree",
        )
        folder = Path(re.search(r"metrics of the process tree folder=(\S+)", text).group(1))
        child = int(re.search(r"child started role=consumer0 pid=(\d+)", text).group(1))
        assert folder.is_dir()
    finally:
        first.kill()  # SIGKILL: no clean-up of its own
        first.wait(30)
    # Its child hears of it (SIGTERM from the kernel), finishes and exits; its folder stays behind.
    wait_for(lambda: not Path(f"/proc/{child}").exists(), timeout=60, what="the orphaned child to exit")
    assert folder.is_dir()
    second = start(second_log)
    try:
        wait_for(lambda: "supervisor started" in second_log.read_text(), timeout=60, what="the second tree")
        assert not folder.exists(), second_log.read_text()[-3000:]
        own = Path(re.search(r"metrics of the process tree folder=(\S+)", second_log.read_text()).group(1))
        assert own.is_dir()  # a live tree's folder is never taken for a gone one's
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, second_log.read_text()[-3000:]
    assert not own.exists()
