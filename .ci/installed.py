"""What the wheel carries, read from the venv it was installed into (.ci/run's
wheel test runs this with that venv's python): the version the checkout says
(``.ci/installed.py VERSION``; tests/test_release.py holds it to the CHANGELOG)
in the metadata and in ``__version__``, and the compiled German, French and
Spanish catalogues. Exits 1 saying what is wrong.
"""

import sys
from importlib.metadata import version
from pathlib import Path

import django_platformkit

expected = sys.argv[1]
package = Path(django_platformkit.__file__).parent
problems = [
    f"{what} is {found}, the checkout says {expected}"
    for what, found in (
        ("the metadata's version", version("django-platformkit")),
        ("__version__", django_platformkit.__version__),
    )
    if found != expected
]
problems += [
    f"no {language} catalogue ({path})"
    for language in ("de", "fr", "es")
    if not (path := package / "locale" / language / "LC_MESSAGES" / "django.mo").is_file()
]
if Path(sys.prefix) not in package.parents:
    problems.append(f"django_platformkit came from {package}, not from the venv {sys.prefix}")
print("\n".join(problems) or f"the wheel: django-platformkit {expected} from {package}, catalogues de, fr, es")
sys.exit(1 if problems else 0)
