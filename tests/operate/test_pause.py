"""Pausing a subscription or a task queue, against real worker processes,
PostgreSQL and NATS: nothing starts on any worker while it is paused - a
worker started during the pause included, and a message a worker's pull
request caught after the pause (Bull's #447: a pending fetch returned a
job after the pause and ran it) - its messages wait in the stream, and
after the resume every one is handled once, no attempt counted, nothing
dead-lettered. Bad input is refused with nothing written."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from django.contrib.admin.models import ADDITION, DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

from django_platformkit import publish
from django_platformkit.broker.transport import Transport
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.exceptions import ControlRefused
from django_platformkit.models import Attempt, DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.models.controls import Pause
from django_platformkit.operate.pause import pause, paused, resolve, resume
from django_platformkit.runtime.controlwatch import CONTROL_POLL_SECONDS
from tests.conftest import manage, wait_for, worker_env
from tests.testapp.models import Attempt as HandlerRun
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

SUB = "testapp.record_order"
#: DESIGN.md: every worker stops starting the handlers within 5 s of the pause.
PAUSE_TAKES_EFFECT_SECONDS = 5.0


def start_worker(broker, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return manage(
            "runworker",
            "--no-jobs",
            "--subscription",
            SUB,
            env=worker_env(broker),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def orders(n: int) -> list:
    with transaction.atomic():
        return [publish("testapp.order_placed", {"n": i}) for i in range(n)]


def durable_counts() -> tuple[int, int]:
    """(num_pending, num_ack_pending) of the subscription's durable."""
    transport = Transport()
    transport.connect()
    try:
        info = transport.consumer_info(get_subscription(SUB).durable)
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)
    finally:
        transport.close()


@pytest.mark.process
def test_a_paused_subscription_starts_nothing_on_any_worker_then_resumed_every_message_runs_once(broker, tmp_path):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    workers = [start_worker(broker, log) for log in logs]
    try:
        warm = orders(2)
        wait_for(lambda: Effect.objects.filter(event_id__in=warm).count() == 2, timeout=60, what="both workers up")
        for log in logs:
            wait_for(lambda log=log: "worker started" in log.read_text(), timeout=60, what=f"{log.name} started")

        paused_at = time.monotonic()
        change = pause([SUB], actor="olga", reason="payment provider down")[0]
        assert change.changed and change.name == SUB
        for log in logs:  # each worker says it read the pause, within the bound
            wait_for(
                lambda log=log: f"subscription paused subscription={SUB}" in log.read_text(),
                timeout=PAUSE_TAKES_EFFECT_SECONDS,
                what=f"{log.name} to read the pause",
            )
        assert time.monotonic() - paused_at <= PAUSE_TAKES_EFFECT_SECONDS

        # Published after the pause: the workers' pull requests were open (idle
        # lanes long-poll), so a message can reach one: it must not start.
        ids = orders(30)
        late = start_worker(broker, tmp_path / "late.log")  # started while paused
        workers.append(late)
        wait_for(lambda: "worker started" in (tmp_path / "late.log").read_text(), timeout=60, what="the late worker")
        watched_until = time.monotonic() + 8
        while time.monotonic() < watched_until:
            assert not Effect.objects.filter(event_id__in=ids).exists(), "a handler started while paused"
            time.sleep(0.25)
        assert not HandledEvent.objects.filter(event_id__in=ids).exists()
        assert not Attempt.objects.filter(event_id__in=ids).exists()
        # Every message waits in the stream: unfetched, or (caught by a pull
        # request open at the pause) handed back with a nak, which JetStream
        # keeps counting as ack pending until its next delivery.
        pending, ack_pending = durable_counts()
        assert pending + ack_pending == 30, (pending, ack_pending)

        resume([SUB], actor="olga", reason="provider back")
        wait_for(lambda: Effect.objects.filter(event_id__in=ids).count() >= 30, timeout=60, what="every order handled")
        time.sleep(1)
        assert Effect.objects.filter(event_id__in=ids).count() == 30, "each handled exactly once"
        assert not DeadLetter.objects.exists()
        assert not Attempt.objects.counted().filter(event_id__in=ids).exists(), "waiting counted no attempt"
        assert durable_counts() == (0, 0)
        for log in logs:  # each worker reads the resume within the bound, handled anything or not
            wait_for(
                lambda log=log: f"subscription resumed subscription={SUB}" in log.read_text(),
                timeout=PAUSE_TAKES_EFFECT_SECONDS + CONTROL_POLL_SECONDS,
                what=f"{log.name} to read the resume",
            )
    finally:
        for proc in workers:
            stop(proc)
    assert [p.returncode for p in workers] == [0, 0, 0]


@pytest.mark.process
def test_a_run_in_flight_when_paused_finishes_and_acks_and_nothing_after_it_starts(broker, tmp_path):
    log = tmp_path / "w.log"
    with open(log, "wb") as out:
        proc = manage(
            "runworker",
            "--no-jobs",
            "--subscription",
            "testapp.slow",
            env=worker_env(broker),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with transaction.atomic():
            first = publish("testapp.slow", {"sleep": 4})
            rest = [publish("testapp.slow", {}) for _ in range(3)]
        wait_for(lambda: HandlerRun.objects.filter(event_id=first).exists(), timeout=60, what="the 4 s run to start")
        pause(["testapp.slow"], actor="olga", reason="downstream maintenance")
        wait_for(lambda: Effect.objects.filter(event_id=first).exists(), timeout=30, what="the in-flight run to finish")
        time.sleep(CONTROL_POLL_SECONDS + 4)
        assert not Effect.objects.filter(event_id__in=rest).exists()
        assert HandledEvent.objects.filter(event_id=first).exists(), "the in-flight run committed its claim"
        resume(["testapp.slow"], actor="olga")
        wait_for(lambda: Effect.objects.filter(event_id__in=rest).count() == 3, timeout=60, what="the rest")
    finally:
        stop(proc)
    assert proc.returncode == 0


# --- the library and the commands: what is written, and what is refused --------------


@pytest.fixture
def operator(transactional_db) -> User:
    user = User.objects.create_user("olga", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_platformkit", codename="replay_deadletter")
    )
    return user


def test_pause_and_resume_write_the_row_the_audit_events_and_a_log_entry_each(broker, operator):
    call_command("pause", SUB, "--actor", "olga", "--reason", "supplier outage", verbosity=0)
    row = Pause.objects.get()
    assert (row.name, row.paused_by, row.reason) == (SUB, "olga", "supplier outage")
    again = pause([SUB], actor="bob", reason="other")[0]
    assert not again.changed and (again.paused_by, again.reason) == ("olga", "supplier outage")
    call_command("resume", SUB, "--actor", "olga", verbosity=0)
    assert not Pause.objects.exists()
    events = OutboxEvent.objects.filter(name__startswith="platformkit.subscription_").order_by("created_at")
    assert [(e.name, e.payload["actor"]) for e in events] == [
        ("platformkit.subscription_paused", "olga"),
        ("platformkit.subscription_resumed", "olga"),
    ]
    assert events[0].payload == {"subscription": SUB, "queue": None, "actor": "olga", "reason": "supplier outage"}
    assert events[1].payload["paused_by"] == "olga"
    entries = LogEntry.objects.order_by("action_time")
    assert [(e.action_flag, e.object_id, e.user.username) for e in entries] == [
        (ADDITION, SUB, "olga"),
        (DELETION, SUB, "olga"),
    ]
    assert "supplier outage" in entries[0].change_message
    assert not resume([SUB], actor="olga")[0].changed  # not paused: nothing written
    assert OutboxEvent.objects.filter(name__startswith="platformkit.subscription_").count() == 2


@pytest.fixture
def task_queues(broker, registries, settings):
    """TASKS -> OutboxBackend with queues default and emails, registered as AppConfig.ready() does."""
    from django_platformkit.tasks.registry import register_task_queues

    settings.TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default", "emails"]}}
    register_task_queues()


@pytest.mark.django_tasks
def test_a_task_queue_is_paused_under_its_subscription_and_listed(task_queues, operator, capsys):
    call_command("pause", "--queue", "default", "--actor", "olga", "--reason", "deploy")
    assert [p.name for p in paused()] == ["platformkit.task_default"]
    assert "paused queue default (platformkit.task_default)" in capsys.readouterr().out
    call_command("pause", "--list")
    assert "queue default (platformkit.task_default)  paused by olga" in capsys.readouterr().out
    assert resolve(["platformkit.task_default"]) == ["platformkit.task_default"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["testapp.record_ordr", "--actor", "olga", "--reason", "x"], "did you mean 'testapp.record_order'"),
        pytest.param(
            ["--queue", "emials", "--actor", "olga", "--reason", "x"],
            "unknown task queue 'emials'; did you mean 'emails'",
            marks=pytest.mark.django_tasks,
        ),
        ([SUB, "--actor", "olga"], 'give --reason "..."'),
        ([SUB, "--actor", "olga", "--reason", "  "], 'give --reason "..."'),
        ([SUB, "--reason", "x"], "give --actor USERNAME"),
        ([SUB, "--actor", "mallory", "--reason", "x"], "lacks the permission 'django_platformkit.replay_deadletter'"),
        ([SUB, "--actor", "nobody", "--reason", "x"], "no such user"),
        (["--actor", "olga", "--reason", "x"], "name a subscription or a task queue"),
    ],
)
def test_pause_refuses_bad_input_and_writes_nothing(task_queues, operator, args, expected):
    User.objects.create_user("mallory", is_staff=True)
    with pytest.raises(CommandError, match=expected.replace("(", r"\(").replace("'", "'")):
        call_command("pause", *args)
    assert not Pause.objects.exists()
    assert not OutboxEvent.objects.exists()
    assert not LogEntry.objects.exists()


def test_resume_knows_a_paused_name_the_code_no_longer_declares(broker):
    Pause.objects.create(name="shop.removed_handler", paused_by="olga", reason="old")
    with pytest.raises(ControlRefused, match="unknown subscription 'shop.removed'"):
        resume(["shop.removed"], actor="olga")
    assert resume(["shop.removed_handler"], actor="olga")[0].changed
    with pytest.raises(ControlRefused, match="needs a reason"):
        pause([SUB], actor="olga", reason="")


def test_a_paused_task_queue_starts_none_of_its_priority_bands_until_resumed(broker, transport, background_worker):
    """A queue is five priority bands (their own durables): pausing the
    queue holds every one of them, on a worker started while it is paused."""
    pytest.importorskip("django.tasks")
    from django_platformkit.outbox.relay import Relay
    from django_platformkit.tasks.registry import queue_subscriptions
    from tests.conftest import tasks_registered
    from tests.testapp import tasks

    config = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default"]}}
    with tasks_registered(config):
        change = pause(queues=["default"], actor="olga", reason="the search cluster is reindexing")[0]
        assert (change.name, change.queue) == ("platformkit.task_default", "default")
        with transaction.atomic():
            for n, priority in enumerate([100, 0, -100, 40, -40, 0]):
                tasks.record.using(priority=priority).enqueue("paused-queue", n=n)
        Relay(transport).drain()
        background_worker(subscriptions=queue_subscriptions(["default"]), relay=False)
        time.sleep(CONTROL_POLL_SECONDS + 4)
        assert not Effect.objects.filter(subscription="paused-queue").exists(), "a band ran while its queue was paused"
        resume(queues=["default"], actor="olga")
        wait_for(lambda: Effect.objects.filter(subscription="paused-queue").count() == 6, timeout=60, what="every band")
    assert not DeadLetter.objects.exists()
    assert not Attempt.objects.counted().exists()


@pytest.mark.process
def test_a_burst_worker_whose_database_is_down_gives_up_on_the_controls_after_its_connect_timeout(broker):
    """A worker reads the controls before it starts anything; a run-once
    worker (a script's step) with the database down must fail after its
    --connect-timeout, not wait for the controls for ever."""
    env = worker_env(broker, DATABASE_URL="postgresql://postgres@127.0.0.1:1/pk_nowhere")
    started = time.monotonic()
    proc = manage(
        "runworker",
        "--burst",
        "--no-relay",
        "--connect-timeout",
        "3",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    assert "CommandError: the database is not available" in err and "Traceback" not in err, err
    assert time.monotonic() - started < 60
