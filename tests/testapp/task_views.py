"""Async views that enqueue a task and read its result (tests/tasks/test_backend.py)."""

from django.http import JsonResponse

from .tasks import record


async def enqueue(request):
    result = await record.aenqueue(request.GET["label"])
    return JsonResponse({"id": result.id, "status": str(result.status)})


async def result(request, result_id):
    found = await record.aget_result(result_id)
    return JsonResponse(
        {"id": found.id, "status": str(found.status), "return_value": found.return_value if found.is_finished else None}
    )
