"""The release this code is, written only here: ``django_platformkit.__version__``
re-exports it, setuptools reads it for the wheel's metadata (pyproject.toml),
and ``runworker --version``, the worker heartbeat and ``platformkit_build_info``
show it. PEP 440; CHANGELOG.md's newest dated section is this version, or this
is a ``.devN`` of the next one (tests/test_release.py holds the two together).
"""

__version__ = "0.3.0.dev0"
