"""The task functions of Django's own docs for ``django.tasks``
(``docs/topics/tasks.txt``), as written there (``Thing`` is ``Order``),
for ``tests/tasks/test_django_docs.py``. Defined under the test settings'
default backend; the tests re-validate them against OutboxBackend."""

import logging
import time

from django.core.mail import send_mail
from django.tasks import task

from .models import Effect, Order

logger = logging.getLogger(__name__)


@task
def email_users(emails, subject, message):
    return send_mail(subject=subject, message=message, from_email=None, recipient_list=emails)


@task(takes_context=True)
def email_users_with_context(context, emails, subject, message):
    logger.debug(f"Attempt {context.attempt} to send user email. Task result id: {context.task_result.id}.")  # noqa: G004 - as the docs write it
    return send_mail(subject=subject, message=message, from_email=None, recipient_list=emails)


@task()
def process_data(data):
    return data


@task()
def double_dictionary(key):
    return {key: key * 2}


@task
def my_task(thing_num):
    Order.objects.get(total=thing_num)


@task
def the_answer():
    return 42


@task
def raises_value_error():
    raise ValueError("the docs' failing task")


@task
def answers_when_released(label):
    """Runs until an Effect '<label>.release' is committed (at most 20 s): a result a test can see RUNNING."""
    deadline = time.monotonic() + 20
    while not Effect.objects.filter(subscription=f"{label}.release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 42


@task
def returns_now():
    from django.utils import timezone

    return timezone.now()
