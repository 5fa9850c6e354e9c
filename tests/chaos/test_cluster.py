"""A three-node JetStream cluster on loopback, the stream with three
replicas - how a user who outgrows one machine runs us: the relay and the
workers get all three URLs (``NATS_URL`` is comma-separated) and
``STREAM_REPLICAS = 3``. The stream's leader is SIGKILLed mid-relay and
restarted later, twice over; in another scenario it is paused (SIGSTOP)
and then cut off from its peers (``partition.RouteProxies``) while its
clients stay connected to it: no event lost, no effect doubled, and no
event the stream stored dead-lettered by the relay (a leader that can't
commit answers "409 duplicate message id is in process" to a re-send,
which only means "not decided yet")."""

from __future__ import annotations

import signal
import time

import pytest

from django_platformkit.devservices import NatsServer, free_port
from tests.conftest import wait_for

from .harness import STREAM, nats_call, scaled, stream_leader
from .partition import RouteProxies

# 1200 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1200)]


def cluster_config(name: str, route_port: int, routes: list[str], *, advertise: str | None = None) -> str:
    """One node's config. JetStream and its store directory come from the
    command line ``NatsServer`` builds (``-js -sd``); a config file may not
    repeat ``store_dir``. ``advertise``: the route address gossiped to the
    other nodes (a proxied cluster gossips a closed port, so no node dials
    a peer around its proxy)."""
    gossip = f'  advertise: "{advertise}"\n' if advertise else ""
    return (
        f"server_name: {name}\ncluster {{\n  name: chaos\n  listen: 127.0.0.1:{route_port}\n{gossip}"
        f"  routes: [{', '.join(routes)}]\n}}\n"
    )


@pytest.fixture
def nats_cluster(tmp_path):
    """Three JetStream servers n1..n3 routed to each other; a dict name -> server."""
    route_ports = [free_port() for _ in range(3)]
    servers = {}
    for i, route_port in enumerate(route_ports, start=1):
        root = tmp_path / f"n{i}"
        routes = [f"nats-route://127.0.0.1:{port}" for port in route_ports if port != route_port]
        servers[f"n{i}"] = NatsServer(store_dir=root, config=cluster_config(f"n{i}", route_port, routes))
    yield from _running(servers)


@pytest.fixture
def partitionable_cluster(tmp_path):
    """``(servers, proxies)``: three JetStream servers whose routes all pass
    through ``RouteProxies``, so ``proxies.cut(name)`` partitions a node."""
    proxies = RouteProxies(["n1", "n2", "n3"])
    servers = {
        name: NatsServer(
            store_dir=tmp_path / name,
            config=cluster_config(name, proxies.route_ports[name], proxies.routes_of(name), advertise="127.0.0.1:1"),
        )
        for name in proxies.nodes
    }
    try:
        for running in _running(servers):
            yield running, proxies
    finally:
        proxies.close()


def _running(servers):
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
            if server.running:
                server.process.send_signal(signal.SIGCONT)  # a paused server would ignore its SIGTERM
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


def test_a_paused_then_partitioned_stream_leader_loses_doubles_and_dead_letters_nothing(
    make_rig, partitionable_cluster
):
    """The issue-27 probe: the leader SIGSTOPped 15 s, then (the new leader)
    cut off from its peers 20 s, while two writers publish and the relay
    sends. Re-sends of what the stuck leader had proposed get 409 "duplicate
    message id is in process" (err_code 10158); they must stay pending until
    the stream decides, never become relay dead letters."""
    servers, proxies = partitionable_cluster
    events = scaled(3_000)
    urls = ",".join(s.url for s in servers.values())
    rig = make_rig("cluster_pause_partition", urls, PLATFORMKIT_TEST_STREAM_REPLICAS="3")
    relay = rig.relay()
    workers = [rig.worker(1), rig.worker(2)]
    for process in [relay, *workers]:
        process.wait_for_log("started")
    assert nats_call(urls, stream_replicas) == 3
    writers = rig.writers(2, events, seconds=45)

    def at(seconds: float) -> None:
        time.sleep(max(0.0, rig.started + seconds - time.monotonic()))

    at(4.0)
    paused = wait_for(lambda: stream_leader(urls), timeout=30, what="a stream leader")
    servers[paused].process.send_signal(signal.SIGSTOP)
    rig.fault(f"SIGSTOP stream leader {paused}")
    at(19.0)
    servers[paused].process.send_signal(signal.SIGCONT)
    rig.fault(f"SIGCONT {paused}")
    at(25.0)
    cut = wait_for(lambda: stream_leader(urls), timeout=30, what="a stream leader")
    proxies.cut(cut)
    rig.fault(f"routes of stream leader {cut} cut")
    at(45.0)
    proxies.heal(cut)
    rig.fault(f"routes of {cut} healed")
    rig.wait_for_writers(writers)
    tally = rig.wait_until_settled(events, timeout=600)
    rig.report(tally)
    print(f"paused {paused}, cut {cut}; leader now {stream_leader(urls)}")
    assert all(p.running and p.generation == 1 for p in (relay, *workers)), rig.logs()
    rig.assert_exactly_once(tally, events)  # dead_letters == 0: none of the relay's either


async def stream_replicas(js) -> int:
    return (await js.stream_info(STREAM)).config.num_replicas
