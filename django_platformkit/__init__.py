"""django_platformkit: events are the job queue.

The public API only; importing this module touches no models (the functions
import their modules on first use), so it is safe in settings and AppConfigs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

#: The release, written here only: pyproject.toml reads it (setuptools
#: dynamic version), so the wheel's metadata and this never disagree.
__version__ = "0.1.0"

__all__ = [
    "EventType",
    "ReceivedEvent",
    "declare",
    "job",
    "publish",
    "publish_many",
    "replay",
    "republish",
    "subscribe",
]

_WHERE = {
    "EventType": "events",
    "ReceivedEvent": "wire",
    "declare": "events",
    "job": "jobs",
    "publish": "events",
    "publish_many": "events",
    "replay": "deadletters",
    "republish": "recovery",
    "subscribe": "subscriptions",
}

if TYPE_CHECKING:
    from .deadletters import replay
    from .events import EventType, declare, publish, publish_many
    from .jobs import job
    from .recovery import republish
    from .subscriptions import subscribe
    from .wire import ReceivedEvent


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'django_platformkit' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
