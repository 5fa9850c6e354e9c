"""What "the database is unavailable" means, decided in one place, and how a
long-running loop reports an outage: once when it starts, once when it ends.

The relay, its LISTEN connection, the scheduler and ``runrelay`` all ride out
an outage of any length (a PostgreSQL restart, refused connections,
``max_connections`` reached) by retrying; nothing is lost, because every row
they work on stays where it is until a transaction that finished says
otherwise. Errors reach them wrapped by Django (``django.db.utils``) or raw
from psycopg (the listener and the job connections use psycopg directly):
both count.
"""

from __future__ import annotations

import logging
import time

from django.db import DatabaseError

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
    from django.db import InterfaceError, OperationalError

    current: BaseException | None = exc
    for _ in range(5):
        if current is None:
            break
        if isinstance(current, (psycopg.OperationalError, psycopg.InterfaceError, OperationalError, InterfaceError)):
            return True
        current = current.__cause__ or current.__context__
    return False


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
