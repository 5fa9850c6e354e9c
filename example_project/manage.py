#!/usr/bin/env python
"""manage.py of the example project.

``manage.py demo`` on a machine without ``DATABASE_URL`` / ``NATS_URL``
starts throwaway PostgreSQL and NATS servers here, before Django reads the
settings (which take their URLs from the environment), and stops them when
the command ends. Every other command uses the environment or the local
defaults and starts nothing.
"""

import contextlib
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")
    from django.core.management import execute_from_command_line

    services = contextlib.nullcontext()
    if sys.argv[1:2] == ["demo"] and "--help" not in sys.argv and "-h" not in sys.argv:
        from example_project.services import throwaway_services

        services = throwaway_services(keep="--keep-servers" in sys.argv)
    try:
        with services:
            execute_from_command_line(sys.argv)
    except KeyboardInterrupt:
        sys.exit(130)  # the servers were stopped on the way out


if __name__ == "__main__":
    main()
