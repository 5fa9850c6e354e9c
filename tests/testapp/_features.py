"""Subscriptions for the issue-28 features run by real worker processes:
a rate-limited subscription beside an unlimited twin on the same event
(tests/consume/test_ratelimit.py), and one that worker recycling drains
(tests/runtime/test_recycling.py). Loaded only in worker processes started
with ``PLATFORMKIT_TEST_FEATURES=1``, so the test process's catalogue (and
the AsyncAPI snapshot) stays as it was.
"""

import os
import time

from django_platformkit import declare, subscribe

from .models import Effect

RATED = declare("testapp.rated", description="Events two subscriptions handle: one rate-limited, one not.")
RECYCLED = declare("testapp.recycled", description="Events that workers recycled mid-backlog handle.")
#: The limit of ``testapp.rated_limited`` (the test reads it from here).
RATE_LIMIT = "20/s"


def _started(subscription, event):
    # The handler's start, on this machine's clock (the test compares starts across processes).
    Effect.objects.create(
        subscription=subscription,
        event_id=event.id,
        payload={"started": time.time(), "pid": os.getpid(), "attempt": event.attempt},
    )


@subscribe(RATED, name="testapp.rated_limited", rate_limit=RATE_LIMIT)
def rated_limited(event):
    _started("testapp.rated_limited", event)


@subscribe(RATED, name="testapp.rated_free")
def rated_free(event):
    _started("testapp.rated_free", event)


@subscribe(RECYCLED, name="testapp.recycled")
def recycled(event):
    _started("testapp.recycled", event)
    time.sleep(float(event.payload.get("sleep", 0)))
