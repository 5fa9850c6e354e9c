"""2. The broker: the only NATS and asyncio code, behind one Protocol
(``port.Broker``). ``transport.Transport`` speaks to JetStream;
``memory.InMemoryTransport`` is its in-process twin, held to the same
behaviour suite."""
