"""The identity of this project's database: one row, a random UUID made at
migrate time. The stream records it (``identity.py``), so a worker never
consumes a stream another project's database owns.

A row, not ``pg_control_system()``'s system identifier: that one is shared by
every database of a PostgreSQL cluster (two projects on one server would look
like one) and changes when the data is restored into a new cluster (a
restored project would look like a stranger to its own stream). A row is
carried by pg_dump / pg_restore with the data it belongs to.
"""

import uuid

from django.db import migrations

TABLE = "platformkit_identity"


def make_identity(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (singleton, database_id) VALUES (true, %s) ON CONFLICT DO NOTHING", [uuid.uuid4()]
        )


class Migration(migrations.Migration):
    dependencies = [
        ("django_platformkit", "0003_tasks"),
    ]

    operations = [
        migrations.RunSQL(
            f"CREATE TABLE {TABLE} ("
            "singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton), "
            "database_id uuid NOT NULL, "
            "created_at timestamptz NOT NULL DEFAULT now())",
            reverse_sql=f"DROP TABLE {TABLE}",
        ),
        migrations.RunPython(make_identity, migrations.RunPython.noop),
    ]
