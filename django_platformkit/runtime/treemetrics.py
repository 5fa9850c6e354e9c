"""One ``/metrics`` for ``runworker --processes N --metrics-port PORT``.

The children count (each its ``Metrics``, fed by its own signals) into
prometheus-client's multiprocess files in a folder the supervisor made for
this run; the supervisor serves their sum, so a scrape sees the whole tree
and a child that exits or recycles takes none of its counts with it. The
gauges computed at scrape time (outbox backlog and lag, dead letters,
consumer pending) are the supervisor's own: they describe the database and
the stream, not a process, so one process asks, once per scrape.

The folder is the tree's for as long as any process of it lives: the
supervisor holds an exclusive ``flock`` on its ``.owner`` file, and the
children it forks inherit the lock. A supervisor killed by SIGKILL can't
remove its folder (prometheus-client's multiprocess users know the pile of
stale ``.db`` files that leaves); the next tree to start removes every such
folder whose lock nobody holds any more - never one a live tree still uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from django_platformkit.runtime.metrics import Metrics

logger = logging.getLogger(__name__)

#: prometheus-client's switch to multiprocess mode, read by every child.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: The folders' names (in the system's temporary folder) and the lock file in each.
FOLDER_PREFIX = "platformkit-metrics-"
OWNER_FILE = ".owner"


def remove_orphaned_folders(parent: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the metrics folders under ``parent`` (default: the system's
    temporary folder) whose tree is gone: no process holds the lock on
    their ``.owner`` file. Returns those removed. A folder without the file
    (another tool's, or being made right now) and one a live tree holds are left."""
    removed = []
    for folder in sorted(Path(parent or tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*")):
        owner = folder / OWNER_FILE
        try:
            fd = os.open(owner, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live tree holds it
        finally:
            os.close(fd)  # the lock, if taken, goes with it: the folder is removed next
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


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
        for folder in remove_orphaned_folders():
            logger.info("metrics: removed the folder of a process tree that is gone folder=%s", folder)
        self.directory = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        # Held while this process or a child it forks lives (the children inherit the descriptor).
        self._owner_fd: int | None = os.open(Path(self.directory, OWNER_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._owner_fd, fcntl.LOCK_EX)
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
        if self._owner_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._owner_fd)
            self._owner_fd = None
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
