"""Event ids: time-ordered UUIDs (RFC 9562 version 7) from the ``uuid6``
library, returned as plain ``uuid.UUID`` so they compare, hash and pickle like
any other UUID."""

import uuid

import uuid6


def uuid7() -> uuid.UUID:
    """A new UUIDv7 (48-bit Unix-millisecond prefix, so ids sort by time)."""
    return uuid.UUID(int=uuid6.uuid7().int)
