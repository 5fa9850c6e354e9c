"""Network faults between the nodes of a loopback NATS cluster: every route
goes through a small TCP proxy in this process, one per ordered pair of
nodes, so a test can cut a node off from its peers and heal it again while
its clients stay connected to it - the partition a cloud network produces,
which SIGKILL or SIGSTOP of the node can't imitate.

A cut stops forwarding, it doesn't close anything: bytes already sent wait
in the proxy and the kernel's buffers, the senders' writes stall (nats-server
drops such a route itself after its write deadline), and a route dialled
while cut is held unconnected. Healing forwards what waited, as a network
that came back would deliver its retransmissions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from django_platformkit.devservices import free_port


class RouteProxies:
    """One proxy per ordered pair of nodes (``a`` dials ``b`` through
    ``route_url(a, b)``), all on one event loop in a thread of their own."""

    def __init__(self, nodes: Iterable[str]) -> None:
        self.nodes = list(nodes)
        #: The port each node's cluster listener binds (its config's ``cluster.listen``).
        self.route_ports = {node: free_port() for node in self.nodes}
        self._proxy_ports = {(a, b): free_port() for a in self.nodes for b in self.nodes if a != b}
        self._cut: set[str] = set()
        self._open: dict[tuple[str, str], asyncio.Event] = {}
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="route-proxies", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def route_url(self, a: str, b: str) -> str:
        return f"nats-route://127.0.0.1:{self._proxy_ports[(a, b)]}"

    def routes_of(self, node: str) -> list[str]:
        """The route URLs ``node``'s config lists: every other node, through its proxy."""
        return [self.route_url(node, other) for other in self.nodes if other != node]

    def cut(self, node: str) -> None:
        """Stop every byte between ``node`` and its peers, both ways."""
        self._loop.call_soon_threadsafe(self._set, node, True)

    def heal(self, node: str) -> None:
        self._loop.call_soon_threadsafe(self._set, node, False)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                writer.close()
            await asyncio.sleep(0.1)  # the pipes see their ends and return

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    # -- on the loop --
    def _set(self, node: str, cut: bool) -> None:
        (self._cut.add if cut else self._cut.discard)(node)
        for (a, b), gate in self._open.items():
            if a in self._cut or b in self._cut:
                gate.clear()
            else:
                gate.set()

    async def _start(self) -> None:
        for (a, b), port in self._proxy_ports.items():
            gate = self._open[(a, b)] = asyncio.Event()
            gate.set()
            server = await asyncio.start_server(
                lambda r, w, b=b, gate=gate: self._link(r, w, b, gate), "127.0.0.1", port
            )
            self._servers.append(server)

    async def _link(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, b: str, gate: asyncio.Event
    ) -> None:
        self._writers.add(client_w)
        await gate.wait()  # dialled while cut: held, as a SYN into a partition is
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.route_ports[b])
        except OSError:
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(server_w)
        await asyncio.gather(self._pipe(client_r, server_w, gate), self._pipe(server_r, client_w, gate))
        self._writers.difference_update((client_w, server_w))

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: asyncio.Event) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                await gate.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
