"""What "the database is unavailable" means, decided in one place, and how a
long-running loop reports an outage: once when it starts, once when it ends.

The relay, its LISTEN connection, the scheduler and ``runrelay`` all ride out
an outage of any length (a PostgreSQL restart, refused connections,
``max_connections`` reached) by retrying; nothing is lost, because every row
they work on stays where it is until a transaction that finished says
otherwise. Errors reach them wrapped by Django (``django.db.utils``) or raw
from psycopg (the listener and the job connections use psycopg directly):
both count. For a consumer's unit of work, ``not_the_handlers_fault()``
decides the same question for a handler's failure: the database's state is
waited out and never counted as an attempt - a read-only refusal only when
the unit's own connection met it, not a write through a read-only alias.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator

from django.db import DatabaseError, InterfaceError, OperationalError, connections

logger = logging.getLogger(__name__)

# SQLSTATE classes and codes that say "not now", never "not this" (PostgreSQL
# docs, Appendix A "PostgreSQL Error Codes"): 08 connection exception, 53
# insufficient resources (53300 too_many_connections), 57P01 admin_shutdown,
# 57P02 crash_shutdown, 57P03 cannot_connect_now (starting up / shutting
# down), 25006 read_only_sql_transaction (a failover, a replica promoted late).
_UNAVAILABLE_CLASSES = ("08", "53")
_UNAVAILABLE_CODES = frozenset({"57P01", "57P02", "57P03", "25006"})


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of ``exc`` or of the psycopg error it wraps, else None."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        code = getattr(current, "sqlstate", None)
        if isinstance(code, str) and code:
            return code
        current = current.__cause__ or current.__context__
        seen += 1
    return None


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database can't serve us for now (retry
    later, nothing is wrong with the work): a refused or lost connection,
    a shutdown or start-up in progress, too many connections, a read-only
    database. Accepts Django's wrapped errors and raw psycopg ones."""
    import psycopg

    code = sqlstate(exc)
    if code is not None:
        return code[:2] in _UNAVAILABLE_CLASSES or code in _UNAVAILABLE_CODES
    # No SQLSTATE: the server never answered (refused, reset, timed out).
    current: BaseException | None = exc
    for _ in range(5):
        if current is None:
            break
        if isinstance(current, (psycopg.OperationalError, psycopg.InterfaceError, OperationalError, InterfaceError)):
            return True
        current = current.__cause__ or current.__context__
    return False


def database_location(using: str) -> str:
    """Where the database behind alias ``using`` is, for an error an operator
    reads: ``host:port/name`` (a socket folder as it is), never the user or
    the password."""
    settings_dict = connections[using].settings_dict
    host = str(settings_dict.get("HOST") or "localhost")
    port = str(settings_dict.get("PORT") or "5432")
    where = host if host.startswith("/") else f"{host}:{port}"
    return f"{where}/{settings_dict.get('NAME') or ''}"


@contextlib.contextmanager
def connect_timeout(using: str, seconds: float) -> Iterator[None]:
    """While inside, a new connection of alias ``using`` gives up after
    ``seconds`` (libpq's ``connect_timeout``, whole seconds, 2 at least)
    unless the project's ``OPTIONS`` set one: without it, a host that drops
    packets holds a connect for the kernel's TCP timeout, minutes."""
    options = connections[using].settings_dict.setdefault("OPTIONS", {})
    if "connect_timeout" in options:
        yield
        return
    options["connect_timeout"] = max(2, math.ceil(seconds))
    try:
        yield
    finally:
        options.pop("connect_timeout", None)


def is_database_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the database at all (Django's ``DatabaseError`` or any psycopg error)."""
    import psycopg

    return isinstance(exc, (DatabaseError, psycopg.Error))


class Outage:
    """One loop's view of the database's availability, for logging.

    ``failed(exc)`` logs the first failure of an outage at ERROR (``what``
    names the loop, e.g. ``relay``) and the retries that follow at DEBUG;
    ``recovered()`` logs the end at WARNING with how long it lasted. So an
    outage of any length is two lines, not one per retry.
    """

    def __init__(self, what: str, log: logging.Logger | None = None) -> None:
        self.what = what
        self.log = log or logger
        self.since: float | None = None
        self.retries = 0

    def failed(self, exc: BaseException, retry_seconds: float) -> None:
        kind = "unavailable" if database_unavailable(exc) else "error"
        text = " ".join(str(exc).split()) or type(exc).__name__
        if kind == "error":
            # Not an outage (a missing table, a bug): say so every time.
            self.log.error("%s: database error=%s; retrying in %.1fs", self.what, text, retry_seconds)
            return
        if self.since is None:
            self.since, self.retries = time.monotonic(), 0
            self.log.error(
                "%s: database %s error=%s; retrying until it is back (nothing is lost: work stays in the database)",
                self.what,
                kind,
                text,
            )
        else:
            self.retries += 1
            self.log.debug(
                "%s: database still %s retry=%s in=%.1fs error=%s", self.what, kind, self.retries, retry_seconds, text
            )

    def recovered(self) -> None:
        if self.since is not None:
            self.log.warning(
                "%s: database back after %.1fs retries=%s", self.what, time.monotonic() - self.since, self.retries
            )
            self.since = None


# --- a handler's unit of work: the database's state or the handler's fault ---

#: SQLSTATEs that are the database's state, never the handler's fault: the
#: unit waits and is retried, nothing counted. 08 = connection exception,
#: 57P01-57P03 = admin/crash shutdown, cannot connect now; 53300 = too many
#: connections; 25006 = read-only transaction (a failover, a replica promoted
#: late; on the unit's own connection only, see ``ONLY_ON_THE_UNITS_CONNECTION``);
#: 40001/40P01 = serialization failure / deadlock (retry is the cure).
#: (57014, a statement timeout, stays the handler's failure.)
NOT_THE_HANDLERS_FAULT = frozenset({"57P01", "57P02", "57P03", "53300", "25006", "40001", "40P01"})

#: The codes of ``NOT_THE_HANDLERS_FAULT`` that are an outage only when the
#: unit's own connection (the outbox's alias) raised them. 25006 there means a
#: failover left the worker on a read-only node, which waiting cures; raised
#: by another alias's connection it means the handler wrote through a
#: read-only alias (``.using("replica")``), which no wait cures: counted as a
#: failed attempt, so it retries with backoff and ends as a dead letter
#: instead of stalling the subscription forever. (A second read-write
#: database caught mid-failover counts attempts too: its events retry with
#: backoff and dead-letter if it outlasts them, and replay brings them back.)
#: The other codes stay outages whichever alias raised them: a deadlock or
#: a serialization failure (40P01, 40001) is contention that a rerun cures
#: wherever it happened, and a database that is restarting, full (53300) or
#: gone (08, a lost connection) is waited out as the unit's own would be;
#: counting those would dead-letter healthy events while it is away.
ONLY_ON_THE_UNITS_CONNECTION = frozenset({"25006"})


def not_the_handlers_fault(exc: BaseException, alias: str | None = None, *, own_connection: bool = True) -> bool:
    """True when ``exc`` is the database's state (lost session, cannot
    connect, shutdown, too many connections, read-only, serialization or
    deadlock), not the handler's logic: then nothing is counted against the
    event. Django wraps psycopg's errors; the SQLSTATE is on ``__cause__``.

    ``alias``: the unit's database alias. ``own_connection``: whether ``exc``
    came from the unit's own connection; False when the handler met it on
    another alias's, where a read-only refusal (25006) is the handler's fault
    (``ONLY_ON_THE_UNITS_CONNECTION``)."""
    if not isinstance(exc, DatabaseError):
        return False
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None)
    if code is not None:
        if not own_connection and code in ONLY_ON_THE_UNITS_CONNECTION:
            return False  # a write through a read-only alias: no wait cures it, the attempt counts
        return code[:2] == "08" or code in NOT_THE_HANDLERS_FAULT
    if not isinstance(exc, (OperationalError, InterfaceError)):
        return False
    import psycopg

    # No SQLSTATE = libpq lost the socket. Leaving the failed atomic block
    # makes Django reconnect, so after pg_terminate_backend the connection
    # looks healthy again: judge by the error first, then by the connection.
    # Another alias's lost socket is an outage too (waited out, see
    # ONLY_ON_THE_UNITS_CONNECTION); close_broken_connections() lets the
    # retry reconnect it.
    if isinstance(cause, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    if alias is None:
        return False
    connection = connections[alias]
    return connection.connection is None or not connection.is_usable()


def close_old_connections_for(alias: str) -> None:
    """Before a unit of work in a worker thread: drop this thread's
    connection if it broke, or if it outlived a positive ``CONN_MAX_AGE``, so
    the next query reconnects. Unlike Django's request cycle, ``CONN_MAX_AGE
    = 0`` (the default) does NOT mean a new connection per message: a worker
    is one long "request", and reconnecting per event cost 3-8x throughput."""
    connection = connections[alias]
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.errors_occurred:
        if not connection.is_usable():
            connection.close()
            return
        connection.errors_occurred = False
    max_age = connection.settings_dict.get("CONN_MAX_AGE") or 0
    if max_age > 0 and connection.close_at is not None and time.monotonic() >= connection.close_at:
        connection.close()


def close_broken_connections() -> None:
    """After an outage a unit waited out: close this thread's connection of
    every alias that an error left unusable (``close_old_connections_for``
    each), so the retry reconnects. Without it, a handler whose other
    database (a replica, a second alias) went away would meet "the
    connection is closed" on every retry after that database came back:
    Django reconnects an alias only at a request's boundaries, and a
    worker thread is one long request."""
    for connection in connections.all(initialized_only=True):
        close_old_connections_for(connection.alias)
