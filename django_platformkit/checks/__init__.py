"""System checks: ``manage.py check`` says where the contract is broken.

Keeps "an undeclared event can't be published, and ``check`` says where one
would be". Every text is in ``messages.MESSAGES``, under a stable id. Checks
read settings, the registries and the project's own source files only: never
a query, never a network call, so ``check`` and ``migrate`` work on an empty
database with the broker down. ``apps.PlatformKitConfig.ready()`` imports this package; each
module registers its checks with Django as it is imported.
"""

from django_platformkit.checks import declarations, services, settings  # noqa: F401 - registers the checks
