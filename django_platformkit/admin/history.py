"""The admin's history of an operator's Replay or Discard of a dead letter:
one ``LogEntry`` on the dead letter and one on its outbox row, written the
same way by the admin's actions (``admin_deadletters.py``, ``admin_tasks.py``)
and by ``manage.py deadletters replay|discard --actor USERNAME``, so the
History pages read alike whoever acted and from where. Registers nothing;
needs ``django.contrib.admin`` installed (its ``LogEntry`` table).
"""

from __future__ import annotations

from typing import Any

from django_platformkit.models import DeadLetter, OutboxEvent


def log_dead_letter_action(user_id: Any, row: DeadLetter, verb: str, reason: str) -> None:
    """Write the ``LogEntry`` rows for ``verb`` (``"replay"`` or
    ``"discard"``) of dead letter ``row`` by the user whose primary key is
    ``user_id``: CHANGE (replay) or DELETION (discard) on the dead letter
    (gone afterwards, its History still lists it) and, where the event is
    ours, CHANGE on the outbox row (whose History page survives). The text
    carries the reason; the entry the user."""
    from django.contrib.admin.models import CHANGE, DELETION, LogEntry

    past = "Replayed" if verb == "replay" else "Discarded"
    message = f"{past} for subscription {row.subscription} (event {row.event_id}). Reason: {reason}"
    LogEntry.objects.log_actions(
        user_id=user_id,
        queryset=[row],
        action_flag=CHANGE if verb == "replay" else DELETION,
        change_message=message,
        single_object=True,
    )
    outbox_row = OutboxEvent.objects.filter(pk=row.event_id).only("id", "name").first()
    if outbox_row is not None:
        LogEntry.objects.log_actions(
            user_id=user_id,
            queryset=[outbox_row],
            action_flag=CHANGE,
            change_message=message,
            single_object=True,
        )


def user_id_for(username: str) -> Any:
    """The primary key of the user whose ``USERNAME_FIELD`` is
    ``username``, or None: no such user, or no ``django.contrib.admin`` /
    ``django.contrib.auth`` to write a ``LogEntry`` for one."""
    from django.apps import apps

    if not (apps.is_installed("django.contrib.admin") and apps.is_installed("django.contrib.auth")):
        return None
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    return (
        user_model._default_manager.filter(**{user_model.USERNAME_FIELD: username}).values_list("pk", flat=True).first()
    )
