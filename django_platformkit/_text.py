"""Text on its way into a PostgreSQL ``text`` column: PostgreSQL can't store
NUL (U+0000), and an error message or traceback may hold one (a handler or a
job raising ``ValueError("a\\x00b")``). Escaping it keeps the record instead
of losing it to a second error."""

from __future__ import annotations

NUL_ESCAPE = "\\x00"


def storable_text(value: str, *, max_chars: int | None = None) -> str:
    """``value`` with each NUL written as the four characters ``\\x00`` (how
    Python's ``repr`` shows it), cut to ``max_chars`` if given. Pure."""
    text = value.replace("\x00", NUL_ESCAPE) if "\x00" in value else value
    return text if max_chars is None else text[:max_chars]
