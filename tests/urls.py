from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]

try:  # django.tasks is Django 6+ (tests/test_tasks.py)
    from tests.testapp import task_views
except ImportError:
    pass
else:
    urlpatterns += [
        path("tasks/enqueue/", task_views.enqueue),
        path("tasks/result/<str:result_id>/", task_views.result),
    ]
