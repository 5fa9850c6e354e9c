"""Django's Tasks API (``django.tasks``, Django 6.0+) over the outbox: set
``TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend"}}``."""

from django_platformkit.tasks.backend import OutboxBackend

__all__ = ["OutboxBackend"]
