"""How the overview page runs a query: in a savepoint of its own, under a
``statement_timeout``, so a slow or failing figure becomes one sentence on
the page (a note) instead of a hung or aborted admin.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

logger = logging.getLogger(__name__)

#: Each database query of the page gets this long (``SET LOCAL statement_timeout``):
#: a huge hour of claims shows "not charted", it doesn't hang the admin.
QUERY_TIMEOUT_MS = 2000


class Timed:
    """Run each query in its own savepoint under ``statement_timeout``; a
    query that times out (or fails) yields None and a note instead of an
    aborted page."""

    def __init__(self, alias: str, notes: list[str]) -> None:
        self.alias = alias
        self.notes = notes

    def rows(self, sql: str, params: Sequence[Any], what: str) -> list[tuple[Any, ...]] | None:
        try:
            with transaction.atomic(using=self.alias), connections[self.alias].cursor() as cursor:
                cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(QUERY_TIMEOUT_MS)])
                cursor.execute(sql, list(params))
                return list(cursor.fetchall())
        except DatabaseError as exc:
            logger.warning("overview query failed what=%s error=%s", what, exc)
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.notes.append(_("%(what)s: not shown (%(why)s).") % {"what": _(what), "why": why})
            return None


#: What a note calls each query (``Timed.rows``' ``what``), marked for the
#: translation catalogue here and translated when a note is written.
QUERY_NAMES = (
    gettext_noop("open dead letters"),
    gettext_noop("handled per subscription"),
    gettext_noop("last handled"),
    gettext_noop("outbox pending"),
    gettext_noop("relayed per minute"),
    gettext_noop("pending per event"),
    gettext_noop("job locks"),
    gettext_noop("jobs"),
    gettext_noop("job controls"),
    gettext_noop("pauses"),
    gettext_noop("workers"),
    gettext_noop("last dead letters"),
    gettext_noop("retrying events"),
    gettext_noop("handled per task"),
    gettext_noop("dead letters per task"),
)
