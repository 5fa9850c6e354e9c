from django.db import migrations, models


class Migration(migrations.Migration):
    """A worker's state on its heartbeat row - waiting for the broker,
    running, contested by a copy of its database, refused - with the reason
    and the database instance it works for, so the overview lists a worker
    that waits for NATS as such (issue 27)."""

    dependencies = [
        ("django_platformkit", "0007_features"),
    ]

    operations = [
        migrations.AddField(
            model_name="workerheartbeat",
            name="state",
            field=models.CharField(
                choices=[
                    ("starting", "starting"),
                    ("waiting_for_broker", "waiting for the broker"),
                    ("running", "running"),
                    ("contested", "contested"),
                    ("refused", "refused"),
                ],
                default="running",
                max_length=32,
            ),
        ),
        migrations.AddField(
            model_name="workerheartbeat",
            name="detail",
            field=models.TextField(blank=True, default="", help_text="why it waits or was refused, and the fix"),
        ),
        migrations.AddField(
            model_name="workerheartbeat",
            name="instance",
            field=models.CharField(
                blank=True,
                default="",
                help_text="the database instance it works for (system id:database oid)",
                max_length=64,
            ),
        ),
    ]
