"""django-tasks-db: Django's own ``@task`` functions, enqueued on the ``db``
backend (``TASKS["db"]`` in bench/settings.py) inside the publisher's
``transaction.atomic()`` and run by ``manage.py db_worker --backend db`` at
its defaults (one process, one task at a time, a 1 s poll interval when the
queue is empty). django-tasks-db has no periodic tasks: none run beside."""

from __future__ import annotations

from django.tasks import task

from .handler import idle_names, sink


@task
def trickle_a(key: str) -> None:
    sink("trickle_a", key)


@task
def trickle_b(key: str) -> None:
    sink("trickle_b", key)


def _idle(name: str):
    def run(key: str) -> None:
        sink(name, key)

    run.__name__ = run.__qualname__ = name
    run.__module__ = __name__
    return task(run)


for _name in idle_names():
    globals()[_name] = _idle(_name)


def enqueue(key: str) -> None:
    trickle_a.using(backend="db").enqueue(key)
    trickle_b.using(backend="db").enqueue(key)
