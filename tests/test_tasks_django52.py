"""On Django 5.2 (no django.tasks) django_platformkit.tasks imports, registers
no queues, and configuring OutboxBackend says that Django 6 is needed."""

import pytest

from django_platformkit.tasks import backend as tasks


@pytest.mark.skipif(tasks.HAVE_DJANGO_TASKS, reason="Django 6+: tests/test_tasks.py covers the backend")
def test_on_django_52_the_backend_says_it_needs_django_6(settings):
    import django

    settings.TASKS = {"default": {"BACKEND": tasks.BACKEND_PATH, "QUEUES": ["default"]}}
    assert tasks.configured_queues() == {}
    assert tasks.register_task_queues() == []
    with pytest.raises(
        tasks.ConfigurationError,
        match=rf"django.tasks, which is new in Django 6.0; this project runs Django {django.get_version()}",
    ):
        tasks.OutboxBackend("default", {})
