"""Who this process is, as the rows that record a run say it: ``<host>:<pid>``
(``Attempt.worker``, a task result's ``worker_ids``, the overview's workers).

Computed once per process, and again in a forked child (``runworker
--processes`` forks its children after the imports): a value fixed at import
named the supervisor in every child's rows.
"""

from __future__ import annotations

import os
import socket

_worker_id: str | None = None


def worker_id() -> str:
    """``<host>:<pid>`` of this process (a string lookup after the first call:
    it is read for every task a worker runs)."""
    global _worker_id
    if _worker_id is None:
        _worker_id = f"{socket.gethostname()}:{os.getpid()}"
    return _worker_id


def _forget_in_the_child() -> None:
    global _worker_id
    _worker_id = None


os.register_at_fork(after_in_child=_forget_in_the_child)
