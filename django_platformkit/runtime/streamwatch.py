"""A running worker's look at its stream every ``identity.RENEW_SECONDS``,
and at once when JetStream announces a change of it (its stream-update
advisories, ``Broker.watch_stream``): it renews this database instance's
tenure (so a copy of the database started against the same stream is
refused while this one lives), notices when a copy tried (contested:
messages this outbox doesn't know are handed back, not terminated) and stops
the worker when the stream became one it must not use - another holder's,
or limits that could discard events nobody handled - exactly as start-up
refuses it. A limit edited while the relay runs stops it within a second,
not at the next look (28-30 s later, 505 of 1,000 events discarded
meanwhile); what was discarded before is reconciliation's. NATS being away
is waited out: the transport reconnects on its own and the next look tells.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django_platformkit import identity
from django_platformkit.broker.port import Broker
from django_platformkit.exceptions import BrokerUnavailable
from django_platformkit.runtime.startup import StartUp

logger = logging.getLogger(__name__)

#: While contested, the ERROR line is repeated this often (seconds), not at every look.
CONTESTED_LOG_EVERY_SECONDS = 600.0


class StreamWatch:
    """Looks at the stream until ``stop`` is set.

    Args:
        broker: The worker's broker.
        start_up: The worker's start-up: once it read this database's
            identity and instance, they say whose stream this is; ``run()``
            does nothing without them.
        refuse: Called once with the refusal (why, and the fix) when the
            stream must not be used any more; it stops the worker.
        stop: Set when the worker stops (then call ``wake()``).
        every_seconds: The time between two looks (the first is at once).
    """

    def __init__(
        self,
        broker: Broker,
        *,
        start_up: StartUp,
        refuse: Callable[[str], None],
        stop: threading.Event,
        every_seconds: float = identity.RENEW_SECONDS,
    ) -> None:
        self.broker = broker
        self.start_up = start_up
        #: Set while another live database with this identity tried the stream; the consumers read it.
        self.contested = threading.Event()
        self.refuse = refuse
        self.stop = stop
        self.every_seconds = every_seconds
        #: The last contest's text (who tried, the fix): the heartbeat's detail.
        self.text = ""
        self._logged_at: float | None = None
        self._wake = threading.Event()

    @property
    def contest(self) -> str:
        """The contest over the stream now: who tried, and the fix ("" when none)."""
        return self.text if self.contested.is_set() else ""

    def wake(self) -> None:
        """Look now (thread-safe): a change was announced, or the worker stops."""
        self._wake.set()

    def run(self) -> None:
        if self.start_up.owner is None:
            return
        if not self.broker.watch_stream(lambda action: self._wake.set()):
            logger.info("stream changes are noticed by the look every %.0f s", self.every_seconds)
        while not self.stop.is_set():
            if not self.look():
                return
            self._wake.wait(self.every_seconds)
            self._wake.clear()

    def look(self) -> bool:
        """One look at the stream; False once it refused the stream (the worker stops)."""
        owner = self.start_up.owner
        assert owner is not None
        try:
            standing = self.broker.stream_standing(owner=owner, instance=self.start_up.instance)
        except BrokerUnavailable as exc:
            # Not news: the transport reconnects and says so; the heartbeat shows the wait.
            logger.debug("stream not checked error=%s", exc)
            return True
        if standing.exists and standing.refused:
            self.refuse(standing.text)
            return False
        if standing.contested:
            self.text = standing.text
            now = time.monotonic()
            if self._logged_at is None or now - self._logged_at >= CONTESTED_LOG_EVERY_SECONDS:
                self._logged_at = now
                logger.error("stream contested: %s", standing.text)
            self.contested.set()
        elif self.contested.is_set():
            logger.warning("stream no longer contested: the other database has not tried it for a while")
            self.contested.clear()
            self.text, self._logged_at = "", None
        return True
