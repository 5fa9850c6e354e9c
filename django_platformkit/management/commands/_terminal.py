"""Text from the database on its way to an operator's terminal (an error, a
traceback, a malformed message's body): control characters escaped, never
acted on, and cut to what a screen can hold. An error often quotes input,
and its escape sequences must not reach the terminal (colours, a cleared
screen, a ``\\r`` that overwrites the line)."""

from __future__ import annotations

import re

#: C0 and C1 control characters but newline and tab: what a terminal acts on.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with control characters written as ``\\x1b``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text or "")


def excerpt(text: str, *, chars: int, lines: int) -> str:
    """The start of ``text``: at most ``chars`` characters and ``lines`` lines."""
    head = text[:chars]
    if head.count("\n") >= lines:
        head = "\n".join(head.split("\n")[:lines])
    return head


def first_line(text: str, width: int) -> str:
    """``text``'s first line, printable, cut to ``width`` characters (an ellipsis marks a cut)."""
    stripped = (text or "").strip()
    # Lines end at newlines only: a \r is shown escaped, not taken as an end of line.
    line = printable(stripped.split("\n", 1)[0].rstrip("\r")) if stripped else ""
    return line if len(line) <= width else line[: width - 1] + "…"
