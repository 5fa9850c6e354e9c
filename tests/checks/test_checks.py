"""Boot validation refuses malformed declarations naming the app, the
function and the fix; ``manage.py check`` reports each broken rule under a
stable id with the exact text below; and checks never query the database or
open a connection, so ``check`` and ``migrate`` work on an empty database with
the broker down."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psycopg
import pytest
from django.apps import apps
from django.conf import settings as django_settings
from django.core import checks as django_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_platformkit.checks import declarations, services
from django_platformkit.checks import settings as settings_checks
from django_platformkit.checks.messages import MESSAGES
from django_platformkit.consume import subscriptions as subscription_registry
from django_platformkit.devservices import free_port
from django_platformkit.exceptions import ConfigurationError
from django_platformkit.jobs import specs as jobs

ROOT = Path(__file__).resolve().parents[2]
BASE_APPS = list(django_settings.INSTALLED_APPS)


@pytest.fixture
def make_app(tmp_path, monkeypatch, registries):
    """Write a throwaway app package: ``make_app("name", {"views.py": src})``. Its
    INSTALLED_APPS override runs every AppConfig.ready() again: ``registries``
    forgets what that registers."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(name: str, files: dict[str, str]) -> Path:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        for relative, source in files.items():
            target = package / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            for parent in target.parents:
                if parent == package:
                    break
                (parent / "__init__.py").touch()
            target.write_text(textwrap.dedent(source).lstrip())
        made.append(name)
        return package

    yield make
    for module in [m for m in sys.modules if m.split(".")[0] in made]:
        del sys.modules[module]


def ids(messages) -> list[str]:
    return [m.id for m in messages]


def only(messages, check_id: str):
    found = [m for m in messages if m.id == f"platformkit.{check_id}"]
    assert len(found) == 1, messages
    assert len(found[0].msg) < 80 and "\n" not in found[0].hint
    return found[0]


def handler_path(func) -> str:
    return f"{func.__module__}.{func.__qualname__}"


# --- the texts themselves ----------------------------------------------------


def test_every_check_text_is_one_line():
    for check_id, (message, hint) in MESSAGES.items():
        assert "\n" not in message and "\n" not in hint, check_id


# --- E001 / W002: subscriptions ----------------------------------------------


def test_e001_a_subscription_to_a_near_miss_event_suggests_the_declared_one(registries):
    def on_typo(event):
        pass

    subscription_registry.subscribe("testapp.order_placd", name="testapp.on_typo")(on_typo)
    message = only(declarations.check_subscriptions(), "E001")
    assert isinstance(message, django_checks.Error)
    assert message.msg == "subscription 'testapp.on_typo': event 'testapp.order_placd' is not declared"
    assert (
        message.hint
        == "Did you mean 'testapp.order_placed'? Else add declare('testapp.order_placd') to an app's platformkit.py."
    )
    assert message.obj == handler_path(on_typo)


def test_e001_without_a_near_miss_says_to_declare_it(registries):
    def on_unknown(event):
        pass

    subscription_registry.subscribe("billing.invoice_paid", name="testapp.on_unknown")(on_unknown)
    message = only(declarations.check_subscriptions(), "E001")
    assert message.msg == "subscription 'testapp.on_unknown': event 'billing.invoice_paid' is not declared"
    assert message.hint == "Add declare('billing.invoice_paid') to an app's platformkit.py."


def test_w002_a_subscription_backoff_longer_than_its_retries_warns(registries):
    def overlong(event):
        pass

    subscription_registry.subscribe(
        "testapp.flaky", name="testapp.overlong", max_attempts=2, backoff_seconds=[1, 2, 3]
    )(overlong)
    message = only(declarations.check_subscriptions(), "W002")
    assert isinstance(message, django_checks.Warning)
    assert message.msg == "subscription 'testapp.overlong': 3 delays; max_attempts=2 uses 1"
    assert message.hint == "One delay per retry, so the extra delays never run: drop them or raise max_attempts."
    assert message.obj == handler_path(overlong)


@pytest.mark.parametrize("bad", ["0/s", "-1/s", "1e9/s", "10/x", "", 10])
def test_e011_a_rate_limit_that_is_no_rate_is_a_check_error_naming_the_forms_not_an_import_error(registries, bad):
    def limited(event):
        pass

    subscription_registry.subscribe("testapp.order_placed", name="testapp.limited", rate_limit=bad)(limited)
    message = only(declarations.check_subscriptions(), "E011")
    assert message.msg == f"subscription 'testapp.limited': rate_limit={bad!r} is not a rate"
    assert message.hint == (
        "Write it as handler starts per second, minute or hour, every worker together: '100/s', '30/m' or "
        "'1000/h' (a whole number from 1 to 999999999), or leave rate_limit out for no limit."
    )
    assert message.obj == handler_path(limited)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_subscribe_refuses_a_concurrency_that_is_not_a_positive_integer(registries, bad):
    def handler(event):
        pass

    with pytest.raises(ConfigurationError, match=r"concurrency must be an integer >= 1, got "):
        subscription_registry.subscribe("testapp.flaky", name="testapp.concurrent_bad", concurrency=bad)(handler)
    assert "testapp.concurrent_bad" not in {s.name for s in subscription_registry.subscriptions()}


def test_a_subscription_backoff_shorter_than_its_retries_is_fine_the_last_delay_repeats(registries):
    def constant(event):
        pass

    subscription_registry.subscribe("testapp.flaky", name="testapp.constant", max_attempts=10, backoff_seconds=[5])(
        constant
    )
    assert declarations.check_subscriptions() == []


# --- E002: literal event names in the project's own source -------------------

VIEWS = """
    import redis
    import django_platformkit as pk
    from django_platformkit import publish, publish_many
    from django_platformkit.outbox.events import publish as emit

    def place(order):
        publish("testapp.order_placd", {"order": 1})
        publish("testapp.order_placed", {"order": 1})
        pk.publish(event="billing.invoice_paid", payload={})
        publish_many("testapp.flaky", [{}])
        publish_many(
            "testapp.slwo", [{}], tenant="tenant-1"
        )
        emit(f"testapp.{order}", {})
        redis.publish("not.ours", "message")
"""


def test_e002_reports_undeclared_literal_names_with_file_line_and_did_you_mean(make_app):
    make_app("pkchecks_shop", {"views.py": VIEWS})
    with override_settings(INSTALLED_APPS=[*BASE_APPS, "pkchecks_shop"]):
        messages = declarations.check_publish_calls()
    assert [(m.id, m.obj, m.msg, m.hint) for m in messages] == [
        (
            "platformkit.E002",
            "pkchecks_shop/views.py:7",
            "publish() of undeclared event 'testapp.order_placd'",
            "Did you mean 'testapp.order_placed'? Else add declare('testapp.order_placd') to an app's platformkit.py.",
        ),
        (
            "platformkit.E002",
            "pkchecks_shop/views.py:9",
            "publish() of undeclared event 'billing.invoice_paid'",
            "Add declare('billing.invoice_paid') to an app's platformkit.py.",
        ),
        (
            "platformkit.E002",
            "pkchecks_shop/views.py:12",
            "publish_many() of undeclared event 'testapp.slwo'",
            "Did you mean 'testapp.slow'? Else add declare('testapp.slwo') to an app's platformkit.py.",
        ),
    ]
    assert str(messages[0]) == (
        "pkchecks_shop/views.py:7: (platformkit.E002) publish() of undeclared event 'testapp.order_placd'\n"
        "\tHINT: Did you mean 'testapp.order_placed'? Else add declare('testapp.order_placd') to an app's platformkit.py."
    )


def test_e002_reads_only_the_projects_own_apps_not_site_packages_or_this_package():
    sources = [path for path, _ in declarations.project_sources(apps.get_app_configs())]
    assert sources, "the test app's files are scanned"
    testapp = ROOT / "tests" / "testapp"
    assert all(testapp in path.parents for path in sources), sources


def test_e002_skips_virtualenvs_and_hidden_directories_inside_an_app(make_app):
    app = make_app(
        "pkchecks_vendored",
        {
            ".cache/bad.py": "from django_platformkit import publish\npublish('nope.hidden', {})\n",
            "venv/lib/bad.py": "from django_platformkit import publish\npublish('nope.venv', {})\n",
            "node_modules/x/bad.py": "from django_platformkit import publish\npublish('nope.node', {})\n",
        },
    )
    (app / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    with override_settings(INSTALLED_APPS=[*BASE_APPS, "pkchecks_vendored"]):
        assert declarations.check_publish_calls() == []


# --- E003 / E004: the outbox's database --------------------------------------


def test_e003_an_outbox_database_that_is_not_postgresql_is_an_error(settings, monkeypatch):
    monkeypatch.setitem(
        django_settings.DATABASES, "legacy", {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    )
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "DATABASE_ALIAS": "legacy"}
    message = only(services.check_database(), "E003")
    assert message.msg == "database 'legacy' behind the outbox is sqlite, not PostgreSQL"
    assert message.hint == "Point PLATFORMKIT['DATABASE_ALIAS'] at a PostgreSQL database (SKIP LOCKED, advisory locks)."
    assert message.obj == "settings.DATABASES"


def test_e004_a_database_alias_not_in_databases_is_an_error(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "DATABASE_ALIAS": "outbox"}
    message = only(services.check_database(), "E004")
    assert message.msg == "PLATFORMKIT['DATABASE_ALIAS'] = 'outbox' is not in DATABASES"
    assert message.hint == "Set it to one of ['default']."


# --- E005..E008 / W001: settings -----------------------------------------------


def test_e005_a_platformkit_setting_that_is_not_a_dict_is_an_error(settings):
    settings.PLATFORMKIT = [("NATS_URL", "nats://x")]
    message = only(settings_checks.check_settings(), "E005")
    assert message.msg == "settings.PLATFORMKIT is a list, not a dict"
    assert message.hint == "Make PLATFORMKIT a dict of settings, e.g. {'NATS_URL': 'nats://...'}."


def test_e006_unknown_keys_are_errors_with_a_did_you_mean(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "MAX_ATTEMPT": 3, "COLOUR": "blue"}
    messages = [m for m in settings_checks.check_settings() if m.id == "platformkit.E006"]
    assert [(m.msg, m.hint) for m in messages] == [
        ("unknown PLATFORMKIT key 'COLOUR'", "Remove it; the known keys are in django_platformkit.conf.DEFAULTS."),
        ("unknown PLATFORMKIT key 'MAX_ATTEMPT'", "Did you mean 'MAX_ATTEMPTS'? Else remove it."),
    ]


def test_e007_invalid_values_are_errors_naming_the_key(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "MAX_ATTEMPTS": 0, "TENANT_CONTEXT": "nowhere.tenant_context"}
    messages = [m for m in settings_checks.check_settings() if m.id == "platformkit.E007"]
    assert [(m.msg, m.hint) for m in messages] == [
        ("PLATFORMKIT['MAX_ATTEMPTS'] is invalid", "PLATFORMKIT['MAX_ATTEMPTS'] must be an integer >= 1, got 0."),
        (
            "PLATFORMKIT['TENANT_CONTEXT'] is invalid",
            "'nowhere.tenant_context' can't be imported (No module named 'nowhere'): give the dotted path of a callable.",
        ),
    ]


def test_e007_relay_lanes_past_16_is_an_error_saying_what_to_do_instead(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "RELAY_LANES": 150}
    (message,) = [m for m in settings_checks.check_settings() if m.id == "platformkit.E007"]
    assert message.msg == "PLATFORMKIT['RELAY_LANES'] is invalid"
    assert message.hint.startswith(
        "PLATFORMKIT['RELAY_LANES'] must be 1 to 16, got 150: each lane holds a database connection"
    )
    assert message.hint.endswith("Run more runrelay processes instead.")


def test_e008_a_handler_timeout_not_below_the_ack_wait_is_an_error(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "HANDLER_TIMEOUT_SECONDS": 30, "ACK_WAIT_SECONDS": 30}
    message = only(settings_checks.check_settings(), "E008")
    assert message.msg == "HANDLER_TIMEOUT_SECONDS (30) is not below ACK_WAIT_SECONDS (30)"
    assert (
        message.hint
        == "Lower HANDLER_TIMEOUT_SECONDS or raise ACK_WAIT_SECONDS: the broker redelivers after the ack wait."
    )


def test_e010_a_duplicate_window_longer_than_the_retention_is_an_error(settings):
    # NATS refuses such a stream (err_code 10052): check said nothing and
    # every relay and worker then failed at start.
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "RETENTION_DAYS": 0.001}
    message = only(settings_checks.check_settings(), "E010")
    assert message.msg == "DUPLICATE_WINDOW_SECONDS (120) exceeds RETENTION_DAYS (86.4 s)"
    assert message.hint.endswith("lower DUPLICATE_WINDOW_SECONDS or raise RETENTION_DAYS.")
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "RETENTION_DAYS": 7, "DUPLICATE_WINDOW_SECONDS": 7 * 86400}
    assert not [m for m in settings_checks.check_settings() if m.id == "platformkit.E010"]


def test_w001_a_backoff_list_longer_than_max_attempts_retries_warns(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "MAX_ATTEMPTS": 3, "BACKOFF_SECONDS": [1, 2, 3, 4, 5]}
    message = only(settings_checks.check_settings(), "W001")
    assert isinstance(message, django_checks.Warning)
    assert message.msg == "BACKOFF_SECONDS has 5 delays; MAX_ATTEMPTS=3 uses 2"
    assert message.hint == "One delay per retry, so the extra delays never run: drop them or raise MAX_ATTEMPTS."


def test_fewer_delays_than_retries_and_the_default_list_cut_short_are_fine(settings):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, "MAX_ATTEMPTS": 10, "BACKOFF_SECONDS": [1, 5]}
    assert settings_checks.check_settings() == []
    cut_short = {k: v for k, v in settings.PLATFORMKIT.items() if k != "BACKOFF_SECONDS"}
    settings.PLATFORMKIT = {**cut_short, "MAX_ATTEMPTS": 2}
    assert settings_checks.check_settings() == []


# --- E009: job schedules --------------------------------------------------------


def test_e009_a_job_whose_cron_can_never_fire_is_an_error(registries):
    def leap_day_report():
        pass

    # @job refuses this at import; a spec registered some other way is still caught.
    jobs._jobs["testapp.never"] = jobs.JobSpec(
        name="testapp.never",
        func=leap_day_report,
        cron="0 0 30 2 *",
        declared_in=handler_path(leap_day_report),
    )
    message = only(declarations.check_jobs(), "E009")
    assert message.msg == "job 'testapp.never' has a schedule that can't run"
    assert message.hint == (
        "cron '0 0 30 2 *' can never fire: no month it names has day 30 (February has 29 days at most); pick a day that exists"
    )
    assert message.obj == handler_path(leap_day_report)


def test_e009_a_time_zone_on_an_interval_job_is_an_error(registries):
    jobs._jobs["testapp.zoned"] = jobs.JobSpec(
        name="testapp.zoned", func=lambda: None, every=datetime.timedelta(minutes=5), timezone="Mars/Olympus"
    )
    message = only(declarations.check_jobs(), "E009")
    assert message.msg == "job 'testapp.zoned' has a schedule that can't run"
    assert message.obj == "testapp.zoned"
    assert message.hint.startswith("timezone='Mars/Olympus' applies to cron only")


# --- W003 / W004: two apps provide runworker ----------------------------------

RUNWORKER = """
    from django.core.management.base import BaseCommand

    class Command(BaseCommand):
        def handle(self, *args, **options):
            pass
"""


def test_w003_another_app_listed_first_hides_our_runworker(make_app):
    make_app("pkchecks_channels", {"management/commands/runworker.py": RUNWORKER})
    with override_settings(INSTALLED_APPS=["pkchecks_channels", *BASE_APPS]):
        messages = settings_checks.check_runworker()
    message = only(messages, "W003")
    assert message.msg == "runworker of 'pkchecks_channels' hides django_platformkit's runworker"
    assert (
        message.hint
        == "List 'django_platformkit' before 'pkchecks_channels' in INSTALLED_APPS: the first app listed wins."
    )
    assert ids(messages) == ["platformkit.W003"]


def test_w004_our_runworker_hides_another_apps(make_app):
    make_app("pkchecks_channels", {"management/commands/runworker.py": RUNWORKER})
    with override_settings(INSTALLED_APPS=[*BASE_APPS, "pkchecks_channels"]):
        messages = settings_checks.check_runworker()
    message = only(messages, "W004")
    assert message.msg == "runworker of 'pkchecks_channels' is hidden by django_platformkit's"
    assert (
        message.hint
        == "List 'pkchecks_channels' first if you need its worker (ours is then hidden), or silence platformkit.W004."
    )
    assert ids(messages) == ["platformkit.W004"]


# --- no queries, no network ----------------------------------------------------


@pytest.mark.django_db
def test_the_test_settings_pass_every_check_without_a_query_or_a_connection(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a check opened a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    with CaptureQueriesContext(connection) as queries:
        messages = django_checks.run_checks(include_deployment_checks=False)
    assert [m for m in messages if m.id.startswith("platformkit.")] == []
    assert len(queries) == 0


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tests" / "manage.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PLATFORMKIT_TEST_") and k != "DJANGO_SETTINGS_MODULE"
    }
    env.update(PYTHONPATH=str(ROOT), NATS_URL=f"nats://127.0.0.1:{free_port()}", **extra)
    return env


@pytest.mark.process
def test_check_and_migrate_exit_0_on_a_new_empty_database_with_no_broker_and_operator_commands_say_migrate():
    database_url = os.environ["DATABASE_URL"]
    name = f"pk_empty_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = _env(PLATFORMKIT_TEST_DB_NAME=name)
        checked = _run("check", env=env)
        assert checked.returncode == 0, checked.stderr
        assert "System check identified no issues" in checked.stdout
        # Before migrate, the operator commands say what to do, not a traceback.
        for command in (
            ("deadletters", "list"),
            ("purgeoutbox", "--dry-run"),
            ("republish", "--since", "1h", "--reason", "r", "--dry-run"),
        ):
            refused = _run(*command, env=env)
            assert refused.returncode == 1, (command, refused.stdout, refused.stderr)
            assert "run `manage.py migrate django_platformkit` first" in refused.stderr, refused.stderr
            assert "Traceback" not in refused.stderr, refused.stderr
        migrated = _run("migrate", "--noinput", env=env)
        assert migrated.returncode == 0, migrated.stderr
        assert "Applying django_platformkit.0001_initial... OK" in migrated.stdout
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.process
def test_check_exits_0_with_the_database_and_the_broker_both_unreachable():
    closed = free_port()
    checked = _run("check", env=_env(DATABASE_URL=f"postgres://postgres@127.0.0.1:{closed}/nowhere"))
    assert checked.returncode == 0, checked.stderr


# --- boot validation -----------------------------------------------------------


def _boot(app: str):
    """Install ``app`` the way a project would: the app registry populates
    and ``PlatformKitConfig.ready()`` runs."""
    return override_settings(INSTALLED_APPS=[*BASE_APPS, app])


def boot_error(make_app, app: str, platformkit_py: str) -> str:
    """The message boot refuses ``app`` with, given its ``platformkit.py``."""
    make_app(app, {"platformkit.py": platformkit_py})
    with pytest.raises(ImproperlyConfigured) as raised, _boot(app):
        pass
    return str(raised.value)


def test_boot_refuses_a_bad_event_name_naming_the_app_and_the_fix(registries, make_app):
    assert boot_error(
        make_app, "pkboot_name", "from django_platformkit import declare\ndeclare('Shop.OrderPlaced')\n"
    ) == (
        "app 'pkboot_name' (pkboot_name.platformkit): declare() in pkboot_name.platformkit: 'Shop.OrderPlaced' is not an "
        "event name: use '<module>.<event>', lower case, each part [a-z][a-z0-9_]*, exactly one dot (e.g. 'shop.order_placed')."
    )


def test_boot_refuses_one_event_declared_with_two_schemas(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_schema",
        """
        from django_platformkit import declare
        declare("testapp.order_placed", schema={"type": "object"})
    """,
    ) == (
        "app 'pkboot_schema' (pkboot_schema.platformkit): event 'testapp.order_placed' is declared twice with different "
        "schemas (in tests.testapp.platformkit and pkboot_schema.platformkit): declare it once and import the EventType."
    )


def test_boot_refuses_an_invalid_json_schema(registries, make_app):
    message = boot_error(
        make_app,
        "pkboot_jsonschema",
        """
        from django_platformkit import declare
        declare("pkboot.thing_done", schema={"type": "objekt"})
    """,
    )
    assert message.startswith(
        "app 'pkboot_jsonschema' (pkboot_jsonschema.platformkit): declare('pkboot.thing_done') in "
        "pkboot_jsonschema.platformkit: the schema is not valid JSON Schema at type: "
    )
    assert message.endswith("Fix the schema (check it with jsonschema's check_schema).")


def test_boot_refuses_two_handlers_with_one_subscription_name(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_twice",
        """
        from django_platformkit import subscribe

        @subscribe("testapp.order_placed", name="pkboot.one")
        def first(event):
            pass

        @subscribe("testapp.order_placed", name="pkboot.one")
        def second(event):
            pass
    """,
    ) == (
        "app 'pkboot_twice' (pkboot_twice.platformkit): two subscriptions are named 'pkboot.one': "
        "pkboot_twice.platformkit.first (testapp.order_placed) and pkboot_twice.platformkit.second (testapp.order_placed). "
        "Pass name='...' to one of them."
    )


def test_boot_refuses_one_function_stacked_under_two_events_with_the_default_name(registries, make_app):
    assert "two subscriptions are named 'pkboot_stacked.both'" in boot_error(
        make_app,
        "pkboot_stacked",
        """
        from django_platformkit import subscribe

        @subscribe("testapp.order_placed")
        @subscribe("testapp.flaky")
        def both(event):
            pass
    """,
    )


def test_boot_refuses_a_handler_that_cannot_take_one_event(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_signature",
        """
        from django_platformkit import subscribe

        @subscribe("testapp.order_placed")
        def handle(event, order):
            pass
    """,
    ) == (
        "app 'pkboot_signature': handler pkboot_signature.platformkit.handle can't take one event "
        "(missing a required argument: 'order'). Fix: define it as 'def handle(event): ...' (one ReceivedEvent)."
    )


def test_a_subscription_to_an_event_another_app_declares_boots_fine(registries, make_app):
    make_app(
        "pkboot_ok",
        {
            "platformkit.py": """
        from django_platformkit import subscribe

        @subscribe("testapp.order_placed")
        def audit(event):
            pass
    """
        },
    )
    with _boot("pkboot_ok"):
        assert "pkboot_ok.audit" in {s.name for s in subscription_registry.subscriptions()}
        assert declarations.check_subscriptions() == []


def test_boot_refuses_a_job_with_an_unknown_time_zone_naming_app_and_function(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_zone",
        """
        from django_platformkit import job

        @job(cron="0 3 * * *", timezone="Mars/Olympus")
        def nightly():
            pass
    """,
    ) == (
        "app 'pkboot_zone' (pkboot_zone.platformkit): @job (pkboot_zone.platformkit.nightly): timezone 'Mars/Olympus' "
        "is not a time zone zoneinfo knows; use an IANA name such as 'Europe/Paris' or 'UTC'."
    )


def test_boot_refuses_a_job_that_takes_arguments(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_jobargs",
        """
        from datetime import timedelta
        from django_platformkit import job

        @job(every=timedelta(minutes=5))
        def tidy(batch):
            pass
    """,
    ) == (
        "app 'pkboot_jobargs': job pkboot_jobargs.platformkit.tidy can't be called with no arguments "
        "(missing a required argument: 'batch'). Fix: define it as 'def tidy(): ...' (no arguments)."
    )


@pytest.mark.parametrize(
    "key,value", [("STREAM", "ORDERS\n"), ("SUBJECT_PREFIX", "orders\n"), ("SUBJECT_PREFIX", "a.b\n")]
)
def test_e007_a_trailing_newline_in_a_stream_or_subject_prefix_is_refused(settings, key, value):
    settings.PLATFORMKIT = {**settings.PLATFORMKIT, key: value}
    (message,) = [m for m in settings_checks.check_settings() if m.id == "platformkit.E007"]
    assert message.msg == f"PLATFORMKIT[{key!r}] is invalid"
    assert repr(value) in message.hint


def test_w005_stream_and_subject_prefix_left_at_their_defaults_warn_when_debug_is_off(settings):
    settings.DEBUG = False
    settings.PLATFORMKIT = {k: v for k, v in settings.PLATFORMKIT.items() if k not in ("STREAM", "SUBJECT_PREFIX")}
    messages = [m for m in services.check_broker_namespace() if m.id == "platformkit.W006"]
    assert [m.msg for m in messages] == [
        "PLATFORMKIT['STREAM'] is left at its default 'PLATFORMKIT'",
        "PLATFORMKIT['SUBJECT_PREFIX'] is left at its default 'platformkit'",
    ]
    assert messages[0].hint == (
        "Set PLATFORMKIT['STREAM'] and ['SUBJECT_PREFIX'] to this project's own names: projects sharing a NATS must not share them."
    )
    only(messages[:1], "W006")
    settings.DEBUG = True
    assert services.check_broker_namespace() == []
    settings.DEBUG = False
    settings.PLATFORMKIT = dict(settings.PLATFORMKIT, STREAM="SHOP", SUBJECT_PREFIX="shop")
    assert services.check_broker_namespace() == []


def test_a_bare_subscribe_without_the_event_is_refused_not_silently_ignored(registries):
    def bare(event):
        pass

    before = subscription_registry.subscriptions()
    with pytest.raises(ConfigurationError) as excinfo:
        subscription_registry.subscribe(bare)
    assert "use @subscribe(EVENT_OR_NAME)" in str(excinfo.value)
    assert "bare" in str(excinfo.value)
    assert subscription_registry.subscriptions() == before


def test_boot_says_a_handler_that_takes_no_argument_must_take_one_event(registries, make_app):
    assert boot_error(
        make_app,
        "pkboot_noarg",
        """
        from django_platformkit import subscribe

        @subscribe("testapp.order_placed")
        def handle():
            pass
    """,
    ) == (
        "app 'pkboot_noarg': handler pkboot_noarg.platformkit.handle takes no argument; a handler takes one event. "
        "Fix: define it as 'def handle(event): ...' (one ReceivedEvent)."
    )


@pytest.mark.process
def test_setting_django_up_registers_every_check_family():
    """apps.ready() imports the checks package, which registers each family:
    in a process of its own, where no test has imported a check module."""
    probe = (
        "import django; django.setup(); from django.core.checks.registry import registry; "
        "print(sorted(f'{c.__module__}.{c.__name__}' for c in registry.get_checks() if c.__module__.startswith('django_platformkit')))"
    )
    env = _env(DJANGO_SETTINGS_MODULE="tests.settings", PLATFORMKIT_TEST_SERVICES="none")
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    registered = result.stdout
    for family in ("declarations.check_subscriptions", "settings.check_settings", "services.check_database"):
        assert f"django_platformkit.checks.{family}" in registered, registered
