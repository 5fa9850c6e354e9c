"""Bad input, generated (hypothesis).

- A payload is either accepted - and the handler then receives exactly
  ``received(payload)``, the documented encoding below - or refused with
  ``InvalidPayload`` naming the JSON path of a value that can't be stored;
  never a database error, never a row the relay can't send.
- Event names and tenants are accepted exactly per the grammar; anything else
  raises ``InvalidEventName`` before any SQL.
- Arbitrary bytes and headers on our subjects are recorded as dead letters
  and terminated; the consumer keeps going and handles the next good event.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import math
import re
import time
import uuid
from collections.abc import Mapping

import pytest
from django.db import connection, transaction
from django.utils.duration import duration_iso_string
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from django_platformkit import publish
from django_platformkit.consume.consumer import Consumer
from django_platformkit.consume.subscriptions import Subscription
from django_platformkit.exceptions import InvalidEventName, InvalidPayload, TransactionRequired, UndeclaredEvent
from django_platformkit.models import DeadLetter
from django_platformkit.names import check_event_name, check_tenant
from django_platformkit.outbox.events import catalogue
from django_platformkit.outbox.payload import MAX_DEPTH, encode_payload
from django_platformkit.outbox.relay import Relay
from django_platformkit.wire import subject_for

EVENT = "testapp.flaky"  # declared, no schema
#: Python refuses to print or parse an int with more digits (sys.get_int_max_str_digits).
MAX_INT_DIGITS = 4300
EVENT_GRAMMAR = r"[a-z][a-z0-9_]*\.[a-z][a-z0-9_]*"
TENANT_GRAMMAR = r"[A-Za-z0-9_-]{1,64}"


# --- the documented encoding -------------------------------------------------


def received(value, *, stored: bool = True):
    """What a handler finds in ``event.payload`` for a value ``publish()``
    accepted. ``stored=False``: what ``encode_payload`` hands to the database,
    before PostgreSQL's jsonb has normalised the numbers.

    - ``None``, ``True``, ``False``, ``str`` (and subclasses): unchanged.
    - ``int`` of any size up to 4300 digits (and ``IntEnum``): the same int.
    - ``float``: jsonb keeps the exact decimal of Python's ``repr`` and prints
      it in plain notation, so ``-0.0`` arrives as ``0.0``; a float whose repr
      has a positive exponent (``abs(x) >= 1e16``) arrives as the *int* of
      that decimal (``1e16`` -> ``10000000000000000``, ``1.5e300`` -> 15 and
      299 zeros); every other float arrives unchanged (``5e-324`` too).
    - ``Decimal`` and ``UUID``: ``str(value)`` (``Decimal('1E+5')`` -> ``'1E+5'``,
      ``Decimal('NaN')`` -> ``'NaN'``).
    - ``datetime``: ISO 8601, microseconds cut (not rounded) to milliseconds,
      ``+00:00`` written ``Z``; naive stays naive. ``date``: ISO 8601.
      ``time`` (naive only): ISO 8601, cut to milliseconds.
      ``timedelta``: ISO 8601 duration (``django.utils.duration.duration_iso_string``).
    - tuple and list: list; any Mapping: dict. Key order is not kept (jsonb
      sorts keys: shorter first, then bytewise).
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not stored:
            return float(value)
        text = repr(float(value))
        if "e+" in text:
            return int(decimal.Decimal(text))
        return 0.0 if value == 0 else float(value)
    if isinstance(value, dt.datetime):
        text = value.isoformat(timespec="milliseconds" if value.microsecond else "auto")
        return text.removesuffix("+00:00") + "Z" if text.endswith("+00:00") else text
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dt.time):
        return value.isoformat(timespec="milliseconds" if value.microsecond else "auto")
    if isinstance(value, dt.timedelta):
        return duration_iso_string(value)
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): received(v, stored=stored) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [received(v, stored=stored) for v in value]
    raise AssertionError(f"received() has no rule for {type(value).__name__}: problems() should have refused it")


def json_path(parent: str, key) -> str:
    """How an ``InvalidPayload`` names a place: ``$.key``, ``$[3]``, ``$["odd key"]``."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{parent}.{key}"
    return f"{parent}[{json.dumps(key, ensure_ascii=True)}]"


def _bad_text(text: str) -> bool:
    return "\x00" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def problems(value, path: str = "$", depth: int = 0) -> list[str]:
    """Every JSON path ``publish()`` may name when it refuses ``value``
    (which one it names first is not part of the contract); [] = accepted."""
    if depth > MAX_DEPTH:
        return [path]
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, str):
        return [path] if _bad_text(value) else []
    if isinstance(value, int):
        return [path] if abs(value) >= 10**MAX_INT_DIGITS else []
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path]
    if isinstance(value, Mapping):
        found = []
        for key, item in value.items():
            if not isinstance(key, str):
                found.append(path)
                continue
            child = json_path(path, key)
            found += [child] if _bad_text(key) else []
            found += problems(item, child, depth + 1)
        return found
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in problems(item, json_path(path, i), depth + 1)]
    if isinstance(value, dt.time) and value.utcoffset() is not None:
        return [path]  # JSON has no way to say "10:00 in Paris" without a date
    if isinstance(value, (dt.date, dt.time, dt.timedelta, decimal.Decimal, uuid.UUID)):
        return [path] if depth + 1 > MAX_DEPTH else []  # converted to a string one level down
    return [path]  # sets, bytes, complex, objects: not JSON


def same(a, b) -> bool:
    """Equal, and of the same JSON type: 1 is not 1.0 is not True; -0.0 is not 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# --- strategies --------------------------------------------------------------

NASTY_CHARS = [
    "\x00",
    "\ud800",
    "\udfff",
    "\U0010ffff",
    "\u2028",
    "\x7f",
    "\x1b",
    "\ufeff",
    "\U00020000",
    "\U000e0001",
    "\U0001f600",
    '"',
    "\\",
]
#: Every code point, surrogates included, plus a sampler that reaches each of
#: the 17 planes and the characters JSON and PostgreSQL treat specially.
characters = st.one_of(
    st.characters(exclude_categories=()),
    st.sampled_from(NASTY_CHARS),
    st.integers(0, 16).map(lambda plane: chr(plane * 0x10000 + 0x41)),
)
texts = st.text(characters, max_size=12)
long_keys = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, exclude_categories=("Cs",)), min_size=200, max_size=1200
)
keys = st.one_of(
    texts, long_keys, st.integers(), st.none(), st.booleans(), st.floats(), st.tuples(st.integers()), st.uuids()
)
special_numbers = st.sampled_from(
    [
        -0.0,
        0.0,
        5e-324,
        2.2250738585072014e-308,
        1e-7,
        1e15,
        1e16,
        1.0000000000000002e16,
        1.5e300,
        1.7976931348623157e308,
        -1.7976931348623157e308,
        float("nan"),
        float("inf"),
        float("-inf"),
        2**63,
        -(2**63) - 1,
        2**64,
        2**200,
    ]
)
# Built, not listed: hypothesis can't print an int past 4300 digits as a strategy.
longest_ints = st.builds(
    lambda sign, digits: sign * 10 ** (digits - 1),
    st.sampled_from([1, -1]),
    st.sampled_from([MAX_INT_DIGITS, MAX_INT_DIGITS + 1]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    texts,
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.floats(),
    special_numbers,
    longest_ints,
    st.decimals(),
    st.datetimes(timezones=st.none() | st.timezones()),
    st.dates(),
    st.times(timezones=st.none() | st.timezones()),
    st.timedeltas(),
    st.uuids(),
    st.binary(max_size=4),
    st.frozensets(st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=10),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=24,
)


@st.composite
def deeply_nested(draw):
    """A value nested right around MAX_DEPTH, through lists and dicts."""
    value = draw(st.one_of(st.integers(), texts))
    for _ in range(draw(st.integers(MAX_DEPTH - 3, MAX_DEPTH + 2))):
        value = [value] if draw(st.booleans()) else {draw(st.sampled_from(["k", "odd key", "ü"])): value}
    return {"deep": value}


payloads = st.one_of(st.dictionaries(keys, values, max_size=6), deeply_nested())


# --- payloads ----------------------------------------------------------------


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(payloads)
@example({"negative_zero": -0.0, "tiny": 5e-324, "huge": 1.7976931348623157e308, "big_int": 2**70, "int_float": 1e16})
@example(
    {
        "at": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
        "naive": dt.datetime(2026, 1, 2),
        "price": decimal.Decimal("9.990"),
    }
)
@example({"nul": "a\x00b"})
@example({"lone": "\udc00"})
@example({1: "non-string key"})
@example({"tags": {"a", "b"}})
@example({"raw": b"\x00\xff"})
@example({"at": dt.time(10, 0, tzinfo=dt.UTC)})
@example({"too_long": 10**MAX_INT_DIGITS})
@example({"deep": json.loads('[{"ü": ' * (MAX_DEPTH // 2 + 1) + "1" + "}]" * (MAX_DEPTH // 2 + 1))})
def test_a_payload_is_encoded_as_documented_or_refused_naming_its_path(payload):
    expected = problems(payload)
    try:
        text, data = encode_payload(payload)
    except InvalidPayload as exc:
        assert expected, f"refused a valid payload: {exc}"
        assert exc.path in expected, (str(exc), expected)
        cut = re.search(r"levels at (\$.*)…(.*) \((\d+) levels\): ", str(exc))
        if cut:  # a very deep path is shown by its ends: they are the path's
            assert exc.path.startswith(cut[1]) and exc.path.endswith(cut[2]), (str(exc), exc.path)
        else:
            assert exc.path in str(exc) or exc.path == "$"
        return
    assert not expected, f"accepted a payload with problems at {expected}"
    assert same(data, received(payload, stored=False))
    # strict JSON: no NaN/Infinity tokens, and it parses back to the same data
    assert same(json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in {text!r}")), data)


@pytest.mark.django_db(transaction=True)
def test_an_accepted_payload_reaches_the_handler_exactly_as_documented(transport):
    """Through PostgreSQL, the relay, JetStream and the consumer. A refused
    payload raises before any SQL: the caller's transaction stays usable."""
    seen: dict[uuid.UUID, dict] = {}
    subscription = Subscription(
        name="testapp.props_roundtrip", event=EVENT, handler=lambda event: seen.__setitem__(event.id, event.payload)
    )
    consumer = Consumer(subscription, transport)
    consumer.ensure()
    relay = Relay(transport)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payloads)
    @example(
        {
            "negative_zero": -0.0,
            "tiny": 5e-324,
            "huge": 1.7976931348623157e308,
            "big_int": -(2**70),
            "int_float": 1e16,
            "float": 0.1,
        }
    )
    @example(
        {
            "at": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
            "d": dt.date(1, 1, 1),
            "dur": dt.timedelta(days=-1, microseconds=5),
        }
    )
    @example(
        {
            "planes": "".join(chr(p * 0x10000 + 0x41) for p in range(17)) + "\u2028\x7f\x01",
            "ключ" * 100: [None, True, ()],
        }
    )
    @example({"x": [1.5e300] * 4000})  # tiny as compact JSON, 1.2 MB as jsonb prints it
    def roundtrip(payload):
        expected = problems(payload)
        with transaction.atomic():
            try:
                event_id = publish(EVENT, payload)
            except InvalidPayload as exc:
                assert expected or "MAX_PAYLOAD_BYTES" in str(exc), f"refused a valid payload: {exc}"
                with connection.cursor() as cursor:  # no SQL ran: the transaction is still usable
                    cursor.execute("SELECT 1")
                return
        assert not expected, f"accepted a payload with problems at {expected}"
        stats = relay.drain()
        assert (stats.stored, stats.temporary, stats.dead_lettered) == (1, 0, 0), stats
        deadline = time.monotonic() + 15
        while event_id not in seen and time.monotonic() < deadline:
            consumer.poll(timeout=0.5)
        assert event_id in seen, "the event never reached the handler"
        assert same(seen[event_id], received(payload)), (seen[event_id], received(payload))

    roundtrip()
    assert consumer.counts["malformed"] == consumer.counts["dead_lettered"] == 0


# --- event names and tenants ------------------------------------------------

anything = st.one_of(
    st.text(characters, max_size=20),
    st.none(),
    st.integers(),
    st.binary(max_size=8),
    st.floats(),
    st.lists(st.text(max_size=3), max_size=2),
)
name_like = st.one_of(
    anything,
    st.from_regex(EVENT_GRAMMAR, fullmatch=True),
    st.from_regex(EVENT_GRAMMAR, fullmatch=True).map(lambda n: n + "\n"),
    st.from_regex(r"[a-zA-Z0-9_.\-*> ]{1,12}", fullmatch=True),
)
tenant_like = st.one_of(
    anything,
    st.from_regex(TENANT_GRAMMAR, fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_.\-*> \n]{0,70}", fullmatch=True),
    st.uuids(),
)


@settings(max_examples=200, deadline=None)
@given(name_like)
@example("shop.order_placed\n")
@example("Shop.order")
@example("shop.order.placed")
@example("shöp.order")
def test_an_event_name_is_accepted_exactly_per_the_grammar_and_refused_before_any_sql(name):
    valid = isinstance(name, str) and re.fullmatch(EVENT_GRAMMAR, name) is not None
    if valid:
        assert check_event_name(name) == name
        # outside transaction.atomic and without database access (pytest-django forbids it here)
        with pytest.raises(TransactionRequired if name in catalogue() else UndeclaredEvent):
            publish(name, {})
    else:
        with pytest.raises(InvalidEventName, match="is not an event name"):
            check_event_name(name)
        with pytest.raises(InvalidEventName):
            publish(name, {})


@settings(max_examples=200, deadline=None)
@given(tenant_like)
@example("acme\n")
@example("a" * 65)
@example("")
@example("tenant.with.dots")
@example("_")
def test_a_tenant_is_accepted_exactly_per_the_grammar_and_refused_before_any_sql(tenant):
    if isinstance(tenant, uuid.UUID):
        tenant_text = str(tenant)
    else:
        tenant_text = tenant
    if tenant_text == "_":
        # The grammar's one reserved token: "_" means "no tenant" on the subject.
        with pytest.raises(InvalidEventName, match="is reserved"):
            check_tenant(tenant)
        with pytest.raises(InvalidEventName):
            publish(EVENT, {}, tenant=tenant)
        return
    valid = tenant is None or (isinstance(tenant_text, str) and re.fullmatch(TENANT_GRAMMAR, tenant_text) is not None)
    if valid:
        assert check_tenant(tenant) == tenant_text
        with pytest.raises(TransactionRequired):
            publish(EVENT, {}, tenant=tenant)
    else:
        with pytest.raises(InvalidEventName, match="is not a tenant token"):
            check_tenant(tenant)
        with pytest.raises(InvalidEventName):
            publish(EVENT, {}, tenant=tenant)


# --- broker messages that aren't ours --------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@st.composite
def envelopes(draw):
    """A CloudEvents envelope of ours with some attributes dropped or replaced."""
    body = {
        "specversion": "1.0",
        "id": str(uuid.uuid4()),
        "source": "/testapp",
        "type": EVENT,
        "time": "2026-01-01T00:00:00Z",
        "datacontenttype": "application/json",
        "data": {"n": 1},
    }
    if draw(st.booleans()):
        body["tenantid"] = draw(st.from_regex(TENANT_GRAMMAR, fullmatch=True))
    for key in draw(st.lists(st.sampled_from(sorted(body) + ["tenantid", "traceparent"]), max_size=3)):
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(json_values)
    return json.dumps(body).encode()


bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    envelopes(),
    st.text(characters.filter(lambda c: not 0xD800 <= ord(c) <= 0xDFFF), max_size=50).map(lambda t: t.encode()),
)
# Header names are tokens; Nats-* headers are instructions to the broker
# (dedup ids, expectations), not message content, so they are left out.
header_names = st.from_regex(r"[A-Za-z][A-Za-z0-9_-]{0,15}", fullmatch=True).filter(
    lambda h: not h.lower().startswith("nats")
)
headers = st.dictionaries(
    header_names, st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30), max_size=4
)
subject_tenants = st.one_of(
    st.just("_"),
    st.from_regex(TENANT_GRAMMAR, fullmatch=True),
    st.from_regex(r"[A-Za-z0-9$%&+=@!~]{1,8}", fullmatch=True),
)


@pytest.mark.django_db(transaction=True)
def test_arbitrary_bytes_and_headers_on_our_subjects_are_recorded_terminated_and_the_next_good_event_is_handled(
    transport, broker
):
    handled: list[uuid.UUID] = []
    subscription = Subscription(name="testapp.props_fuzz", event=EVENT, handler=lambda event: handled.append(event.id))
    consumer = Consumer(subscription, transport)
    consumer.ensure()
    relay = Relay(transport)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=bodies, message_headers=headers, tenant=subject_tenants)
    @example(body=b"", message_headers={}, tenant="_")
    @example(body=b"\xff\xfe{", message_headers={"traceparent": "garbage"}, tenant="acme")
    def fuzz(body, message_headers, tenant):
        subject = subject_for(EVENT, None if tenant == "_" else tenant)
        ack = transport.publish_raw(subject, body, headers=message_headers or None)
        # The outbox is the authority (DESIGN.md "Trust model"): whatever these
        # bytes are, this project's outbox never held them, so none may run.
        before = dict(consumer.counts)
        with transaction.atomic():
            good = publish(EVENT, {"good": True})
        relay.drain()
        deadline = time.monotonic() + 15
        while good not in handled and time.monotonic() < deadline:
            consumer.poll(timeout=0.5)  # raising here would be the worker dying
        assert good in handled, "the good event behind the bad message was not handled"
        delta = {k: consumer.counts[k] - before[k] for k in before}
        assert delta["handled"] == 1 and delta["malformed"] == 1, delta
        assert DeadLetter.objects.filter(
            subscription=subscription.name, name="(malformed)", error__contains=f"stream_seq={ack.seq}:"
        ).exists()

    fuzz()

    # The last ack/term is on its way: the server applies it to the consumer
    # asynchronously, so give it a moment before reading the counts.
    def counts():
        info = transport.consumer_info(subscription.durable)
        return (info.num_pending, info.num_ack_pending, info.num_redelivered)

    deadline = time.monotonic() + 5
    while counts() != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts() == (0, 0, 0)  # every bad message terminated, none redelivered
