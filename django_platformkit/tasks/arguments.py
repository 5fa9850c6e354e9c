"""A task's arguments, checked before ``enqueue()`` writes anything: the
call must fit the task function's signature (as Celery checks at the call),
and each value must be one Django's task backends accept (its
``normalize_json`` rule), so a task runs the same on any backend and never
fails on the worker for what the caller could have been told.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from django_platformkit.exceptions import InvalidTaskArgument

if TYPE_CHECKING:
    from django.tasks import Task


def django_json_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` under Django's own rule for task arguments
    (``django.utils.json.normalize_json``, which ``TaskResult`` applies:
    str, int, float, bool, None, lists, dicts; tuples become lists, UTF-8
    ``bytes`` become str), so a task that runs on Django's built-in backends
    takes the same arguments here - no datetime or Decimal quietly turned
    into a string. Raises ``InvalidTaskArgument`` (an ``InvalidPayload``
    and a ``TypeError``, as Django's backends raise) naming the path of the
    first value Django refuses (``$.args[1]``), Django's own words
    (``Unsupported type: ...``) and what to do.
    """
    from django.utils.json import normalize_json

    try:
        # A list normalizes to a list and a dict to a dict (the stubs return the union of every JSON type).
        return cast(list[Any], normalize_json(list(args))), cast(dict[str, Any], normalize_json(dict(kwargs)))
    except (TypeError, ValueError) as exc:
        django_says = str(exc)
        path, value = (
            refused_by_django(list(args), "$.args") or refused_by_django(dict(kwargs), "$.kwargs") or ("$", None)
        )
    raise InvalidTaskArgument(
        f"{django_says} at {path}: {type(value).__name__} is not a task argument Django's task backends "
        "accept (str, int, float, bool, None, list, dict; bytes only as UTF-8): convert it before enqueue(), "
        "e.g. a datetime with .isoformat(), a Decimal with str(), a model instance by its pk.",
        path=path,
    )


def refused_by_django(value: Any, path: str) -> tuple[str, Any] | None:
    """Where ``normalize_json`` would raise inside ``value``: ``(path, value)``, or None."""
    from django_platformkit.outbox.payload import json_path

    if isinstance(value, Mapping):
        for key, item in value.items():
            found = refused_by_django(key, f"{path} (a key)") or refused_by_django(item, json_path(path, key))
            if found:
                return found
        return None
    if isinstance(value, bytes):
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            return path, value
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return None
    if isinstance(value, Sequence):
        for index, item in enumerate(value):
            found = refused_by_django(item, json_path(path, index))
            if found:
                return found
        return None
    return path, value


# Python 3.14 evaluates annotations when it reads a signature: a name imported
# only under TYPE_CHECKING would raise NameError at enqueue(). Binding needs
# no annotations, so read them as forward references (as django.utils.inspect does).
_SIGNATURE_OPTIONS: dict[str, Any] = {}
if sys.version_info >= (3, 14):
    import annotationlib

    _SIGNATURE_OPTIONS["annotation_format"] = annotationlib.Format.FORWARDREF

#: Binds in the place of the ``TaskContext`` Django passes a
#: ``takes_context`` task first: the caller of ``enqueue()`` doesn't give it.
_CONTEXT = object()


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature, read once per function (``enqueue()`` is
    benchmarked against a bare ORM insert: reading it costs ~8 µs, binding
    ~1.5 µs), or None when it has none (a builtin or C function: nothing to
    check). ``func``'s own, not its ``__wrapped__``'s: a decorator that fills
    an argument in would otherwise have every correct call refused."""
    try:
        return inspect.signature(func, follow_wrapped=False, **_SIGNATURE_OPTIONS)
    except (TypeError, ValueError):
        return None


def refuse_arguments_it_cant_take(task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` when ``task``'s function can't be called with
    ``args`` and ``kwargs`` (after the ``TaskContext`` of a ``takes_context``
    task), as calling it would, naming the task and ``inspect``'s reason
    (``missing a required argument: 'label'``). Celery checks the same at the
    call (``Task.typing``): enqueued, such a task would fail on the worker on
    every attempt and become a dead letter ``MAX_ATTEMPTS`` backoffs later.
    Only here, never on the worker: there a function a rolling deploy changed
    since the enqueue fails that attempt and is retried (a newer worker may
    take the arguments), see ``tasks.runner.run_task``."""
    signature = _signature(task.func)
    if signature is None:
        return
    try:
        if task.takes_context:
            signature.bind(_CONTEXT, *args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        shown = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        context = " after the context (Django passes the TaskContext)" if task.takes_context else ""
        raise TypeError(
            f"task {task.module_path}{shown} can't be called with these arguments: {exc}. Nothing was "
            f"enqueued: pass enqueue() the arguments the function takes{context}, or change the function "
            "(a task enqueued like this would fail on every attempt)."
        ) from None
