"""Tests of the shop's order endpoint (``manage.py test shop``; the project's
pytest suite runs them in ``tests/test_example_project.py``). Real
PostgreSQL; no broker needed: publishing is one outbox row."""

import json

from django.db import transaction
from django.test import TestCase, TransactionTestCase

from django_platformkit.models import DeadLetter, OutboxEvent
from django_platformkit.testing import run_worker_burst

from .models import Confirmation, Order, OrderStats
from .platformkit import STATS_ROW


def post(client, body, **kwargs):
    return client.post(
        "/orders/",
        data=body if isinstance(body, (str, bytes)) else json.dumps(body),
        content_type="application/json",
        **kwargs,
    )


VALID = {"customer": "ada@example.com", "sku": "tea", "quantity": 3, "unit_price": "2.50"}


class PlaceOrderTests(TestCase):
    def test_a_valid_order_commits_the_order_and_its_event_and_answers_201(self):
        response = post(self.client, VALID)
        self.assertEqual(response.status_code, 201)
        reply = response.json()
        order = Order.objects.get(pk=reply["order_id"])
        self.assertEqual(str(order.total), "7.50")
        event = OutboxEvent.objects.get(pk=reply["event_id"])
        self.assertEqual(event.name, "shop.order_placed")
        self.assertEqual(
            event.payload,
            {"order_id": order.pk, "customer": "ada@example.com", "sku": "tea", "quantity": 3, "total": "7.50"},
        )
        self.assertIsNone(event.published_at)

    def test_a_body_that_is_not_json_is_a_400_that_says_so(self):
        response = post(self.client, "{not json")
        self.assertEqual(response.status_code, 400)
        self.assertIn("not valid JSON", response.json()["error"])
        self.assertFalse(Order.objects.exists())
        self.assertFalse(OutboxEvent.objects.exists())

    def test_a_json_array_is_a_400_asking_for_an_object(self):
        response = post(self.client, [VALID])
        self.assertEqual(response.status_code, 400)
        self.assertEqual(response.json()["error"], "the body must be a JSON object, got list")

    def test_invalid_fields_are_a_400_naming_each_field(self):
        response = post(self.client, {"customer": "nobody", "sku": "tea leaves", "quantity": 0})
        self.assertEqual(response.status_code, 400)
        self.assertEqual(sorted(response.json()["fields"]), ["customer", "quantity", "sku", "unit_price"])
        self.assertFalse(OutboxEvent.objects.exists())

    def test_the_handlers_confirm_and_count_the_order_once_as_the_worker_runs_them_without_a_broker(self):
        order_id = post(self.client, VALID).json()["order_id"]
        result = run_worker_burst()  # relay -> in-memory broker -> claim + handler, retries, dead letters
        self.assertEqual(result.failures, [])
        self.assertEqual(Confirmation.objects.get().order_id, order_id)
        self.assertEqual(OrderStats.objects.get(name=STATS_ROW).orders, 1)
        self.assertFalse(DeadLetter.objects.exists())
        self.assertEqual(run_worker_burst().runs, 0)  # nothing left: each handler ran once

    def test_get_is_405(self):
        self.assertEqual(self.client.get("/orders/").status_code, 405)


class OrderTransactionTests(TransactionTestCase):
    def test_a_rollback_around_the_view_leaves_neither_order_nor_event(self):
        with self.assertRaises(RuntimeError), transaction.atomic():
            self.assertEqual(post(self.client, VALID).status_code, 201)
            raise RuntimeError("the caller's transaction fails after the view ran")
        self.assertFalse(Order.objects.exists())
        self.assertFalse(OutboxEvent.objects.exists())
