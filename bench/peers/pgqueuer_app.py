"""pgqueuer as its CLI runs it (``pgq run bench.peers.pgqueuer_app:create``:
asyncpg under uvloop, the CLI's defaults - batch size 10, LISTEN/NOTIFY
with a 30 s dequeue timeout; ``python -m bench.peers.pgqueuer_app`` calls
the CLI's own supervisor with those values, because ``pgq run`` of
pgqueuer 1.6 fails parsing its ``--log-level`` default under the installed
typer), its README's way to call blocking code from an
entrypoint (``asyncio.to_thread``: here the Django ORM insert), and its
scheduler beside the queue: two schedules every minute (its cron has no
seconds field, so the topology's every-5-s job runs every minute here).
The publisher enqueues through pgqueuer's ``SyncQueries`` on Django's own
psycopg connection, so the job rows are part of the publisher's
``transaction.atomic()`` (``enqueue()`` below).

``python -m bench.peers.pgqueuer_app --batch-size 100``: the same with
dequeues of 100 (pgqueuer's best setting in the handle and tasks rows); the
topology's processes part runs two of these side by side on one backlog
(``enqueue_many()``)."""

from __future__ import annotations

import asyncio
import contextlib
import os

from .handler import HOT_KINDS, idle_names, job_often, job_rare, sink


def _django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()


@contextlib.asynccontextmanager
async def create():
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.db import AsyncpgDriver

    _django()
    from django.db import connection

    s = connection.settings_dict
    conn = await asyncpg.connect(
        host=s["HOST"], port=int(s["PORT"]), user=s["USER"], password=s["PASSWORD"] or None, database=s["NAME"]
    )
    pgq = PgQueuer(AsyncpgDriver(conn))

    def entry(kind: str) -> None:
        async def run(job) -> None:
            await asyncio.to_thread(sink, kind, job.payload.decode())

        pgq.entrypoint(kind)(run)

    for kind in (*HOT_KINDS, *idle_names()):
        entry(kind)

    @pgq.schedule("trickle_job_often", "* * * * *")
    async def often(schedule) -> None:
        await asyncio.to_thread(job_often)

    @pgq.schedule("trickle_job_rare", "* * * * *")
    async def rare(schedule) -> None:
        await asyncio.to_thread(job_rare)

    try:
        yield pgq
    finally:
        await conn.close()


_queries = None


def _sync_queries():
    """pgqueuer's ``SyncQueries`` on Django's psycopg connection. Its driver
    refuses a connection that is not in autocommit when it is made (pgqueuer
    commits nothing itself), so it is made outside ``atomic()``; the
    enqueue then runs in whatever transaction the connection is in."""
    global _queries
    from django.db import connection

    if _queries is None or _queries.driver._connection is not connection.connection:
        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        connection.ensure_connection()
        _queries = SyncQueries(SyncPsycopgDriver(connection.connection))
    return _queries


def prepare() -> None:
    """Call outside ``atomic()`` before publishing (see ``_sync_queries``)."""
    _sync_queries()


def enqueue(key: str) -> None:
    payload = key.encode()
    _sync_queries().enqueue(list(HOT_KINDS), [payload, payload], [0, 0])


def enqueue_many(keys: list[str]) -> None:
    """Two jobs per key (one per hot kind), one INSERT per call: a backlog."""
    kinds, payloads = [], []
    for key in keys:
        payload = key.encode()
        kinds += HOT_KINDS
        payloads += [payload, payload]
    _sync_queries().enqueue(kinds, payloads, [0] * len(kinds))


def install() -> None:
    """pgqueuer's tables, once per database (``pgq install`` does the same)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass('pgqueuer') IS NOT NULL")
        if cursor.fetchone()[0]:
            return
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    s = connection.settings_dict

    async def go() -> None:
        conn = await asyncpg.connect(
            host=s["HOST"], port=int(s["PORT"]), user=s["USER"], password=s["PASSWORD"] or None, database=s["NAME"]
        )
        try:
            await Queries(AsyncpgDriver(conn)).install()
        finally:
            await conn.close()

    asyncio.run(go())


def main(argv: list[str] | None = None) -> None:
    """What ``pgq run bench.peers.pgqueuer_app:create`` does, logging at WARNING as our worker does;
    ``--batch-size N`` as ``pgq run --batch-size N`` (default: the CLI's 10)."""
    import argparse
    from datetime import timedelta

    from pgqueuer.adapters.cli import supervisor
    from pgqueuer.adapters.cli.cli import asyncio_run
    from pgqueuer.core import logconfig
    from pgqueuer.domain import types

    parser = argparse.ArgumentParser(prog="python -m bench.peers.pgqueuer_app")
    parser.add_argument("--batch-size", type=int, default=10)
    args = parser.parse_args(argv)
    logconfig.setup_fancy_logger(logconfig.LogLevel.WARNING)
    asyncio_run(
        supervisor.run(
            create,
            dequeue_timeout=timedelta(seconds=30),
            batch_size=args.batch_size,
            restart_delay=timedelta(seconds=5),
            restart_on_failure=False,
            mode=types.QueueExecutionMode.continuous,
            max_concurrent_tasks=None,
            shutdown_on_listener_failure=False,
            heartbeat_timeout=timedelta(seconds=30),
        )
    )


if __name__ == "__main__":
    main()
