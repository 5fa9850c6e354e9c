"""One subscription per task queue: ``register_task_queues()`` declares each
queue's event and subscribes the task runner to it (``AppConfig.ready()``
calls it), and ``queue_subscriptions()`` picks the ones ``runworker
--queue`` serves.
"""

from __future__ import annotations

from collections.abc import Sequence

from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.tasks.queues import (
    BACKEND_PATH,
    QUEUE_NAME,
    batch_of,
    concurrency_of,
    configured_queues,
    event_name,
    queue_of,
    subscribe_options,
)


def register_task_queues() -> list[str]:
    """Declare the event and subscribe the built-in handler of every queue in
    ``TASKS`` (called by ``AppConfig.ready()``; safe to call again after the
    setting changed). Invalid queue names are skipped here and reported by
    the check ``platformkit.E102``. Returns the subscription names."""
    from django_platformkit.consume.subscriptions import get_subscription, subscribe
    from django_platformkit.outbox.events import declare
    from django_platformkit.tasks.results import RUNNING_LOCK_NAMESPACE
    from django_platformkit.tasks.runner import run_task

    names = []
    for queue in configured_queues():
        if not QUEUE_NAME.match(str(queue)):
            continue
        name = event_name(queue)
        declare(
            name,
            description=f"A django.tasks task on queue {queue!r} (payload: task path, args, kwargs, backend alias).",
        )
        subscribe(
            name, name=name, batch=batch_of(queue), concurrency=concurrency_of(queue), **subscribe_options(queue)
        )(run_task)
        # The claim takes each task's RUNNING lock: no statement of its own per task.
        subscription = get_subscription(name)
        assert subscription is not None  # registered by the line above
        subscription.claim_lock_namespace = RUNNING_LOCK_NAMESPACE
        names.append(name)
    return names


def queue_subscriptions(queues: Sequence[str]) -> list[Subscription]:
    """The subscriptions that run ``queues`` (``runworker --queue``). Raises
    ``ConfigurationError`` naming the queues no ``TASKS`` backend of ours has."""
    from django_platformkit.consume.subscriptions import subscriptions

    known = {queue: s for s in subscriptions() if (queue := queue_of(s.name)) is not None}
    missing = sorted(set(queues) - set(known))
    if missing:
        raise ConfigurationError(
            f"unknown queue(s) {', '.join(missing)}; the TASKS queues of {BACKEND_PATH} are: {', '.join(sorted(known)) or '(none)'}"
        )
    return [known[q] for q in dict.fromkeys(queues)]
