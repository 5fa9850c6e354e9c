"""The errors callers catch. One base class; each subclass also inherits the
built-in it means (``ValueError``, ``ImproperlyConfigured``) so generic code
that already catches those keeps working. Messages say what happened and what
to do."""

from django.core.exceptions import ImproperlyConfigured


class PlatformKitError(Exception):
    """Base class of every error django_platformkit raises on purpose."""


class TransactionRequired(PlatformKitError, RuntimeError):
    """``publish()`` was called outside ``transaction.atomic(using=...)``.

    The outbox row must commit or roll back with the write that caused the
    event; outside a transaction there is nothing to tie it to.
    """


class UndeclaredEvent(PlatformKitError, ValueError):
    """The event name is not in the catalogue: ``declare()`` it in an app's
    ``platformkit.py`` first."""


class InvalidEventName(PlatformKitError, ValueError):
    """An event name breaks the grammar ``<module>.<event>``, each part
    ``[a-z][a-z0-9_]*``; or a tenant breaks ``[A-Za-z0-9_-]{1,64}``."""


class InvalidPayload(PlatformKitError, ValueError):
    """A payload can't be stored and relayed as it is. ``path`` is the JSON
    path of the offending value (``$`` for the whole payload)."""

    def __init__(self, message: str, *, path: str = "$") -> None:
        super().__init__(message)
        self.path = path


class InvalidTaskArgument(InvalidPayload, TypeError):
    """A ``django.tasks`` argument the task backends can't store (Django's
    ``normalize_json`` rule). Also a ``TypeError``, as Django's own backends
    raise, so portable code that catches ``TypeError`` catches it."""


class ReplayRefused(PlatformKitError, ValueError):
    """``replay()`` would not run: missing actor or reason, unknown event, or
    nothing to replay. Nothing was written."""


class CancelRefused(PlatformKitError, ValueError):
    """``cancel()`` would not run: missing actor or reason, an unknown event,
    or a subscription that doesn't receive it. Nothing was written."""


class ControlRefused(PlatformKitError, ValueError):
    """An operator's control would not be set: ``pause()`` / ``resume()`` of
    a subscription or task queue this build doesn't declare (the message
    names the closest), a job control of an undeclared job, or a missing
    actor or reason. Nothing was written."""


class Cancelled(PlatformKitError):
    """An operator cancelled the event before its handler ran
    (``cancel()``): the error class a cancelled task's result reads as
    FAILED with."""


class ConfigurationError(PlatformKitError, ImproperlyConfigured):
    """A ``PLATFORMKIT`` setting or a declaration is malformed."""


class BrokerUnavailable(PlatformKitError, ConnectionError):
    """NATS could not be reached or did not answer in time. Retried, never
    lost: the outbox rows stay pending."""


class ConsumerNotFound(PlatformKitError, LookupError):
    """The durable consumer asked about doesn't exist on the stream (yet):
    ``ensure_consumer()`` creates it."""


class ConsumerDrift(PlatformKitError, RuntimeError):
    """An existing durable consumer differs from this build's config in a way
    the broker can't update in place. The message says what differs and what
    to do; nothing is deleted."""


class DatabaseUnavailable(PlatformKitError, ConnectionError):
    """The database could not be reached or can't serve us for now (a
    restart, refused connections, ``max_connections``, read-only). Retried,
    never lost: the work stays in the database."""


class PermanentFailure(PlatformKitError, Exception):
    """Raise it from a handler (or a task) for a failure no retry can fix:
    the attempt counts and its work rolls back as for any error, but the
    event is dead-lettered at once instead of retried, with this error and
    its traceback (the idea of Celery's ``Reject(requeue=False)`` and of
    Dramatiq's ``Retries(throws=...)``). Replay it after the fix. Any other
    exception marked with ``mark_permanent()`` is treated the same way."""


#: The attribute ``mark_permanent()`` sets on an exception.
_PERMANENT = "_platformkit_permanent"


def mark_permanent(error: BaseException) -> BaseException:
    """Mark ``error`` as one no retry can fix (as a ``PermanentFailure``
    is), keeping its class: a task's unstorable return value stays the
    ``TypeError`` Django's backends record. Returns ``error``."""
    setattr(error, _PERMANENT, True)
    return error


def is_permanent(error: BaseException | None) -> bool:
    """Whether ``error`` is a ``PermanentFailure`` or was ``mark_permanent()``-ed."""
    return isinstance(error, PermanentFailure) or bool(getattr(error, _PERMANENT, False))
