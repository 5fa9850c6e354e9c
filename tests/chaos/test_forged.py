"""Anyone who can publish on our subjects, while real work flows: forged
events with ids the outbox never had, and copies of real events carrying
another payload. None of the forgeries runs; every real event is handled
exactly once, with the payload the outbox holds (DESIGN.md "Trust model")."""

from __future__ import annotations

import json
import time
import uuid

import psycopg
import pytest

from .harness import EVENT, PREFIX, SUBSCRIPTIONS, nats_call, scaled

# 900 s: the scenario starts its own PostgreSQL and NATS, then kills,
# partitions or restarts them and waits out the recovery (ack wait, reconnects).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]


def _envelope(event_id: str, tenant: str | None, payload: dict) -> tuple[str, bytes]:
    subject = f"{PREFIX}.{tenant or '_'}.{EVENT}"
    body = {
        "specversion": "1.0",
        "id": event_id,
        "source": "/testapp",
        "type": EVENT,
        "subject": subject,
        "time": "2026-12-01T00:00:00.000000Z",
        "datacontenttype": "application/json",
        "data": payload,
    }
    if tenant:
        body["tenantid"] = tenant
    return subject, json.dumps(body).encode()


def test_forged_messages_beside_real_traffic_never_run_and_real_events_keep_the_outbox_payload(make_rig, nats_server):
    events = scaled(2_000)
    rig = make_rig("forged_messages", nats_server.url)
    rig.relay()
    for worker in (rig.worker(1), rig.worker(2)):
        worker.wait_for_log("worker started")
    writers = rig.writers(2, events, seconds=12)

    forged_ids: list[str] = []
    copies = 0
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        time.sleep(1.0)
        with psycopg.connect(rig.database_url, autocommit=True) as conn:
            real = conn.execute(
                "SELECT id::text, tenant FROM platformkit_outbox WHERE name = %s ORDER BY random() LIMIT 5", [EVENT]
            ).fetchall()
        batch = [
            _envelope(str(uuid.uuid4()), tenant, {"writer": 99, "n": -1, "amount": "99999.00"})
            for _, tenant in real or [(None, None)]
        ]
        forged_ids += [json.loads(body)["id"] for _, body in batch]
        # The same ids as real events, another payload, a fresh Nats-Msg-Id so
        # the broker's dedup window doesn't drop them before the consumer sees them.
        twins = [
            _envelope(event_id, tenant, {"writer": 99, "n": -2, "amount": "99999.00"}) for event_id, tenant in real
        ]
        copies += len(twins)

        async def send(js, messages=batch + twins):
            for subject, body in messages:
                await js.publish(subject, body, headers={"Nats-Msg-Id": str(uuid.uuid4())})

        nats_call(rig.nats_urls, send)
        rig.fault(f"forged {len(batch)} unknown ids and {len(twins)} same-id copies")
    rig.wait_for_writers(writers)

    tally = rig.wait_until_settled(events, timeout=600)
    rig.report(tally)
    assert (tally.lost, tally.duplicated, tally.stray, tally.pending) == (0, 0, 0, 0), (
        tally,
        rig.dead_letter_errors(),
        rig.logs(),
    )
    with psycopg.connect(rig.database_url, autocommit=True) as conn:
        # Every handler run saw the outbox's payload, never a forged one.
        wrong = conn.execute(
            "SELECT count(*) FROM testapp_effect e JOIN platformkit_outbox o ON o.id = e.event_id "
            "WHERE e.subscription = 'testapp.record_order' AND e.payload <> o.payload"
        ).fetchone()[0]
        dead = conn.execute("SELECT name, count(*) FROM platformkit_dead_letters GROUP BY name").fetchall()
        recorded = conn.execute(
            "SELECT count(*) FROM platformkit_dead_letters WHERE name = '(malformed)' AND error LIKE '%%not in this project''s outbox%%'"
        ).fetchone()[0]
    assert wrong == 0
    # Each unknown id is one malformed record per subscription; nothing else dead-lettered.
    assert dict(dead) == {"(malformed)": len(forged_ids) * len(SUBSCRIPTIONS)}, dead
    assert recorded == len(forged_ids) * len(SUBSCRIPTIONS)
    assert copies > 0
