from django.db import migrations, models


class Migration(migrations.Migration):
    """What a claim stands for (``outcome``: handled, dead-lettered or
    cancelled, so ``cancel()`` leaves a terminal claim a reader can tell
    apart; a database default, so adding it rewrites no row), and the shared
    rate limiter of ``subscribe(rate_limit=...)``."""

    dependencies = [
        ("django_platformkit", "0006_translated_labels"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateLimit",
            fields=[
                (
                    "name",
                    models.CharField(max_length=200, primary_key=True, serialize=False, verbose_name="subscription"),
                ),
                ("next_at", models.DateTimeField(verbose_name="next start at")),
            ],
            options={
                "verbose_name": "rate limit",
                "db_table": "platformkit_rate_limits",
            },
        ),
        migrations.AddField(
            model_name="handledevent",
            name="outcome",
            field=models.CharField(
                choices=[("handled", "handled"), ("dead_lettered", "dead_lettered"), ("cancelled", "cancelled")],
                db_default="handled",
                max_length=16,
                verbose_name="outcome",
            ),
        ),
    ]
