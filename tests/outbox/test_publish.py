"""publish() is part of the caller's transaction, and refuses bad input
before it writes anything."""

import datetime
import decimal
import math
import uuid

import pytest
from django.db import connection, transaction

from django_platformkit import publish, publish_many
from django_platformkit.exceptions import InvalidEventName, InvalidPayload, TransactionRequired, UndeclaredEvent
from django_platformkit.models import OutboxEvent
from tests.conftest import mirror_of_default
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_committed_transaction_leaves_one_pending_row():
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"order": 1})
    row = OutboxEvent.objects.get()
    assert row.id == event_id
    assert row.name == "testapp.order_placed"
    assert row.payload == {"order": 1}
    assert row.published_at is None
    assert event_id.version == 7


def test_a_rolled_back_transaction_leaves_no_row():
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        publish("testapp.order_placed", {"order": 1})
        1 / 0
    assert OutboxEvent.objects.count() == 0


def test_a_rolled_back_savepoint_keeps_only_the_outer_event():
    with transaction.atomic():
        outer = publish("testapp.order_placed", {"n": "outer"})
        try:
            with transaction.atomic():
                publish("testapp.order_placed", {"n": "inner"})
                raise RuntimeError
        except RuntimeError:
            pass
    assert list(OutboxEvent.objects.values_list("id", flat=True)) == [outer]


def test_outside_atomic_raises_transaction_required_and_writes_nothing():
    assert connection.get_autocommit()
    with pytest.raises(TransactionRequired, match="transaction.atomic"):
        publish("testapp.order_placed", {"order": 1})
    assert OutboxEvent.objects.count() == 0


def test_events_of_one_transaction_keep_their_order():
    with transaction.atomic():
        ids = [publish("testapp.order_placed", {"n": i}) for i in range(50)]
    stored = list(OutboxEvent.objects.order_by("created_at", "id").values_list("id", flat=True))
    assert stored == ids


class Weird:
    pass


BAD_PAYLOADS = [
    ({"x": Weird()}, "$.x"),
    ({"x": {1, 2}}, "$.x"),
    ({"x": b"bytes"}, "$.x"),
    ({"x": [1, math.nan]}, "$.x[1]"),
    ({"x": math.inf}, "$.x"),
    ({"x": -math.inf}, "$.x"),
    ({"a\x00b": 1}, '$["a\\u0000b"]'),
    ({"x": {"y": "nul\x00here"}}, "$.x.y"),
    ({"x": "\ud800"}, "$.x"),
    ({1: "int key"}, "$"),
    ({"big": "x" * (600 * 1024)}, "$"),
]


@pytest.mark.parametrize("payload,path", BAD_PAYLOADS, ids=[p for _, p in BAD_PAYLOADS])
def test_each_bad_payload_raises_invalid_payload_and_the_transaction_stays_usable(payload, path):
    with transaction.atomic():
        with pytest.raises(InvalidPayload) as info:
            publish("testapp.order_placed", payload)
        assert info.value.path == path
        # the caller's transaction is still usable: no SQL ran
        Order.objects.create(total=1)
        publish("testapp.order_placed", {"ok": True})
    assert Order.objects.count() == 1
    assert OutboxEvent.objects.count() == 1


def test_a_payload_that_fails_its_schema_names_the_path():
    with transaction.atomic():
        with pytest.raises(InvalidPayload, match=r"\$\.qty") as info:
            publish("testapp.with_schema", {"sku": "a", "qty": 0})
        assert info.value.path == "$.qty"
        publish("testapp.with_schema", {"sku": "a", "qty": 2})


def test_too_deep_nesting_is_refused():
    payload = current = {}
    for _ in range(150):
        current["a"] = {}
        current = current["a"]
    with transaction.atomic(), pytest.raises(InvalidPayload, match="deeper"):
        publish("testapp.order_placed", payload)


def test_undeclared_and_malformed_names_are_refused():
    with transaction.atomic():
        with pytest.raises(UndeclaredEvent, match="declare"):
            publish("testapp.never_declared", {})
        for bad in ["NoDot", "a.b.c", "Shop.order", "shop.Order", "shop.", ".x", "shop.order-placed", ""]:
            with pytest.raises(InvalidEventName):
                publish(bad, {})
        for tenant in ["", "a.b", "x" * 65, "sp ace", "*", ">"]:
            with pytest.raises(InvalidEventName, match="tenant"):
                publish("testapp.order_placed", {}, tenant=tenant)
    assert OutboxEvent.objects.count() == 0


def test_an_undeclared_event_without_the_app_installed_says_to_install_it_not_to_declare_it():
    """Forgetting 'django_platformkit' in INSTALLED_APPS means no app's
    platformkit.py is imported: the declaration is there, and "add
    declare(...) to your app's platformkit.py" sent a new user to the wrong
    file. The refusal names the missing app."""
    from django.test import override_settings

    with override_settings(INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth"]):
        with transaction.atomic():
            with pytest.raises(UndeclaredEvent, match="'django_platformkit' is not in INSTALLED_APPS"):
                publish("testapp.never_declared", {})
    with transaction.atomic():
        with pytest.raises(UndeclaredEvent, match=r"add declare\('testapp.never_declared'\)") as caught:
            publish("testapp.never_declared", {})
    assert "INSTALLED_APPS" not in str(caught.value)


def test_an_integer_past_4300_digits_is_refused_even_where_python_may_print_it():
    """A publisher with sys.set_int_max_str_digits(0) (or
    PYTHONINTMAXSTRDIGITS=0) could write a 5,000-digit integer; a worker
    with Python's default limit can't read it back, so the event ended as a
    "(malformed)" dead letter no replay can send again. The README's rule is
    the same for every process: up to 4300 digits."""
    import sys

    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        too_long, longest = 10**4300, 10**4300 - 1  # 4301 and 4300 digits
        with transaction.atomic():
            with pytest.raises(InvalidPayload, match=r"integer at \$.n has more than 4300 digits"):
                publish("testapp.order_placed", {"n": too_long})
            with pytest.raises(InvalidPayload, match="more than 4300 digits"):
                publish("testapp.order_placed", {"n": -too_long})
            publish("testapp.order_placed", {"n": longest})
    finally:
        sys.set_int_max_str_digits(limit)
    assert OutboxEvent.objects.count() == 1


def test_publish_many_says_which_item_is_bad():
    """One bad payload among hundreds: the error named its JSON path but not
    which of the events it was in."""
    payloads = [{"n": i} for i in range(300)]
    payloads[217] = {"n": float("nan")}
    with transaction.atomic():
        with pytest.raises(InvalidPayload, match=r"^publish_many\(\) payload 217: nan at \$.n ") as caught:
            publish_many("testapp.order_placed", payloads)
        assert caught.value.path == "$.n"
        with pytest.raises(UndeclaredEvent, match=r"^publish_many\(\) payload 0: event 'testapp.nope'"):
            publish_many("testapp.nope", [{}])
        with pytest.raises(InvalidEventName, match=r"^publish_many\(\) payload 0: tenant"):
            publish_many("testapp.order_placed", [{}], tenant="a.b")
    assert OutboxEvent.objects.count() == 0


def test_values_encode_the_way_django_json_encoder_does():
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=datetime.UTC)
    uid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    with transaction.atomic():
        publish(
            "testapp.order_placed",
            {
                "d": decimal.Decimal("10.50"),
                "t": when,
                "day": datetime.date(2028, 2, 29),
                "u": uid,
                "tuple": (1, 2),
                "big": 2**70,
            },
            tenant=str(uid),
        )
    row = OutboxEvent.objects.get()
    assert row.payload == {
        "d": "10.50",
        "t": "2026-01-02T03:04:05.600Z",
        "day": "2028-02-29",
        "u": str(uid),
        "tuple": [1, 2],
        "big": 2**70,
    }
    assert row.tenant == str(uid)


def test_publish_many_writes_every_event_in_one_statement_in_order(django_assert_num_queries):
    with transaction.atomic(), django_assert_num_queries(1):
        ids = publish_many("testapp.order_placed", [{"n": i} for i in range(100)], tenant="acme")
    stored = list(OutboxEvent.objects.order_by("created_at", "id").values_list("id", "tenant", "payload"))
    assert [i for i, _, _ in stored] == ids
    assert {tenant for _, tenant, _ in stored} == {"acme"}
    assert [payload["n"] for _, _, payload in stored] == list(range(100))


def test_publish_many_writes_nothing_when_one_event_is_bad():
    with transaction.atomic(), pytest.raises(InvalidPayload):
        publish_many("testapp.order_placed", [{"n": 1}, {"n": math.nan}])
    assert OutboxEvent.objects.count() == 0


def test_publish_is_one_query(django_assert_num_queries):
    with transaction.atomic(), django_assert_num_queries(1):
        publish("testapp.order_placed", {"n": 1})


def test_the_platformkit_event_module_is_reserved():
    from django_platformkit import declare
    from django_platformkit.exceptions import ConfigurationError

    with pytest.raises(ConfigurationError, match="belongs to django_platformkit"):
        declare("platformkit.my_event")


def test_nats_url_must_be_a_nats_url(settings):
    from django.core.exceptions import ImproperlyConfigured

    from django_platformkit import conf

    settings.PLATFORMKIT = {"NATS_URL": "nats://a:4222, http://b:4222"}
    with pytest.raises(ImproperlyConfigured, match="'http://b:4222'.*must start with nats://"):
        conf.settings.NATS_URL


def test_the_reserved_tenant_token_is_refused_at_publish_saying_what_to_pass():
    from django_platformkit.names import RESERVED_TENANTS
    from django_platformkit.wire import NO_TENANT

    assert NO_TENANT in RESERVED_TENANTS  # the subject's "no tenant" is what is reserved
    with transaction.atomic():
        with pytest.raises(
            InvalidEventName, match=r"tenant '_' is reserved: on the subject it means 'no tenant'.*tenant=None"
        ):
            publish("testapp.order_placed", {}, tenant="_")
        # Still usable: the refusal came before any SQL.
        publish("testapp.order_placed", {}, tenant="_a")
    assert list(OutboxEvent.objects.values_list("tenant", flat=True)) == ["_a"]


def test_a_time_with_a_time_zone_is_refused_for_its_time_zone():
    value = datetime.time(9, 30, tzinfo=datetime.UTC)
    with transaction.atomic():
        with pytest.raises(InvalidPayload) as info:
            publish("testapp.order_placed", {"opens": value})
        assert info.value.path == "$.opens"
        assert "has a time zone" in str(info.value)
        assert "not JSON-encodable" not in str(info.value)
        publish("testapp.order_placed", {"opens": datetime.time(9, 30)})  # a naive time is fine
    assert OutboxEvent.objects.get().payload == {"opens": "09:30:00"}


def test_too_deep_nesting_names_a_shortened_path_and_keeps_the_whole_one_on_the_error():
    payload = current = {}
    current["x"] = [[]]
    current = current["x"][0]
    for _ in range(150):
        current.append([])
        current = current[0]
    with transaction.atomic(), pytest.raises(InvalidPayload) as info:
        publish("testapp.order_placed", payload)
    message = str(info.value)
    assert message.startswith("payload nests deeper than 100 levels at $.x[0][0]…[0][0][0] (101 levels): ")
    assert len(message) < 120
    assert info.value.path == "$.x" + "[0]" * 100


@pytest.mark.parametrize("how", ["publish", "publish_many"])
def test_an_unmigrated_outbox_is_an_error_that_says_to_migrate(how):
    from django.db import ProgrammingError

    # The rename is rolled back with the failed statement's transaction: the table is back after.
    with pytest.raises(
        ProgrammingError, match=r"run `python manage\.py migrate django_platformkit --database default`"
    ):
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ALTER TABLE platformkit_outbox RENAME TO platformkit_outbox_away")
            if how == "publish":
                publish("testapp.order_placed", {"order": 1})
            else:
                publish_many("testapp.order_placed", [{"order": 1}])
    with transaction.atomic():
        publish("testapp.order_placed", {"order": 2})
    assert OutboxEvent.objects.count() == 1


#: A second alias on the test database (the project's other database, say).
ELSEWHERE = "elsewhere"


@pytest.fixture(scope="module")
def elsewhere_alias(django_db_setup):
    """Registers ``ELSEWHERE`` for this module's tests."""
    with mirror_of_default(ELSEWHERE) as alias:
        yield alias


@pytest.mark.django_db(transaction=True, databases=["default", ELSEWHERE])
def test_an_outbox_missing_on_another_alias_says_the_relay_reads_database_alias_not_to_migrate_there(
    elsewhere_alias,
):
    """publish(using=X) where X lacks the tables said "run `manage.py
    migrate django_platformkit --database X`": done, publish() worked and
    every event it wrote there stayed pending for ever, since the relay and
    the worker read DATABASE_ALIAS's outbox only (nothing said so, and the
    overview counts that outbox only). The error now says where the outbox
    is and not to migrate another database for it."""
    from django.db import ProgrammingError, connections

    with pytest.raises(ProgrammingError) as refused:
        # The rename is rolled back with the failed statement's transaction.
        with transaction.atomic(using=elsewhere_alias), connections[elsewhere_alias].cursor() as cursor:
            cursor.execute("ALTER TABLE platformkit_outbox RENAME TO platformkit_outbox_away")
            publish("testapp.order_placed", {"order": 1}, using=elsewhere_alias)
    text = str(refused.value)
    assert "migrate django_platformkit --database elsewhere" not in text, text
    assert "does not exist in database 'elsewhere', and it shouldn't" in text, text
    assert "PLATFORMKIT['DATABASE_ALIAS'] ('default')" in text and "would never be sent" in text, text
    assert "transaction.atomic(using='default')" in text, text


def test_another_programming_error_is_raised_as_it_was():
    from django.db import ProgrammingError

    with pytest.raises(ProgrammingError, match="permission denied|does not exist") as raised:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ALTER TABLE platformkit_outbox RENAME COLUMN payload TO payload_away")
            publish("testapp.order_placed", {"order": 1})
    assert "migrate" not in str(raised.value)


@pytest.mark.django_db(transaction=True)
def test_a_misspelt_event_at_run_time_gets_the_did_you_mean_the_check_gives():
    # The check (E002) suggests the declared name; publish() at run time said only "add declare(...)".
    with transaction.atomic():
        with pytest.raises(UndeclaredEvent) as caught:
            publish("testapp.order_placd", {})
        publish("testapp.order_placed", {})  # the caller's transaction is still usable
    assert str(caught.value) == (
        "event 'testapp.order_placd' is not declared: did you mean 'testapp.order_placed'? "
        "Else add declare('testapp.order_placd') to your app's platformkit.py."
    )
