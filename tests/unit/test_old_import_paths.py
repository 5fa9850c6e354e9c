"""The layout moved names along the data's path (wire, payload,
subscriptions, deadletters, attempts, outage; transport's stages streams,
publishing, pulling, acks; consumer's stages claim, handler, units); every
name users, the tests or the benchmarks imported from its old module still
imports from there, and
is the same object as in its new home (a copy would be a second registry or
a second definition to drift)."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    # (old module, new module, names)
    (
        "consumer",
        "subscriptions",
        [
            "Subscription",
            "subscribe",
            "subscriptions",
            "_subscriptions",
            "check_subscription_name",
            "SUBSCRIPTION_NAME_PART",
            "_default_name",
            "set_config_tenant",
            "tenant_context_factory",
        ],
    ),
    ("consumer", "wire", ["ReceivedEvent", "Delivery", "MalformedMessage", "parse_delivery"]),
    ("consumer", "deadletters", ["record_dead_letter"]),
    ("consumer", "attempts", ["WORKER_ID", "RECORD_SLOW_RUN_AFTER_SECONDS"]),
    ("consumer", "outage", ["not_the_handlers_fault", "close_old_connections_for", "NOT_THE_HANDLERS_FAULT"]),
    ("relay", "deadletters", ["replay", "discard", "ReplayResult"]),
    ("relay", "wire", ["envelope"]),
    (
        "transport",
        "wire",
        [
            "subject_for",
            "filter_subject_for",
            "parse_subject",
            "durable_name",
            "NO_TENANT",
            "Delivery",
            "OutgoingMessage",
            "Outcome",
            "PublishResult",
        ],
    ),
    ("events", "payload", ["encode_payload", "MAX_DEPTH"]),
    (
        "transport",
        "streams",
        [
            "stream_config",
            "consumer_config",
            "max_ack_pending_for",
            "consumer_differences",
            "RETRY_BACKLOG_HEADROOM",
        ],
    ),
    ("transport", "publishing", ["classify_publish_error", "PendingPublish"]),
    ("transport", "pulling", ["PullLane", "PullLost", "to_deliveries", "_ack_reply_fields"]),
    ("transport", "acks", ["KeepAlive", "KEEP_ALIVE_TICK_SECONDS"]),
    (
        "consumer",
        "claim",
        ["_claim_sql", "_CLAIM_TRUSTED_SQL", "_CLAIM_EXTERNAL_SQL", "_ALREADY_CLAIMED_SQL", "NOT_IN_OUTBOX"],
    ),
    ("consumer", "handler", ["HandlerTimeout"]),
    ("consumer", "units", ["_Work", "_Redo", "_Stopping", "MAX_SAVEPOINTS_PER_TRANSACTION"]),
    ("worker", "pool", ["UNIT_TARGET_SECONDS", "POOL_ERROR_BACKOFF_SECONDS", "desired_consumer_config", "_Lane"]),
    ("scheduler", "clocks", ["Clock", "SystemClock", "DatabaseClock"]),
    (
        "testing_transport",
        "testing_stream",
        ["ManualClock", "StoredMessage", "StreamInfo", "ConsumerInfo", "PubAck", "ConsumerSpec", "subject_matches"],
    ),
    ("overview", "overview_broker", ["broker_figures", "BROKER_TIMEOUT_SECONDS"]),
    (
        "admin",
        "admin_deadletters",
        ["DeadLetterAdmin", "replay_blocker", "REPLAY_PERMISSION", "CONFIRMATION_LIST_LIMIT", "MALFORMED_NAME"],
    ),
    ("admin", "admin_display", ["ReadOnlyAdmin", "_first_line", "_truncated", "_pretty_json", "_pre", "_duration"]),
    ("checks", "checks_messages", ["MESSAGES", "FIXES", "TAG"]),
    (
        "checks",
        "checks_declarations",
        ["check_subscriptions", "check_publish_calls", "check_jobs", "project_sources", "publish_calls", "PublishCall"],
    ),
    ("checks", "checks_settings", ["check_settings", "check_runworker"]),
    (
        "checks",
        "checks_services",
        ["check_database", "check_max_ack_pending", "check_broker_namespace", "MIN_RETRY_ROOM"],
    ),
]


@pytest.mark.parametrize(("old", "new", "names"), MOVED, ids=[f"{o}->{n}" for o, n, _ in MOVED])
def test_a_moved_name_still_imports_from_its_old_module_as_the_same_object(old, new, names):
    old_module = importlib.import_module(f"django_platformkit.{old}")
    new_module = importlib.import_module(f"django_platformkit.{new}")
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name} is not {new}.{name}"


def test_the_default_tenant_context_and_its_old_dotted_path_name_one_function():
    from django.utils.module_loading import import_string

    from django_platformkit import conf

    default = import_string(conf.settings.TENANT_CONTEXT)  # the test settings leave it at its default
    assert default is import_string("django_platformkit.consumer.set_config_tenant")


def test_the_public_api_lives_where_the_layout_puts_it():
    import django_platformkit

    homes = {
        "subscribe": "django_platformkit.subscriptions",
        "ReceivedEvent": "django_platformkit.wire",
        "replay": "django_platformkit.deadletters",
        "publish": "django_platformkit.events",
    }
    for name, module in homes.items():
        assert getattr(django_platformkit, name).__module__ == module, name
