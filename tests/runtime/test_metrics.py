"""/metrics (django_platformkit.runtime.metrics): what a scrape says after a burst
equals what the database says happened - against real PostgreSQL and NATS."""

import platform
import subprocess
import sys
import time
import urllib.request

import django
import pytest
from django.db import transaction
from prometheus_client.parser import text_string_to_metric_families

from django_platformkit import __version__, publish
from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.runtime.metrics import Metrics
from django_platformkit.wire import subject_for
from tests.conftest import ROOT, manage, wait_for, worker_env
from tests.testapp.models import Attempt

pytestmark = pytest.mark.django_db(transaction=True)

SUBS = ["testapp.record_order", "testapp.count_order", "testapp.flaky"]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics over HTTP; {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def handled(samples, subscription, outcome, task=""):
    labels = (("outcome", outcome), ("subscription", subscription), ("task", task))
    return samples.get(("platformkit_handled_total", labels), 0.0)


def test_a_tasks_handlings_durations_latency_and_dead_letter_carry_its_dotted_path_as_the_task_label():
    import uuid

    from django.utils import timezone

    from django_platformkit import signals
    from django_platformkit.wire import ReceivedEvent

    m = Metrics(subscriptions=[]).connect()
    try:
        event = ReceivedEvent(
            uuid.uuid4(), "platformkit.task_default", None, {"task": "shop.tasks.send"}, timezone.now(), 1
        )
        common = dict(sender=None, subscription="shop.runner", event=event)
        signals.event_handled.send(**common, outcome="handled", duration_seconds=0.5, delivery_latency_seconds=2.0)
        signals.event_failed.send(**common, error=ValueError(), attempt=1, will_retry=True, duration_seconds=0.1)
        signals.event_dead_lettered.send(sender=None, subscription="shop.runner", task="shop.tasks.send")
        value = m.registry.get_sample_value
        labels = {"subscription": "shop.runner", "task": "shop.tasks.send"}
        assert value("platformkit_handled_total", {**labels, "outcome": "handled"}) == 1
        assert value("platformkit_handled_total", {**labels, "outcome": "retried"}) == 1
        assert value("platformkit_handled_total", {**labels, "outcome": "dead_lettered"}) == 1
        assert value("platformkit_handler_duration_seconds_count", labels) == 2
        assert value("platformkit_delivery_latency_seconds_sum", labels) == 2.0
    finally:
        m.close()


@pytest.fixture
def metrics():
    subs = [s for s in subscriptions() if s.name in SUBS]
    m = Metrics(subscriptions=subs).connect()
    yield m
    m.close()


def test_metrics_scraped_after_a_burst_equal_what_the_database_says_happened(run_worker, metrics, transport):
    with transaction.atomic():
        for i in range(5):
            publish("testapp.order_placed", {"n": i})
        publish("testapp.flaky", {"fail_until": 1})  # one retry, then handled
        publish("testapp.flaky", {"always_fail": True})  # max_attempts=3: two retries, one dead letter
    transport.publish_raw(subject_for("testapp.flaky", None), b"not json at all")  # one malformed
    subs = [s for s in subscriptions() if s.name in SUBS]
    metrics.transport = transport
    port = metrics.serve(0, "127.0.0.1")
    run_worker(subscriptions=subs)

    samples = scrape(port)
    # relayed: every outbox row the relay stamped (the replay-free run: 7)
    assert (
        samples[("platformkit_relayed_total", ())]
        == OutboxEvent.objects.filter(published_at__isnull=False).count()
        == 7
    )
    dead = DeadLetter.objects.exclude(name="(malformed)")
    for name in SUBS:
        claims = HandledEvent.objects.filter(subscription=name).count()
        terminal = dead.filter(subscription=name).count()
        assert handled(samples, name, "handled") == claims - terminal, name
        assert handled(samples, name, "dead_lettered") == terminal, name
        assert (
            handled(samples, name, "malformed")
            == DeadLetter.objects.filter(subscription=name, name="(malformed)").count()
        ), name
    # retried = every attempt that ran and was not the last one of its event
    runs = Attempt.objects.filter(subscription="testapp.flaky").count()
    flaky_events = HandledEvent.objects.filter(subscription="testapp.flaky").count()
    assert handled(samples, "testapp.flaky", "retried") == runs - flaky_events == 3
    assert handled(samples, "testapp.flaky", "dead_lettered") == 1
    assert handled(samples, "testapp.flaky", "malformed") == 1
    assert handled(samples, "testapp.record_order", "handled") == 5
    # one observation per handler run, failed runs included
    assert (
        samples[("platformkit_handler_duration_seconds_count", (("subscription", "testapp.flaky"), ("task", "")))]
        == runs
        == 5
    )
    # one delivery latency per handler run too, from the row's commit to the start
    assert (
        samples[("platformkit_delivery_latency_seconds_count", (("subscription", "testapp.flaky"), ("task", "")))]
        == runs
    )
    # scrape-time gauges: nothing waits after a burst ...
    assert samples[("platformkit_outbox_pending", ())] == 0
    assert samples[("platformkit_outbox_lag_seconds", ())] == 0
    for name in SUBS:
        assert samples[("platformkit_consumer_pending", (("subscription", name),))] == 0
    assert (
        samples[("platformkit_dead_letters", (("subscription", "testapp.flaky"),))]
        == DeadLetter.objects.filter(subscription="testapp.flaky").count()
        == 2
    )
    assert samples[("platformkit_scrape_ok", (("source", "database"),))] == 1
    assert samples[("platformkit_scrape_ok", (("source", "nats"),))] == 1

    # ... and a row written now is pending, with a lag that grows
    with transaction.atomic():
        publish("testapp.order_placed", {"n": 99})
    time.sleep(0.3)
    later = scrape(port)
    assert later[("platformkit_outbox_pending", ())] == OutboxEvent.objects.pending().count() == 1
    assert later[("platformkit_outbox_lag_seconds", ())] >= 0.3


def test_a_scrape_with_nats_unreachable_still_reports_the_database_figures(metrics, broker):
    from django_platformkit.broker.transport import Transport

    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
    metrics.transport = Transport(url="nats://127.0.0.1:1")  # never connected
    samples = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("platformkit_outbox_pending", ())] == 1
    assert samples[("platformkit_scrape_ok", (("source", "nats"),))] == 0
    assert not any(name == "platformkit_consumer_pending" for name, _ in samples)


def test_build_info_says_which_release_django_and_python_the_process_runs(metrics):
    labels = {"version": __version__, "django": django.get_version(), "python": platform.python_version()}
    assert metrics.registry.get_sample_value("platformkit_build_info", labels) == 1


def test_two_metrics_in_one_process_have_registries_of_their_own(metrics):
    from django_platformkit import signals

    other = Metrics().connect()
    try:
        signals.job_finished.send_robust(
            sender=None, job="testapp.tick", slot=None, outcome="succeeded", error=None, duration_seconds=0.1
        )
        for m in (metrics, other):
            assert (
                m.registry.get_sample_value(
                    "platformkit_job_runs_total", {"job": "testapp.tick", "outcome": "succeeded"}
                )
                == 1
            )
    finally:
        other.close()
    signals.job_finished.send_robust(
        sender=None, job="testapp.tick", slot=None, outcome="failed", error=None, duration_seconds=0.1
    )
    assert (
        other.registry.get_sample_value("platformkit_job_runs_total", {"job": "testapp.tick", "outcome": "failed"})
        is None
    )
    assert (
        metrics.registry.get_sample_value("platformkit_job_runs_total", {"job": "testapp.tick", "outcome": "failed"})
        == 1
    )


@pytest.mark.process
def test_runrelay_metrics_port_serves_metrics_from_a_real_process(broker):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with transaction.atomic():
        for i in range(3):
            publish("testapp.order_placed", {"n": i})
    process = manage(
        "runrelay",
        "--metrics-port",
        str(port),
        env=worker_env(broker),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def relayed():
            try:
                return scrape(port).get(("platformkit_relayed_total", ()), 0) == 3
            except OSError:
                return False

        wait_for(relayed, timeout=60, what="runrelay's /metrics to show 3 relayed")
        assert scrape(port)[("platformkit_outbox_pending", ())] == OutboxEvent.objects.pending().count() == 0
        assert listening_on(process.pid, port) == {"127.0.0.1"}  # the documented default: this machine only
        assert [labels for name, labels in scrape(port) if name == "platformkit_build_info"] == [
            (("django", django.get_version()), ("python", platform.python_version()), ("version", __version__))
        ]
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err.decode()


def listening_on(pid: int, port: int) -> set[str]:
    import psutil

    return {
        c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    }


@pytest.mark.process
@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_metrics_host_chooses_the_address_metrics_listen_on(broker, host):
    """``--metrics-port`` bound every interface with no way to choose (issue 27)."""
    from django_platformkit.devservices import free_port

    port = free_port()
    process = manage(
        "runrelay",
        "--metrics-port",
        str(port),
        "--metrics-host",
        host,
        env=worker_env(broker),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: listening_on(process.pid, port), timeout=60, what="the metrics listener")
        assert listening_on(process.pid, port) == {host}
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.mark.process
def test_metrics_port_taken_is_a_clear_command_error(broker):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "manage.py"), "runrelay", "--once", "--metrics-port", str(port)],
            env=worker_env(broker),
            cwd=ROOT,
            capture_output=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert f"--metrics-port {port}: can't listen there" in result.stderr.decode()


@pytest.mark.process
def test_runworker_metrics_port_counts_what_the_database_holds_in_a_real_process(broker, tmp_path):
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:  # a file, not a pipe nobody reads while the test waits
        process = manage(
            "runworker",
            "--metrics-port",
            str(port),
            "--no-jobs",
            "--subscription",
            "testapp.record_order",
            env=worker_env(broker),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with transaction.atomic():
            for i in range(4):
                publish("testapp.order_placed", {"n": i})

        def settled():
            try:
                samples = scrape(port)
            except OSError:
                return False
            return handled(samples, "testapp.record_order", "handled") == 4 and samples

        try:
            # 150 s: on CI's loaded machine NATS once took 41 s to make a
            # fresh stream and durable (every request of the worker's, the
            # scrapes' included, went unanswered for seconds at a time);
            # handling follows within a second of the durable.
            samples = wait_for(settled, timeout=150, what="runworker's /metrics to show 4 handled")
        except AssertionError as failure:
            raise AssertionError(f"{failure}; the worker's log:\n{log.read_text()}") from None
        assert (
            handled(samples, "testapp.record_order", "handled")
            == HandledEvent.objects.filter(subscription="testapp.record_order").count()
        )
        assert (
            samples[("platformkit_relayed_total", ())]
            == OutboxEvent.objects.filter(published_at__isnull=False).count()
            == 4
        )
        assert samples[("platformkit_consumer_pending", (("subscription", "testapp.record_order"),))] == 0
        assert (
            "platformkit_consumer_pending",
            (("subscription", "testapp.count_order"),),
        ) not in samples  # not this worker's
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    assert process.returncode == 0, log.read_text()


def test_a_scrape_inside_a_callers_transaction_leaves_it_usable_and_its_timeout_alone(metrics):
    from django.db import connection

    with transaction.atomic():
        publish("testapp.order_placed", {"n": 1})
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            before = cursor.fetchone()[0]
        assert b"platformkit_outbox_pending 1.0" in metrics.exposition()  # sees its own uncommitted row
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            assert cursor.fetchone()[0] == before
        publish("testapp.order_placed", {"n": 2})
    assert OutboxEvent.objects.pending().count() == 2


def test_a_reconciliation_pass_counts_what_it_sent_again_per_subscription_and_cause(metrics, broker):
    from tests.conftest import lose_the_stream_and_reconcile

    orders = ["testapp.record_order", "testapp.count_order"]
    assert lose_the_stream_and_reconcile(orders, 3).resent == 6
    port = metrics.serve(0, "127.0.0.1")
    samples = scrape(port)
    for name in orders:
        labels = (("cause", "stream_replaced"), ("subscription", name))
        assert samples[("platformkit_reconciled_total", labels)] == 3
