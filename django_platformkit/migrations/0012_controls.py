import django.db.models.functions.datetime
from django.db import migrations, models


class Migration(migrations.Migration):
    """The operator's controls (issue 34): a paused subscription or task
    queue (``platformkit_pauses``), and a job's switches - disabled, a run
    asked for by hand, the last such run (``platformkit_job_controls``).
    Text columns default to '' in the database: the controls' own SQL
    names only what it sets."""

    dependencies = [
        ("django_platformkit", "0011_rate_limit_spacing"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobControl",
            fields=[
                ("name", models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name="job")),
                ("disabled_at", models.DateTimeField(blank=True, null=True, verbose_name="disabled at")),
                (
                    "disabled_by",
                    models.CharField(blank=True, db_default="", max_length=150, verbose_name="disabled by"),
                ),
                ("disabled_reason", models.TextField(blank=True, db_default="", verbose_name="why disabled")),
                ("enabled_at", models.DateTimeField(blank=True, null=True, verbose_name="enabled again at")),
                ("run_requested_at", models.DateTimeField(blank=True, null=True, verbose_name="run asked for at")),
                (
                    "run_requested_by",
                    models.CharField(blank=True, db_default="", max_length=150, verbose_name="run asked for by"),
                ),
                ("run_reason", models.TextField(blank=True, db_default="", verbose_name="why run")),
                (
                    "manual_started_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="manual run started at"),
                ),
                (
                    "manual_finished_at",
                    models.DateTimeField(blank=True, null=True, verbose_name="manual run finished at"),
                ),
                (
                    "manual_by",
                    models.CharField(blank=True, db_default="", max_length=150, verbose_name="manual run by"),
                ),
                ("manual_reason", models.TextField(blank=True, db_default="", verbose_name="why the manual run")),
                ("manual_error", models.TextField(blank=True, db_default="", verbose_name="manual run error")),
            ],
            options={
                "verbose_name": "job control",
                "db_table": "platformkit_job_controls",
            },
        ),
        migrations.CreateModel(
            name="Pause",
            fields=[
                (
                    "name",
                    models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name="subscription"),
                ),
                (
                    "paused_at",
                    models.DateTimeField(
                        db_default=django.db.models.functions.datetime.Now(), verbose_name="paused at"
                    ),
                ),
                ("paused_by", models.CharField(max_length=150, verbose_name="paused by")),
                ("reason", models.TextField(verbose_name="reason")),
            ],
            options={
                "verbose_name": "pause",
                "db_table": "platformkit_pauses",
            },
        ),
    ]
