from django.db import migrations, models


class Migration(migrations.Migration):
    """The spacing a rate limit's next start was reserved under, so a
    changed limit takes effect within one period of the new one (issue 33):
    a taker under another spacing judges the reservation again. Rows from
    before it hold NULL: their next start is then at most one new spacing away."""

    dependencies = [
        ("django_platformkit", "0010_reconciliation"),
    ]

    operations = [
        migrations.AddField(
            model_name="ratelimit",
            name="spacing_seconds",
            field=models.FloatField(
                help_text="period / count of the limit the next start was reserved under",
                null=True,
                verbose_name="spacing (seconds)",
            ),
        ),
    ]
