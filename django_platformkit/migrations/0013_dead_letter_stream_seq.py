from django.db import migrations, models

#: Dead letters recorded before this migration carry a malformed message's
#: place in the stream only in their error text (" stream_seq=N"): read it
#: there once, so ``deadletters show`` still says where the whole message is.
BACKFILL = r"""
UPDATE platformkit_dead_letters
SET stream_seq = substring(error from ' stream_seq=(\d+)')::bigint
WHERE name = '(malformed)' AND stream_seq IS NULL AND error ~ ' stream_seq=\d+'
"""


class Migration(migrations.Migration):
    """A malformed message's place in the stream, stored as a value of its
    own dead letter (issue 36) rather than read back out of the error
    text. Additive: a nullable column, null for an outbox event's dead
    letter; reversing it drops the column, the error text keeps the number."""

    dependencies = [
        ("django_platformkit", "0012_controls"),
    ]

    operations = [
        migrations.AddField(
            model_name="deadletter",
            name="stream_seq",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="stream sequence"),
        ),
        migrations.RunSQL(BACKFILL, reverse_sql=migrations.RunSQL.noop),
    ]
