"""The helpers users get for their own tests work inside a TestCase."""

from django.db import transaction
from django.test import TestCase

from django_platformkit import publish
from django_platformkit.models import HandledEvent, OutboxEvent
from django_platformkit.testing import capture_events, run_pending
from tests.testapp.models import Effect


class HelpersInATestCase(TestCase):
    def test_capture_events_sees_what_was_published(self):
        with capture_events() as events, transaction.atomic():
            event_id = publish("testapp.order_placed", {"n": 1}, tenant="acme")
        self.assertEqual(
            [(e.id, e.name, e.tenant, e.payload) for e in events],
            [(event_id, "testapp.order_placed", "acme", {"n": 1})],
        )

    def test_run_pending_runs_each_subscription_once_with_its_tenant(self):
        with transaction.atomic():
            event_id = publish("testapp.order_placed", {"n": 1}, tenant="acme")
        self.assertEqual(run_pending(), 2)
        self.assertEqual(run_pending(), 0)
        self.assertEqual(
            set(Effect.objects.values_list("subscription", "tenant_seen")),
            {("testapp.record_order", "acme"), ("testapp.count_order", "acme")},
        )
        self.assertEqual(HandledEvent.objects.filter(event_id=event_id).count(), 2)
        self.assertFalse(OutboxEvent.objects.pending().exists())
