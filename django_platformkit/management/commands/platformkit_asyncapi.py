"""``manage.py platformkit_asyncapi``: print the event catalogue as an
AsyncAPI 3.0 document. Deterministic, so it can be committed and diffed."""

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_platformkit.asyncapi import document, render
from django_platformkit.management.commands._base import import_urlconf


class Command(BaseCommand):
    help = "Print the declared events and subscriptions as an AsyncAPI 3.0 document (sorted keys, stable output)."
    # Documentation of the catalogue as it is: `manage.py check` judges it.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--format",
            choices=["json", "yaml"],
            default="json",
            help="Output format (default: json; yaml needs PyYAML).",
        )
        parser.add_argument(
            "--title", default="Event catalogue", help="info.title of the document (default: %(default)s)."
        )
        parser.add_argument(
            "--api-version", default="1.0.0", help="info.version of the document (default: %(default)s)."
        )
        parser.add_argument("--output", "-o", type=Path, help="Write to this file instead of stdout.")

    def handle(self, *args: Any, **options: Any) -> None:
        # No checks run here (above), so nothing else would import the URLconf
        # and a views-declared subscription or event would be left out.
        import_urlconf()
        doc = document(title=options["title"], version=options["api_version"])
        try:
            text = render(doc, fmt=options["format"])
        except ImportError:
            raise CommandError(
                "--format yaml needs PyYAML (pip install pyyaml); --format json needs nothing."
            ) from None
        if options["output"]:
            try:
                options["output"].write_text(text, encoding="utf-8")
            except OSError as exc:
                raise CommandError(f"can't write {options['output']}: {exc.strerror or exc}") from None
        else:
            self.stdout.write(text, ending="")
