"""Processes die mid-flow - SIGKILL of the relay, SIGKILL of workers,
SIGTERM under load - and every event still reaches every subscription
exactly once: nothing pending, nothing lost, nothing doubled."""

from __future__ import annotations

import random
import time

import pytest

from .harness import HANDLER_TIMEOUT_SECONDS, scaled

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

#: The longest a worker may take to exit after SIGTERM: the in-flight
#: handler's timeout, plus a pull request that was waiting (1 s), plus the
#: flush on close (2 s), plus start-up slack on a loaded two-core machine.
DRAIN_SECONDS = HANDLER_TIMEOUT_SECONDS + 5


def assert_exactly_once(rig, tally, events):
    assert tally.events == events
    assert (tally.lost, tally.duplicated, tally.stray, tally.pending) == (0, 0, 0, 0), (tally, rig.dead_letter_errors(), rig.logs())
    assert tally.dead_letters == 0, rig.dead_letter_errors()


def test_relay_sigkilled_ten_times_while_four_writers_publish_loses_and_doubles_nothing(make_rig, nats_server):
    events = scaled(20_000)
    rig = make_rig("relay_sigkill", nats_server.url)
    rng = random.Random(1)
    relay = rig.relay()
    rig.worker(1)
    rig.worker(2)
    writers = rig.writers(4, events, seconds=24)
    for _ in range(10):
        relay.wait_for_log("relay started")
        time.sleep(rng.uniform(1.0, 2.0))
        relay.kill()
        rig.fault("SIGKILL relay")
        relay.start()
    rig.wait_for_writers(writers)
    tally = rig.wait_until_settled(events, timeout=400)
    rig.report(tally)
    assert_exactly_once(rig, tally, events)


def test_workers_sigkilled_repeatedly_while_handling_handle_every_event_once(make_rig, nats_server):
    events = scaled(5_000)
    rig = make_rig("worker_sigkill", nats_server.url)
    rng = random.Random(2)
    rig.wait_for_writers(rig.writers(1, events, seconds=0))
    rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for kill in range(10):
        time.sleep(rng.uniform(1.5, 3.0))
        if rig.tally().complete(events):
            break  # nothing left to handle: a kill now would prove nothing
        victim = workers[kill % 2]
        victim.wait_for_log("worker started")
        victim.kill()
        rig.fault(f"SIGKILL {victim.role}")
        victim.start()
    assert rig.faults >= 5, "the workers finished before five kills: raise the event count"
    tally = rig.wait_until_settled(events, timeout=300)
    rig.report(tally)
    assert_exactly_once(rig, tally, events)


def test_sigterm_under_load_exits_zero_within_the_drain_time_and_loses_nothing(make_rig, nats_server):
    events = scaled(4_000)
    rig = make_rig("worker_sigterm", nats_server.url)
    rng = random.Random(4)
    rig.wait_for_writers(rig.writers(1, events, seconds=0))
    rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    exits = []
    for stop in range(8):
        time.sleep(rng.uniform(1.5, 3.0))
        if rig.tally().complete(events):
            break
        victim = workers[stop % 2]
        victim.wait_for_log("worker started")  # under load, not mid start-up
        code, seconds = victim.terminate(timeout=60)
        rig.fault(f"SIGTERM {victim.role}: exit={code} after {seconds:.1f}s")
        exits.append((code, round(seconds, 1)))
        victim.start()
    assert len(exits) >= 4, "the workers finished before four SIGTERMs: raise the event count"
    tally = rig.wait_until_settled(events, timeout=300)
    rig.report(tally)
    print(f"sigterm exits (status, seconds): {exits}; drain bound {DRAIN_SECONDS:.1f}s")
    assert all(code == 0 for code, _ in exits), exits
    assert max(seconds for _, seconds in exits) <= DRAIN_SECONDS, exits
    assert_exactly_once(rig, tally, events)
