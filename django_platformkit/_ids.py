"""Event ids: time-ordered UUIDs (RFC 9562 version 7: a 48-bit Unix
millisecond prefix, so ids sort by creation time) from the ``uuid-utils``
library (Rust), as plain ``uuid.UUID`` objects that compare, hash and pickle
like any other UUID. Five times faster than a pure-Python generator, which
matters on ``publish_many()``'s per-event path."""

import uuid

from uuid_utils.compat import uuid7 as _uuid7


def uuid7() -> uuid.UUID:
    """A new UUIDv7."""
    return _uuid7()
