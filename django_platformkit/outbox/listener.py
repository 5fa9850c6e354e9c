"""The relay's wake-up: a connection of its own LISTENing on the outbox's
channel, which ``publish()`` notifies in the same statement as its INSERT,
so a committed event is relayed at once instead of at the next poll. A lost
LISTEN connection only means polling until it is back: nothing waits on it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
from django.db import connections

from django_platformkit.outbox.events import NOTIFY_CHANNEL

logger = logging.getLogger(__name__)


class Listener:
    """A dedicated autocommit connection LISTENing on the outbox channel.

    Args:
        using: The database alias whose connection settings it copies.
    """

    def __init__(self, using: str) -> None:
        self.using = using
        self.connection: Any = None

    def ensure(self) -> None:
        """Connect and LISTEN, unless connected already. Raises psycopg's ``OperationalError``."""
        if self.connection is not None and not self.connection.closed:
            return
        wrapper = connections[self.using]
        params = wrapper.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("prepare_threshold", None)
        # A server that doesn't answer must not pin the relay's thread.
        params.setdefault("connect_timeout", 10)
        self.connection = psycopg.connect(**params, autocommit=True)
        self.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def wait(self, seconds: float, stop: threading.Event) -> None:
        """Return at the first notification, after ``seconds``, or soon after ``stop`` is set."""
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                # Short slices so a stop request is seen within a quarter second.
                for _ in self.connection.notifies(timeout=min(remaining, 0.25), stop_after=1):
                    return
            except Exception as exc:
                logger.warning("relay listen connection lost error=%s", exc)
                self.close()
                stop.wait(max(0.0, min(remaining, 1.0)))
                return

    def close(self) -> None:
        """Close the connection (the next ``ensure()`` opens another)."""
        if self.connection is not None:
            try:
                self.connection.close()
            except Exception:
                pass
        self.connection = None
