"""Create the counter row ``shop.count_order`` increments, so the handler's
UPDATE always finds it and concurrent first orders don't race to insert it."""

from django.db import migrations


def create_row(apps, schema_editor):
    apps.get_model("shop", "OrderStats").objects.using(schema_editor.connection.alias).get_or_create(name="all")


class Migration(migrations.Migration):
    dependencies = [("shop", "0001_initial")]

    operations = [migrations.RunPython(create_row, migrations.RunPython.noop)]
