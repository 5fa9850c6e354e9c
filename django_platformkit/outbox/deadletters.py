"""Writing a dead letter: the record of an outbox event a subscription (or
the relay itself) gave up on, written in one transaction with a terminal
claim, so a lost ack can never produce a false dead letter and nothing runs
the event again until an operator replays it. The payload's only copy stays
the outbox row, held while the dead letter is written (purge skips it).
The operator verbs over dead letters are ``operate/deadletters.py``.
"""

from __future__ import annotations

import uuid

from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit._tables import DEAD_LETTER_TABLE, HANDLED_TABLE, OUTBOX_TABLE
from django_platformkit._text import storable_text
from django_platformkit.wire import HandlingOutcome

#: The ``name`` of a dead letter recording a message that isn't an event of ours.
MALFORMED_NAME = "(malformed)"


#: How much of a malformed message's body its dead letter keeps (in
#: ``traceback``): a body can be as large as the server's ``max_payload``.
MALFORMED_BODY_BYTES = 4000


_NAMESPACE_MALFORMED = uuid.UUID("8a1d6c61-3f5e-4c2c-9a59-1f0a3d6b7e21")


_TERMINAL_CLAIM_SQL = (
    f"WITH row AS (SELECT 1 FROM {OUTBOX_TABLE} WHERE id = %s FOR KEY SHARE) "
    f"INSERT INTO {HANDLED_TABLE} (subscription, event_id, handled_at, outcome) "
    f"SELECT %s, %s, now(), '{HandlingOutcome.DEAD_LETTERED}' FROM (SELECT count(*) FROM row) locked "
    "ON CONFLICT (subscription, event_id) DO NOTHING RETURNING 1"
)


_DEAD_LETTER_SQL = (
    f"INSERT INTO {DEAD_LETTER_TABLE} "
    "(event_id, subscription, name, tenant, attempts, error, traceback, stream_seq, failed_at) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, now()) ON CONFLICT (subscription, event_id) DO NOTHING"
)


def record_dead_letter(
    *,
    subscription: str,
    event_id: uuid.UUID,
    name: str,
    tenant: str | None,
    attempts: int,
    error: str,
    traceback: str,
    using: str | None = None,
) -> bool:
    """In one transaction: a terminal claim and, if the claim is new, the dead
    letter. Returns whether a dead letter was written (False: the event was
    already handled - its ack was lost - so there is nothing to report).
    Idempotent: both inserts are ``ON CONFLICT DO NOTHING``."""
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        # Hold the outbox row (it has the payload's only copy) while the dead
        # letter is written: purge locks FOR UPDATE SKIP LOCKED, so it skips it.
        cursor.execute(_TERMINAL_CLAIM_SQL, [event_id, subscription, event_id])
        if cursor.fetchone() is None:
            return False
        cursor.execute(
            _DEAD_LETTER_SQL,
            [
                event_id,
                subscription,
                name,
                tenant,
                attempts,
                storable_text(error, max_chars=10000),
                storable_text(traceback, max_chars=50000),
                None,  # an outbox event: its row has its place in the stream
            ],
        )
    return True


def malformed_id(stream: str, stream_seq: int) -> uuid.UUID:
    """The dead-letter key of a malformed message: a UUIDv5 of its place in
    the stream (``<stream>:<stream_seq>``), never the id it claims - a forged
    or broken message claiming a real event's id must not take that event's
    (subscription, event_id) dead-letter slot, and two bad messages claiming
    one id are two records."""
    return uuid.uuid5(_NAMESPACE_MALFORMED, f"{stream}:{stream_seq}")


def record_malformed(
    *,
    subscription: str,
    event_id: uuid.UUID,
    stream_seq: int,
    attempts: int,
    error: str,
    body: bytes,
    using: str | None = None,
) -> None:
    """Write the dead letter (name ``(malformed)``, no tenant) of a message on
    our subjects that isn't a well-formed event of ours: ``event_id`` from
    ``malformed_id()``, ``stream_seq`` its place in the stream (where the
    whole message is), ``error`` what is wrong, the first
    ``MALFORMED_BODY_BYTES`` of ``body`` (as UTF-8, undecodable bytes as
    U+FFFD) as its traceback. Idempotent (``ON CONFLICT DO NOTHING``).
    Raises Django's ``DatabaseError`` when the database can't take it."""
    alias = using or conf.settings.DATABASE_ALIAS
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(
            _DEAD_LETTER_SQL,
            # NUL can't be stored in PostgreSQL text: unescaped, a body holding one
            # could never be recorded and would come back after every ack wait.
            [
                event_id,
                subscription,
                MALFORMED_NAME,
                None,
                attempts,
                storable_text(error, max_chars=10000),
                storable_text(body[:MALFORMED_BODY_BYTES].decode("utf-8", "replace")),
                stream_seq,
            ],
        )


#: The dead letters the relay writes (the broker refused a row for good):
#: replayable, though no ``@subscribe`` has this name.
RELAY_DEAD_LETTERS = "platformkit.relay"
