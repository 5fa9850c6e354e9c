"""Which database owns a stream. Two projects on one NATS with the same
``STREAM`` would otherwise share durables and handle each other's events
(each losing some, writing the others into the wrong database).

The identity is the row ``0004_identity`` wrote (a UUID); the stream records
it in its ``description`` (NATS 2.9 has no stream metadata) and, on servers
that have it (2.10+), in its ``metadata`` too. A worker or relay whose
database isn't the one recorded refuses to start; a stream made before
identities existed is adopted (ours recorded, logged at WARNING).

A copy of the database (a restore, ``CREATE DATABASE ... TEMPLATE``) keeps
the identity, so the identity alone can't tell production from a staging
copy started against the same NATS and names - which would share
production's durables and take half its deliveries. So the stream also
records which database *instance* holds it (``database_instance()``: the
cluster's ``system_identifier`` and the database's oid) and when that
instance last said it is alive (``Tenure``, renewed by its running workers
every ``RENEW_SECONDS``). Another instance with the same identity is
refused (``judge``), and the holder learns that one tried (``Standing.CONTESTED``:
it then never terminates a message its outbox doesn't know).

A stream changes hands only by an operator's step, ``manage.py stream
takeover --yes`` (``takeover_tenure``), never by itself however long the
holder has been silent: a staging copy started while production was down
for two minutes took production's stream and handled its events in the
staging database. A database restored or upgraded onto a new server is a
new instance: its workers are refused, naming that command, until an
operator runs it. The fix for a copy is a new identity and names of its own
(``copy_text``).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from django.db import connections

from django_platformkit import conf
from django_platformkit._tables import IDENTITY_TABLE
from django_platformkit.exceptions import ConfigurationError, DatabaseUnavailable
from django_platformkit.outage import database_unavailable, is_database_error, sqlstate

logger = logging.getLogger(__name__)

#: The stream's metadata key (NATS 2.10+).
METADATA_KEY = "platformkit_database"
_DESCRIBED = re.compile(r"database ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
# The tenure, in the description: every NATS version has one (2.9 has no metadata).
_INSTANCE = re.compile(r"; instance (\S+) seen (\d+)")
_CONTENDER = re.compile(r"; contender (\S+) seen (\d+)")

#: How often the holder's workers say it is alive (seconds): a running
#: worker checks its stream this often, and renews the tenure when it is older.
RENEW_SECONDS = 30.0
#: An instance seen within this many seconds is live: its workers run (what
#: the refusals say, and ``stream takeover`` refuses without ``--force``), and
#: a contender that tried within it keeps the holder contested. Four
#: renewals, so a slow or missed one (NATS busy, a worker restarting) never
#: looks like an absence; hosts' clocks must agree far better than this.
LIVE_SECONDS = 4 * RENEW_SECONDS

_cache: dict[tuple[str, str], str] = {}
_instances: dict[tuple[str, str], str] = {}


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


def database_instance(using: str | None = None) -> str:
    """Which database instance is behind ``using`` (default
    ``DATABASE_ALIAS``): ``"<system_identifier>:<database oid>"``, read once
    per database and process.

    A copy made with ``CREATE DATABASE ... TEMPLATE`` gets another oid, a
    restore into another server another system identifier; a failover to a
    physical replica keeps both, so it is the same instance. (A block-level
    clone - a snapshot restored as staging - keeps both too: give it a new
    identity when you make it, as the docs' operating guide says.) Where
    ``pg_control_system()`` is not granted, the system identifier reads
    ``-``. Raises ``DatabaseUnavailable`` while the database can't answer."""
    from django.db import transaction

    alias = using or conf.settings.DATABASE_ALIAS
    key = (alias, str(connections[alias].settings_dict.get("NAME")))
    if key in _instances:
        return _instances[key]
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT oid::text FROM pg_database WHERE datname = current_database()")
            oid = cursor.fetchone()[0]
            try:
                with transaction.atomic(using=alias):  # a refusal must not abort a caller's transaction
                    cursor.execute("SELECT system_identifier::text FROM pg_control_system()")
                    system = cursor.fetchone()[0]
            except Exception as exc:
                if not is_database_error(exc) or database_unavailable(exc):
                    raise
                system = "-"  # not granted (some managed services): the oid still tells a TEMPLATE copy apart
    except Exception as exc:
        if is_database_error(exc) and database_unavailable(exc):
            connections[alias].close()
            raise DatabaseUnavailable(f"the database is unavailable: {' '.join(str(exc).split())}") from exc
        raise
    found = _instances[key] = f"{system}:{oid}"
    return found


def describe(identity: str, tenure: Tenure | None = None) -> str:
    """The stream description that records ``identity`` (and ``tenure``'s instances)."""
    text = f"django_platformkit stream of database {identity}"
    if tenure is not None and tenure.instance is not None:
        text += f"; instance {tenure.instance} seen {int(tenure.seen or 0)}"
        if tenure.contender is not None:
            text += f"; contender {tenure.contender} seen {int(tenure.contender_seen or 0)}"
    return text


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
        "with `manage.py stream reset --yes` and the worker makes a new one."
    )


class Standing(enum.StrEnum):
    """A database instance's standing on a stream (``judge``)."""

    #: It holds the stream, and no other live instance with its identity tried it.
    OWNER = "owner"
    #: It holds the stream, and another live database with its identity tried
    #: it within ``LIVE_SECONDS`` (a staging copy): it runs on, but never
    #: terminates a message its outbox doesn't know - the copy's, perhaps.
    CONTESTED = "contested"
    #: Another instance with the same identity holds it, live or not: refused
    #: (a copy; or its replacement, until an operator runs ``stream takeover``).
    COPY = "copy"
    #: Another project's database owns it: refused.
    FOREIGN = "foreign"


@dataclass(frozen=True)
class Tenure:
    """What a stream records about who holds it: the owning ``identity``,
    the ``instance`` holding it and when it was last ``seen`` (unix
    seconds), and the last other live instance of the same identity that
    tried it (``contender``, ``contender_seen``). None where nothing is recorded."""

    identity: str | None
    instance: str | None = None
    seen: float | None = None
    contender: str | None = None
    contender_seen: float | None = None

    @classmethod
    def read(cls, description: str | None, metadata: Mapping[str, object] | None) -> Tenure:
        """The tenure a stream's description (and metadata) record."""
        holder = _INSTANCE.search(description or "")
        contender = _CONTENDER.search(description or "")
        return cls(
            identity=recorded_identity(description, metadata),
            instance=holder[1] if holder else None,
            seen=float(holder[2]) if holder else None,
            contender=contender[1] if contender else None,
            contender_seen=float(contender[2]) if contender else None,
        )

    def contender_live(self, now: float) -> bool:
        return self.contender is not None and now - (self.contender_seen or 0) < LIVE_SECONDS


@dataclass(frozen=True)
class Judgement:
    """``judge``'s answer: the ``standing``; the ``tenure`` to record now
    (None: nothing to write); the text an operator reads (refusal or
    contest, with the fix; "" for a plain owner)."""

    standing: Standing
    tenure: Tenure | None
    text: str

    @property
    def refused(self) -> bool:
        return self.standing in (Standing.COPY, Standing.FOREIGN)


def judge(recorded: Tenure, identity: str, instance: str | None, *, now: float, stream: str, url: str) -> Judgement:
    """Decide ``instance`` (of database ``identity``) on a stream recording
    ``recorded``, at ``now`` (unix seconds: the hosts' clocks; ``LIVE_SECONDS``
    is far above any sane skew). ``instance`` None: the identity alone is checked.

    - another identity: ``FOREIGN`` (``foreign_stream_text``);
    - no identity or no instance recorded (a new stream, one made by an
      older build): ours is recorded, ``OWNER``;
    - our instance: ``OWNER`` (the tenure renewed once it is ``RENEW_SECONDS``
      old), ``CONTESTED`` while a contender was seen within ``LIVE_SECONDS``;
    - another instance, however long ago it was seen: ``COPY``, recorded as
      the contender so the holder learns it (``copy_text``: a copy, or a
      replacement that ``manage.py stream takeover --yes`` moves the stream to).

    Pure: it reads and writes nothing; the caller records ``tenure``.
    """
    if recorded.identity is not None and recorded.identity != identity:
        return Judgement(Standing.FOREIGN, None, foreign_stream_text(stream, url, recorded.identity, identity))
    if instance is None:
        return Judgement(Standing.OWNER, None if recorded.identity else Tenure(identity), "")
    if recorded.identity is None or recorded.instance is None:
        return Judgement(Standing.OWNER, Tenure(identity, instance, now), "")
    if recorded.instance == instance:
        due = now - (recorded.seen or 0) >= RENEW_SECONDS
        renewed = replace(recorded, seen=now) if due else None
        if recorded.contender_live(now) and recorded.contender != instance:
            return Judgement(Standing.CONTESTED, renewed, contested_text(stream, identity, instance, recorded, now))
        return Judgement(Standing.OWNER, renewed, "")
    # Never taken over here, however long the holder was silent: only an operator knows a
    # replacement from a copy started while the holder was down (stream takeover).
    tried = replace(recorded, contender=instance, contender_seen=now)
    return Judgement(Standing.COPY, tried, copy_text(stream, url, identity, instance, recorded, now))


def takeover_tenure(recorded: Tenure, identity: str, instance: str, now: float) -> Tenure:
    """The tenure ``manage.py stream takeover`` records: ``instance`` holds
    the stream from ``now``, with no contender. Raises ``ValueError`` for a
    stream another identity owns (a takeover moves a stream between
    instances of one database, never between projects)."""
    if recorded.identity is not None and recorded.identity != identity:
        raise ValueError(f"the stream belongs to database {recorded.identity}, not {identity}")
    return Tenure(identity, instance, now)


def _seen(recorded: Tenure, now: float) -> str:
    """How long ago the holder was seen, and whether that means its workers run."""
    ago = now - (recorded.seen or 0)
    if ago < LIVE_SECONDS:
        return f"seen {ago:.0f} s ago (its workers are running)"
    return f"not seen for {ago:.0f} s (its workers stopped?)"


_NEW_IDENTITY = "UPDATE platformkit_identity SET database_id = gen_random_uuid()"


def copy_text(stream: str, url: str, identity: str, instance: str, recorded: Tenure, now: float) -> str:
    """The ``ConfigurationError`` text for a database instance that doesn't hold the stream its identity owns."""
    return (
        f"the stream {stream!r} on {conf.redact_url(url)} is held by another database instance with this "
        f"database's identity ({identity}): instance {recorded.instance}, {_seen(recorded, now)}. This database is "
        f"instance {instance} and does not hold it; a stream changes hands only by an operator's step, never by "
        "itself. If this database is a copy (a staging database restored or templated from production?), sharing "
        f"the stream would take the other database's deliveries: give it an identity and names of its own, "
        f"`{_NEW_IDENTITY};` in this database and its own PLATFORMKIT['STREAM'] and PLATFORMKIT['SUBJECT_PREFIX']. "
        f"If it replaced instance {recorded.instance} for good (restored or upgraded onto a new server), stop that "
        "one's workers and run `manage.py stream takeover --yes` with this database's settings."
    )


def contested_text(stream: str, identity: str, instance: str, recorded: Tenure, now: float) -> str:
    """What the holder of a stream says while another instance of its database tries it."""
    return (
        f"another database instance with this database's identity ({identity}) tried the stream {stream!r}: "
        f"instance {recorded.contender}, {now - (recorded.contender_seen or 0):.0f} s ago. This database, instance "
        f"{instance}, holds it and goes on; the other was refused. Until it stops trying, messages this outbox "
        f"doesn't know are handed back, not terminated. If that database is a copy: `{_NEW_IDENTITY};` in it and "
        "its own PLATFORMKIT['STREAM'] and PLATFORMKIT['SUBJECT_PREFIX']. If it replaces this one for good, stop "
        "this database's workers and run `manage.py stream takeover --yes` with its settings."
    )
