"""App config: import every installed app's ``platformkit.py`` (as the admin
imports ``admin.py``) so declarations, subscriptions and jobs are registered
before anything runs, and register the system checks."""

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class PlatformKitConfig(AppConfig):
    name = "django_platformkit"
    label = "django_platformkit"
    verbose_name = "Platform kit"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the system checks
        from . import events  # noqa: F401 - declares the built-in events

        autodiscover_modules("platformkit")
