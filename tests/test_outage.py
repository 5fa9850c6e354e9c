"""One classifier decides "the database is unavailable" - for Django's wrapped
errors and psycopg's own - against real PostgreSQL errors: refused
connections, too many connections (53300), a read-only transaction; a query
that is simply wrong is not an outage. And an outage is logged twice (start,
end), not once per retry."""

from __future__ import annotations

import logging
import uuid

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction

from django_platformkit.devservices import free_port
from django_platformkit.outage import Outage, database_unavailable, is_database_error, sqlstate

pytestmark = pytest.mark.django_db(transaction=True)


def _params(**extra):
    params = {
        k: v
        for k, v in connection.get_connection_params().items()
        if k not in ("cursor_factory", "context", "prepare_threshold")
    }
    params.update(extra)
    return params


def test_a_refused_connection_is_an_outage():
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(**_params(host="127.0.0.1", port=free_port(), connect_timeout=2))
    assert database_unavailable(refused.value) and is_database_error(refused.value)


def test_too_many_connections_is_an_outage():
    role = f"pk_limited_{uuid.uuid4().hex[:6]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT 0")
    try:
        with pytest.raises(psycopg.OperationalError) as refused:
            psycopg.connect(**_params(user=role, password=None))
        assert "too many connections" in str(refused.value)
        assert database_unavailable(refused.value)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP ROLE {role}")


def test_a_read_only_transaction_is_an_outage_and_a_wrong_query_is_not():
    with pytest.raises(DatabaseError) as read_only, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION READ ONLY")
        cursor.execute("INSERT INTO platformkit_jobs (name, last_error) VALUES ('x', '')")
    assert sqlstate(read_only.value) == "25006" and database_unavailable(read_only.value)
    with pytest.raises(DatabaseError) as wrong, connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table_here")
    assert sqlstate(wrong.value) == "42P01"
    assert is_database_error(wrong.value) and not database_unavailable(wrong.value)


def test_an_outage_is_two_log_lines_however_many_retries(caplog):
    log = logging.getLogger("django_platformkit.test_outage")
    caplog.set_level(logging.DEBUG, logger="django_platformkit")
    outage = Outage("relay", log)
    error = psycopg.OperationalError("connection refused")
    for _ in range(50):
        outage.failed(error, 1.0)
    outage.recovered()
    outage.recovered()  # nothing more to say
    loud = [(r.levelno, r.getMessage().split(" error=")[0]) for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud[0] == (logging.ERROR, "relay: database unavailable")
    assert len(loud) == 2 and loud[1][0] == logging.WARNING and loud[1][1].startswith("relay: database back after")
