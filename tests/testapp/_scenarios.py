"""Subscriptions for the worker-runtime scenarios (issue 11): deploys in the
middle of a backlog, a hanging handler in a batch, retries parked ahead of
healthy events, many idle subscriptions beside a busy one. Loaded only in
worker processes started with ``PLATFORMKIT_TEST_SCENARIOS=1``, so the test
process's catalogue (and the AsyncAPI snapshot) stays as it was.

Every handler notes each run in ``testapp_attempt`` on a connection of its
own (so failed runs count) and writes one ``Effect`` when it commits.
Behaviour comes from the payload: ``sleep`` (seconds, every run), ``hang``
(seconds, every run: past the handler timeout), ``fail`` (raise every run).
"""

import time

from django_platformkit import declare, subscribe

from ._attempts import note_attempt
from .models import Effect

DEPLOY = declare("testapp.deploy", description="Work that a deploy interrupts (tests/chaos/test_deploys.py).")
PARKED = declare("testapp.parked", description="Events that fail and park for retry, and healthy ones behind them.")
PING = declare("testapp.ping", description="One event that every idle subscription handles.")
BUSY = declare("testapp.busy", description="Slow events that keep one subscription busy.")

#: Subscriptions on ``testapp.ping``: with ``testapp.busy_step`` they make
#: the issue's 24 subscriptions of one worker.
IDLE_SUBSCRIPTIONS = tuple(f"testapp.idle_{i:02d}" for i in range(23))


class ScenarioFailure(RuntimeError):
    """The error a scenario's failing handler raises; tests look for its text."""


def _run(subscription, event):
    note_attempt(subscription, event)
    payload = event.payload
    time.sleep(float(payload.get("sleep", 0)))
    time.sleep(float(payload.get("hang", 0)))
    if payload.get("fail"):
        raise ScenarioFailure(f"scenario failure n={payload.get('n')} attempt={event.attempt}")
    Effect.objects.create(subscription=subscription, event_id=event.id, payload=payload)


# Retries spaced out (1 s, 1.5 s, then 2 s) so a failing event is still
# being retried while the scenario restarts the worker around it.
@subscribe(DEPLOY, name="testapp.deploy_step", backoff_seconds=[1.0, 1.5, 2.0])
def deploy_step(event):
    _run("testapp.deploy_step", event)


# A failure parks its event for two minutes: far longer than the scenario.
@subscribe(PARKED, name="testapp.park_step", backoff_seconds=[120.0])
def park_step(event):
    _run("testapp.park_step", event)


@subscribe(BUSY, name="testapp.busy_step")
def busy_step(event):
    _run("testapp.busy_step", event)


def _idle(name):
    def handler(event):
        _run(name, event)

    handler.__name__ = name.split(".", 1)[1]
    return handler


for _name in IDLE_SUBSCRIPTIONS:
    subscribe(PING, name=_name)(_idle(_name))
