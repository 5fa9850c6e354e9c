from django.db import migrations, models


class Migration(migrations.Migration):
    """What a claim stands for (``outcome``: handled, dead-lettered or
    cancelled, so ``cancel()`` leaves a terminal claim a reader can tell
    apart; a database default, so adding it rewrites no row), and the shared
    rate limiter of ``subscribe(rate_limit=...)``."""

    dependencies = [
        ("django_platformkit", "0005_ops"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateLimit",
            fields=[
                (
                    "name",
                    models.CharField(help_text="the subscription", max_length=200, primary_key=True, serialize=False),
                ),
                ("next_at", models.DateTimeField()),
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
            ),
        ),
    ]
