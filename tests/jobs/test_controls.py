"""Jobs by hand, against real worker processes and PostgreSQL: a run asked
for is run once, by one of the workers, recorded as manual with its actor,
the slot ledger untouched; a disabled job's slots are skipped on every
worker (one started later too), it is shown as disabled, never overdue, and
enabling it runs it from its next slot, never for the slots it skipped
(django-celery-beat's re-enabled task ran at once; its bulk disable went
unnoticed by a running beat). Bad input is refused, nothing written."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from django_platformkit import conf
from django_platformkit.admin.jobfigures import job_figures
from django_platformkit.admin.queries import Timed
from django_platformkit.exceptions import ControlRefused
from django_platformkit.jobs import specs as jobs_module
from django_platformkit.jobs.controls import JobSwitch, JobSwitches, disable, enable, request_run
from django_platformkit.jobs.scheduler import Scheduler
from django_platformkit.jobs.specs import job
from django_platformkit.models import JobState
from django_platformkit.models.controls import JobControl
from django_platformkit.runtime.controlwatch import CONTROL_POLL_SECONDS
from tests.conftest import manage, wait_for, worker_env
from tests.testapp._jobs import RUNS_TABLE, RUNS_TABLE_DDL

pytestmark = pytest.mark.django_db(transaction=True)

#: DESIGN.md: a control takes effect on every worker within 5 s.
TAKES_EFFECT_SECONDS = 5.0


@pytest.fixture
def runs_table(django_db_blocker):
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(RUNS_TABLE_DDL)
    yield RUNS_TABLE
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {RUNS_TABLE}")


def recorded(name: str) -> list[tuple[datetime | None, int, datetime]]:
    """(slot, pid, at) of each run of ``name``, in order."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT slot, pid, at FROM {RUNS_TABLE} WHERE job = %s ORDER BY at", [name])
        return cursor.fetchall()


def start_workers(broker, tmp_path, name: str, count: int, tag: str = "w") -> tuple[list[subprocess.Popen], list]:
    env = worker_env(broker, PLATFORMKIT_TEST_JOBS="1")
    logs = [tmp_path / f"{tag}{i}.log" for i in range(count)]
    procs = []
    for log in logs:
        with log.open("w") as out:
            procs.append(
                manage("runworker", "--no-relay", "--no-consumers", "--job", name, env=env, stdout=out, stderr=out)
            )
    wait_for(lambda: all("scheduler started" in log.read_text() for log in logs), 60, what="the schedulers")
    return procs, logs


def stop_workers(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


@pytest.mark.process
def test_run_now_runs_once_on_one_worker_recorded_as_manual_and_leaves_the_slots_alone(broker, runs_table, tmp_path):
    name = "testapp.nightly"  # its slot is 03:00: every run seen here is the one asked for
    procs, logs = start_workers(broker, tmp_path, name, 2)
    try:
        asked = time.monotonic()
        change = request_run([name], actor="olga", reason="the report must go out today")[0]
        assert change.changed
        wait_for(lambda: recorded(name), TAKES_EFFECT_SECONDS, what="the run asked for")
        assert time.monotonic() - asked <= TAKES_EFFECT_SECONDS
        wait_for(
            lambda: JobControl.objects.filter(name=name, manual_finished_at__isnull=False).exists(), 10, what="its end"
        )
        time.sleep(CONTROL_POLL_SECONDS + 1.5)  # both workers read the controls again: no second run
    finally:
        stop_workers(procs)
    assert [p.returncode for p in procs] == [0, 0]
    runs = recorded(name)
    assert len(runs) == 1 and runs[0][0] is None, runs  # once, and with no slot
    control = JobControl.objects.get(name=name)
    assert (control.manual_by, control.manual_reason, control.manual_error) == (
        "olga",
        "the report must go out today",
        "",
    )
    assert control.run_requested_at is None
    assert not JobState.objects.filter(name=name, last_slot__isnull=False).exists(), "the ledger never saw it"
    texts = [log.read_text() for log in logs]
    assert sum("job run by hand started name=testapp.nightly actor=olga" in t for t in texts) == 1


@pytest.mark.process
def test_a_failing_run_by_hand_is_recorded_with_its_error_and_run_wait_says_so(broker, runs_table, tmp_path):
    name = "testapp.nightly_fails"
    User.objects.create_user("olga", is_staff=True).user_permissions.set(
        Permission.objects.filter(codename="replay_deadletter")
    )
    procs, _logs = start_workers(broker, tmp_path, name, 1)
    try:
        with pytest.raises(CommandError, match="testapp.nightly_fails failed"):
            call_command("jobs", "run", name, "--actor", "olga", "--reason", "retry the report", "--wait", "20")
    finally:
        stop_workers(procs)
    control = JobControl.objects.get(name=name)
    assert control.manual_error.startswith("RuntimeError: report server down")
    assert LogEntry.objects.get().object_id == name


@pytest.mark.process
def test_a_disabled_job_skips_its_slots_everywhere_and_enabled_again_runs_from_its_next_slot(
    broker, runs_table, tmp_path
):
    name = "testapp.every_second"
    procs, _logs = start_workers(broker, tmp_path, name, 2)
    late: list[subprocess.Popen] = []
    try:
        wait_for(lambda: len(recorded(name)) >= 2, 20, what="the first runs")
        disable([name], actor="olga", reason="the mail relay is being moved")
        time.sleep(TAKES_EFFECT_SECONDS)
        disabled_from = datetime.now(UTC)
        count = len(recorded(name))
        late, _late_logs = start_workers(broker, tmp_path, name, 1, tag="late")  # started while disabled
        time.sleep(6)
        assert len(recorded(name)) == count, "a disabled job's slot ran"
        figures = {j.name: j for j in job_figures(Timed(conf.settings.DATABASE_ALIAS, []))}[name]
        assert figures.disabled and not figures.overdue, "disabled, never overdue"
        enable([name], actor="olga", reason="moved")
        enabled_at = JobControl.objects.get(name=name).enabled_at
        wait_for(lambda: len(recorded(name)) > count, TAKES_EFFECT_SECONDS + 2, what="runs again after enable")
    finally:
        stop_workers(procs + late)
    slots = [slot for slot, _pid, _at in recorded(name)]
    assert len(slots) == len(set(slots)), "a slot ran twice"
    skipped = [s for s in slots if disabled_from <= s < enabled_at - timedelta(seconds=1)]
    assert not skipped, f"slots of the disabled time ran: {skipped}"
    figures = {j.name: j for j in job_figures(Timed(conf.settings.DATABASE_ALIAS, []))}[name]
    assert not figures.overdue, "the slots skipped while disabled never make it overdue"


def test_a_worker_starting_after_an_enable_does_not_catch_up_a_slot_skipped_while_disabled(broker, registries):
    """The scheduler's start-up catch-up (the newest missed slot within its
    grace) leaves alone a slot that came while the job was disabled."""
    ran = []
    job(every=timedelta(hours=1), name="testapp.hourly")(lambda: ran.append(1))
    JobState.objects.create(name="testapp.hourly", last_slot=datetime(2026, 3, 1, 10, tzinfo=UTC))
    switches = JobSwitches()
    switches.replace([JobSwitch("testapp.hourly", enabled_at=datetime(2026, 3, 1, 11, 30, tzinfo=UTC))])

    class At:
        def now(self) -> datetime:
            return datetime(2026, 3, 1, 11, 40, tzinfo=UTC)

        def wait(self, stop: threading.Event, seconds: float) -> bool:
            return stop.is_set()

    scheduler = Scheduler(clock=At(), jobs=["testapp.hourly"], switches=switches, max_ahead_seconds=None)
    for thread in scheduler.tick():
        thread.join(10)
    assert ran == [], "the 11:00 slot fell while disabled: not caught up"
    without = Scheduler(clock=At(), jobs=["testapp.hourly"], max_ahead_seconds=None)
    for thread in without.tick():
        thread.join(10)
    assert ran == [1], "without the disable it is caught up (the control proves the test)"
    scheduler.close()
    without.close()
    jobs_module._jobs.pop("testapp.hourly", None)


# --- the command: what is printed, what is refused ------------------------------------


@pytest.fixture
def operator(transactional_db) -> User:
    user = User.objects.create_user("olga", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="replay_deadletter"))
    User.objects.create_user("mallory", is_staff=True)
    return user


def test_jobs_list_disable_enable_and_run_say_what_they_did(operator, capsys):
    call_command("jobs", "disable", "platformkit.outbox_purge", "--actor", "olga", "--reason", "big migration")
    assert "disabled platformkit.outbox_purge actor=olga" in capsys.readouterr().out
    call_command("jobs", "list")
    listed = capsys.readouterr().out
    assert "platformkit.outbox_purge" in listed and "disabled by olga" in listed
    call_command("jobs", "disable", "platformkit.outbox_purge", "--actor", "olga", "--reason", "again")
    assert "unchanged platformkit.outbox_purge: disabled already by olga" in capsys.readouterr().out
    call_command("jobs", "enable", "platformkit.outbox_purge", "--actor", "olga", "--reason", "done", "-v", "0")
    assert capsys.readouterr().out == ""
    call_command("jobs", "run", "platformkit.outbox_purge", "--actor", "olga", "--reason", "now")
    assert "asked platformkit.outbox_purge" in capsys.readouterr().out
    assert LogEntry.objects.count() == 3  # the unchanged disable wrote none
    assert [e.change_message for e in LogEntry.objects.order_by("action_time")] == [
        "Disabled. Reason: big migration",
        "Enabled. Reason: done",
        "Asked for a run by hand. Reason: now",
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["run", "platformkit.outbox_purg", "--actor", "olga", "--reason", "x"],
            "did you mean 'platformkit.outbox_purge'",
        ),
        (["disable", "nope", "--actor", "olga", "--reason", "x"], "unknown job 'nope'"),
        (["disable", "platformkit.outbox_purge", "--actor", "olga"], 'give --reason "..."'),
        (["run", "platformkit.outbox_purge", "--reason", "x"], "give --actor USERNAME"),
        (["run", "platformkit.outbox_purge", "--actor", "mallory", "--reason", "x"], "lacks the permission"),
    ],
)
def test_jobs_refuses_bad_input_and_writes_nothing(operator, args, expected):
    with pytest.raises(CommandError, match=expected.replace(".", r"\.")):
        call_command("jobs", *args)
    assert not JobControl.objects.exists() and not LogEntry.objects.exists()


def test_the_library_refuses_an_undeclared_job_and_a_missing_reason():
    with pytest.raises(ControlRefused, match="unknown job"):
        request_run(["testapp.nothing"], actor="olga", reason="x")
    with pytest.raises(ControlRefused, match="needs a reason"):
        disable(["platformkit.outbox_purge"], actor="olga", reason=" ")
    assert not JobControl.objects.exists()
