"""On Django 5.2 (no django.tasks) django_platformkit.tasks imports, registers
no queues, and configuring OutboxBackend says that Django 6 is needed."""

import pytest

from django_platformkit.exceptions import ConfigurationError
from django_platformkit.tasks.backend import OutboxBackend
from django_platformkit.tasks.queues import BACKEND_PATH, HAVE_DJANGO_TASKS, configured_queues
from django_platformkit.tasks.registry import register_task_queues


@pytest.mark.skipif(HAVE_DJANGO_TASKS, reason="Django 6+: tests/tasks/test_backend.py covers the backend")
def test_on_django_52_the_backend_says_it_needs_django_6(settings):
    import django

    settings.TASKS = {"default": {"BACKEND": BACKEND_PATH, "QUEUES": ["default"]}}
    assert configured_queues() == {}
    assert register_task_queues() == []
    with pytest.raises(
        ConfigurationError,
        match=rf"django.tasks, which is new in Django 6.0; this project runs Django {django.get_version()}",
    ):
        OutboxBackend("default", {})
