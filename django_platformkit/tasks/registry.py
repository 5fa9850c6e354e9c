"""One subscription per task queue and priority band: ``register_task_queues()``
declares each band's event and subscribes the task runner to it
(``AppConfig.ready()`` calls it), and ``queue_subscriptions()`` picks the
ones ``runworker --queue`` serves. A band is an ordinary subscription (its
own subject, durable, claims and dead letters); only the consumer pool
knows that the bands of one queue share its slots and take turns by band
(``Subscription.priority_group``, ``consume.bands``).
"""

from __future__ import annotations

from collections.abc import Sequence

from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.tasks.queues import (
    BACKEND_PATH,
    PRIORITY_BANDS,
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
        group = event_name(queue)
        options = {"batch": batch_of(queue), "concurrency": concurrency_of(queue), **subscribe_options(queue)}
        for rank, band in enumerate(PRIORITY_BANDS):
            name = event_name(queue, band.highest)
            declare(
                name,
                description=(
                    f"A django.tasks task on queue {queue!r}, priority {band.lowest}..{band.highest} "
                    "(payload: task path, args, kwargs, backend alias, priority)."
                ),
            )
            subscribe(name, name=name, **options)(run_task)
            subscription = get_subscription(name)
            assert subscription is not None  # registered by the line above
            # The claim takes each task's RUNNING lock: no statement of its own per task.
            subscription.claim_lock_namespace = RUNNING_LOCK_NAMESPACE
            # The queue's bands share its slots and its rate limit; the highest band with work goes first.
            subscription.priority_group, subscription.priority_rank = group, rank
            names.append(name)
    return names


def queue_subscriptions(queues: Sequence[str]) -> list[Subscription]:
    """The subscriptions that run ``queues`` (``runworker --queue``): every
    priority band of each. Raises
    ``ConfigurationError`` naming the queues no ``TASKS`` backend of ours has."""
    from django_platformkit.consume.subscriptions import subscriptions

    known: dict[str, list[Subscription]] = {}
    for subscription in subscriptions():
        queue = queue_of(subscription.name)
        if queue is not None:
            known.setdefault(queue, []).append(subscription)
    missing = sorted(set(queues) - set(known))
    if missing:
        raise ConfigurationError(
            f"unknown queue(s) {', '.join(missing)}; the TASKS queues of {BACKEND_PATH} are: {', '.join(sorted(known)) or '(none)'}"
        )
    return [s for q in dict.fromkeys(queues) for s in known[q]]
