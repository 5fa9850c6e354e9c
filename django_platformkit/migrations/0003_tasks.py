"""django.tasks over the outbox: a not-before time on outbox rows (deferred
runs), the relay's indexes that keep due rows fast behind any number of
deferred ones, and the task results table (deleted with its outbox row)."""

from django.db import migrations, models

CASCADE_SQL = (
    "ALTER TABLE platformkit_task_results ADD CONSTRAINT platformkit_task_results_outbox "
    "FOREIGN KEY (event_id) REFERENCES platformkit_outbox (id) ON DELETE CASCADE"
)


class Migration(migrations.Migration):
    dependencies = [
        ("django_platformkit", "0002_attempts"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxevent",
            name="not_before",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RemoveIndex(model_name="outboxevent", name="platformkit_outbox_pending"),
        migrations.AddIndex(
            model_name="outboxevent",
            index=models.Index(
                condition=models.Q(published_at__isnull=True, not_before__isnull=True),
                fields=["created_at", "id"],
                name="platformkit_outbox_pending",
            ),
        ),
        migrations.AddIndex(
            model_name="outboxevent",
            index=models.Index(
                condition=models.Q(published_at__isnull=True, not_before__isnull=False),
                fields=["not_before", "id"],
                name="platformkit_outbox_deferred",
            ),
        ),
        migrations.CreateModel(
            name="TaskResultRecord",
            fields=[
                ("event_id", models.UUIDField(primary_key=True, serialize=False)),
                (
                    "status",
                    models.CharField(
                        blank=True, default="", help_text="SUCCESSFUL once a run committed; '' before", max_length=16
                    ),
                ),
                ("return_value", models.JSONField(blank=True, null=True)),
                ("started_at", models.DateTimeField(blank=True, null=True)),
                ("last_attempted_at", models.DateTimeField(blank=True, null=True)),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                (
                    "errors",
                    models.JSONField(default=list, help_text="[{exception_class_path, traceback}] per failed attempt"),
                ),
                ("worker_ids", models.JSONField(default=list, help_text="host:pid per run, in order")),
            ],
            options={"verbose_name": "task result", "db_table": "platformkit_task_results"},
        ),
        migrations.CreateModel(
            name="OutboxTask",
            fields=[],
            options={"verbose_name": "task", "proxy": True, "indexes": [], "constraints": []},
            bases=("django_platformkit.outboxevent",),
        ),
        # Not a Django ForeignKey: the result must go when purge deletes the
        # row with raw SQL, and the ORM's cascade would never see that.
        migrations.RunSQL(
            CASCADE_SQL, "ALTER TABLE platformkit_task_results DROP CONSTRAINT platformkit_task_results_outbox"
        ),
    ]
