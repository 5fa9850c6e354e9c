"""Processes die mid-flow - SIGKILL of the relay, SIGKILL of workers,
SIGTERM under load - and every event still reaches every subscription
exactly once: nothing pending, nothing lost, nothing doubled."""

from __future__ import annotations

import random
import time

import pytest

from .harness import HANDLER_TIMEOUT_SECONDS, scaled

# 1200 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]

#: The longest a worker may take to exit after SIGTERM: the in-flight
#: handler's timeout, plus a pull request that was waiting (1 s), plus the
#: flush on close (2 s), plus start-up slack on a loaded two-core machine.
DRAIN_SECONDS = HANDLER_TIMEOUT_SECONDS + 5


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
    rig.finish(events, timeout=900)


def test_workers_sigkilled_repeatedly_while_handling_handle_every_event_once(make_rig, nats_server):
    events = scaled(5_000)
    rig = make_rig("worker_sigkill", nats_server.url)

    def kill(worker):
        worker.kill()
        rig.fault(f"SIGKILL {worker.role}")
        worker.start()

    rig.faults_while_handling(events, rounds=10, seed=2, inject=kill)
    assert rig.faults >= 5, "the workers finished before five kills: raise the event count"
    rig.finish(events, timeout=600)


def test_sigterm_under_load_exits_zero_within_the_drain_time_and_loses_nothing(make_rig, nats_server):
    events = scaled(4_000)
    rig = make_rig("worker_sigterm", nats_server.url)
    exits = []

    def terminate(worker):
        code, seconds = worker.terminate(timeout=60)
        rig.fault(f"SIGTERM {worker.role}: exit={code} after {seconds:.1f}s")
        exits.append((code, round(seconds, 1)))
        worker.start()

    rig.faults_while_handling(events, rounds=8, seed=4, inject=terminate)
    assert len(exits) >= 4, "the workers finished before four SIGTERMs: raise the event count"
    rig.finish(events, timeout=600)
    print(f"sigterm exits (status, seconds): {exits}; drain bound {DRAIN_SECONDS:.1f}s")
    assert all(code == 0 for code, _ in exits), exits
    assert max(seconds for _, seconds in exits) <= DRAIN_SECONDS, exits
