"""Django's own Tasks API (``django.tasks``, Django 6.0+) over the outbox.

A task is an event. ``enqueue()`` writes one outbox row in the caller's
transaction (outside ``atomic()`` it commits on its own: the one place we
don't require ``atomic``), so a task commits or rolls back with the write that
asked for it: no ``transaction.on_commit()`` needed, nothing lost if the
process dies after the commit. Each queue is one built-in subscription whose
handler calls the task inside the claim's transaction, so the task's database
writes happen exactly once; retries, ``MAX_ATTEMPTS``, backoff, dead letters,
replay and the tenant context are the subscription machinery's.

Naming: queue ``Q`` is the event ``platformkit.task_Q`` and the subscription
of the same name (durable ``platformkit-task_Q``). Our event grammar allows
``[a-z0-9_]`` after ``task_``; any other queue name is refused by the
system check ``platformkit.E102`` (rename the queue), never mapped lossily.
Results: see ``django_platformkit.tasks.results``.

On Django < 6.0 (no ``django.tasks``) this module still imports;
``OutboxBackend`` then raises ``ImproperlyConfigured`` saying Django 6 is
needed. We don't support the ``django-tasks`` backport: one contract, Django's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.db import connections, transaction

from django_platformkit import conf
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.tasks.arguments import django_json_arguments, refuse_arguments_it_cant_take
from django_platformkit.tasks.checks import CHECKS, check_backend, queues_refusal
from django_platformkit.tasks.queues import BACKEND_PATH, HAVE_DJANGO_TASKS, QUEUE_NAME, event_name

if HAVE_DJANGO_TASKS:  # Django 6.0+
    from django.tasks import TaskResult, TaskResultStatus
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.exceptions import InvalidTask
    from django.tasks.signals import task_enqueued
else:  # Django 5.2
    BaseTaskBackend = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from django.tasks import Task


logger = logging.getLogger(__name__)


NEEDS_DJANGO_6 = (
    "django_platformkit.tasks.OutboxBackend implements django.tasks, which is new in Django 6.0; "
    "this project runs Django {version}. Upgrade to Django 6.0+ or remove the backend from TASKS "
    "(publish() + @subscribe work on Django 5.2)."
)


def _refuse_atomic_elsewhere(alias: str) -> None:
    """Raise ``TransactionRequired`` if ``enqueue()`` runs inside an atomic
    block of another database than the outbox's (``alias``): committing on
    its own there, the task would run whatever became of those writes."""
    from django_platformkit.exceptions import TransactionRequired

    others = [c.alias for c in connections.all(initialized_only=True) if c.in_atomic_block and c.alias != alias]
    if others:
        raise TransactionRequired(
            f"enqueue() inside transaction.atomic() on {others[0]!r}, but the outbox is on {alias!r} "
            "(PLATFORMKIT['DATABASE_ALIAS']): the task can only commit or roll back with writes on "
            f"{alias!r}. Point DATABASE_ALIAS at the database your writes use, enqueue inside "
            f"transaction.atomic(using={alias!r}) around writes there, or enqueue after the block commits."
        )


# --- the backend ---------------------------------------------------------------


class OutboxBackend(BaseTaskBackend):
    """``django.tasks`` backend: a task is an outbox row run by ``runworker``.

    ``TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend",
    "QUEUES": ["default", "emails"], "OPTIONS": {}}}``. The outbox lives on
    ``PLATFORMKIT["DATABASE_ALIAS"]``. ``OPTIONS``: ``"BATCH"`` (default
    True, as ``@subscribe``) runs its queues as batch subscriptions: a unit
    of tasks (sized by measured run time to ~0.1 s, so a slow task runs
    alone) in one transaction, a savepoint per task after a failure; each
    task's writes still happen exactly once. ``{"BATCH": False}``: every
    task commits in a transaction of its own. ``supports_defer`` (``run_after``, honoured
    by the relay), ``supports_get_result``, ``supports_priority`` (a queue
    is five priority bands, ``queues.PRIORITY_BANDS``: a worker starts the
    highest band with work first, equal priorities in enqueue order;
    ``docs/how-to/django-tasks.md`` says exactly what is kept) and
    ``supports_async_task`` (an ``async def`` task runs in the worker through
    Django's ``async_to_sync``: its ORM calls come back to the claim's thread
    and connection, so they commit with the claim).
    """

    supports_defer = True
    supports_get_result = True
    supports_async_task = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        if not HAVE_DJANGO_TASKS:
            import django

            raise ConfigurationError(NEEDS_DJANGO_6.format(version=django.get_version()))
        super().__init__(alias, params)
        # As written: Django's set() of a str is its letters (check E107).
        self.queues_setting = params.get("QUEUES", ["default"])
        self._app_installed: bool | None = None  # looked up at the first enqueue()

    def validate_task(self, task: Task[..., Any]) -> None:
        refusal = self._queues_refusal()
        if refusal is not None:
            # Check E107's words, here too: a @task is validated when its
            # module is imported, usually before the checks could say it,
            # and Django's own refusal ("Queue 'emails' is not valid")
            # hides that QUEUES was read as letters.
            raise InvalidTask(f"{refusal.msg}: {refusal.hint} ({refusal.id})")
        super().validate_task(task)
        if not QUEUE_NAME.match(task.queue_name):
            raise InvalidTask(
                f"Queue {task.queue_name!r} can't be an event name: rename it (lowercase letters, digits, "
                "single '_': '__' separates a queue from its priority band)."
            )

    # -- enqueue --
    def enqueue[**P, R](self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        """Write the task as one outbox row and return its ``TaskResult``
        (id = the event id, status READY, ``enqueued_at`` = the row's
        ``created_at``). Inside ``transaction.atomic()`` the row commits or
        rolls back with the caller's writes; outside, it commits at once.

        Raises, before any SQL (the caller's transaction stays usable):
        ``InvalidTask`` (Django's validation: queue not in ``QUEUES``,
        ``run_after`` naive, ...), ``TypeError`` when the task's function
        can't take ``args`` and ``kwargs`` (a missing or unknown argument, too
        many; a ``takes_context`` task's context excepted: Django passes it),
        naming the task and why, ``InvalidTaskArgument`` (a ``TypeError``
        and an ``InvalidPayload``, as Django's backends raise ``TypeError``)
        when an argument isn't one Django's task backends store, naming its
        path (``$.args[0]``, ``$.kwargs.when``), ``InvalidPayload`` (a
        ``ValueError``) when the payload exceeds ``MAX_PAYLOAD_BYTES``.
        ``ConfigurationError`` when ``django_platformkit`` is not in
        ``INSTALLED_APPS``. ``TransactionRequired`` when called inside an atomic block of another
        database than the outbox's. ``ProgrammingError`` saying to migrate if
        the outbox table is missing.
        """
        from django_platformkit.names import check_tenant
        from django_platformkit.outbox.events import current_event, write_event
        from django_platformkit.outbox.payload import encode_payload

        if not self._app_installed:
            self._refuse_unless_installed()
        self.validate_task(task)
        # The arguments' shape before their values: a call the function can't
        # take is the mistake Python itself would report first, whatever the values.
        refuse_arguments_it_cant_take(task, args, kwargs)
        args, kwargs = django_json_arguments(args, kwargs)
        # Django validated the priority (a whole number in -100..100) above; 5.0 is allowed there.
        priority = int(task.priority)
        payload: dict[str, Any] = {"task": task.module_path, "args": args, "kwargs": kwargs, "backend": self.alias}
        if priority:
            payload["priority"] = priority
        text, data = encode_payload(payload)
        handled = current_event.get()
        tenant = check_tenant(handled.tenant if handled is not None else None)
        name = event_name(task.queue_name, priority)  # its priority band's subject and durable
        alias = conf.settings.DATABASE_ALIAS
        if not connections[alias].in_atomic_block:
            # The one place we don't require atomic(): plain code may enqueue
            # anywhere, and then the row is its own transaction - one
            # autocommit statement, not BEGIN, INSERT, COMMIT.
            _refuse_atomic_elsewhere(alias)
        # testing.capture_events() and the metrics hear of it as of a publish().
        written = write_event(name, text, tenant=tenant, using=alias, not_before=task.run_after)
        result: TaskResult[P, R] = TaskResult(
            task=task,
            id=str(written.event_id),
            status=TaskResultStatus.READY,
            enqueued_at=written.created_at,
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=data["args"],
            kwargs=data["kwargs"],
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        # As Django's database backend does: enqueued means committed, so a
        # rollback sends nothing (and outside atomic() it is sent at once).
        transaction.on_commit(
            lambda: task_enqueued.send_robust(type(self), task_result=result), using=alias, robust=True
        )
        return result

    def _refuse_unless_installed(self) -> None:
        """Raise ``ConfigurationError`` (check E101's text) when
        ``django_platformkit`` isn't installed: nothing would ever run the
        row. The check alone can't say it: Django registers its task checks
        only once something imports ``django.tasks``."""
        from django.apps import apps

        self._app_installed = apps.is_installed("django_platformkit")
        if not self._app_installed:
            message, hint = CHECKS["E101"]
            raise ConfigurationError(
                f"{message.format(alias=self.alias, backend=BACKEND_PATH)}: no worker would run this task. {hint}"
            )

    # -- results --
    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """The ``TaskResult`` of ``result_id`` as the database has it now.
        Raises ``TaskResultDoesNotExist`` when no task row has that id (never
        enqueued, rolled back, or purged). See ``tasks.results.load_result``."""
        from django_platformkit.tasks.results import load_result

        return load_result(self, result_id)

    # -- checks --
    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Django's checks of a backend, then ours (``tasks.checks``: ids
        ``platformkit.E101`` to ``E115``). No queries."""
        return [*super().check(**kwargs), *check_backend(self)]

    def _queues_refusal(self, where: str = "settings.TASKS") -> checks.Error | None:
        """Check ``E107`` when ``QUEUES`` as written isn't a list of names, else None."""
        return queues_refusal(self.alias, self.queues_setting, where)
