"""procrastinate through its Django integration (``procrastinate.contrib.django``,
as its Django how-to sets it up): ``task.defer()`` writes the job with
Django's connection, inside the publisher's ``transaction.atomic()``; the
worker is ``manage.py procrastinate worker`` at its defaults (concurrency 1,
LISTEN/NOTIFY with a 5 s poll), running these sync tasks (procrastinate
runs a sync task in a thread, with Django's ORM), and its periodic
deferrer: a job every 5 s and one every minute."""

from __future__ import annotations

from procrastinate.contrib.django import app

from .handler import idle_names, job_often, job_rare, sink


@app.task(name="trickle_a")
def trickle_a(key: str) -> None:
    sink("trickle_a", key)


@app.task(name="trickle_b")
def trickle_b(key: str) -> None:
    sink("trickle_b", key)


def _idle(name: str) -> None:
    @app.task(name=name)
    def run(key: str) -> None:
        sink(name, key)


for _name in idle_names():
    _idle(_name)


@app.periodic(cron="*/5 * * * * *")  # the 6th field is seconds
@app.task(name="trickle_job_often")
def trickle_job_often(timestamp: int) -> None:
    job_often()


@app.periodic(cron="* * * * *")
@app.task(name="trickle_job_rare")
def trickle_job_rare(timestamp: int) -> None:
    job_rare()


def enqueue(key: str) -> None:
    trickle_a.defer(key=key)
    trickle_b.defer(key=key)
