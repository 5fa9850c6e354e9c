from django.db import migrations


class Migration(migrations.Migration):
    """Each model's plural label, its own translatable string (Django's default
    appends "s", which no catalogue can translate: "unzustellbare Nachrichts").
    Labels only: ``sqlmigrate`` shows every operation as a no-op."""

    dependencies = [
        ("django_platformkit", "0008_worker_state"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="attempt",
            options={
                "ordering": ["subscription", "event_id", "attempt"],
                "verbose_name": "attempt",
                "verbose_name_plural": "attempts",
            },
        ),
        migrations.AlterModelOptions(
            name="deadletter",
            options={
                "ordering": ["-failed_at", "-id"],
                "permissions": [("replay_deadletter", "Can replay or discard dead letters")],
                "verbose_name": "dead letter",
                "verbose_name_plural": "dead letters",
            },
        ),
        migrations.AlterModelOptions(
            name="handledevent",
            options={"verbose_name": "claim", "verbose_name_plural": "claims"},
        ),
        migrations.AlterModelOptions(
            name="jobstate",
            options={"verbose_name": "job state", "verbose_name_plural": "job states"},
        ),
        migrations.AlterModelOptions(
            name="outboxevent",
            options={"verbose_name": "outbox event", "verbose_name_plural": "outbox events"},
        ),
        migrations.AlterModelOptions(
            name="outboxtask",
            options={"verbose_name": "task", "verbose_name_plural": "tasks"},
        ),
        migrations.AlterModelOptions(
            name="ratelimit",
            options={"verbose_name": "rate limit", "verbose_name_plural": "rate limits"},
        ),
        migrations.AlterModelOptions(
            name="taskresultrecord",
            options={"verbose_name": "task result", "verbose_name_plural": "task results"},
        ),
    ]
