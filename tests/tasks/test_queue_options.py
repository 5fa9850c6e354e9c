"""Per-queue options, ``TASKS[alias]["OPTIONS"]["QUEUES"][name]``:
``MAX_ATTEMPTS``, ``BACKOFF_SECONDS`` and ``RATE_LIMIT`` become the queue's
subscription's, and the checks E109-E115 say what is wrong, one test per id."""

from __future__ import annotations

import pytest
from django.test import override_settings

pytest.importorskip("django.tasks")

from django_platformkit.tasks.backend import OutboxBackend
from django_platformkit.tasks.checks import CHECKS

pytestmark = pytest.mark.unit

BACKEND = "django_platformkit.tasks.OutboxBackend"


def ids(options, queues=("default", "emails")):
    return [e.id for e in OutboxBackend("default", {"QUEUES": list(queues), "OPTIONS": options}).check()]


def test_valid_queue_options_pass_the_checks():
    assert ids({"QUEUES": {"emails": {"MAX_ATTEMPTS": 3, "BACKOFF_SECONDS": [1, 10], "RATE_LIMIT": "10/s"}}}) == []


def test_e110_queues_options_not_a_dict():
    assert ids({"QUEUES": ["emails"]}) == ["platformkit.E110"]
    assert ids({"QUEUES": {"emails": 3}}) == ["platformkit.E110"]


def test_e111_options_for_a_queue_the_backend_doesnt_serve():
    assert ids({"QUEUES": {"emials": {"MAX_ATTEMPTS": 3}}}) == ["platformkit.E111"]


def test_e112_an_unknown_queue_option_with_a_suggestion():
    errors = OutboxBackend("default", {"QUEUES": ["emails"], "OPTIONS": {"QUEUES": {"emails": {"MAX_ATTEMPT": 3}}}})
    (error,) = errors.check()
    assert error.id == "platformkit.E112" and "did you mean 'MAX_ATTEMPTS'" in error.msg


@pytest.mark.parametrize("bad", [0, -1, "3", True, 1.5])
def test_e113_max_attempts_not_a_positive_int(bad):
    assert ids({"QUEUES": {"emails": {"MAX_ATTEMPTS": bad}}}) == ["platformkit.E113"]


@pytest.mark.parametrize("bad", ["10", [], [-1], [float("nan")]])
def test_e114_backoff_seconds_not_a_list_of_delays(bad):
    assert ids({"QUEUES": {"emails": {"BACKOFF_SECONDS": bad}}}) == ["platformkit.E114"]


@pytest.mark.parametrize("bad", ["10", "10/d", "0/s", 10, None])
def test_e115_rate_limit_not_a_rate(bad):
    assert ids({"QUEUES": {"emails": {"RATE_LIMIT": bad}}}) == ["platformkit.E115"]


def test_e109_two_backends_serving_a_queue_with_different_queue_options():
    tasks = {
        "a": {"BACKEND": BACKEND, "QUEUES": ["emails"], "OPTIONS": {"QUEUES": {"emails": {"MAX_ATTEMPTS": 3}}}},
        "b": {"BACKEND": BACKEND, "QUEUES": ["emails"]},
    }
    with override_settings(TASKS=tasks):
        errors = OutboxBackend("a", tasks["a"]).check()
    assert [e.id for e in errors] == ["platformkit.E109"] and "QUEUES['emails']" in errors[0].msg


def test_every_check_id_has_a_message_and_a_hint():
    assert sorted(CHECKS) == [f"E{n}" for n in range(101, 116)]
    assert all(message and hint for message, hint in CHECKS.values())


def test_a_queues_options_become_its_subscriptions(registries):
    from django_platformkit.consume.subscriptions import get_subscription
    from django_platformkit.tasks.registry import register_task_queues

    options = {"QUEUES": {"emails": {"MAX_ATTEMPTS": 2, "BACKOFF_SECONDS": [5, 50], "RATE_LIMIT": "30/m"}}}
    with override_settings(
        TASKS={"default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"], "OPTIONS": options}}
    ):
        register_task_queues()
    emails, default = get_subscription("platformkit.task_emails"), get_subscription("platformkit.task_default")
    assert (emails.max_attempts, emails.backoff_seconds, str(emails.rate_limit)) == (2, (5, 50), "30/m")
    assert default.rate_limit is None and default.max_attempts_override is None
