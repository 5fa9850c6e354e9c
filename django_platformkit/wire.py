"""The wire format, pure: what a message is on the broker and what a handler
receives. No ``nats`` import and no database: a web process that publishes,
and ``django.setup()``, import this and never the broker client.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class ReceivedEvent:
    """What a handler receives.

    ``id``: the event id (outbox id = CloudEvents ``id`` = claim key);
    ``name``: the event name; ``tenant``: the tenant token or None;
    ``payload``: the JSON object published (as decoded from JSON);
    ``occurred_at``: aware datetime of the outbox insert (database clock);
    ``attempt``: 1-based, how many times the handler has started for this
    (subscription, event), this run included - hand-backs, outages and
    deliveries that never reached the handler don't count (DESIGN.md
    "Attempts"); ``headers``: message
    headers (``traceparent``/``tracestate`` when the publisher had a trace).
    """

    id: uuid.UUID
    name: str
    tenant: str | None
    payload: dict[str, Any]
    occurred_at: datetime
    attempt: int
    headers: Mapping[str, str] = field(default_factory=dict)
