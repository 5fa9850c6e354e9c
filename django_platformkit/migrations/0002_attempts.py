import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_platformkit", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="Attempt",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("subscription", models.CharField(max_length=200)),
                ("event_id", models.UUIDField()),
                ("attempt", models.PositiveIntegerField(help_text="1-based: the how-many-th run of the handler")),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("running", "running"),
                            ("failed", "failed"),
                            ("handled", "handled"),
                            ("interrupted", "interrupted"),
                        ],
                        default="running",
                        max_length=16,
                    ),
                ),
                ("started_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("finished_at", models.DateTimeField(blank=True, null=True)),
                ("error", models.TextField(blank=True, default="")),
                ("traceback", models.TextField(blank=True, default="")),
                (
                    "worker",
                    models.CharField(
                        blank=True, default="", help_text="host:pid of the worker that ran it", max_length=200
                    ),
                ),
            ],
            options={
                "verbose_name": "attempt",
                "db_table": "platformkit_attempts",
                "ordering": ["subscription", "event_id", "attempt"],
                "indexes": [models.Index(fields=["event_id"], name="platformkit_attempt_event")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("subscription", "event_id", "attempt"), name="platformkit_attempt_once"
                    )
                ],
            },
        ),
    ]
