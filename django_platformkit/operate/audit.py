"""The audit trail of what an operator did, as the admin's History shows
it: a Replay or Discard of a dead letter leaves one ``LogEntry`` on the dead
letter and one on its outbox row, written the same way by the admin's
actions (``admin/deadletters.py``, ``admin/tasks.py``) and by ``manage.py
deadletters replay|discard --actor USERNAME``, so the History pages read
alike whoever acted and from where - and ``--actor`` must be a user the
admin would let act (``acting_user``). The operator's controls (pause,
resume, a job disabled, enabled or run by hand) leave one ``LogEntry`` each
the same way (``log_control``). Below the surfaces, so the admin and the
commands share it; registers nothing; needs ``django.contrib.admin``
installed (its ``LogEntry`` table) only when it writes.
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


def log_control(user_id: Any, model: Any, name: str, message: str, *, flag: int | None = None) -> None:
    """Write the ``LogEntry`` of an operator's control - a pause or a resume
    (``model`` ``controls.Pause``), a job disabled, enabled or run by hand
    (``models.JobState``: the job's History page lists it) - by the user
    whose primary key is ``user_id``, on the object ``name`` whether or not
    its row exists (a resumed pause's is gone). ``flag``: ADDITION,
    CHANGE (default) or DELETION. Needs ``django.contrib.admin`` installed."""
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.contrib.contenttypes.models import ContentType

    LogEntry.objects.create(
        user_id=user_id,
        content_type=ContentType.objects.get_for_model(model),
        object_id=name,
        object_repr=name[:200],
        action_flag=CHANGE if flag is None else flag,
        change_message=message,
    )


#: The permission the admin's Replay and Discard need (``DeadLetter.Meta.permissions``).
REPLAY_PERMISSION = "django_platformkit.replay_deadletter"


def acting_user(username: str) -> Any:
    """The primary key of the Django user whose ``USERNAME_FIELD`` is
    ``username``, if that user may do what the admin's own Replay and
    Discard let a user do: active, holding ``REPLAY_PERMISSION``
    (``manage.py deadletters ... --actor``, ``manage.py cancel --actor``;
    ``management.commands._base.checked_actor``). None without
    ``django.contrib.auth`` (no users to check). Raises ``ValueError``
    saying what is missing: no such user, an inactive one, or one without
    the permission."""
    from django.apps import apps

    if not apps.is_installed("django.contrib.auth"):
        return None  # no users to check: the name is recorded as given, with no LogEntry
    from django.contrib.auth import get_user_model

    model = get_user_model()
    user = model._default_manager.filter(**{model.USERNAME_FIELD: username}).first()
    if user is None:
        raise ValueError("no such user.")
    if not user.is_active:
        raise ValueError("the user is inactive.")
    if not user.has_perm(REPLAY_PERMISSION):
        raise ValueError(
            f"the user lacks the permission {REPLAY_PERMISSION!r} (Can replay or discard dead letters), which the "
            "admin's Replay and Discard need: grant it, or act as a user who has it."
        )
    return user.pk
