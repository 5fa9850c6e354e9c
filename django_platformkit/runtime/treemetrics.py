"""One ``/metrics`` for ``runworker --processes N --metrics-port PORT``.

The children count (each its ``Metrics``, fed by its own signals) into
prometheus-client's multiprocess files in a folder the supervisor made for
this run; the supervisor serves their sum, so a scrape sees the whole tree
and a child that exits or recycles takes none of its counts with it. The
gauges computed at scrape time (outbox backlog and lag, dead letters,
consumer pending) are the supervisor's own: they describe the database and
the stream, not a process, so one process asks, once per scrape.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from django_platformkit.runtime.metrics import Metrics

logger = logging.getLogger(__name__)

#: prometheus-client's switch to multiprocess mode, read by every child.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class ConnectionPerScrape:
    """``consumer_infos`` over a NATS connection opened for one scrape and
    closed after it: the supervisor keeps no event-loop thread between
    scrapes, so a child forked meanwhile inherits none (see ``TreeMetrics.forking``)."""

    def consumer_infos(self, durables: Sequence[str], *, timeout: float) -> list[Any]:
        from django_platformkit.broker.transport import Transport

        transport = Transport(name="django_platformkit-metrics", request_timeout_seconds=timeout)
        try:
            transport.connect()
            return transport.consumer_infos(durables, timeout=timeout)
        finally:
            transport.close()


class TreeMetrics:
    """The supervisor's side: the private folder, the served registry, the children's start and end.

    Args:
        subscriptions: Whose durables the scrape asks about (``Subscription`` objects).
        using: The outbox's database alias (default ``DATABASE_ALIAS``).

    Raises:
        ConfigurationError: prometheus-client isn't installed.
    """

    def __init__(self, *, subscriptions: Sequence[Any] = (), using: str | None = None) -> None:
        self.subscriptions = list(subscriptions)
        self.directory = tempfile.mkdtemp(prefix="platformkit-metrics-")
        self._previous = os.environ.get(MULTIPROC_DIR_ENV)
        os.environ[MULTIPROC_DIR_ENV] = self.directory
        logger.info("metrics of the process tree folder=%s", self.directory)
        _count_into_files()
        try:
            self.metrics = Metrics(
                using=using,
                transport=ConnectionPerScrape(),
                subscriptions=self.subscriptions,
                multiprocess_dir=self.directory,
            )
        except BaseException:
            self.close()
            raise

    def serve(self, port: int, addr: str) -> int:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the port. Raises ``OSError``."""
        return self.metrics.serve(port, addr)

    def forking(self) -> contextlib.AbstractContextManager[Any]:
        """Hold around ``os.fork()``: no scrape runs meanwhile, so no
        database connection or NATS loop of a scrape is copied into a child."""
        return self.metrics.scrape_lock

    def in_child(self, subscriptions: Sequence[Any]) -> None:
        """In a freshly forked child: let go of the supervisor's listening
        socket and count this process's signals into the shared folder."""
        self.metrics.drop_listener_copy()
        Metrics(subscriptions=subscriptions).connect()

    def child_exited(self, pid: int) -> None:
        """A child ended (stopped, died or recycled): its live gauges go; its counts stay in the sum."""
        import prometheus_client.multiprocess

        try:
            prometheus_client.multiprocess.mark_process_dead(pid, self.directory)  # type: ignore[no-untyped-call]
        except OSError as exc:
            logger.warning("metrics: files of pid=%s not cleared error=%s", pid, exc)

    def close(self) -> None:
        """Stop serving and remove the folder (and the environment variable that named it)."""
        with contextlib.suppress(Exception):
            if getattr(self, "metrics", None) is not None:
                self.metrics.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._previous is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = self._previous


def _count_into_files() -> None:
    """Make every metric created from now on in this process (and the
    children it forks) write prometheus-client's multiprocess files.
    prometheus-client chooses at its import, from ``PROMETHEUS_MULTIPROC_DIR``;
    a project that imported it earlier (another app's metrics) chose already."""
    try:
        from prometheus_client import values
    except ImportError:
        return  # Metrics() says what to install
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
