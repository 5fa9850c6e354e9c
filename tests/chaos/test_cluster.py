"""A three-node JetStream cluster on loopback, the stream with three
replicas - how a user who outgrows one machine runs us: the relay and the
workers get all three URLs (``NATS_URL`` is comma-separated) and
``STREAM_REPLICAS = 3``. The stream's leader is SIGKILLed mid-relay and
restarted later, twice over: no event lost, no effect doubled."""

from __future__ import annotations

import time

import pytest

from django_platformkit.devservices import NatsServer, free_port
from tests.conftest import wait_for

from .harness import STREAM, nats_call, scaled, stream_leader

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]


def cluster_config(name: str, route_port: int, route_ports: list[int]) -> str:
    """One node's config. JetStream and its store directory come from the
    command line ``NatsServer`` builds (``-js -sd``); a config file may not
    repeat ``store_dir``."""
    routes = ", ".join(f"nats-route://127.0.0.1:{port}" for port in route_ports if port != route_port)
    return (
        f"server_name: {name}\ncluster {{\n  name: chaos\n  listen: 127.0.0.1:{route_port}\n  routes: [{routes}]\n}}\n"
    )


@pytest.fixture
def nats_cluster(tmp_path):
    """Three JetStream servers n1..n3 routed to each other; a dict name -> server."""
    route_ports = [free_port() for _ in range(3)]
    servers = {}
    for i, route_port in enumerate(route_ports, start=1):
        root = tmp_path / f"n{i}"
        servers[f"n{i}"] = NatsServer(store_dir=root, config=cluster_config(f"n{i}", route_port, route_ports))
    try:
        for server in servers.values():
            server.start()
        urls = ",".join(s.url for s in servers.values())

        def jetstream_ready() -> bool:
            async def ask(js):
                await js.account_info()
                return True

            try:
                return nats_call(urls, ask)
            except Exception:
                return False

        wait_for(jetstream_ready, timeout=60, what="the JetStream cluster to elect a meta leader", interval=0.5)
        yield servers
    finally:
        for server in servers.values():
            server.cleanup()


def test_killing_the_stream_leader_of_a_three_replica_cluster_mid_relay_loses_and_doubles_nothing(
    make_rig, nats_cluster
):
    events = scaled(5_000)
    urls = ",".join(s.url for s in nats_cluster.values())
    rig = make_rig("cluster_leader_kill", urls, PLATFORMKIT_TEST_STREAM_REPLICAS="3")
    relay = rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for process in [relay, *workers]:
        process.wait_for_log("started")
    assert nats_call(urls, stream_replicas) == 3
    writers = rig.writers(2, events, seconds=20)
    killed = []
    for kill_at, restart_at in [(4.0, 9.0), (12.0, 17.0)]:
        time.sleep(max(0.0, rig.started + kill_at - time.monotonic()))
        leader = wait_for(lambda: stream_leader(urls), timeout=30, what="a stream leader")
        nats_cluster[leader].kill()
        rig.fault(f"SIGKILL stream leader {leader}")
        killed.append(leader)
        time.sleep(max(0.0, rig.started + restart_at - time.monotonic()))
        nats_cluster[leader].start()  # same port, same store: it catches up as a follower
    rig.wait_for_writers(writers)
    tally = rig.wait_until_settled(events, timeout=600)
    rig.report(tally)
    print(f"killed leaders: {killed}; leader now {stream_leader(urls)}")
    assert all(p.running and p.generation == 1 for p in (relay, *workers)), rig.logs()
    rig.assert_exactly_once(tally, events)


async def stream_replicas(js) -> int:
    return (await js.stream_info(STREAM)).config.num_replicas
