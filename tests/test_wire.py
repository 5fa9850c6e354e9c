"""Pure functions that need no server: the event and tenant name grammar,
payload encoding, the subject scheme and durable names."""

from __future__ import annotations

import json

import pytest

from django_platformkit.exceptions import InvalidEventName, InvalidPayload
from django_platformkit.jobs.cron import cron_problems
from django_platformkit.names import check_event_name
from django_platformkit.outbox.payload import encode_payload
from django_platformkit.wire import durable_name, parse_subject, subject_for

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["orders.placed", "shop.order_placed", "billing.invoice_paid2"])
def test_good_event_names_are_returned_unchanged(name):
    assert check_event_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "orders",
        "orders.",
        ".placed",
        "orders..placed",
        "a.b.c",
        "orders.*",
        "orders.>",
        "Shop.placed",
        "shop.order\n",
        7,
        None,
    ],
)
def test_bad_event_names_are_refused_with_our_error(name):
    with pytest.raises(InvalidEventName):
        check_event_name(name)


def test_subject_scheme_round_trips_with_and_without_a_tenant(settings):
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, SUBJECT_PREFIX="pkunit")
    plain, tenanted = subject_for("orders.placed", None), subject_for("orders.placed", "acme")
    assert plain.startswith("pkunit.")
    assert tenanted.startswith("pkunit.")
    assert plain != tenanted
    assert parse_subject(plain) == (None, "orders.placed")
    assert parse_subject(tenanted) == ("acme", "orders.placed")
    assert parse_subject("someone.else.entirely") is None


def test_durable_names_are_stable_and_legal_for_jetstream():
    first, again, other = durable_name("shop.send_email"), durable_name("shop.send_email"), durable_name("shop.bill")
    assert first == again
    assert first != other
    assert not set(first) & set(" .*>\t")  # JetStream refuses these in a durable name


def test_payload_encoding_is_compact_json_and_names_the_bad_path():
    text, _ = encode_payload({"b": 1, "a": [1, 2]})
    assert json.loads(text) == {"b": 1, "a": [1, 2]}
    assert " " not in text  # compact separators: the row and the message stay small
    with pytest.raises(InvalidPayload, match=r"items\[1\]"):
        encode_payload({"items": [1, object()]})


def test_cron_grammar_refuses_what_crons_read_differently():
    assert cron_problems("30 2 * * *") == []
    assert cron_problems("0 0 L * *")  # L means different things in different crons
    assert cron_problems("0 0 */2 * mon")  # day-of-month AND/OR day-of-week
    assert cron_problems("0 0 30 2 *")  # never fires


@pytest.mark.process
def test_worker_id_is_host_and_pid_and_a_forked_child_names_itself():
    """runworker --processes forks its children after the imports: each
    child's rows must name the child, not the supervisor. Forked in a
    process of its own (one thread: a fork beside this run's threads warns)."""
    import subprocess
    import sys

    program = """
import os, socket
from django_platformkit._process import worker_id
host = socket.gethostname()
assert worker_id() == f"{host}:{os.getpid()}" and worker_id() is worker_id()
pid = os.fork()
if pid == 0:
    assert worker_id() == f"{host}:{os.getpid()}", worker_id()
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert status == 0, "the child named the parent"
assert worker_id() == f"{host}:{os.getpid()}"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_targeted_re_send_is_for_the_subscriptions_it_names_and_its_header_never_reaches_a_handler(settings):
    import uuid

    from django_platformkit.wire import TARGET_HEADER, Delivery, OutgoingMessage, meant_for, parse_delivery

    plain = OutgoingMessage("p._.shop.placed", b"{}", "id-1")
    targeted = OutgoingMessage("p._.shop.placed", b"{}", "id-1:replay:1", targets=("shop.mail", "shop.stock"))
    assert plain.headers() == {"Nats-Msg-Id": "id-1"}
    assert targeted.headers() == {"Nats-Msg-Id": "id-1:replay:1", TARGET_HEADER: "shop.mail,shop.stock"}
    assert meant_for(plain.headers(), "shop.anything")
    assert meant_for(targeted.headers(), "shop.stock") and not meant_for(targeted.headers(), "shop.mail_copy")
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "SUBJECT_PREFIX": "p"}
    body = (
        '{"specversion":"1.0","id":"%s","type":"shop.placed","time":"2026-12-05T00:00:00Z","data":{}}' % uuid.uuid4()
    ).encode()
    event = parse_delivery(Delivery("p._.shop.placed", body, {**targeted.headers(), "traceparent": "00-x"}, 1, 7, None))
    assert event.headers == {"traceparent": "00-x"}
