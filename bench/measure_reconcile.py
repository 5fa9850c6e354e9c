"""Reconciliation's cost on a seven-day outbox: a pass over 1M stamped rows,
every one handled by both subscriptions of its event (the worst case: a
first pass, or the one after a stream was reset, reads everything); the
steady pass, whose window is what the durables settled since the last one
(``window`` rows, whatever the table's size); and a pass that finds
``resend`` events lost for both subscriptions and sends them again.

The stream is real and empty, purged up to past the rows' sequences, so
every durable's horizon covers them all (what a stream whose messages aged
out looks like); the rows and claims are written by SQL, as a week of
traffic would have left them. The relay's and the consumer's rows of the
same run (``--only relay --only handle``) are the hot path's figures.
"""

from __future__ import annotations

import threading
import time

from django_platformkit import identity, subscribe
from django_platformkit.consume.subscriptions import get_subscription
from django_platformkit.operate.reconcile import reconcile
from django_platformkit.runtime.startup import StartUp

from .benchapp.platformkit import RECONCILE
from .harness import Result, Sizes, log, reset_broker, reset_tables, scalar, sql

SUBSCRIPTIONS = ("bench.reconcile_a", "bench.reconcile_b")


def _subscriptions() -> list:
    for name in SUBSCRIPTIONS:
        if get_subscription(name) is None:
            subscribe(RECONCILE, name=name)(lambda event: None)
    return [get_subscription(name) for name in SUBSCRIPTIONS]


def _fill(rows: int, created) -> None:
    """``rows`` rows relayed into the stream made at ``created`` (sequences 1..rows), each handled by both."""
    sql(
        "INSERT INTO platformkit_outbox (id, name, tenant, payload, headers, created_at, published_at, "
        "stream_created, stream_seq) "
        "SELECT gen_random_uuid(), %s, NULL, jsonb_build_object('n', g, 'sku', 'sku-' || g, 'qty', 1), '{}'::jsonb, "
        "clock_timestamp(), clock_timestamp(), %s, g FROM generate_series(1, %s) AS g",
        [RECONCILE.name, created, rows],
    )
    sql(
        "INSERT INTO platformkit_handled (subscription, event_id, handled_at) "
        "SELECT s, o.id, now() FROM platformkit_outbox o CROSS JOIN unnest(%s::text[]) AS s",
        [list(SUBSCRIPTIONS)],
    )
    sql("VACUUM ANALYZE platformkit_outbox")
    sql("VACUUM ANALYZE platformkit_handled")


def _cursor_at(created, seq: int) -> None:
    """Both subscriptions reconciled up to ``seq`` some minutes ago (nothing staged)."""
    sql(
        "UPDATE platformkit_subscriptions SET reconciled_stream_created = %s, reconciled_seq = %s, "
        "staged_stream_created = NULL, staged_seq = 0, staged_at = NULL, reconciled_at = now() - interval '10 min' "
        "WHERE name = ANY(%s)",
        [created, seq, list(SUBSCRIPTIONS)],
    )


def _pass(transport, subs) -> tuple[float, int]:
    started = time.perf_counter()
    report = reconcile(
        transport, owner=identity.database_identity(), instance=identity.database_instance(), declared=subs
    )
    if report.note or report.failed:
        raise RuntimeError(f"reconciliation did nothing: {report.note or report.failed}")
    return time.perf_counter() - started, report.resent


def run_reconcile(sizes: Sizes, transport) -> list[Result]:
    rows, window, resend = sizes.reconcile_rows, sizes.reconcile_window_rows, sizes.reconcile_resend_rows
    subs = _subscriptions()
    reset_tables("platformkit_subscriptions")
    reset_broker(transport, *(s.durable for s in subs))
    start_up = StartUp(transport, using="default", stop_event=threading.Event(), connect_timeout_seconds=10.0)
    start_up.connect_and_ensure_stream(give_up=True)
    for sub in subs:
        start_up.ensure_durable(sub)  # the subscriptions begin: their origins recorded
    facts = transport.stream_facts(owner=start_up.owner, instance=start_up.instance)
    log(f"reconcile: {rows:,} stamped rows, each handled by {len(subs)} subscriptions")
    _fill(rows, facts.created)

    async def past_them() -> None:  # the stream's messages are gone (aged out): every horizon covers the rows
        from django_platformkit import conf

        await transport.connection.js.purge_stream(conf.settings.STREAM, seq=rows + 1)

    transport.connection.call(past_them(), timeout=60)
    size = scalar("SELECT pg_size_pretty(pg_relation_size('platformkit_outbox_stream'))")
    results = []
    seconds, resent = _pass(transport, subs)
    assert resent == 0, resent
    results.append(
        Result(
            key="reconcile_full",
            what=f"reconciliation pass over a {rows:,}-row outbox, all handled (a first pass)",
            ours=seconds,
            unit="s",
            target="info",
            note=f"{rows * len(subs) / seconds:,.0f} (row, subscription) pairs/s; index platformkit_outbox_stream {size}",
        )
    )
    steady = []
    for _ in range(sizes.reps):
        _cursor_at(facts.created, rows - window)
        steady.append(_pass(transport, subs)[0])
    results.append(
        Result(
            key="reconcile_steady",
            what=f"reconciliation pass, {window:,} rows settled since the last, {rows:,}-row outbox",
            ours=min(steady) * 1000,
            unit="ms",
            target="info",
            note=f"passes {', '.join(f'{s * 1000:.0f} ms' for s in steady)}",
            samples={"ours": steady},
        )
    )
    sql(
        "DELETE FROM platformkit_handled WHERE event_id IN (SELECT id FROM platformkit_outbox "
        "WHERE name = %s AND stream_seq > %s)",
        [RECONCILE.name, rows - resend],
    )
    _cursor_at(facts.created, rows - window)
    seconds, resent = _pass(transport, subs)
    assert resent == resend * len(subs), (resent, resend)
    results.append(
        Result(
            key="reconcile_resend",
            what=f"reconciliation pass re-sending {resend:,} lost events to both subscriptions",
            ours=resend / seconds,
            unit="events/s",
            target="info",
            note=f"{seconds:.2f} s: one targeted message per event",
        )
    )
    reset_tables("platformkit_subscriptions")
    reset_broker(transport, *(s.durable for s in subs))
    return results
