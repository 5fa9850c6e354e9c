"""Subscriptions for the issue-28 features run by real worker processes:
a rate-limited subscription beside an unlimited twin on the same event
(tests/consume/test_ratelimit.py), and one that worker recycling drains
(tests/runtime/test_recycling.py). Loaded only in worker processes started
with ``PLATFORMKIT_TEST_FEATURES=1``, so the test process's catalogue (and
the AsyncAPI snapshot) stays as it was. The limit and concurrency of
``testapp.rated_limited`` come from ``PLATFORMKIT_TEST_RATE_LIMIT`` and
``PLATFORMKIT_TEST_RATE_CONCURRENCY`` (a changed limit, a deploy), and with
``PLATFORMKIT_TEST_STARTS_FILE`` every handler start is also appended to
that file, outside the database (a start whose transaction an outage rolled
back still counts against the limit). ``PLATFORMKIT_TEST_STARVATION=1``
adds ``CONSUMER_THREADS``' worth of slow limited subscriptions and an
unlimited one beside them (the starvation test).
"""

import os
import time

from django_platformkit import declare, subscribe

from .models import Effect

RATED = declare("testapp.rated", description="Events two subscriptions handle: one rate-limited, one not.")
RECYCLED = declare("testapp.recycled", description="Events that workers recycled mid-backlog handle.")
#: The limit of ``testapp.rated_limited`` (the test reads it from here).
RATE_LIMIT = os.environ.get("PLATFORMKIT_TEST_RATE_LIMIT", "20/s")
RATE_CONCURRENCY = int(os.environ.get("PLATFORMKIT_TEST_RATE_CONCURRENCY", "1"))
#: The slow limit of the starvation test's subscriptions (one start per 5 s each).
SLOW_LIMIT = "12/m"


def _started(subscription, event):
    # The handler's start, on this machine's clock (the test compares starts across processes).
    starts = os.environ.get("PLATFORMKIT_TEST_STARTS_FILE")
    if starts:
        with open(starts, "a") as file:  # one short append per start: whole lines, whatever the process
            file.write(f"{time.time():.6f} {os.getpid()} {subscription} {event.id}\n")
    Effect.objects.create(
        subscription=subscription,
        event_id=event.id,
        payload={"started": time.time(), "pid": os.getpid(), "attempt": event.attempt},
    )


@subscribe(RATED, name="testapp.rated_limited", rate_limit=RATE_LIMIT, concurrency=RATE_CONCURRENCY)
def rated_limited(event):
    _started("testapp.rated_limited", event)


@subscribe(RATED, name="testapp.rated_free")
def rated_free(event):
    _started("testapp.rated_free", event)


@subscribe(RECYCLED, name="testapp.recycled")
def recycled(event):
    _started("testapp.recycled", event)
    time.sleep(float(event.payload.get("sleep", 0)))


if os.environ.get("PLATFORMKIT_TEST_STARVATION"):
    from django_platformkit import conf

    THROTTLED = declare("testapp.throttled", description="Events slow rate-limited subscriptions handle.")
    PROMPT = declare("testapp.prompt", description="Events an unlimited subscription beside them handles.")

    def _slow(number):
        def handler(event):
            _started(f"testapp.throttled_{number}", event)

        handler.__name__ = handler.__qualname__ = f"throttled_{number}"
        return handler

    # As many limited lanes as the pool has threads (CONSUMER_THREADS, default 4): each unit waiting
    # for its turn put a thread to sleep, and nothing else started.
    for _number in range(int(conf.settings.CONSUMER_THREADS)):
        subscribe(THROTTLED, name=f"testapp.throttled_{_number}", rate_limit=SLOW_LIMIT)(_slow(_number))

    @subscribe(PROMPT, name="testapp.prompt")
    def prompt(event):
        _started("testapp.prompt", event)
