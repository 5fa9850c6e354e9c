"""Delivery metadata read from a JetStream ack subject agrees with nats-py's
own parse, for both forms of ADR-15 (pure: starts nothing)."""

import pytest
from nats.aio.msg import Msg

from django_platformkit.broker.messages import ack_reply_fields

pytestmark = pytest.mark.unit

V1 = "$JS.ACK.PLATFORMKIT.shop-send_receipt.3.1042.977.1764590000000000000.12"
V2 = "$JS.ACK._.ACCHASH.PLATFORMKIT.shop-send_receipt.3.1042.977.1764590000000000000.12.RANDOM"
V2_NO_TOKEN = "$JS.ACK._.ACCHASH.PLATFORMKIT.shop-send_receipt.1.7.7.1764590000000000000.0"


@pytest.mark.parametrize("reply", [V1, V2, V2_NO_TOKEN])
def test_delivery_count_sequence_and_pending_match_nats_py(reply):
    metadata = Msg.Metadata._from_reply(reply)
    assert ack_reply_fields(reply) == (
        metadata.num_delivered,
        metadata.sequence.stream,
        metadata.num_pending,
    )


@pytest.mark.parametrize(
    "reply", [None, "", "_INBOX.abc.1", "$JS.ACK.too.short", "$JS.ACK.S.C.x.1042.977.1764590000000000000.12"]
)
def test_anything_else_is_none_so_the_caller_falls_back(reply):
    assert ack_reply_fields(reply) is None
