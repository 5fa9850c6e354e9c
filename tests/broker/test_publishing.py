"""What a broker's answer to one publish means for its outbox row: only a
refusal that can never succeed is PERMANENT (the relay dead-letters the
row); anything that doesn't prove the message stored or refused for good
leaves it pending, to be sent again with the same ``Nats-Msg-Id``."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from django_platformkit.broker.publishing import classify_publish_error
from django_platformkit.wire import PublishOutcome

pytestmark = pytest.mark.unit


def api_error(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, err_code=err_code, description=description)


def test_a_re_send_the_stream_has_not_decided_yet_stays_pending():
    # A clustered leader answers a re-send of a message it proposed and has
    # not committed (paused, partitioned, electing) with this 409: the first
    # copy may still be stored. Dead-lettering it lost events (issue 27).
    result = classify_publish_error(api_error(409, 10158, "duplicate message id is in process"))
    assert result.outcome is PublishOutcome.TEMPORARY
    assert "10158" in result.error and "not decided" in result.error


@pytest.mark.parametrize(
    ("code", "err_code", "description"),
    [
        (503, 10077, "maximum messages exceeded"),  # discard new: room comes back
        (503, 10008, "JetStream system temporarily unavailable"),
        (429, 10167, "too many requests"),
        (400, 10109, "invalid operation on sealed stream"),  # the stream, not the message: a new one takes it
        (400, 10060, "expected stream does not match"),
        (400, 99999, "a refusal this build doesn't know"),
        (500, 10009, "JetStream cluster can not handle request"),
    ],
)
def test_a_refusal_that_is_not_about_the_message_itself_stays_pending(code, err_code, description):
    assert classify_publish_error(api_error(code, err_code, description)).outcome is PublishOutcome.TEMPORARY


@pytest.mark.parametrize(
    ("code", "err_code", "description"),
    [(400, 10054, "message size exceeds maximum allowed"), (400, 10097, "header size exceeds maximum allowed of 64k")],
)
def test_a_message_the_stream_can_never_take_is_refused_for_good(code, err_code, description):
    result = classify_publish_error(api_error(code, err_code, description))
    assert result.outcome is PublishOutcome.PERMANENT
    assert description in result.error


def test_a_message_over_the_servers_max_payload_is_refused_for_good():
    assert classify_publish_error(nats.errors.MaxPayloadError()).outcome is PublishOutcome.PERMANENT


@pytest.mark.parametrize(
    "exc", [nats.errors.TimeoutError(), nats.js.errors.NoStreamResponseError(), nats.errors.ConnectionClosedError()]
)
def test_no_answer_stays_pending(exc):
    assert classify_publish_error(exc).outcome is PublishOutcome.TEMPORARY
