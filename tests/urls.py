from django.contrib import admin
from django.urls import path

from tests.testapp import task_views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("tasks/enqueue/", task_views.enqueue),
    path("tasks/result/<str:result_id>/", task_views.result),
]
