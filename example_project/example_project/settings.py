"""Settings of the example project: a shop whose order endpoint publishes
``shop.order_placed`` and whose worker confirms and counts orders.

PostgreSQL and NATS: ``DATABASE_URL`` / ``NATS_URL`` from the environment;
unset, the local defaults in ``example_project.services`` (127.0.0.1:5432 and
:4222). ``manage.py demo`` is the exception: it starts throwaway servers for
whichever is unset before these settings are read (see ``manage.py``).
"""

import os

from django_platformkit.devservices import database_settings

from . import services

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = [
    "127.0.0.1",
    "localhost",
    "testserver",
    *filter(None, os.environ.get("DJANGO_ALLOWED_HOSTS", "").split(",")),
]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_platformkit",
    "shop",
]
# Django's Tasks API through the outbox: send_receipt (shop/tasks.py).
TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default", "emails"]}}
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    # The admin, the console included, in the browser's language (English, German, French, Spanish).
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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

# Keep connections across requests (and check them before reuse): a new
# PostgreSQL connection per request costs more than the order insert itself.
DATABASES = {"default": database_settings(services.database_url(), CONN_MAX_AGE=60, CONN_HEALTH_CHECKS=True)}

PLATFORMKIT = {
    "NATS_URL": services.nats_url(),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "loggers": {
        "django_platformkit": {"handlers": ["stderr"], "level": os.environ.get("PLATFORMKIT_LOG_LEVEL", "INFO")},
        "shop": {"handlers": ["stderr"], "level": "INFO"},  # the periodic report (shop.report_sales)
        # Django logs every task's state change at INFO ("Task id=... state=RUNNING"): one line per
        # task run is noise in a worker's log (ours logs counts per interval and every failure).
        "django.tasks": {"level": "WARNING"},
    },
}
