"""``manage.py platformkit_asyncapi`` prints the catalogue as AsyncAPI 3.0,
byte for byte the same on every run, so it can be committed and diffed in CI.

The snapshots under ``tests/snapshots/`` are the committed documents; after
an intended change to a catalogue, rewrite them with
``UPDATE_SNAPSHOTS=1 pytest tests/test_asyncapi.py`` and review the diff.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from django_platformkit import declare, subscribe
from django_platformkit.asyncapi import TASK_SCHEMA, document
from django_platformkit.consume import subscriptions as subscription_registry
from django_platformkit.tasks.queues import HAVE_DJANGO_TASKS
from django_platformkit.tasks.registry import register_task_queues

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment without the knobs tests turn for worker processes,
    so the document depends on the committed settings only."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PLATFORMKIT_TEST_") and k != "DJANGO_SETTINGS_MODULE"
    }
    env.update(extra)
    return env


def _command_output(manage_py: Path, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, str(manage_py), "platformkit_asyncapi"],
        env=env,
        cwd=manage_py.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def _matches_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    if os.environ.get("UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no snapshot {path}: run UPDATE_SNAPSHOTS=1 pytest {__file__}"
    assert text == path.read_text(encoding="utf-8"), (
        f"the AsyncAPI document differs from {path}; if the catalogue changed on purpose, "
        "rewrite it with UPDATE_SNAPSHOTS=1 and review the diff"
    )


@pytest.mark.process
def test_the_test_catalogue_matches_its_committed_snapshot():
    # The test settings name a stream and prefix per session (tests/settings.py): pin the committed ones.
    env = _clean_env(PYTHONPATH=str(ROOT), PLATFORMKIT_TEST_STREAM="PLATFORMKIT_TEST", PLATFORMKIT_TEST_PREFIX="pktest")
    text = _command_output(ROOT / "tests" / "manage.py", env)
    _matches_snapshot("asyncapi_testapp.json", text)


@pytest.mark.process
@pytest.mark.skipif(
    not (ROOT / "example_project" / "manage.py").exists(), reason="the example project is not in this tree"
)
def test_the_example_projects_catalogue_matches_its_committed_snapshot():
    env = _clean_env(
        PYTHONPATH=os.pathsep.join([str(ROOT / "example_project"), str(ROOT)]),
        DJANGO_SETTINGS_MODULE="example_project.settings",
        # Pinned: the document names the subjects, and the command opens no connection.
        NATS_URL="nats://127.0.0.1:4222",
    )
    text = _command_output(ROOT / "example_project" / "manage.py", env)
    if HAVE_DJANGO_TASKS:
        _matches_snapshot("asyncapi_example_project.json", text)
    else:
        # Django 5.2 has no django.tasks: the example's TASKS serves no queue,
        # and the document is the committed one without its queues.
        snapshot = json.loads((SNAPSHOTS / "asyncapi_example_project.json").read_text(encoding="utf-8"))
        assert json.loads(text) == _without_task_queues(snapshot)


def _without_task_queues(doc: dict) -> dict:
    """``doc`` less every channel, message, operation and schema of a django.tasks queue."""

    def kept(entries: dict) -> dict:
        return {key: value for key, value in entries.items() if "platformkit.task_" not in key and key != TASK_SCHEMA}

    components = {part: kept(entries) for part, entries in doc["components"].items()}
    return {**doc, "channels": kept(doc["channels"]), "operations": kept(doc["operations"]), "components": components}


def _render(**options) -> str:
    out = io.StringIO()
    call_command("platformkit_asyncapi", stdout=out, **options)
    return out.getvalue()


def test_the_output_is_the_same_on_every_run_with_sorted_keys():
    first, second = _render(), _render()
    assert first == second
    doc = json.loads(first)
    assert first == json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    assert doc["asyncapi"] == "3.0.0"


def _pointer(doc, ref: str):
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_channels_are_subjects_messages_carry_schemas_operations_are_subscriptions(settings):
    doc = document()
    prefix = settings.PLATFORMKIT["SUBJECT_PREFIX"]
    channel = doc["channels"]["testapp.with_schema"]
    assert channel["address"] == f"{prefix}.{{tenant}}.testapp.with_schema"
    assert set(channel["parameters"]) == {"tenant"}
    message = doc["components"]["messages"]["testapp.order_placed"]
    assert message["summary"] == "An order was placed."
    assert message["contentType"] == "application/cloudevents+json"
    assert doc["components"]["schemas"]["testapp.with_schema"]["required"] == ["sku"]
    assert doc["components"]["schemas"]["testapp.flaky"] == {"type": "object"}
    receive = doc["operations"]["receive.testapp.flaky"]
    assert receive["action"] == "receive"
    assert receive["channel"] == {"$ref": "#/channels/testapp.flaky"}
    assert receive["x-platformkit-durable"] == "testapp-flaky"
    assert receive["x-platformkit-max-attempts"] == 3
    assert doc["operations"]["send.testapp.flaky"]["action"] == "send"
    assert {op.removeprefix("receive.") for op in doc["operations"] if op.startswith("receive.")} == {
        s.name for s in subscription_registry.subscriptions()
    }


def test_every_ref_in_the_document_resolves_inside_it(registries):
    declare(
        "pkdoc.with_defs",
        schema={
            "type": "object",
            "properties": {"line": {"$ref": "#/$defs/line"}},
            "$defs": {"line": {"type": "object", "properties": {"sku": {"type": "string"}}}},
        },
    )
    doc = document()
    refs = list(_refs(doc))
    assert "#/components/schemas/pkdoc.with_defs/$defs/line" in refs
    for ref in refs:
        _pointer(doc, ref)  # KeyError if it dangles


def test_a_subscription_to_an_undeclared_event_is_left_out(registries):
    @subscribe("pkdoc.never_declared", name="pkdoc.orphan")
    def orphan(event):
        pass

    assert "receive.pkdoc.orphan" not in document()["operations"]


def test_yaml_is_offered_only_with_pyyaml():
    try:
        import yaml
    except ImportError:
        with pytest.raises(CommandError, match="needs PyYAML"):
            _render(format="yaml")
    else:
        assert yaml.safe_load(_render(format="yaml")) == json.loads(_render())


def test_output_can_go_to_a_file(tmp_path):
    target = tmp_path / "asyncapi.json"
    _render(output=target)
    assert target.read_text(encoding="utf-8") == _render()


@pytest.mark.process
def test_the_document_has_a_subscription_only_the_urlconf_imports():
    """The command runs no checks, so nothing else imported the URLconf: a
    ``@subscribe`` in a views.py was left out of the document."""
    env = _clean_env(PYTHONPATH=str(ROOT), PLATFORMKIT_TEST_URL_ONLY="1")
    doc = json.loads(_command_output(ROOT / "tests" / "manage.py", env))
    assert doc["operations"]["receive.testapp.url_only"]["channel"] == {"$ref": "#/channels/testapp.order_placed"}


# --- django.tasks queues -------------------------------------------------------

OUTBOX_TASKS = {"default": {"BACKEND": "django_platformkit.tasks.OutboxBackend", "QUEUES": ["default", "emails"]}}
needs_django_tasks = pytest.mark.skipif(not HAVE_DJANGO_TASKS, reason="django.tasks is Django 6.0+")


@pytest.fixture
def outbox_queues(registries):
    """TASKS -> OutboxBackend with two queues, registered as AppConfig.ready() does."""
    with override_settings(TASKS=OUTBOX_TASKS):
        names = register_task_queues()
        # One subscription per priority band, the default band under the queue's own name.
        assert [n for n in names if "__" not in n] == ["platformkit.task_default", "platformkit.task_emails"]
        assert len(names) == 2 * 5
        yield


def _task_names(doc) -> set[str]:
    parts = [doc["channels"], doc["operations"], doc["components"]["messages"], doc["components"]["schemas"]]
    return {key for part in parts for key in part if "platformkit.task_" in key or key == TASK_SCHEMA}


def _message_validator(doc, message: str) -> jsonschema.Draft202012Validator:
    """A validator of ``message``'s payload whose refs resolve inside ``doc``."""
    registry = Registry().with_resource("urn:asyncapi", Resource(contents=doc, specification=DRAFT202012))
    return jsonschema.Draft202012Validator(
        {"$ref": f"urn:asyncapi#/components/messages/{message}/payload"}, registry=registry
    )


@needs_django_tasks
def test_each_outbox_backend_queue_is_a_channel_its_worker_receives_on(outbox_queues, settings):
    doc = document()
    prefix = settings.PLATFORMKIT["SUBJECT_PREFIX"]
    for queue in ("default", "emails"):
        name = f"platformkit.task_{queue}"
        channel = doc["channels"][name]
        assert channel["address"] == f"{prefix}.{{tenant}}.platformkit.task_{queue}"
        assert channel["x-platformkit-task-queue"] == queue
        assert f"runworker --queue {queue}" in channel["description"]
        assert "Not for other services" in channel["description"]
        receive = doc["operations"][f"receive.{name}"]
        assert receive["channel"] == {"$ref": f"#/channels/{name}"}
        assert receive["x-platformkit-durable"] == f"platformkit-task_{queue}"
        assert receive["x-platformkit-filter-subject"] == f"{prefix}.*.platformkit.task_{queue}"
        assert doc["operations"][f"send.{name}"]["summary"].startswith("Task.enqueue() on OutboxBackend")
        data = doc["components"]["messages"][name]["payload"]["allOf"][1]["properties"]["data"]
        assert data == {"$ref": f"#/components/schemas/{TASK_SCHEMA}"}
    assert doc["components"]["schemas"][TASK_SCHEMA]["required"] == ["task", "args", "kwargs", "backend"]
    high = doc["channels"]["platformkit.task_emails__high"]
    assert high["address"] == f"{prefix}.{{tenant}}.platformkit.task_emails__high"
    assert high["x-platformkit-task-queue"] == "emails"
    assert high["x-platformkit-task-priority"] == {"minimum": 1, "maximum": 50}
    assert doc["channels"]["platformkit.task_emails"]["x-platformkit-task-priority"] == {"minimum": 0, "maximum": 0}
    for ref in _refs(doc):
        _pointer(doc, ref)  # KeyError if it dangles


@needs_django_tasks
@pytest.mark.django_db
def test_a_queues_message_describes_the_message_the_relay_sends_for_an_enqueued_task(outbox_queues):
    """The document is checked against the wire, not against itself: the
    CloudEvents body the relay would send for a row enqueue() wrote is valid
    against the queue's message, and a payload of another shape is not."""
    from django_platformkit.models import OutboxEvent
    from django_platformkit.wire import envelope
    from tests.testapp import tasks

    with transaction.atomic():
        tasks.send_email.enqueue("ada@example.com")
        tasks.record.enqueue("label", n=[1, {"two": 2}])
    doc = document()
    for row in OutboxEvent.objects.order_by("created_at"):
        message = envelope(row.id, row.name, row.tenant, json.dumps(row.payload), row.headers, row.created_at)
        body = json.loads(message.body)
        _message_validator(doc, row.name).validate(body)
        assert message.subject == doc["channels"][row.name]["address"].replace("{tenant}", "_")
    body["data"]["colour"] = "red"  # a key enqueue() never writes
    assert not _message_validator(doc, row.name).is_valid(body)
    body["data"].pop("colour")
    body["data"]["priority"] = 101  # outside Django's -100..100
    assert not _message_validator(doc, row.name).is_valid(body)


def test_without_an_outbox_backend_in_tasks_no_queue_is_in_the_document():
    # The test settings' TASKS use Django's ImmediateBackend (tests/settings.py).
    assert _task_names(document()) == set()


@needs_django_tasks
def test_a_queue_tasks_no_longer_configures_is_left_out(outbox_queues):
    with override_settings(TASKS={"default": {**OUTBOX_TASKS["default"], "QUEUES": ["default"]}}):
        names = _task_names(document())
    assert "platformkit.task_default" in names and not any("task_emails" in name for name in names)


@pytest.mark.skipif(HAVE_DJANGO_TASKS, reason="Django 6+: the queues are documented (tests above)")
def test_on_django_52_the_document_builds_with_the_backend_configured_and_no_queues(settings):
    settings.TASKS = OUTBOX_TASKS
    assert _task_names(document()) == set()
    assert json.loads(_render())["asyncapi"] == "3.0.0"
