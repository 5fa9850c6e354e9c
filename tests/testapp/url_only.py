"""A subscription declared in a module only the URLconf imports (as a
``views.py`` would be), switched on by PLATFORMKIT_TEST_URL_ONLY so other
tests' workers don't serve it (tests/runtime/test_worker.py)."""

import os

from django_platformkit import subscribe

from .models import Effect

if os.environ.get("PLATFORMKIT_TEST_URL_ONLY"):

    @subscribe("testapp.order_placed", name="testapp.url_only")
    def url_only(event):
        Effect.objects.create(subscription="testapp.url_only", event_id=event.id)
