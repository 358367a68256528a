"""Link certificates and their party bindings (chaos_flwr.transport.tls), without sockets."""

from __future__ import annotations

import datetime
import os
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from link_world import FED, ident, policy
from test_direct_links import _cert_with

from chaos_flwr import codec
from chaos_flwr.errors import ChaosError, DecodeError, LinkAuthError, NotMemberError
from chaos_flwr.membership import parse_address
from chaos_flwr.transport.tls import (
    BINDING_OID,
    LINK_SERVER_NAME,
    LinkCredentials,
    binding_expires,
    serve_cert_pem_of,
    spki_digest,
    verify_dial_cert,
)

FUZZ = settings(
    max_examples=int(os.environ.get("CHAOS_FUZZ_EXAMPLES", "700")) // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
B = LinkCredentials.create(ident("b"), FED)
KEYS = dict(policy().keyring)


def test_a_dial_certificate_names_its_party_and_both_certificates_share_the_key() -> None:
    assert verify_dial_cert(B.dial_cert_pem, FED, KEYS) == ident("b").party_id
    dial = x509.load_pem_x509_certificate(B.dial_cert_pem)
    serve = x509.load_pem_x509_certificate(B.serve_cert_pem)
    assert spki_digest(dial) == spki_digest(serve)
    names = serve.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [LINK_SERVER_NAME]
    assert serve_cert_pem_of(B.serve_cert_der) == B.serve_cert_pem
    other = LinkCredentials.create(ident("b"), FED)  # a fresh key each time
    assert other.key_pem != B.key_pem


def test_bindings_are_refused_for_another_federation_key_or_party() -> None:
    with pytest.raises(LinkAuthError, match="does not verify"):
        verify_dial_cert(B.dial_cert_pem, "another-federation", KEYS)
    swapped = {**KEYS, ident("b").party_id: ident("c").public_key}
    with pytest.raises(LinkAuthError, match="does not verify"):
        verify_dial_cert(B.dial_cert_pem, FED, swapped)
    with pytest.raises(NotMemberError):
        verify_dial_cert(LinkCredentials.create(ident("x"), FED).dial_cert_pem, FED, KEYS)
    with pytest.raises(LinkAuthError, match="no party binding"):
        verify_dial_cert(B.serve_cert_pem, FED, KEYS)  # a serve certificate binds nothing
    for bad in (b"", b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"):
        with pytest.raises(LinkAuthError):
            verify_dial_cert(bad, FED, KEYS)
    with pytest.raises(LinkAuthError):
        serve_cert_pem_of(b"\x30\x03\x02\x01\x00")
    with pytest.raises(LinkAuthError):
        serve_cert_pem_of(b"\x00" * 5000)


def test_a_stolen_link_key_is_refused_once_its_binding_expires() -> None:
    year_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=365)
    old = LinkCredentials.create(ident("b"), FED, now=year_ago)  # e.g. from an old backup
    expires = binding_expires(old.dial_cert_pem)
    assert expires is not None and expires < time.time()
    with pytest.raises(LinkAuthError, match="expired"):
        verify_dial_cert(old.dial_cert_pem, FED, KEYS)
    # its binding copied into a fresh certificate for the same (stolen) key, valid for a day:
    # the binding signs its own expiry, so it is still refused
    binding = x509.load_pem_x509_certificate(old.dial_cert_pem).extensions
    raw = binding.get_extension_for_oid(BINDING_OID).value
    assert isinstance(raw, x509.UnrecognizedExtension)
    key = serialization.load_pem_private_key(old.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    with pytest.raises(LinkAuthError, match="expired"):
        verify_dial_cert(_cert_with(raw.value, key, "b"), FED, KEYS)
    # a later expiry written into the copied binding breaks its signature
    value = codec.decode(raw.value)
    forged = codec.encode({**value, "expires": int(time.time()) + 86400})
    with pytest.raises(LinkAuthError, match="does not verify"):
        verify_dial_cert(_cert_with(forged, key, "b"), FED, KEYS)
    # the current one verifies until its expiry, not after
    now_exp = binding_expires(B.dial_cert_pem)
    assert now_exp is not None
    assert verify_dial_cert(B.dial_cert_pem, FED, KEYS, now=now_exp) == ident("b").party_id
    with pytest.raises(LinkAuthError, match="expired"):
        verify_dial_cert(B.dial_cert_pem, FED, KEYS, now=now_exp + 1)


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_binding_extension_values_raise_only_typed_errors(value: bytes) -> None:

    pem = _cert_with(value, ec.generate_private_key(ec.SECP256R1()), "fuzz")
    with pytest.raises((LinkAuthError, NotMemberError)):
        verify_dial_cert(pem, FED, KEYS)


@FUZZ
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_fuzz_addresses_parse_or_raise_decode_error(text: str) -> None:
    try:
        host, port = parse_address(text)
    except DecodeError:
        return
    except ChaosError as exc:  # pragma: no cover - would be a wrong type
        raise AssertionError(f"untyped refusal {exc!r}") from None
    assert 0 < port < 65536 and parse_address(
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ) == (host, port)


def test_the_binding_oid_is_stable() -> None:
    assert BINDING_OID.dotted_string.startswith("2.25.")  # a UUID OID (no registry needed)
