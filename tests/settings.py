"""Settings for the test suite (and the worker processes tests start).

Importing this module starts nothing and connects to nothing: the servers
come from ``DATABASE_URL`` / ``NATS_URL`` when set (a worker process a test
starts inherits them), otherwise from the session fixture
``platformkit_services`` in ``tests/conftest.py``, which starts throwaway
ones only when a test that needs them runs, and points these settings at
them. Until then both URLs name a closed port, so a test that reaches a
server without asking for one fails at once instead of finding someone
else's server. mypy's Django plugin and mkdocstrings load this module too.
"""

import os
import uuid

from django_platformkit.devservices import database_settings

from .services import NOT_STARTED_DATABASE_URL, NOT_STARTED_NATS_URL

DATABASE_URL = os.environ.get("DATABASE_URL") or NOT_STARTED_DATABASE_URL
NATS_URL = os.environ.get("NATS_URL") or NOT_STARTED_NATS_URL

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.urls"
# The admin's CSS, served by pytest-django's live_server (tests/admin/test_browser.py).
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_platformkit",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# Worker processes started by a test connect to the test database by name.
_db_name = os.environ.get("PLATFORMKIT_TEST_DB_NAME")
DATABASES = {"default": database_settings(DATABASE_URL, **({"NAME": _db_name} if _db_name else {}))}
if _db_name:
    DATABASES["default"]["TEST"] = {"NAME": _db_name}
# Django's connection pool for a worker process a test starts (JSON: the pool's options).
if os.environ.get("PLATFORMKIT_TEST_DB_POOL"):
    import json

    DATABASES["default"]["OPTIONS"] = {"pool": json.loads(os.environ["PLATFORMKIT_TEST_DB_POOL"])}

# A token per test session, set once and inherited by the processes tests
# start: each run creates a fresh test database (a new identity), so a stream
# shared with an earlier run against the same NATS (CI runs the suite twice)
# would be refused as another project's. Stream and prefix both carry it
# (two streams can't hold the same subjects).
_RUN = os.environ.setdefault("PLATFORMKIT_TEST_RUN", uuid.uuid4().hex[:8])

PLATFORMKIT = {
    "NATS_URL": NATS_URL,
    "STREAM": os.environ.get("PLATFORMKIT_TEST_STREAM", f"PLATFORMKIT_TEST_{_RUN}"),
    "SUBJECT_PREFIX": os.environ.get("PLATFORMKIT_TEST_PREFIX", f"pktest_{_RUN}"),
    "BACKOFF_SECONDS": [0.2, 0.5, 1],
    "ACK_WAIT_SECONDS": float(os.environ.get("PLATFORMKIT_TEST_ACK_WAIT", "30")),
    "HANDLER_TIMEOUT_SECONDS": float(os.environ.get("PLATFORMKIT_TEST_HANDLER_TIMEOUT", "25")),
    "HANDLER_STUCK_GRACE_SECONDS": float(os.environ.get("PLATFORMKIT_TEST_STUCK_GRACE", "60")),
    "RELAY_INTERVAL_SECONDS": 0.5,
    # The library's default (5); a scenario that needs another limit sets
    # PLATFORMKIT_TEST_MAX_ATTEMPTS (tests/chaos/ runs with the default).
    "MAX_ATTEMPTS": int(os.environ.get("PLATFORMKIT_TEST_MAX_ATTEMPTS", "5")),
    "STREAM_REPLICAS": int(os.environ.get("PLATFORMKIT_TEST_STREAM_REPLICAS", "1")),
    # The library's default (60 s); the reconciliation scenarios (tests/chaos/test_reconcile.py) pass less.
    "RECONCILE_INTERVAL_SECONDS": float(os.environ.get("PLATFORMKIT_TEST_RECONCILE_INTERVAL", "60")),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}},
    "loggers": {
        "django_platformkit": {"handlers": ["stderr"], "level": os.environ.get("PLATFORMKIT_LOG_LEVEL", "INFO")}
    },
}

# django.tasks (Django 6+): the test app's tasks are decorated against these
# queues; tests/tasks/test_backend.py switches the backend to OutboxBackend (and so
# do worker processes it starts, through PLATFORMKIT_TEST_TASKS), so other
# tests' workers don't get the task subscriptions.
TASKS = {
    "default": {
        "BACKEND": "django_platformkit.tasks.OutboxBackend"
        if os.environ.get("PLATFORMKIT_TEST_TASKS")
        else "django.tasks.backends.immediate.ImmediateBackend",
        "QUEUES": ["default", "emails"],
    }
}
# Two rate-limited queues beside the default one (tests/consume/test_ratelimit.py's starvation test).
RATED_QUEUES = {"slow_a": {"RATE_LIMIT": "12/m"}, "slow_b": {"RATE_LIMIT": "12/m"}}
if os.environ.get("PLATFORMKIT_TEST_TASKS_RATED"):
    TASKS["default"]["QUEUES"] = ["default", "emails", *RATED_QUEUES]
    TASKS["default"]["OPTIONS"] = {"QUEUES": RATED_QUEUES}
