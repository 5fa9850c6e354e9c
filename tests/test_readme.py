"""What the docs say about the schema matches what the migrations create: the
installing page's `migrate` comment names every platformkit_* table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.db import connection

INSTALL = Path(__file__).resolve().parent.parent / "docs" / "install.md"


@pytest.mark.django_db
def test_the_migrate_comment_names_every_platformkit_table_the_migrations_create():
    tables = {name for name in connection.introspection.table_names() if name.startswith("platformkit_")}
    assert tables, "the test database has no platformkit_* table: did the migrations run?"
    text = INSTALL.read_text()
    start = text.index("python manage.py migrate ")
    comment = " ".join(
        line.split("#", 1)[1] for line in text[start:].splitlines()[:3] if "#" in line and "check" not in line
    )
    named = {"platformkit_" + part for part in re.findall(r"(?:platformkit)?_(\w+)", comment)}
    assert tables <= named, f"docs/install.md's migrate comment misses {sorted(tables - named)}"
