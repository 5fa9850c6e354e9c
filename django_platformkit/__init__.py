"""django_platformkit: events are the job queue.

The public API. Importing it loads neither the broker client (``nats``) nor
the models, so it is safe in settings modules and AppConfigs.
"""

from django_platformkit._version import __version__ as __version__  # the one place it is written
from django_platformkit.consume.subscriptions import subscribe
from django_platformkit.jobs.specs import job
from django_platformkit.operate.cancel import cancel
from django_platformkit.operate.deadletters import discard, replay
from django_platformkit.operate.republish import republish
from django_platformkit.outbox.events import EventType, declare, publish, publish_many
from django_platformkit.wire import ReceivedEvent

__all__ = [
    "EventType",
    "ReceivedEvent",
    "cancel",
    "declare",
    "discard",
    "job",
    "publish",
    "publish_many",
    "replay",
    "republish",
    "subscribe",
]
