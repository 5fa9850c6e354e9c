"""The no-op django.tasks task every backend in bench/measure_tasks.py runs."""

from django.tasks import task


@task
def noop(n: int) -> None:
    return None
