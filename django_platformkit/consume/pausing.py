"""Which subscriptions are paused, as this worker last read them: the one
shared state the consumer pool (it fetches nothing for a paused lane) and
the consumer (it starts no unit of a paused subscription: what was fetched
before the pause is handed back, uncounted) ask. The worker's control
watch (``runtime/controlwatch.py``) fills it from ``platformkit_pauses``;
nothing here reads the database.
"""

from __future__ import annotations

import threading

from django_platformkit.consume.subscriptions import Subscription


def pause_key(subscription: Subscription) -> str:
    """The name a pause of ``subscription`` is recorded under: its own, or
    for a task queue's priority band its queue's (``priority_group``:
    ``platformkit.task_<queue>``, the default band's name), so a queue's
    bands pause and resume together - a band paused alone would hold the
    bands below it back for good (``bands``: a lower band waits while a
    higher one may have work)."""
    return subscription.priority_group or subscription.name


class Pauses:
    """The paused subscription names (``pause_key``) a worker knows of;
    thread-safe: the watch replaces the set, pool threads and the broker's
    loop read it."""

    def __init__(self) -> None:
        self._keys: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def holds(self, subscription: Subscription) -> bool:
        """Whether ``subscription`` is paused: nothing of it is fetched or started."""
        return pause_key(subscription) in self._keys

    def replace(self, keys: frozenset[str]) -> tuple[frozenset[str], frozenset[str]]:
        """Make ``keys`` the paused names.

        Returns:
            ``(paused, resumed)``: the names paused and resumed by this change.
        """
        with self._lock:
            before, self._keys = self._keys, frozenset(keys)
        return self._keys - before, before - self._keys
