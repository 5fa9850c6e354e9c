"""Advisory-lock keys, defined once. A job's name becomes a 64-bit key in a
namespace of our own, so two job names can't collide the way 32-bit hashes do
(``plumless``/``buckeroo`` under CRC32) and another app's advisory locks can't
block ours."""

import hashlib

NAMESPACE = b"django_platformkit:"


def advisory_key(name: str) -> int:
    """The signed 64-bit key ``pg_try_advisory_lock(bigint)`` takes for ``name``.

    BLAKE2b with an 8-byte digest over ``NAMESPACE + name`` (UTF-8), read as a
    signed big-endian integer (PostgreSQL's ``bigint`` range).
    """
    digest = hashlib.blake2b(NAMESPACE + name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
