"""Stream ownership and the broker's clear refusals, against a real NATS: a
stream records the database that owns it, a worker of another database is
refused saying which settings to change, an old stream is adopted, a create
NATS refuses for good is a ConfigurationError (logged "created" only after
success), a server without JetStream says to start it with -js, and no
credential reaches a log line or an error."""

from __future__ import annotations

import logging
import subprocess
import uuid

import pytest
from django.core.management import CommandError, call_command

from django_platformkit import conf, identity
from django_platformkit.broker.transport import Transport
from django_platformkit.devservices import NatsServer, free_port, wait_for_port
from django_platformkit.exceptions import BrokerUnavailable, ConfigurationError

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def bare_transport(broker):
    """Connected, with no stream made yet (unlike the ``transport`` fixture)."""
    t = Transport()
    t.connect()
    yield t
    t.close()


def test_the_database_has_one_identity_read_from_its_row():
    ours = identity.database_identity()
    assert str(uuid.UUID(ours)) == ours
    assert identity.database_identity() == ours


def test_a_new_stream_records_its_owner_and_a_stream_of_another_database_is_refused(bare_transport, caplog):
    ours, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    caplog.set_level(logging.INFO, logger="django_platformkit")
    info = bare_transport.ensure_stream(owner=theirs)
    assert theirs in info.config.description
    assert identity.recorded_identity(info.config.description, getattr(info.config, "metadata", None)) == theirs
    assert bare_transport.ensure_stream(owner=theirs).config.name == info.config.name  # its owner is welcome
    with pytest.raises(ConfigurationError) as refused:
        bare_transport.ensure_stream(owner=ours)
    text = str(refused.value)
    assert f"belongs to another project's database ({theirs}; this database is {ours})" in text
    assert "PLATFORMKIT['STREAM']" in text and "PLATFORMKIT['SUBJECT_PREFIX']" in text


def test_a_stream_made_before_identities_is_adopted_with_a_warning(bare_transport, caplog):
    bare_transport.ensure_stream()  # no owner recorded, as an older build made it
    ours = str(uuid.uuid4())
    caplog.set_level(logging.INFO, logger="django_platformkit")
    info = bare_transport.ensure_stream(owner=ours)
    assert identity.recorded_identity(info.config.description, getattr(info.config, "metadata", None)) == ours
    adopted = [r for r in caplog.records if r.getMessage().startswith("stream adopted")]
    assert len(adopted) == 1 and adopted[0].levelno == logging.WARNING
    with pytest.raises(ConfigurationError, match="belongs to another project's database"):
        bare_transport.ensure_stream(owner=str(uuid.uuid4()))


def test_a_stream_whose_subjects_overlap_another_is_a_clear_error_and_never_logged_created(
    broker, bare_transport, settings, caplog
):
    bare_transport.ensure_stream(owner=str(uuid.uuid4()))
    other = dict(broker, STREAM=broker["STREAM"] + "_B")  # its own stream, the same subject prefix
    settings.PLATFORMKIT = other
    caplog.set_level(logging.INFO, logger="django_platformkit")
    try:
        with pytest.raises(ConfigurationError) as refused:
            bare_transport.ensure_stream(owner=str(uuid.uuid4()))
    finally:
        settings.PLATFORMKIT = broker
    text = str(refused.value)
    assert f"refused to create the stream {other['STREAM']!r}" in text and "overlap" in text
    assert "PLATFORMKIT['SUBJECT_PREFIX']" in text
    assert not any(
        r.getMessage().startswith("stream created") and other["STREAM"] in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    "change, says",
    [
        # 86 s of retention, under the default 120 s duplicate window.
        ({"RETENTION_DAYS": 0.001}, "DUPLICATE_WINDOW_SECONDS (120 s)"),
        # Production's replica count copied to a single (non-clustered) server.
        ({"STREAM_REPLICAS": 3}, "PLATFORMKIT['STREAM_REPLICAS'] is 3, which needs a NATS cluster"),
    ],
)
def test_stream_settings_nats_never_accepts_are_a_clear_error_not_retried_forever(
    broker, bare_transport, settings, change, says
):
    # NATS answers these with code 500 (err_code 10052 / 10074), which read as
    # "unavailable": the relay and worker retried every 10 s, forever.
    settings.PLATFORMKIT = dict(broker, **change)
    with pytest.raises(ConfigurationError) as refused:
        bare_transport.ensure_stream(owner=identity.database_identity())
    text = str(refused.value)
    assert f"refused to create the stream {broker['STREAM']!r}" in text and says in text
    assert "SUBJECT_PREFIX" not in text  # not the overlap advice
    with pytest.raises(CommandError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        call_command("runrelay", "--once", "--connect-timeout", "5")


def test_the_overview_shows_no_figures_of_a_stream_another_projects_database_owns(broker, bare_transport):
    # The worker refuses such a stream; the overview page used to show its
    # durables' counts as this project's.
    from django_platformkit.admin import figures as overview

    theirs = str(uuid.uuid4())
    bare_transport.ensure_stream(owner=theirs)
    result = overview.collect()
    assert not result.broker_ok
    assert "belongs to another project's database" in result.broker_error and theirs in result.broker_error
    assert all(s.num_pending is None and s.num_ack_pending is None for s in result.subscriptions)
    # Our own stream: figures as before.
    bare_transport.connection.call(bare_transport.connection.js.delete_stream(broker["STREAM"]), timeout=10)
    bare_transport.ensure_stream(owner=identity.database_identity())
    assert overview.collect().broker_ok


def _stream_refused_by(args: list[str], port: int, url: str, before=None) -> str:
    """Start ``nats-server args`` (listening on ``port``), connect to
    ``url``, run ``before(transport)``, then ``ensure_stream``: the text of
    the ``ConfigurationError`` it must raise."""
    server = subprocess.Popen([NatsServer.binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process=server)
        t = Transport(url=url)
        t.connect()
        try:
            if before is not None:
                before(t)
            with pytest.raises(ConfigurationError) as refused:
                t.ensure_stream(owner=identity.database_identity())
        finally:
            t.close()
    finally:
        server.terminate()
        server.wait(10)
    return str(refused.value)


@pytest.mark.process
def test_an_account_limit_refusing_the_stream_is_a_clear_error_without_the_overlap_advice(broker, settings, tmp_path):
    # An account allowed one stream, which another stream already uses:
    # NATS refuses ours with 400 / err_code 10027. It was reported as a
    # subject overlap, advising a new SUBJECT_PREFIX that changes nothing.
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "accounts { A { jetstream { max_streams: 1, max_mem: 64MB, max_file: 64MB }, users [ {user: a, password: a} ] } }\n"
    )
    text = _stream_refused_by(
        ["-c", str(config)],
        port,
        f"nats://a:a@127.0.0.1:{port}",
        before=lambda t: t.connection.call(
            t.connection.js.add_stream(name="SOMEONE_ELSE", subjects=["someone.else.>"]), timeout=10
        ),
    )
    assert f"refused to create the stream {broker['STREAM']!r}" in text and "err_code 10027" in text
    assert "account's JetStream limits" in text
    assert "SUBJECT_PREFIX" not in text


@pytest.mark.process
def test_a_server_without_jetstream_says_to_start_it_with_js(broker, settings):
    port = free_port()
    text = _stream_refused_by(["-a", "127.0.0.1", "-p", str(port)], port, f"nats://127.0.0.1:{port}")
    assert (
        text
        == f"JetStream is not enabled on nats://127.0.0.1:{port}: start nats-server with -js (or jetstream {{}} in its config)."
    )


# An "@" or a "/" in the password (nats-py takes the userinfo up to the last
# "@"): the redaction stopped at the first one and printed the rest.
@pytest.mark.parametrize("password", ["s3cret", "s3cr@t-s3cret", "s3cr/t-s3cret"])
def test_credentials_never_reach_a_log_line_an_error_or_a_command_error(broker, settings, caplog, password):
    port = free_port()  # nothing listens: a real refused connection
    url = f"nats://worker:{password}@127.0.0.1:{port}"
    settings.PLATFORMKIT = dict(broker, NATS_URL=url, NATS_OPTIONS={"token": "t0ken-xyz"})
    caplog.set_level(logging.DEBUG, logger="django_platformkit")
    t = Transport()
    try:
        with pytest.raises(BrokerUnavailable) as refused:
            t.connect_until(__import__("threading").Event(), retry_seconds=0.2, give_up_after_seconds=0.5)
    finally:
        t.close()
    with pytest.raises(CommandError) as command_error:
        call_command("runrelay", "--once", "--connect-timeout", "0.5")
    texts = [str(refused.value), str(command_error.value)] + [r.getMessage() for r in caplog.records]
    assert f"127.0.0.1:{port}" in str(refused.value)
    assert "nats://***@127.0.0.1" in str(command_error.value)
    leaked = [text for text in texts if "s3cret" in text or "t0ken-xyz" in text or "worker:" in text]
    assert leaked == []
    assert conf.redact_url(f"{url}, nats://other:{password}@127.0.0.2:4222") == (
        f"nats://***@127.0.0.1:{port},nats://***@127.0.0.2:4222"
    )


def test_consumer_drift_says_a_new_name_runs_everything_again_and_how_to_keep_the_claims(transport):
    from django_platformkit.broker.streams import consumer_config
    from django_platformkit.exceptions import ConsumerDrift

    want = consumer_config("testapp.drifted", "testapp.order_placed")
    other = consumer_config("testapp.drifted", "testapp.flaky")  # the same durable, another filter subject
    transport.ensure_consumer(other)
    with pytest.raises(ConsumerDrift) as drift:
        transport.ensure_consumer(want)
    text = str(drift.value)
    assert "Claims are keyed by the subscription's name" in text
    assert "runs the handler again for every event the stream still holds" in text
    assert "claims skip what was handled" not in text
    assert "`manage.py stream prune --durable testapp-drifted`" in text


def transport_stream() -> str:
    from django_platformkit import conf

    return conf.settings.STREAM
