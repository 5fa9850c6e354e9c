"""The one handler every system of the trickle runs, and the topology's names.

``sink(kind, key)``: one ORM ``Sink.objects.create()`` - the shape a user's
handler has, and the same call as the topology's subscriptions make
(bench/benchapp/platformkit.py ``_orm_sink``). ``at`` is
``clock_timestamp()`` at the INSERT: when the handler ran, on the machine's
clock, which the publisher's commit stamp reads too.
"""

from __future__ import annotations

#: The two handlings of each hot event: two subscriptions (ours), two jobs or tasks (the peers).
HOT_KINDS = ("trickle_a", "trickle_b")
#: Idle task types registered beside them (ours: 21 idle subscriptions + 1 slow one).
IDLE_COUNT = 22


def idle_names() -> list[str]:
    return [f"trickle_idle_{i:03d}" for i in range(IDLE_COUNT)]


def sink(kind: str, key: str) -> None:
    from bench.benchapp.models import Sink

    Sink.objects.create(kind=kind, event_id=key, occurred_at=None)


def job_often() -> None:
    """The periodic job of the topology (every 5 s where the peer can say so): one COUNT."""
    from bench.benchapp.models import Row

    Row.objects.filter(name="bench.topo_job").count()


def job_rare() -> None:
    """The topology's every-minute job: nothing."""
