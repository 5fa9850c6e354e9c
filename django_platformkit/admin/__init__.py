"""The admin operators work in: the overview page, the operational tables
(read-only), and the named actions on dead letters and tasks. Django's
autodiscovery imports this package; importing each page registers it."""

from django_platformkit.admin import deadletters, tables, tasks  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages  # noqa: F401 - registers the pages
