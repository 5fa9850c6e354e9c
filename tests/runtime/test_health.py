"""The health file a probe reads: replaced whole, never half-written, and a
write that fails is a warning, never the worker's death."""

from __future__ import annotations

import json
import logging

import pytest

from django_platformkit.runtime.health import HealthFile

pytestmark = pytest.mark.unit


def test_each_write_replaces_the_whole_state_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "health.json"
    health = HealthFile(path)
    health.write({"healthy": True, "counts": {"handled": 1}})
    health.write({"healthy": False, "stopped": True})
    assert json.loads(path.read_text()) == {"healthy": False, "stopped": True}
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]


def test_a_write_that_fails_is_logged_and_not_raised(tmp_path, caplog):
    path = tmp_path / "gone" / "health.json"  # the folder doesn't exist
    with caplog.at_level(logging.WARNING, logger="django_platformkit.runtime.health"):
        HealthFile(path).write({"healthy": True})
    assert not path.exists()
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"health file not written path={path} error="), message
    assert "No such file or directory" in message
