"""Count attempts on a connection of its own, so they survive the handler's rollback."""

import psycopg
from django.db import connection


def note_attempt(subscription, event):
    params = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(key, None)
    with psycopg.connect(**params, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO testapp_attempt (subscription, event_id, attempt, at) VALUES (%s, %s, %s, now())",
            [subscription, event.id, event.attempt],
        )
