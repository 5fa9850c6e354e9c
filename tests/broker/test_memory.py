"""The in-memory transport: users' tests run the worker's real path (relay,
durable, claim + handler, retries, dead letters) with no broker. These tests
need PostgreSQL (the claim is real) and never NATS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.test import TestCase

from django_platformkit import conf, publish
from django_platformkit.broker.memory import InMemoryTransport
from django_platformkit.broker.memory_stream import ManualClock
from django_platformkit.consume.claim import NOT_IN_OUTBOX
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import PermanentFailure
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.testing import capture_events, consumer_spec, run_pending, run_worker_burst
from django_platformkit.wire import OutgoingMessage, PublishOutcome, subject_for
from tests.testapp.models import Effect

ROOT = Path(__file__).resolve().parents[2]
#: (subscription, event id, attempt, tenant seen by the handler) of every run, failed ones included.
RUNS: list[tuple[str, uuid.UUID, int, str]] = []


def _effect(name: str, event, *, tenant_seen: str = "") -> None:
    RUNS.append((name, event.id, event.attempt, tenant_seen))
    Effect.objects.create(subscription=name, event_id=event.id, payload=event.payload, tenant_seen=tenant_seen)


def fails_twice(event):
    _effect("tests.fails_twice", event)
    if event.attempt <= 2:
        raise RuntimeError(f"not yet (attempt {event.attempt})")


def always_fails(event):
    _effect("tests.always_fails", event)
    raise ValueError("this handler never works")


def refuses_for_good(event):
    _effect("tests.refuses_for_good", event)
    raise PermanentFailure("this order can never be shipped: the product no longer exists")


def sees_tenant(event):
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('platformkit.tenant', true)")
        seen = cursor.fetchone()[0]
    _effect("tests.sees_tenant", event, tenant_seen=f"{event.tenant}/{seen}")


def records(event):
    _effect("tests.records", event)


def subscription(handler, *, event: str = "testapp.flaky", **options) -> Subscription:
    # Not registered (no @subscribe): the suite's other workers never see these.
    return Subscription(name=f"tests.{handler.__name__}", event=event, handler=handler, **options)


def publish_one(name: str = "testapp.flaky", payload: dict | None = None, *, tenant: str | None = None) -> uuid.UUID:
    with transaction.atomic():
        return publish(name, payload or {}, tenant=tenant)


class RetriesAndDeadLetters(TestCase):
    def setUp(self):
        RUNS.clear()

    def test_a_handler_that_fails_twice_runs_three_times_and_its_write_exists_once(self):
        sub = subscription(fails_twice, max_attempts_override=3, backoff_seconds_override=(5.0, 60.0))
        event_id = publish_one()

        result = run_worker_burst(subscriptions=[sub])

        self.assertEqual([r[2] for r in RUNS], [1, 2, 3])
        self.assertEqual(Effect.objects.filter(subscription="tests.fails_twice", event_id=event_id).count(), 1)
        self.assertEqual((result.relayed, result.handled, result.retried, result.dead_lettered), (1, 1, 2, 0))
        self.assertEqual([(f.attempt, f.will_retry) for f in result.failures], [(1, True), (2, True)])
        self.assertEqual(str(result.failures[0].error), "not yet (attempt 1)")
        self.assertEqual(result.runs, 3)
        # The backoffs passed on the transport's clock, not the test's: 5 s, then 60 s.
        self.assertEqual(result.transport.clock.now(), 65.0)
        self.assertTrue(HandledEvent.objects.filter(subscription=sub.name, event_id=event_id).exists())
        self.assertFalse(DeadLetter.objects.exists())
        self.assertFalse(OutboxEvent.objects.pending().exists())

    def test_a_handler_that_always_fails_ends_as_one_dead_letter_after_max_attempts_runs(self):
        sub = subscription(always_fails)
        event_id = publish_one(tenant="acme")

        result = run_worker_burst(subscriptions=[sub])

        attempts = conf.settings.MAX_ATTEMPTS
        self.assertEqual([r[2] for r in RUNS], list(range(1, attempts + 1)))
        self.assertEqual(result.dead_lettered, 1)
        self.assertEqual([f.will_retry for f in result.failures], [True] * (attempts - 1) + [False])
        letter = DeadLetter.objects.get()
        self.assertEqual(
            (letter.subscription, letter.event_id, letter.name, letter.tenant, letter.attempts),
            ("tests.always_fails", event_id, "testapp.flaky", "acme", attempts),
        )
        self.assertEqual(letter.error, "ValueError: this handler never works")
        self.assertIn("raise ValueError", letter.traceback)
        self.assertFalse(Effect.objects.exists())  # every run rolled back
        # The terminal claim: nothing runs it again, on this broker or a new one.
        self.assertTrue(HandledEvent.objects.filter(subscription=sub.name, event_id=event_id).exists())
        info = result.transport.consumer_info(sub.durable)
        self.assertEqual((info.num_pending, info.num_ack_pending), (0, 0))
        self.assertEqual(run_worker_burst(subscriptions=[sub]).runs, 0)

    def test_a_permanent_failure_is_dead_lettered_after_its_one_run_with_its_error(self):
        sub = subscription(refuses_for_good)
        event_id = publish_one()
        self.assertGreater(conf.settings.MAX_ATTEMPTS, 1)

        result = run_worker_burst(subscriptions=[sub])

        self.assertEqual([r[2] for r in RUNS], [1])
        self.assertEqual((result.runs, result.retried, result.dead_lettered), (1, 0, 1))
        self.assertEqual([f.will_retry for f in result.failures], [False])
        letter = DeadLetter.objects.get()
        self.assertEqual((letter.event_id, letter.attempts), (event_id, 1))
        self.assertEqual(
            letter.error, "PermanentFailure: this order can never be shipped: the product no longer exists"
        )
        self.assertIn("raise PermanentFailure", letter.traceback)
        self.assertFalse(Effect.objects.exists())  # its run rolled back, as any failed run's

    def test_a_subscriptions_max_attempts_bounds_the_runs(self):
        sub = subscription(always_fails, max_attempts_override=2)
        publish_one()
        result = run_worker_burst(subscriptions=[sub])
        self.assertEqual((result.runs, result.dead_lettered), (2, 1))
        self.assertEqual(DeadLetter.objects.get().attempts, 2)

    def test_with_the_clock_held_a_retry_waits_until_the_test_moves_the_clock(self):
        sub = subscription(fails_twice, max_attempts_override=3, backoff_seconds_override=(5.0, 60.0))
        transport = InMemoryTransport(auto_advance=False)
        publish_one()

        first = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((first.runs, first.retried), (1, 1))
        info = transport.consumer_info(sub.durable)
        self.assertEqual((info.num_pending, info.num_ack_pending), (0, 1))  # parked for its retry

        transport.clock.advance(4.9)
        self.assertEqual(run_worker_burst(transport, subscriptions=[sub]).runs, 0)
        transport.clock.advance(0.1)
        self.assertEqual(run_worker_burst(transport, subscriptions=[sub]).runs, 1)
        self.assertEqual(transport.next_due(), 65.0)
        transport.clock.advance(60)
        last = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((last.runs, last.handled), (1, 1))
        self.assertEqual([r[2] for r in RUNS], [1, 2, 3])


class TenantsAndSettings(TestCase):
    def setUp(self):
        RUNS.clear()

    def test_the_handler_runs_in_the_events_tenant_context(self):
        sub = subscription(sees_tenant, event="testapp.order_placed")
        publish_one("testapp.order_placed", {"n": 1}, tenant="acme")
        publish_one("testapp.order_placed", {"n": 2})
        run_worker_burst(subscriptions=[sub])
        self.assertEqual(
            sorted(Effect.objects.values_list("payload__n", "tenant_seen")), [(1, "acme/acme"), (2, "None/")]
        )

    def test_inside_a_testcase_the_claims_transaction_settings_do_not_outlive_the_burst(self):
        # The test's transaction is the handlers' outer one: their SET LOCALs would otherwise stay.
        def settings():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('idle_in_transaction_session_timeout'), "
                    "current_setting('enable_seqscan'), coalesce(current_setting('platformkit.tenant', true), '')"
                )
                return cursor.fetchone()

        before = settings()
        publish_one("testapp.order_placed", {"n": 1}, tenant="acme")
        run_worker_burst(subscriptions=[subscription(sees_tenant, event="testapp.order_placed")])
        self.assertEqual(settings(), before)
        self.assertEqual(Effect.objects.get().tenant_seen, "acme/acme")

    def test_handlers_in_a_testcase_see_default_planner_settings_not_the_relays(self):
        # The relay turns sorts, sequential scans and JIT off for its
        # transaction, which in a TestCase is the handlers' transaction too.
        seen = []

        def planner(event):
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('enable_seqscan'), current_setting('enable_sort'), current_setting('jit')"
                )
                seen.append(cursor.fetchone())

        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('jit')")
            (jit,) = cursor.fetchone()
        publish_one("testapp.order_placed", {"n": 1})
        run_worker_burst(subscriptions=[subscription(planner, event="testapp.order_placed")])
        self.assertEqual(seen, [("on", "on", jit)])

    def test_the_relays_plan_settings_turn_jit_off_for_its_transaction(self):
        from django_platformkit.identity import database_identity
        from django_platformkit.outbox.relay import Relay

        transport = InMemoryTransport()
        transport.ensure_stream(owner=database_identity("default"))
        publish_one("testapp.order_placed", {"n": 1})
        self.assertEqual(Relay(transport, lanes=1).drain().stored, 1)
        with connection.cursor() as cursor:  # still the TestCase's transaction, the relay's too
            cursor.execute("SELECT current_setting('jit'), current_setting('enable_seqscan')")
            self.assertEqual(cursor.fetchone(), ("off", "off"))


class Deduplication(TestCase):
    def test_a_second_publish_of_one_message_id_within_the_window_is_a_duplicate(self):
        transport = InMemoryTransport()
        transport.ensure_stream()
        subject = subject_for("testapp.flaky", None)
        message = OutgoingMessage(subject=subject, body=b"{}", msg_id="one")
        first, again, other = transport.publish_start(
            [message, message, OutgoingMessage(subject, b"{}", "two")]
        ).results()
        self.assertEqual([r.outcome for r in (first, again, other)], [PublishOutcome.STORED] * 3)
        self.assertEqual([(r.seq, r.duplicate) for r in (first, again, other)], [(1, False), (1, True), (2, False)])
        self.assertEqual(len(transport.messages()), 2)
        # After DUPLICATE_WINDOW_SECONDS the same id is a new message.
        transport.clock.advance(conf.settings.DUPLICATE_WINDOW_SECONDS)
        late = transport.publish_start([message]).results()[0]
        self.assertEqual((late.seq, late.duplicate), (3, False))

    def test_a_relay_resend_is_dropped_by_the_broker_and_after_the_window_skipped_by_the_claim(self):
        RUNS.clear()
        sub = subscription(records)
        transport = InMemoryTransport()
        event_id = publish_one()
        self.assertEqual(run_worker_burst(transport, subscriptions=[sub]).handled, 1)

        # A relay that crashed between the broker's ack and its stamp sends the row again.
        OutboxEvent.objects.filter(id=event_id).update(published_at=None)
        again = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((again.relayed, again.runs, again.skipped), (1, 0, 0))
        self.assertEqual(len(transport.messages()), 1)

        OutboxEvent.objects.filter(id=event_id).update(published_at=None)
        transport.clock.advance(conf.settings.DUPLICATE_WINDOW_SECONDS + 1)
        late = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((late.relayed, late.runs, late.skipped), (1, 0, 1))  # delivered again, the claim skips it
        self.assertEqual(Effect.objects.filter(event_id=event_id).count(), 1)


class WhatTheBrokerRefuses(TestCase):
    def setUp(self):
        RUNS.clear()

    def test_a_malformed_message_is_recorded_and_never_run(self):
        sub = subscription(records)
        transport = InMemoryTransport()
        transport.ensure_stream()
        transport.ensure_consumer(consumer_spec(sub))
        transport.publish_raw(subject_for("testapp.flaky", None), b"not json")
        result = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((result.malformed, result.runs), (1, 0))
        letter = DeadLetter.objects.get()
        self.assertEqual((letter.subscription, letter.name), ("tests.records", "(malformed)"))
        self.assertIn("body is not JSON", letter.error)

    def test_an_event_the_outbox_does_not_hold_is_recorded_as_malformed(self):
        sub = subscription(records)
        transport = InMemoryTransport()
        transport.ensure_stream()
        forged = {
            "specversion": "1.0",
            "id": str(uuid.uuid4()),
            "source": "/testapp",
            "type": "testapp.flaky",
            "time": "2026-01-01T00:00:00Z",
            "data": {},
        }
        transport.ensure_consumer(consumer_spec(sub))
        transport.publish_raw(subject_for("testapp.flaky", None), json.dumps(forged).encode())
        result = run_worker_burst(transport, subscriptions=[sub])
        self.assertEqual((result.malformed, result.runs), (1, 0))
        self.assertIn(NOT_IN_OUTBOX, DeadLetter.objects.get().error)

    def test_a_message_over_max_payload_is_dead_lettered_by_the_relay_and_the_queue_goes_on(self):
        sub = subscription(records)
        big = publish_one(payload={"blob": "x" * 500})
        small = publish_one()
        result = run_worker_burst(InMemoryTransport(max_payload=400), subscriptions=[sub])
        self.assertEqual((result.relayed, result.handled), (1, 1))
        letter = DeadLetter.objects.get()
        self.assertEqual((letter.subscription, letter.event_id), ("platformkit.relay", big))
        self.assertEqual([r[1] for r in RUNS], [small])
        self.assertFalse(OutboxEvent.objects.pending().exists())

    def test_a_stream_another_database_owns_is_refused(self):
        from django_platformkit.exceptions import ConfigurationError

        transport = InMemoryTransport()
        transport.ensure_stream(owner="11111111-1111-1111-1111-111111111111")
        with self.assertRaisesMessage(ConfigurationError, "belongs to another project's database"):
            run_worker_burst(transport, subscriptions=[subscription(records)])


class RunPendingStillWorks(TestCase):
    def test_run_pending_and_capture_events_are_unchanged(self):
        with capture_events() as events:
            publish_one("testapp.order_placed", {"n": 1}, tenant="acme")
        self.assertEqual([e.name for e in events], ["testapp.order_placed"])
        self.assertEqual(run_pending(), 2)
        self.assertEqual(run_pending(), 0)


def test_the_clock_moves_only_forward():
    clock = ManualClock(10)
    clock.advance(2.5)
    clock.advance_to(5)
    assert clock.now() == 12.5
    with pytest.raises(ValueError, match="only moves forward"):
        clock.advance(-1)


@pytest.mark.django_db(transaction=True)
def test_the_worker_runs_its_burst_over_the_in_memory_transport():
    from django_platformkit.runtime.options import WorkerOptions
    from django_platformkit.runtime.worker import Worker

    RUNS.clear()
    subs = [
        subscription(fails_twice, max_attempts_override=3, backoff_seconds_override=(5.0, 60.0)),
        subscription(records, event="testapp.order_placed"),
    ]
    flaky = publish_one()
    order = publish_one("testapp.order_placed", {"n": 1})
    transport = InMemoryTransport()
    worker = Worker(WorkerOptions(burst=True, burst_timeout_seconds=60, subscriptions=subs), transport=transport)
    assert worker.run() == 0
    assert sorted(RUNS) == sorted(
        [("tests.fails_twice", flaky, n, "") for n in (1, 2, 3)] + [("tests.records", order, 1, "")]
    )
    assert Effect.objects.filter(event_id=flaky).count() == 1
    assert transport.clock.now() == 65.0
    assert not OutboxEvent.objects.pending().exists()


PROBE = r"""
import sys
import django
django.setup()
from django.db import transaction
from django_platformkit import publish
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.testing import run_worker_burst
from tests.testapp.models import Effect

def handler(event):
    Effect.objects.create(subscription="probe", event_id=event.id)
    if event.attempt == 1:
        raise RuntimeError("once")

with transaction.atomic():
    event_id = publish("testapp.flaky", {})
result = run_worker_burst(subscriptions=[Subscription(name="probe.handler", event="testapp.flaky", handler=handler)])
print("runs", result.runs, "handled", result.handled, "effects", Effect.objects.filter(event_id=event_id).count())
print("nats", sorted(m for m in sys.modules if m == "nats" or m.startswith("nats.")))
"""


@pytest.mark.process
@pytest.mark.django_db(transaction=True)
def test_the_in_memory_path_never_imports_nats(platformkit_services):
    database_url, _ = platformkit_services
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}  # the closed port: no broker to find
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=database_url,
        PLATFORMKIT_TEST_DB_NAME=connection.settings_dict["NAME"],
        PYTHONPATH=str(ROOT),
    )
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stdout + probe.stderr
    lines = dict(line.split(" ", 1) for line in probe.stdout.splitlines())
    assert lines["runs"] == "2 handled 1 effects 1", probe.stdout
    assert lines["nats"] == "[]", probe.stdout
