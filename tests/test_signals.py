"""django_platformkit.signals: each signal fires once per occurrence, with the
documented kwargs, through the real outbox, relay, NATS and consumer."""

import json
import logging
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction

from django_platformkit import publish, publish_many, signals
from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.jobs import specs as jobs_module
from django_platformkit.jobs.scheduler import Scheduler
from django_platformkit.jobs.specs import job
from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.testing import capture_events
from django_platformkit.wire import subject_for

pytestmark = pytest.mark.django_db(transaction=True)


class Recorder:
    """Connects to every signal; keeps (signal name, kwargs) per send, thread-safe."""

    NAMES = (
        "event_published",
        "event_handled",
        "event_failed",
        "event_dead_lettered",
        "event_malformed",
        "events_relayed",
        "job_finished",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[tuple[str, dict]] = []
        self._receivers = []
        for name in self.NAMES:

            def receiver(sender, signal=None, _name=name, **kwargs):
                with self.lock:
                    self.sent.append((_name, dict(kwargs, sender=sender)))

            getattr(signals, name).connect(receiver, weak=False, dispatch_uid=f"recorder-{name}")

    def of(self, name: str) -> list[dict]:
        return [kwargs for n, kwargs in self.sent if n == name]

    def close(self) -> None:
        for name in self.NAMES:
            getattr(signals, name).disconnect(dispatch_uid=f"recorder-{name}")


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


def subs(*names):
    return [s for s in subscriptions() if s.name in names]


def test_publish_and_publish_many_send_event_published_once_per_row(recorder):
    with transaction.atomic():
        one = publish("testapp.order_placed", {"n": 1}, tenant="acme")
        many = publish_many("testapp.order_placed", [{"n": 2}]) + publish_many(
            "testapp.flaky", [{"n": 3}], tenant="beta"
        )
    sent = recorder.of("event_published")
    assert [s["event_id"] for s in sent] == [one, *many]
    assert [(s["name"], s["tenant"]) for s in sent] == [
        ("testapp.order_placed", "acme"),
        ("testapp.order_placed", None),
        ("testapp.flaky", "beta"),
    ]
    assert [json.loads(s["payload_text"]) for s in sent] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert {s["using"] for s in sent} == {"default"}
    assert sent[0]["sender"].name == "testapp.order_placed"


def test_a_receiver_that_raises_never_fails_publish(recorder):
    def broken(sender, **kwargs):
        raise RuntimeError("receiver bug")

    signals.event_published.connect(broken, weak=False, dispatch_uid="broken")
    try:
        with transaction.atomic():
            event_id = publish("testapp.order_placed", {"n": 1})
    finally:
        signals.event_published.disconnect(dispatch_uid="broken")
    assert OutboxEvent.objects.filter(id=event_id).exists()
    assert len(recorder.of("event_published")) == 1


def test_handled_failed_dead_lettered_malformed_and_relayed_fire_once_per_occurrence(
    recorder, run_worker, transport, caplog
):
    with transaction.atomic():
        good = publish("testapp.order_placed", {"n": 1})
        bad = publish("testapp.flaky", {"always_fail": True})  # max_attempts=3
    transport.publish_raw(subject_for("testapp.flaky", None), b"not json at all")
    caplog.set_level(logging.INFO, logger="django_platformkit")
    run_worker(subscriptions=subs("testapp.record_order", "testapp.count_order", "testapp.flaky"))

    handled = recorder.of("event_handled")
    assert sorted((h["subscription"], h["event"].id, h["outcome"]) for h in handled) == sorted(
        [("testapp.record_order", good, "handled"), ("testapp.count_order", good, "handled")]
    )
    assert all(h["duration_seconds"] > 0 for h in handled)
    failed = recorder.of("event_failed")
    assert [(f["event"].id, f["attempt"], f["will_retry"]) for f in failed] == [
        (bad, 1, True),
        (bad, 2, True),
        (bad, 3, False),
    ]
    assert all(isinstance(f["error"], RuntimeError) for f in failed)
    (dead,) = recorder.of("event_dead_lettered")
    assert (dead["subscription"], dead["event_id"], dead["attempts"]) == ("testapp.flaky", bad, 3)
    assert dead["exception"] is failed[-1]["error"]
    (malformed,) = recorder.of("event_malformed")
    assert malformed["subscription"] == "testapp.flaky" and "not JSON" in malformed["reason"]
    assert DeadLetter.objects.filter(event_id=malformed["event_id"], name="(malformed)").exists()
    assert sum(r["stored"] for r in recorder.of("events_relayed")) == 2
    # Error trackers (Sentry's logging integration) get the exception itself.
    (line,) = [r for r in caplog.records if r.getMessage().startswith("dead letter subscription=testapp.flaky")]
    assert line.levelno == logging.ERROR and line.exc_info[1] is dead["exception"]


def test_job_finished_fires_once_per_run_with_its_outcome(recorder):
    saved = dict(jobs_module._jobs)
    calls = []

    def flaky_job():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first run fails")

    flaky_job.__qualname__ = flaky_job.__name__ = "signal_job"
    job(every=timedelta(minutes=5), name="testapp.signal_job")(flaky_job)

    class Clock:
        moment = datetime(2026, 6, 1, 12, 4, tzinfo=UTC)

        def now(self):
            return self.moment

        def wait(self, stop, seconds):
            return stop.is_set()

    clock = Clock()
    scheduler = Scheduler(clock=clock, jobs=["testapp.signal_job"])
    try:
        for moment in (clock.moment, clock.moment + timedelta(minutes=1), clock.moment + timedelta(minutes=6)):
            clock.moment = moment
            for thread in scheduler.tick():
                thread.join(10)
    finally:
        scheduler.close()
        jobs_module._jobs.clear()
        jobs_module._jobs.update(saved)
    finished = recorder.of("job_finished")
    assert [(f["job"], f["outcome"]) for f in finished] == [
        ("testapp.signal_job", "failed"),
        ("testapp.signal_job", "succeeded"),
    ]
    assert isinstance(finished[0]["error"], RuntimeError) and finished[1]["error"] is None
    assert all(f["duration_seconds"] >= 0 and f["slot"].tzinfo is not None for f in finished)


def test_an_every_second_jobs_runs_log_at_debug_and_a_five_minute_jobs_at_info(caplog):
    from django_platformkit.jobs.slots import run_log_level
    from django_platformkit.jobs.specs import JobSpec

    assert run_log_level(JobSpec(name="a.b", func=lambda: None, every=timedelta(seconds=1))) == logging.DEBUG
    assert run_log_level(JobSpec(name="a.b", func=lambda: None, every=timedelta(minutes=5))) == logging.INFO
    assert run_log_level(JobSpec(name="a.b", func=lambda: None, cron="* * * * *")) == logging.INFO


def test_capture_events_uses_the_signal_and_nests():
    with capture_events() as outer:
        with transaction.atomic():
            publish("testapp.order_placed", {"n": 1})
        with capture_events() as inner, transaction.atomic():
            publish_many("testapp.order_placed", [{"n": 2}])
    assert [e.payload for e in outer] == [{"n": 1}, {"n": 2}]
    assert [e.payload for e in inner] == [{"n": 2}]
    assert not signals.event_published.has_listeners()
