from django.contrib import admin
from django.urls import path

from tests.testapp import url_only  # noqa: F401 - a subscription only the URLconf imports (test_runtime.py)

urlpatterns = [path("admin/", admin.site.urls)]

try:  # django.tasks is Django 6+ (tests/tasks/test_backend.py)
    from tests.testapp import task_views
except ImportError:
    pass
else:
    urlpatterns += [
        path("tasks/enqueue/", task_views.enqueue),
        path("tasks/result/<str:result_id>/", task_views.result),
    ]
