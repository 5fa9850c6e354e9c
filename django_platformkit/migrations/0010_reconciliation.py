"""Reconciliation (issue 32): where each outbox row's send was stored - the
stream's creation time and the sequence its PubAck gave, written by the
relay's stamp - and, per subscription, where it began and how far its events
are reconciled (``operate/reconcile.py``).

The index is built ``CONCURRENTLY``, so a large outbox keeps taking
``publish()``'s INSERTs while it is built; its rows are all NULL then (the
index is partial), so it is quick. Rows stamped before this migration have
no sequence and are never reconciled: what is already in the stream is
delivered as before.
"""

import django.db.models.functions.datetime
from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # CREATE INDEX CONCURRENTLY can't run inside a transaction.
    atomic = False

    dependencies = [
        ("django_platformkit", "0009_plural_labels"),
    ]

    operations = [
        migrations.CreateModel(
            name="SubscriptionState",
            fields=[
                (
                    "name",
                    models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name="subscription"),
                ),
                (
                    "first_seen_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(), verbose_name="first seen at"
                    ),
                ),
                ("origin_stream_created", models.DateTimeField(verbose_name="began in the stream created at")),
                ("origin_seq", models.BigIntegerField(db_default=0, verbose_name="began after the sequence")),
                ("reconciled_stream_created", models.DateTimeField(blank=True, null=True)),
                ("reconciled_seq", models.BigIntegerField(db_default=0)),
                ("staged_stream_created", models.DateTimeField(blank=True, null=True)),
                ("staged_seq", models.BigIntegerField(db_default=0)),
                ("staged_at", models.DateTimeField(blank=True, null=True)),
                ("reconciled_at", models.DateTimeField(blank=True, null=True, verbose_name="reconciled at")),
                (
                    "note",
                    models.TextField(
                        blank=True, db_default="", help_text="why its last pass did nothing", verbose_name="note"
                    ),
                ),
                ("resent_at", models.DateTimeField(blank=True, null=True, verbose_name="re-sent at")),
                (
                    "resent",
                    models.JSONField(db_default={}, help_text="{cause: count} of that pass", verbose_name="re-sent"),
                ),
            ],
            options={
                "verbose_name": "subscription state",
                "verbose_name_plural": "subscription states",
                "db_table": "platformkit_subscriptions",
            },
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="stream_created",
            field=models.DateTimeField(blank=True, null=True, verbose_name="stream created"),
        ),
        migrations.AddField(
            model_name="outboxevent",
            name="stream_seq",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="stream sequence"),
        ),
        AddIndexConcurrently(
            model_name="outboxevent",
            index=models.Index(
                condition=models.Q(("stream_seq__isnull", False)),
                fields=["name", "stream_created", "stream_seq"],
                name="platformkit_outbox_stream",
            ),
        ),
    ]
