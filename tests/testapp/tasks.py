"""django.tasks tasks of the test app (run through OutboxBackend in tests/tasks/test_backend.py).
Each writes an Effect row, so a duplicate run shows up as an extra row."""

import functools
import uuid

from django.tasks import task

from .models import Effect


@task
def record(label, n=1):
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={"n": n})
    return {"label": label, "n": n}


@task(queue_name="emails")
def send_email(to):
    Effect.objects.create(subscription="emails", event_id=uuid.uuid4(), payload={"to": to})
    return to


@task(takes_context=True)
def record_with_context(context, label):
    Effect.objects.create(subscription=label, event_id=context.task_result.id, payload={"attempt": context.attempt})
    return context.attempt


@task
def fails_until_fixed(label):
    """Writes an Effect, then raises unless a 'fixed' Effect exists: a failed
    run's write must roll back with it."""
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={})
    if not Effect.objects.filter(subscription=f"{label}.fixed").exists():
        raise RuntimeError(f"{label}: not fixed yet")
    return "fixed"


@task
def returns_a_set(label):
    """Writes an Effect, then returns what Django's task results can't store."""
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={})
    return {"ok": {1, 2}}


@task
def returns_what_jsonb_refuses(label, kind):
    """Writes an Effect, then returns a value JSON allows and PostgreSQL's jsonb refuses (``kind``)."""
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={})
    return {"nul": {"at": "a\x00b"}, "nan": {"at": float("nan")}, "huge": {"at": 10**5000}}[kind]


@task
def waits_for_release(label):
    """Runs until an Effect '<label>.release' is committed (at most 20 s): a task a test can see RUNNING."""
    import time

    deadline = time.monotonic() + 20
    while not Effect.objects.filter(subscription=f"{label}.release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={})
    return "released"


@task
def takes_anything(*args, **kwargs):
    """Any arguments bind: the function decides what it accepts."""
    Effect.objects.create(subscription="anything", event_id=uuid.uuid4(), payload={"args": args, "kwargs": kwargs})
    return len(args) + len(kwargs)


def with_unit(func):
    """A decorator that gives the function its first argument itself (as one
    passing a session or a lock would): callers don't pass it."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        return func("unit", *args, **kwargs)

    return wrapper


@task
@with_unit
def decorated(unit, label):
    Effect.objects.create(subscription=label, event_id=uuid.uuid4(), payload={"unit": unit})
    return unit


# --- Django's own tests/tasks task functions (tests/tasks/test_django_contract.py) ---


@task
def noop_task(*args, **kwargs):
    return None


@task
def calculate_meaning_of_life():
    return 42


@task
def failing_task_value_error():
    raise ValueError("This task failed due to ValueError")


@task
def failing_task_system_exit():
    raise SystemExit("This task failed due to SystemExit")


@task
def complex_exception():
    raise ValueError(ValueError("This task failed"))


@task
def complex_return_value():
    # Return something which isn't JSON serializable nor picklable.
    return lambda: True


@task(takes_context=True)
def get_task_id(context):
    return context.task_result.id


@task(takes_context=True)
def check_context(context, attempt):
    from django.tasks import TaskContext

    assert isinstance(context, TaskContext)
    assert context.attempt == attempt


@task
async def arecord(label, n=1):
    """``record`` as an async task function: its write through the ORM's async API."""
    await Effect.objects.acreate(subscription=label, event_id=uuid.uuid4(), payload={"n": n})
    return {"label": label, "n": n}


@task
async def afails_until_fixed(label):
    """``fails_until_fixed`` as an async task function: a failed run's ``acreate`` must roll back with it."""
    await Effect.objects.acreate(subscription=label, event_id=uuid.uuid4(), payload={})
    if not await Effect.objects.filter(subscription=f"{label}.fixed").aexists():
        raise RuntimeError(f"{label}: not fixed yet")
    return "fixed"


@task(takes_context=True)
async def asees_its_claim(context, label):
    """Whether the async task's ORM reads see its own claim row - written by
    the worker in the unit's transaction and not committed yet, so visible
    only on the claim's connection, inside that transaction."""
    from django_platformkit.models import HandledEvent

    seen = await HandledEvent.objects.filter(event_id=context.task_result.id).aexists()
    await Effect.objects.acreate(subscription=label, event_id=uuid.uuid4(), payload={"claim_seen": seen})
    return seen
