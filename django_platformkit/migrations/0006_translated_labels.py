import django.db.models.functions.datetime
from django.db import migrations, models

import django_platformkit._ids
import django_platformkit.wire


class Migration(migrations.Migration):
    """The field labels the admin shows, translatable (``gettext_lazy``).
    Labels only: ``sqlmigrate`` shows every operation as a no-op."""

    dependencies = [
        ("django_platformkit", "0005_ops"),
    ]

    operations = [
        migrations.AlterField(
            model_name="attempt",
            name="attempt",
            field=models.PositiveIntegerField(
                help_text="1-based: the how-many-th run of the handler", verbose_name="attempt"
            ),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="error",
            field=models.TextField(blank=True, default="", verbose_name="error"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="event_id",
            field=models.UUIDField(verbose_name="event id"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="finished_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="outcome",
            field=models.CharField(
                choices=[
                    ("running", "running"),
                    ("failed", "failed"),
                    ("handled", "handled"),
                    ("interrupted", "interrupted"),
                ],
                default=django_platformkit.wire.AttemptOutcome["RUNNING"],
                max_length=16,
                verbose_name="outcome",
            ),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="started_at",
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), verbose_name="started at"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="subscription",
            field=models.CharField(max_length=200, verbose_name="subscription"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="traceback",
            field=models.TextField(blank=True, default="", verbose_name="traceback"),
        ),
        migrations.AlterField(
            model_name="attempt",
            name="worker",
            field=models.CharField(
                blank=True,
                default="",
                help_text="host:pid of the worker that ran it",
                max_length=200,
                verbose_name="worker",
            ),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="attempts",
            field=models.PositiveIntegerField(default=0, verbose_name="attempts"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="error",
            field=models.TextField(blank=True, default="", verbose_name="error"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="event_id",
            field=models.UUIDField(verbose_name="event id"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="failed_at",
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), verbose_name="failed at"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="name",
            field=models.CharField(max_length=200, verbose_name="name"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="subscription",
            field=models.CharField(max_length=200, verbose_name="subscription"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="tenant",
            field=models.CharField(blank=True, max_length=64, null=True, verbose_name="tenant"),
        ),
        migrations.AlterField(
            model_name="deadletter",
            name="traceback",
            field=models.TextField(blank=True, default="", verbose_name="traceback"),
        ),
        migrations.AlterField(
            model_name="handledevent",
            name="event_id",
            field=models.UUIDField(verbose_name="event id"),
        ),
        migrations.AlterField(
            model_name="handledevent",
            name="handled_at",
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), verbose_name="handled at"),
        ),
        migrations.AlterField(
            model_name="handledevent",
            name="subscription",
            field=models.CharField(max_length=200, verbose_name="subscription"),
        ),
        migrations.AlterField(
            model_name="jobstate",
            name="finished_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="finished at"),
        ),
        migrations.AlterField(
            model_name="jobstate",
            name="last_error",
            field=models.TextField(blank=True, default="", verbose_name="last error"),
        ),
        migrations.AlterField(
            model_name="jobstate",
            name="last_slot",
            field=models.DateTimeField(blank=True, null=True, verbose_name="last slot"),
        ),
        migrations.AlterField(
            model_name="jobstate",
            name="name",
            field=models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name="name"),
        ),
        migrations.AlterField(
            model_name="jobstate",
            name="started_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="started at"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="created_at",
            field=models.DateTimeField(
                db_default=models.Func(function="clock_timestamp", output_field=models.DateTimeField()),
                verbose_name="created at",
            ),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="headers",
            field=models.JSONField(default=dict, verbose_name="headers"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="id",
            field=models.UUIDField(
                default=django_platformkit._ids.uuid7,
                editable=False,
                primary_key=True,
                serialize=False,
                verbose_name="event id",
            ),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="name",
            field=models.CharField(max_length=200, verbose_name="name"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="not_before",
            field=models.DateTimeField(blank=True, null=True, verbose_name="not before"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="payload",
            field=models.JSONField(verbose_name="payload"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="published_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="published at"),
        ),
        migrations.AlterField(
            model_name="outboxevent",
            name="tenant",
            field=models.CharField(blank=True, max_length=64, null=True, verbose_name="tenant"),
        ),
    ]
