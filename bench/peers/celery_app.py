"""Celery as its "First steps with Django" sets it up: settings from
Django's (``CELERY_`` namespace, bench/settings.py), Redis as the broker
(``BENCH_REDIS_URL``), no result backend (``task_ignore_result``: nothing
reads results), Django's connections kept across tasks
(``CELERY_DB_REUSE_MAX``: Celery's Django fixup otherwise reconnects for
every task, whatever ``CONN_MAX_AGE`` says), everything else at Celery's defaults - the prefork pool
with one child per CPU, prefetch multiplier 4, acks on receipt. The
publisher enqueues with ``transaction.on_commit(lambda: task.delay(...))``,
as Celery's Django docs recommend; ``celery beat`` (its own process) sends
a job every 5 s and one every minute.

    celery -A bench.peers.celery_app worker
    celery -A bench.peers.celery_app beat
"""

from __future__ import annotations

import os
from datetime import timedelta

from celery import Celery

from .handler import idle_names

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

app = Celery("bench")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(name="trickle_a")
def trickle_a(key: str) -> None:
    from .handler import sink

    sink("trickle_a", key)


@app.task(name="trickle_b")
def trickle_b(key: str) -> None:
    from .handler import sink

    sink("trickle_b", key)


def _idle(name: str) -> None:
    @app.task(name=name)
    def run(key: str) -> None:
        from .handler import sink

        sink(name, key)


for _name in idle_names():
    _idle(_name)


@app.task(name="trickle_job_often")
def trickle_job_often() -> None:
    from .handler import job_often

    job_often()


@app.task(name="trickle_job_rare")
def trickle_job_rare() -> None:
    from .handler import job_rare

    job_rare()


app.conf.beat_schedule = {
    "often": {"task": "trickle_job_often", "schedule": timedelta(seconds=5)},
    "rare": {"task": "trickle_job_rare", "schedule": timedelta(minutes=1)},
}


def enqueue(key: str) -> None:
    from django.db import transaction

    def send() -> None:
        trickle_a.delay(key)
        trickle_b.delay(key)

    transaction.on_commit(send)
