"""The admin operators work in: the overview page, the operational tables
(read-only), and the named actions on dead letters and tasks. Django's
autodiscovery imports this package; importing each page's module registers it."""

from django_platformkit.admin import attempts, deadletters, jobs, overview, tables, tasks  # noqa: F401 - registers the pages
