"""Payload encoding: a ``publish()`` payload as the JSON text the outbox
stores, or an ``InvalidPayload`` that names the JSON path of what is wrong.
Checked in Python before any SQL runs, so a bad payload leaves the caller's
transaction usable; what passes here jsonb stores and the consumer reads back.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any, Protocol

from django.core.serializers.json import DjangoJSONEncoder

from django_platformkit import conf
from django_platformkit.exceptions import InvalidPayload


class EventSchema(Protocol):
    """What encoding needs of an ``events.EventType``: its name and compiled schema validator (or None)."""

    @property
    def name(self) -> str: ...

    @property
    def validator(self) -> Any: ...


#: Deeper nesting is refused: PostgreSQL's jsonb parser and Python's json
#: module both recurse, and no event needs this much structure.
MAX_DEPTH = 100

_django_encoder = DjangoJSONEncoder()


def json_path(parent: str, key: Any) -> str:
    """The JSON path of ``key`` under ``parent``: ``$.args[0]``, ``$.kwargs.when``, ``$["a b"]``."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    if isinstance(key, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
        return f"{parent}.{key}"
    return f"{parent}[{json.dumps(key, ensure_ascii=True)}]"


#: A location as nested ``(parent, key)`` pairs, ``()`` at the root.
type _At = tuple[()] | tuple[_At, str | int]


def _render(at: _At) -> str:
    """The JSON path of a location kept as nested ``(parent, key)`` pairs:
    built only when there is an error to report, never on the happy path."""
    keys: list[str | int] = []
    while at:
        at, key = at
        keys.append(key)
    path = "$"
    for key in reversed(keys):
        path = json_path(path, key)
    return path


#: A path deeper than this many keys is shown cut in messages (``InvalidPayload.path`` stays whole).
_SHOWN_KEYS = 6


def _render_short(at: _At) -> str:
    """``_render(at)``, its middle left out when the path is very deep:
    ``$.x[0][0]…[0].y (101 levels)``."""
    keys = []
    node = at
    while node:
        node, key = node
        keys.append(key)
    if len(keys) <= _SHOWN_KEYS:
        return _render(at)
    keys.reverse()
    head = "$"
    for key in keys[: _SHOWN_KEYS // 2]:
        head = json_path(head, key)
    tail = ""
    for key in keys[-(_SHOWN_KEYS // 2) :]:
        tail = json_path(tail, key)
    return f"{head}…{tail} ({len(keys)} levels)"


def _check_text(text: str, path: str, what: str) -> None:
    if "\x00" in text:
        raise InvalidPayload(
            f"{what} at {path} contains a NUL character (\\u0000), which PostgreSQL jsonb can't store: remove it.",
            path=path,
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidPayload(
            f"{what} at {path} contains a lone surrogate, which is not valid Unicode: fix the string.", path=path
        ) from None


#: Python refuses to print integers past 4300 digits (~14,300 bits).
_MAX_INT_BITS = 14_000
#: The smallest integer of 4301 digits. Compared, not printed: a process with
#: sys.set_int_max_str_digits(0) could write a longer one, which a worker with
#: Python's default limit can't read back (a "(malformed)" dead letter).
_TOO_MANY_DIGITS = 10**4300


def _normalize(value: Any, at: _At, depth: int, growth: list[int]) -> Any:
    """Return ``value`` as plain JSON data (dict/list/str/int/float/bool/None),
    converting what ``DjangoJSONEncoder`` converts; raise ``InvalidPayload``
    naming the path of anything else. Strings are checked later, on the
    encoded text, in one pass. ``growth[0]`` collects the bytes PostgreSQL
    adds by printing floats in plain notation (``1e+300`` -> 301 digits)."""
    if depth > MAX_DEPTH:
        raise InvalidPayload(
            f"payload nests deeper than {MAX_DEPTH} levels at {_render_short(at)}: flatten it.", path=_render(at)
        )
    kind = type(value)
    if kind is str or value is None or kind is bool:
        return value
    if kind is dict:  # the common containers first, by exact type (ABC checks are slow)
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                break
            out[key] = _normalize(item, (at, key), depth + 1, growth)
        else:
            return out
    elif kind is list:
        return [_normalize(item, (at, i), depth + 1, growth) for i, item in enumerate(value)]
    elif kind is int and value.bit_length() <= _MAX_INT_BITS:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        if value.bit_length() > _MAX_INT_BITS and abs(value) >= _TOO_MANY_DIGITS:
            # Whatever this process's int_max_str_digits: the consumer's may be Python's default.
            path = _render(at)
            raise InvalidPayload(f"integer at {path} has more than 4300 digits: send it as a string.", path=path)
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            path = _render(at)
            raise InvalidPayload(
                f"{value!r} at {path} is not a JSON number (NaN and Infinity aren't JSON): send null or a string.",
                path=path,
            )
        text = repr(value)
        if "e" in text:
            growth[0] += len(format(Decimal(text), "f")) - len(text)
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                if not isinstance(key, str):
                    path = _render(at)
                    raise InvalidPayload(
                        f"key {key!r} at {path} is a {type(key).__name__}: JSON object keys must be strings; convert it with str().",
                        path=path,
                    )
                key = str(key)
            out[key] = _normalize(item, (at, key), depth + 1, growth)
        return out
    if isinstance(value, (list, tuple)):
        return [_normalize(item, (at, i), depth + 1, growth) for i, item in enumerate(value)]
    if isinstance(value, dt.time) and value.utcoffset() is not None:
        path = _render(at)
        raise InvalidPayload(
            f"time {value.isoformat()} at {path} has a time zone, which a time of day can't carry "
            "(its offset depends on the date): send a timezone-aware datetime, or a naive time.",
            path=path,
        )
    try:
        converted = _django_encoder.default(value)
    except (TypeError, ValueError):
        path = _render(at)
        raise InvalidPayload(
            f"{type(value).__name__} at {path} is not JSON-encodable by DjangoJSONEncoder: "
            "convert it to a string, number, list or dict.",
            path=path,
        ) from None
    if isinstance(converted, float) and not math.isfinite(converted):  # e.g. Decimal('NaN') subclasses
        path = _render(at)
        raise InvalidPayload(f"{value!r} at {path} is not a finite number.", path=path)
    return _normalize(converted, at, depth + 1, growth)


def _find_bad_text(data: Any, at: _At = ()) -> None:
    """Raise ``InvalidPayload`` for the first key or string holding a NUL or a
    lone surrogate (the slow path, run only when the encoded text has one)."""
    if isinstance(data, str):
        _check_text(data, _render(at), "string")
    elif isinstance(data, dict):
        for key, item in data.items():
            _check_text(key, _render((at, key)), "key")
            _find_bad_text(item, (at, key))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            _find_bad_text(item, (at, i))


def encode_payload(
    payload: Any, event_type: EventSchema | None = None, *, max_bytes: int | None = None
) -> tuple[str, Any]:
    """Validate ``payload`` and return ``(json_text, normalized_data)``.

    ``payload`` must be a dict (a JSON object). Values are encoded the way
    ``DjangoJSONEncoder`` does (Decimal and UUID -> string, datetime -> ISO
    8601 with ``Z`` for UTC). Raises ``InvalidPayload`` naming the JSON path
    for: a value it can't encode, a non-string key, NaN/Infinity, a NUL
    character or lone surrogate, nesting past ``MAX_DEPTH``, an encoded size
    over ``MAX_PAYLOAD_BYTES`` (bytes of UTF-8 JSON), or a schema violation.
    """
    if not isinstance(payload, Mapping):
        raise InvalidPayload(f"payload must be a dict (a JSON object), got {type(payload).__name__}.")
    text, data = encode_json_value(payload, max_bytes=max_bytes)
    if event_type is not None and event_type.validator is not None:
        error = next(iter(sorted(event_type.validator.iter_errors(data), key=lambda e: list(e.absolute_path))), None)
        if error is not None:
            path = "$"
            for part in error.absolute_path:
                path = json_path(path, part)
            raise InvalidPayload(
                f"payload for {event_type.name!r} fails its schema at {path}: {error.message}", path=path
            )
    return text, data


def encode_json_value(value: Any, *, max_bytes: int | None = None) -> tuple[str, Any]:
    """``encode_payload``'s checks for any JSON value, an object or not, and
    no schema (a task's return value): ``(json_text, normalized_data)``.
    Raises ``InvalidPayload`` naming the path (``$`` is ``value`` itself).
    ``max_bytes``: the size limit, ``MAX_PAYLOAD_BYTES`` when None."""
    growth = [0]
    data = _normalize(value, (), 0, growth)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate somewhere: say where
        _find_bad_text(data)
        raise
    if "\\u0000" in text:  # json escapes NUL; jsonb refuses it (a literal backslash-u0000 string is fine)
        _find_bad_text(data)
    limit = conf.settings.MAX_PAYLOAD_BYTES if max_bytes is None else max_bytes
    size = len(encoded) + growth[0]
    if size > limit:
        raise InvalidPayload(
            f"payload is {size} bytes of JSON, over MAX_PAYLOAD_BYTES ({limit}): "
            "store the bulk elsewhere and publish a reference to it.",
        )
    return text, data
