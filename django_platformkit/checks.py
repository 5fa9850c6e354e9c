"""System checks: ``manage.py check`` says where the contract is broken.

Keeps "an undeclared event can't be published, and ``check`` says where one
would be". Every text is in ``checks_messages.MESSAGES``, under a stable id. Checks
read settings, the registries and the project's own source files only: never
a query, never a network call, so ``check`` and ``migrate`` work on an empty
database with the broker down.
"""

from __future__ import annotations

# The checks by what they read; importing each module registers its checks
# with Django (apps.ready() imports this module). The names stay importable
# from here, where tests and docs/hooks.py look for them.
from .checks_declarations import (
    PublishCall,
    check_jobs,
    check_publish_calls,
    check_subscriptions,
    project_sources,
    publish_calls,
)
from .checks_messages import FIXES, MESSAGES, TAG
from .checks_services import MIN_RETRY_ROOM, check_broker_namespace, check_database, check_max_ack_pending
from .checks_settings import check_runworker, check_settings

__all__ = [
    "FIXES",
    "MESSAGES",
    "MIN_RETRY_ROOM",
    "TAG",
    "PublishCall",
    "check_broker_namespace",
    "check_database",
    "check_jobs",
    "check_max_ack_pending",
    "check_publish_calls",
    "check_runworker",
    "check_settings",
    "check_subscriptions",
    "project_sources",
    "publish_calls",
]
