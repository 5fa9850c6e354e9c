"""Security: a message is never run in a tenant other than the one its
subject names; the admin's Replay and Discard need their permission, not
just staff status; and the worker talks to a NATS server that demands
credentials or TLS - user/password, token, nkey, a creds file (JWT + nkey
seed, operator mode), TLS with our own CA, mutual TLS - through
``PLATFORMKIT["NATS_OPTIONS"]``, while wrong credentials fail at once with a
``BrokerUnavailable`` that says why."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import time
import uuid

import pytest
from django.db import transaction
from django.urls import reverse

from django_platformkit import publish
from django_platformkit.broker.transport import Transport
from django_platformkit.consume.subscriptions import subscriptions
from django_platformkit.devservices import NatsServer
from django_platformkit.exceptions import BrokerUnavailable
from django_platformkit.models import DeadLetter, HandledEvent, OutboxEvent
from django_platformkit.outbox.deadletters import record_dead_letter
from django_platformkit.wire import subject_for
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def sub(name):
    return next(s for s in subscriptions() if s.name == name)


# --- tenant isolation ----------------------------------------------------------


def envelope(**changes):
    body = {
        "specversion": "1.0",
        "id": str(uuid.uuid4()),
        "source": "/testapp",
        "type": "testapp.order_placed",
        "time": "2026-01-01T00:00:00Z",
        "datacontenttype": "application/json",
        "data": {"n": 1},
    }
    for key, value in changes.items():
        if value is ...:
            body.pop(key, None)
        else:
            body[key] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("subject_tenant", "body", "reason"),
    [
        ("attacker", envelope(tenantid="victim"), "tenantid 'victim' differs from the subject's tenant 'attacker'"),
        ("acme", envelope(tenantid=...), "tenantid None differs from the subject's tenant 'acme'"),
        (None, envelope(tenantid="acme"), "tenantid 'acme' differs from the subject's tenant None"),
        ("Acme", envelope(tenantid="acme"), "differs from the subject's tenant 'Acme'"),
        ("acme", envelope(tenantid=None), "tenantid None differs"),
        (None, envelope(tenantid=""), "is not a tenant token"),
        ("acme", envelope(tenantid=["acme"]), "is not a tenant token"),
        ("acme", envelope(tenantid="acme.other"), "is not a tenant token"),
        (
            "acme",
            envelope(tenantid="acme", type="testapp.slow"),
            "type 'testapp.slow' differs from the subject's event",
        ),
    ],
    ids=[
        "other-tenant",
        "tenant-subject-no-tenantid",
        "no-tenant-subject-with-tenantid",
        "case-differs",
        "null-tenantid",
        "empty-tenantid",
        "list-tenantid",
        "dotted-tenantid",
        "type-differs",
    ],
)
def test_a_message_whose_tenant_or_type_differs_from_its_subject_is_never_run(
    transport, run_worker, subject_tenant, body, reason
):
    transport.publish_raw(subject_for("testapp.order_placed", subject_tenant), body)
    with transaction.atomic():
        good = publish("testapp.order_placed", {"n": 2}, tenant="acme")
    run_worker(subscriptions=[sub("testapp.record_order")])
    assert list(Effect.objects.values_list("event_id", "tenant_seen")) == [(good, "acme")]
    dead = DeadLetter.objects.get()
    assert dead.name == "(malformed)" and reason in dead.error, dead.error
    assert not HandledEvent.objects.filter(
        event_id=dead.event_id
    ).exists()  # no claim: the real event, if any, still runs


def test_a_forged_copy_of_a_real_event_in_another_tenant_does_not_block_the_real_one(transport, run_worker):
    """The forger knows the event id: the malformed copy is recorded without
    a claim, so the genuine event is still handled, in its own tenant."""
    with transaction.atomic():
        real = publish("testapp.order_placed", {"n": 1}, tenant="victim")
    transport.publish_raw(subject_for("testapp.order_placed", "attacker"), envelope(id=str(real), tenantid="victim"))
    run_worker(subscriptions=[sub("testapp.record_order")])
    assert list(Effect.objects.values_list("event_id", "tenant_seen")) == [(real, "victim")]
    assert DeadLetter.objects.get().name == "(malformed)"


# --- the admin's operator actions ---------------------------------------------


@pytest.fixture
def dead_letter():
    with transaction.atomic():
        event_id = publish("testapp.order_placed", {"n": 1})
    OutboxEvent.objects.filter(id=event_id).update(published_at=dt.datetime.now(dt.UTC))
    record_dead_letter(
        subscription="testapp.record_order",
        event_id=event_id,
        name="testapp.order_placed",
        tenant=None,
        attempts=5,
        error="RuntimeError: boom",
        traceback="",
    )
    return DeadLetter.objects.get(event_id=event_id)


def staff(django_user_model, username, *perms):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user(username=username, password="pw", is_staff=True)
    for codename in ("view_deadletter", *perms):
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_platformkit", codename=codename)
        )
    return user


def post_action(client, verb, dead, reason="retry after the fix"):
    return client.post(
        reverse("admin:django_platformkit_deadletter_changelist"),
        {
            "action": f"{verb}_selected",
            "_selected_action": [dead.pk],
            "select_across": "0",
            "confirm": "yes",
            "reason": reason,
        },
    )


@pytest.mark.parametrize("verb", ["replay", "discard"])
def test_staff_without_the_replay_permission_can_neither_replay_nor_discard(
    client, django_user_model, dead_letter, verb
):
    client.force_login(staff(django_user_model, "viewer"))
    assert client.get(reverse("admin:django_platformkit_deadletter_changelist")).status_code == 200  # may look
    response = post_action(client, verb, dead_letter)
    assert response.status_code in (200, 302)
    assert (
        client.post(
            reverse(f"admin:django_platformkit_deadletter_{verb}", args=[dead_letter.pk]),
            {"confirm": "yes", "reason": "x"},
        ).status_code
        == 403
    )
    assert DeadLetter.objects.filter(pk=dead_letter.pk).exists()
    assert not OutboxEvent.objects.pending().exists()
    assert not OutboxEvent.objects.filter(name="platformkit.event_replayed").exists()


def test_an_operator_with_the_permission_replays_as_themselves_with_a_reason(client, django_user_model, dead_letter):
    client.force_login(staff(django_user_model, "operator", "replay_deadletter"))
    missing_reason = post_action(client, "replay", dead_letter, reason="  ")
    assert missing_reason.status_code == 200 and DeadLetter.objects.filter(pk=dead_letter.pk).exists()  # asked again
    post_action(client, "replay", dead_letter)
    assert not DeadLetter.objects.exists()
    assert OutboxEvent.objects.get(id=dead_letter.event_id).published_at is None  # pending again
    audit = OutboxEvent.objects.get(name="platformkit.event_replayed")
    assert (audit.payload["actor"], audit.payload["reason"], audit.payload["event_id"]) == (
        "operator",
        "retry after the fix",
        str(dead_letter.event_id),
    )


def test_an_operator_with_the_permission_discards_and_the_terminal_claim_stays(client, django_user_model, dead_letter):
    client.force_login(staff(django_user_model, "operator", "replay_deadletter"))
    response = client.post(
        reverse("admin:django_platformkit_deadletter_discard", args=[dead_letter.pk]),
        {"confirm": "yes", "reason": "obsolete order"},
    )
    assert response.status_code == 302
    assert not DeadLetter.objects.exists()
    assert HandledEvent.objects.filter(subscription="testapp.record_order", event_id=dead_letter.event_id).exists()
    # Nothing is sent again; the one pending row is the discard's audit event.
    (audit,) = OutboxEvent.objects.pending()
    assert audit.name == "platformkit.event_discarded"
    assert audit.payload["actor"] == "operator" and audit.payload["reason"] == "obsolete order"


# --- NATS credentials and TLS ----------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def nkey_pair(prefix: int):
    """A fresh nkey (``nkeys.PREFIX_BYTE_USER`` etc.)."""
    nkeys = pytest.importorskip("nkeys")
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def signed_jwt(issuer, subject: str, name: str, nats_claims: dict) -> str:
    """A NATS JWT (ed25519-nkey), as nsc writes them: ``jti`` is the
    base32 SHA-256 of the claims, the signature the issuer's over
    ``header.claims``."""
    claims = {
        "jti": "",
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": nats_claims,
    }
    claims["jti"] = (
        base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    )
    signing_input = (
        _b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + _b64url(json.dumps(claims).encode())
    )
    return signing_input + "." + _b64url(bytes(issuer.sign(signing_input.encode())))


def operator_mode(tmp_path):
    """(server config, path of a user's creds file): an operator, one account
    with JetStream, one user - the decentralised auth a NATS deployment
    managed with nsc uses."""
    nkeys = pytest.importorskip("nkeys")
    operator, system, account, user = (
        nkey_pair(p)
        for p in (
            nkeys.PREFIX_BYTE_OPERATOR,
            nkeys.PREFIX_BYTE_ACCOUNT,
            nkeys.PREFIX_BYTE_ACCOUNT,
            nkeys.PREFIX_BYTE_USER,
        )
    )
    operator_jwt = signed_jwt(
        operator, operator.public_key.decode(), "test-operator", {"type": "operator", "version": 2}
    )
    unlimited = dict.fromkeys(
        (
            "subs",
            "data",
            "payload",
            "imports",
            "exports",
            "conn",
            "leaf",
            "mem_storage",
            "disk_storage",
            "streams",
            "consumer",
        ),
        -1,
    )
    account_jwt = signed_jwt(
        operator,
        account.public_key.decode(),
        "app",
        {"limits": {**unlimited, "wildcards": True}, "type": "account", "version": 2},
    )
    # JetStream needs a system account in operator mode.
    system_jwt = signed_jwt(
        operator,
        system.public_key.decode(),
        "SYS",
        {
            "limits": {"subs": -1, "data": -1, "payload": -1, "conn": -1, "wildcards": True},
            "type": "account",
            "version": 2,
        },
    )
    user_jwt = signed_jwt(
        account,
        user.public_key.decode(),
        "worker",
        {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2},
    )
    creds = tmp_path / "worker.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
    config = (
        f"operator: {operator_jwt}\nsystem_account: {system.public_key.decode()}\nresolver: MEMORY\n"
        f"resolver_preload: {{\n  {account.public_key.decode()}: {account_jwt}\n  {system.public_key.decode()}: {system_jwt}\n}}\n"
    )
    return config, creds


def certificates(tmp_path, name: str = "ca"):
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client
    certificate, as PEM files: ``{ca, server_cert, server_key, client_cert, client_key}``."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def builder(subject, issuer, public_key):
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        )

    def write(path, cert=None, key=None):
        if cert is not None:
            path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        return str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"platformkit test {name}")])
    ca = (
        builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name, usage, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]), ca_name, key.public_key())
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            cert = cert.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return cert.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf(
        "localhost",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client, client_key = leaf("worker", ExtendedKeyUsageOID.CLIENT_AUTH)
    folder = tmp_path / name
    folder.mkdir()
    return {
        "ca": write(folder / "ca.pem", cert=ca),
        "server_cert": write(folder / "server.pem", cert=server),
        "server_key": write(folder / "server.key", key=server_key),
        "client_cert": write(folder / "client.pem", cert=client),
        "client_key": write(folder / "client.key", key=client_key),
    }


def tls_block(certs, *, verify: bool) -> str:
    return (
        f'tls {{\n  cert_file: "{certs["server_cert"]}"\n  key_file: "{certs["server_key"]}"\n'
        f'  ca_file: "{certs["ca"]}"\n  verify: {"true" if verify else "false"}\n  timeout: 2\n}}\n'
    )


def auth_mode(mode, tmp_path):
    """(server config, good NATS_OPTIONS, wrong NATS_OPTIONS, what the error says) for one mode."""
    if mode == "user_password":
        return (
            "authorization { user: worker, password: s3cret-pw }\n",
            {"user": "worker", "password": "s3cret-pw"},
            {"user": "worker", "password": "wrong"},
            "Authorization Violation",
        )
    if mode == "token":
        return (
            "authorization { token: s3cret-token }\n",
            {"token": "s3cret-token"},
            {"token": "wrong"},
            "Authorization Violation",
        )
    if mode == "nkey":
        nkeys = pytest.importorskip("nkeys")
        good, other = nkey_pair(nkeys.PREFIX_BYTE_USER), nkey_pair(nkeys.PREFIX_BYTE_USER)
        (tmp_path / "good.nk").write_bytes(bytes(good.seed))
        (tmp_path / "other.nk").write_bytes(bytes(other.seed))
        config = f"authorization {{ users: [ {{ nkey: {good.public_key.decode()} }} ] }}\n"
        return (
            config,
            {"nkeys_seed": str(tmp_path / "good.nk")},
            {"nkeys_seed": str(tmp_path / "other.nk")},
            "Authorization Violation",
        )
    if mode == "creds_file":
        config, creds = operator_mode(tmp_path)
        (tmp_path / "elsewhere").mkdir()
        _, stranger = operator_mode(tmp_path / "elsewhere")  # signed by an operator this server doesn't trust
        return config, {"user_credentials": str(creds)}, {"user_credentials": str(stranger)}, "Authorization Violation"
    if mode == "tls_ca":
        certs, stranger = certificates(tmp_path), certificates(tmp_path, "other-ca")
        return (
            tls_block(certs, verify=False),
            {"tls_ca_file": certs["ca"]},
            {"tls_ca_file": stranger["ca"]},
            "CERTIFICATE_VERIFY_FAILED",
        )
    if mode == "tls_ca_hostname":
        certs = certificates(tmp_path)
        return (
            tls_block(certs, verify=False),
            {"tls_ca_file": certs["ca"], "tls_hostname": "localhost"},
            {"tls_ca_file": certs["ca"], "tls_hostname": "elsewhere.example"},
            "CERTIFICATE_VERIFY_FAILED",
        )
    if mode == "mutual_tls":
        certs = certificates(tmp_path)
        good = {"tls_ca_file": certs["ca"], "tls_cert_file": certs["client_cert"], "tls_key_file": certs["client_key"]}
        return (
            tls_block(certs, verify=True),
            good,
            {"tls_ca_file": certs["ca"]},
            "",
        )  # the server hangs up on a client without a certificate
    raise AssertionError(mode)


AUTH_MODES = ["user_password", "token", "nkey", "creds_file", "tls_ca", "tls_ca_hostname", "mutual_tls"]


@pytest.mark.parametrize("mode", AUTH_MODES)
def test_the_worker_connects_with_nats_options_and_wrong_credentials_fail_fast_saying_why(
    broker, settings, run_worker, tmp_path, mode
):
    config, good, wrong, says = auth_mode(mode, tmp_path)
    server = NatsServer(config=config).start()
    try:
        settings.PLATFORMKIT = dict(broker, NATS_URL=server.url, NATS_OPTIONS=good)
        with transaction.atomic():
            event_id = publish("testapp.order_placed", {"mode": mode}, tenant="acme")
        run_worker(subscriptions=[sub("testapp.record_order")])  # relay and consumer, through NATS_OPTIONS
        assert list(Effect.objects.values_list("event_id", flat=True)) == [event_id]

        refused = Transport(url=server.url, options=wrong)
        started = time.monotonic()
        try:
            with pytest.raises(BrokerUnavailable) as info:
                refused.connect()
        finally:
            refused.close()
        # Refused credentials fail within a second or two; a TLS certificate
        # that fails verification only when the connect's 15 s bound ends it
        # (nats-py never returns from that first handshake).
        assert time.monotonic() - started < 20, "a refused connection must fail, not hang"
        assert says in str(info.value), str(info.value)
        assert server.url in str(info.value)

        if not mode.startswith(("tls", "mutual")):  # without TLS options the handshake fails as above
            anonymous = Transport(url=server.url, options={})
            try:
                with pytest.raises(BrokerUnavailable, match="Authorization Violation"):
                    anonymous.connect()
            finally:
                anonymous.close()
    finally:
        server.cleanup()
