"""Django settings of the benchmark (and of the worker and relay processes
it starts). ``bench/run.py`` chooses the servers and puts them in the
environment before Django starts: ``BENCH_DATABASE_URL`` (a database the
benchmark owns: its tables are truncated between measurements),
``BENCH_NATS_URL``, ``BENCH_STREAM`` and ``BENCH_SUBJECT_PREFIX``."""

import json
import os

from django_platformkit.devservices import database_settings

SECRET_KEY = "bench-only"
DEBUG = False  # DEBUG keeps every query in memory: it would skew both speed and RSS
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS: list[str] = []
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_platformkit",
    "bench.benchapp",
]

DATABASES = {
    "default": database_settings(
        os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/platformkit_bench")
    )
}
# Persistent connections (CONN_MAX_AGE=None), as procrastinate's and
# pgqueuer's pools have: the comparisons are of queue designs, not of
# reconnects. BENCH_CONN_MAX_AGE=0 (Django's default) is what the rows marked
# "CONN_MAX_AGE=0" run with; "none" means None.
_age = os.environ.get("BENCH_CONN_MAX_AGE", "none")
DATABASES["default"]["CONN_MAX_AGE"] = None if _age.lower() == "none" else int(_age)

PLATFORMKIT = {
    "NATS_URL": os.environ.get("BENCH_NATS_URL", "nats://127.0.0.1:4222"),
    "STREAM": os.environ.get("BENCH_STREAM", "PLATFORMKIT_BENCH"),
    "SUBJECT_PREFIX": os.environ.get("BENCH_SUBJECT_PREFIX", "pkbench"),
    # An experiment's overrides, e.g. BENCH_PLATFORMKIT='{"CONSUMER_THREADS": 2}'
    # (every row of a published run uses the defaults).
    **json.loads(os.environ.get("BENCH_PLATFORMKIT", "{}")),
}

# django.tasks (bench/measure_tasks.py): ours, and django-tasks-db (the
# reference database backend) when installed, on the same no-op task.
TASKS = {
    "default": {
        "BACKEND": "django_platformkit.tasks.OutboxBackend",
        "QUEUES": ["default"],
        # BENCH_TASKS_BATCH unset: the backend's default OPTIONS, as users get them.
        "OPTIONS": {} if "BENCH_TASKS_BATCH" not in os.environ else {"BATCH": os.environ["BENCH_TASKS_BATCH"] == "1"},
    }
}
try:
    import django_tasks_db  # noqa: F401

    INSTALLED_APPS.append("django_tasks_db")
    TASKS["db"] = {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]}
except ImportError:
    pass

# The trickle's peers (bench/measure_trickle.py, bench/peers/): procrastinate
# through its Django integration (its migrations make its tables), and
# Celery's settings (read by bench/peers/celery_app.py) when installed.
try:
    import procrastinate.contrib.django  # noqa: F401

    INSTALLED_APPS.append("procrastinate.contrib.django")
    PROCRASTINATE_AUTODISCOVER_MODULE_NAME = "procrastinate_tasks"  # no app has one: the tasks are named below
    PROCRASTINATE_IMPORT_PATHS = ["bench.peers.procrastinate_tasks"]
except ImportError:
    pass
CELERY_BROKER_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_IGNORE_RESULT = True  # no result backend: nothing reads the results
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes every database connection before and after
# each task unless this is set (a reconnect per task, ignoring CONN_MAX_AGE);
# every other system here keeps its connections, so Celery does too.
CELERY_DB_REUSE_MAX = 1_000_000
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}},
    "loggers": {
        "django_platformkit": {
            "handlers": ["stderr"],
            "level": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
            "propagate": False,
        }
    },
}
