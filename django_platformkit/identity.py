"""Which database owns a stream. Two projects on one NATS with the same
``STREAM`` would otherwise share durables and handle each other's events
(each losing some, writing the others into the wrong database).

The identity is the row ``0004_identity`` wrote (a UUID); the stream records
it in its ``description`` (NATS 2.9 has no stream metadata) and, on servers
that have it (2.10+), in its ``metadata`` too. A worker or relay whose
database isn't the one recorded refuses to start; a stream made before
identities existed is adopted (ours recorded, logged at WARNING).

A copy of the database (a restore, ``CREATE DATABASE ... TEMPLATE``) keeps
the identity: it is the same project to the broker. Give a staging copy its
own ``STREAM`` and ``SUBJECT_PREFIX`` - or a new identity with
``UPDATE platformkit_identity SET database_id = gen_random_uuid()``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from django.db import connections

from django_platformkit import conf
from django_platformkit._tables import IDENTITY_TABLE
from django_platformkit.exceptions import ConfigurationError, DatabaseUnavailable
from django_platformkit.outage import database_unavailable, is_database_error, sqlstate

#: The stream's metadata key (NATS 2.10+).
METADATA_KEY = "platformkit_database"
_DESCRIBED = re.compile(r"database ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")

_cache: dict[tuple[str, str], str] = {}


def database_identity(using: str | None = None) -> str:
    """The identity (a UUID as text) of the database behind ``using``
    (default ``DATABASE_ALIAS``); read once per database and process.
    Raises ``DatabaseUnavailable`` while the database can't answer (retry),
    ``ConfigurationError`` when the migration that makes it has not run."""
    alias = using or conf.settings.DATABASE_ALIAS
    key = (alias, str(connections[alias].settings_dict.get("NAME")))
    if key in _cache:
        return _cache[key]
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"SELECT database_id::text FROM {IDENTITY_TABLE}")
            row = cursor.fetchone()
    except Exception as exc:
        if not is_database_error(exc):
            raise
        if sqlstate(exc) == "42P01":  # undefined_table
            raise ConfigurationError(
                f"the table {IDENTITY_TABLE} is missing: run `manage.py migrate django_platformkit` first."
            ) from None
        if database_unavailable(exc):
            connections[alias].close()
            raise DatabaseUnavailable(f"the database is unavailable: {' '.join(str(exc).split())}") from exc
        raise
    if row is None:
        raise ConfigurationError(
            f"{IDENTITY_TABLE} is empty: run `manage.py migrate django_platformkit` "
            f"(or INSERT INTO {IDENTITY_TABLE} (database_id) VALUES (gen_random_uuid()))."
        )
    found: str = row[0]
    _cache[key] = found
    return found


def describe(identity: str) -> str:
    """The stream description that records ``identity``."""
    return f"django_platformkit stream of database {identity}"


def recorded_identity(description: str | None, metadata: Mapping[str, object] | None) -> str | None:
    """The identity a stream records (metadata first, then description), or None."""
    if metadata and metadata.get(METADATA_KEY):
        return str(metadata[METADATA_KEY])
    match = _DESCRIBED.search(description or "")
    return match[1] if match else None


def foreign_stream_text(stream: str, url: str, theirs: str, ours: str) -> str:
    """The ``ConfigurationError`` text for a stream another database owns."""
    return (
        f"the stream {stream!r} on {conf.redact_url(url)} belongs to another project's database ({theirs}; this "
        f"database is {ours}): two projects must not share a stream, or they handle each other's events. "
        "Give this project its own PLATFORMKIT['STREAM'] and PLATFORMKIT['SUBJECT_PREFIX'] "
        "(e.g. STREAM='MYSHOP', SUBJECT_PREFIX='myshop'). If this is the same project with its database "
        "re-created (a dev machine), the old stream's events are the old database's: delete the stream "
        f"(`nats stream rm {stream}`) and the worker makes a new one."
    )
