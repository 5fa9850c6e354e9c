import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    """The operator's console: worker heartbeats (``platformkit_workers``)
    and the claims index behind the overview's recent-throughput figures."""

    dependencies = [
        ("django_platformkit", "0004_identity"),
    ]

    operations = [
        migrations.CreateModel(
            name="WorkerHeartbeat",
            fields=[
                ("worker", models.CharField(help_text="host:pid", max_length=200, primary_key=True, serialize=False)),
                ("started_at", models.DateTimeField()),
                ("last_seen", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("stopped_at", models.DateTimeField(blank=True, null=True)),
                (
                    "subscriptions",
                    models.JSONField(default=list, help_text="the subscription names this worker consumes"),
                ),
                (
                    "version",
                    models.CharField(blank=True, default="", help_text="django_platformkit version", max_length=50),
                ),
            ],
            options={
                "verbose_name": "worker heartbeat",
                "db_table": "platformkit_workers",
                "ordering": ["-last_seen"],
            },
        ),
        migrations.CreateModel(
            name="Overview",
            fields=[],
            options={
                "verbose_name": "overview",
                "verbose_name_plural": "overview",
                "proxy": True,
                "indexes": [],
                "constraints": [],
            },
            bases=("django_platformkit.outboxevent",),
        ),
        migrations.AddIndex(
            model_name="handledevent",
            index=models.Index(fields=["subscription", "handled_at"], name="platformkit_handled_recent"),
        ),
    ]
