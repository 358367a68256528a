"""Tests of chaos_flwr.identity: party ids, deterministic seeds, signing, key files."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from chaos_flwr.errors import ChaosError, ConfigError, KeyFileError, SignatureError
from chaos_flwr.identity import (
    Identity,
    is_party_id,
    load_public_key,
    party_id_of,
    public_key_from_b64,
    public_key_to_b64,
    verify_signature,
)


def _raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _write_private(path: Path, key: object, password: bytes | None = None) -> Path:
    enc: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    path.write_bytes(
        key.private_bytes(  # type: ignore[attr-defined]
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc
        )
    )
    return path


# --- party ids ---------------------------------------------------------------------------------


def test_party_id_is_prefix_of_sha256_of_raw_key() -> None:
    key = Ed25519PrivateKey.generate()
    raw = _raw_public(key)
    ident = Identity(key)
    assert ident.public_key == raw
    assert ident.party_id == "p" + hashlib.sha256(raw).hexdigest()[:16]
    assert party_id_of(raw) == ident.party_id
    assert is_party_id(ident.party_id)
    assert ident.name == ident.party_id  # no name given


@pytest.mark.parametrize("bad", [b"", b"x" * 31, b"x" * 33])
def test_party_id_of_refuses_wrong_length(bad: bytes) -> None:
    with pytest.raises(SignatureError, match="32 raw bytes"):
        party_id_of(bad)


@pytest.mark.parametrize(
    "value", ["P0123456789abcdef", "p0123456789abcde", "p0123456789ABCDEF", "q0123456789abcdef", 7]
)
def test_is_party_id_rejects_malformed(value: object) -> None:
    assert not is_party_id(value)


def test_from_seed_is_deterministic_and_seed_sensitive() -> None:
    a1 = Identity.from_seed(b"alice", name="alice")
    a2 = Identity.from_seed(b"alice", name="alice")
    b = Identity.from_seed(b"bob")
    assert a1.public_key == a2.public_key
    assert a1 == a2
    assert a1.sign(b"m") == a2.sign(b"m")  # Ed25519 signatures are deterministic
    assert a1.public_key != b.public_key
    assert Identity.from_seed("alice").public_key == a1.public_key  # str seeds are UTF-8
    assert a1.name == "alice"


def test_generate_gives_distinct_keys() -> None:
    assert Identity.generate().public_key != Identity.generate().public_key


def test_identity_refuses_non_ed25519_key() -> None:
    with pytest.raises(KeyFileError, match="Ed25519"):
        Identity(x25519.X25519PrivateKey.generate())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", ".hidden", "-x", "a/b", "a b", "x" * 129, "é"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="identity name"):
        Identity.generate(name)


def test_repr_does_not_leak_private_key() -> None:
    ident = Identity.from_seed(b"secret", name="s")
    pem = ident.private_key_pem().decode()
    body = "".join(pem.splitlines()[1:-1])
    assert body not in repr(ident)
    assert ident.party_id in repr(ident)


# --- signatures --------------------------------------------------------------------------------


def test_sign_and_verify_roundtrip_and_tamper() -> None:
    ident = Identity.from_seed(b"s")
    sig = ident.sign(b"hello")
    assert len(sig) == 64
    verify_signature(ident.public_key, sig, b"hello")
    with pytest.raises(SignatureError, match="does not verify"):
        verify_signature(ident.public_key, sig, b"hellp")
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    with pytest.raises(SignatureError, match="does not verify"):
        verify_signature(ident.public_key, flipped, b"hello")
    other = Identity.from_seed(b"t")
    with pytest.raises(SignatureError, match=other.party_id):
        verify_signature(other.public_key, sig, b"hello")


def test_verify_refuses_malformed_lengths() -> None:
    ident = Identity.from_seed(b"s")
    sig = ident.sign(b"m")
    with pytest.raises(SignatureError, match="signature must be 64"):
        verify_signature(ident.public_key, sig[:63], b"m")
    with pytest.raises(SignatureError, match="public key must be 32"):
        verify_signature(ident.public_key[:31], sig, b"m")


@pytest.mark.parametrize("message", [b"", b"m", bytes(range(256)) * 40])
def test_signatures_are_those_openssl_makes_and_verify_there(message: bytes) -> None:
    # Signing goes through libsodium; Ed25519 is deterministic, so the bytes must be exactly
    # OpenSSL's, and anyone verifying with plain ``cryptography`` accepts them.
    secret = hashlib.sha256(b"interop").digest()
    ident = Identity(Ed25519PrivateKey.from_private_bytes(secret))
    openssl = Ed25519PrivateKey.from_private_bytes(secret)
    sig = ident.sign(message)
    assert sig == openssl.sign(message)
    openssl.public_key().verify(sig, message)  # raises InvalidSignature if not
    verify_signature(ident.public_key, sig, message)


_L = 2**252 + 27742317777372353535851937790883648493  # the order of the Ed25519 base point


def test_verify_is_strict_a_non_canonical_s_is_refused() -> None:
    # S + L satisfies the verification equation too (malleability); strict verifiers refuse it.
    ident = Identity.from_seed(b"s")
    sig = ident.sign(b"m")
    s = int.from_bytes(sig[32:], "little")
    malleated = sig[:32] + (s + _L).to_bytes(32, "little")
    assert malleated != sig
    with pytest.raises(SignatureError, match="does not verify"):
        verify_signature(ident.public_key, malleated, b"m")


@pytest.mark.parametrize("message", [b"", b"any message at all", bytes(range(256))])
def test_verify_refuses_the_small_order_key_forgery(message: bytes) -> None:
    # With the identity point as public key and as R, and S = 0, the (cofactorless) equation
    # holds for every message: a lax verifier would accept this "signature" of anything.
    identity_point = (1).to_bytes(32, "little")
    forged = identity_point + bytes(32)
    with pytest.raises(SignatureError, match="does not verify"):
        verify_signature(identity_point, forged, message)


def test_a_small_order_public_key_is_refused_where_keys_enter() -> None:
    import base64

    identity_point = base64.b64encode((1).to_bytes(32, "little")).decode("ascii")
    with pytest.raises(SignatureError, match="not a valid Ed25519 key"):
        public_key_from_b64(identity_point)
    good = Identity.from_seed(b"k")
    assert public_key_from_b64(public_key_to_b64(good.public_key)) == good.public_key


def test_b64_helpers_are_canonical() -> None:
    ident = Identity.from_seed(b"k")
    text = public_key_to_b64(ident.public_key)
    assert text == ident.public_key_b64
    assert public_key_from_b64(text) == ident.public_key
    with pytest.raises(SignatureError, match="base64"):
        public_key_from_b64("not base64!")
    with pytest.raises(SignatureError, match="32 raw bytes"):
        public_key_from_b64("AAAA")
    with pytest.raises(SignatureError):
        public_key_from_b64(text.rstrip("=") if text.endswith("=") else text + "==")


# --- key files ---------------------------------------------------------------------------------


def test_save_writes_0600_key_and_pub_and_loads_back(tmp_path: Path) -> None:
    ident = Identity.generate("alice")
    key_path = ident.save(tmp_path / "keys")
    pub_path = tmp_path / "keys" / "alice.pub"
    assert key_path == tmp_path / "keys" / "alice.key"
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert pub_path.is_file()
    assert b"PRIVATE KEY" not in pub_path.read_bytes()
    loaded = Identity.load(key_path)
    assert loaded.party_id == ident.party_id
    assert loaded.name == "alice"
    verify_signature(ident.public_key, loaded.sign(b"x"), b"x")
    assert load_public_key(pub_path) == ident.public_key
    assert load_public_key(key_path) == ident.public_key  # the .key file also gives the key
    # nothing but the two files (no temporary leftovers)
    assert sorted(p.name for p in (tmp_path / "keys").iterdir()) == ["alice.key", "alice.pub"]


def test_save_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    first = Identity.generate("n")
    first.save(tmp_path)
    second = Identity.generate("n")
    with pytest.raises(KeyFileError, match="already exists"):
        second.save(tmp_path)
    assert Identity.load(tmp_path / "n.key").party_id == first.party_id  # untouched
    second.save(tmp_path, overwrite=True)
    assert Identity.load(tmp_path / "n.key").party_id == second.party_id
    assert load_public_key(tmp_path / "n.pub") == second.public_key


def test_save_into_unwritable_place_is_key_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(KeyFileError, match="cannot write"):
        Identity.generate("a").save(blocker / "sub")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="no private key file"):
        Identity.load(tmp_path / "nope.key")
    with pytest.raises(KeyFileError, match="no public key file"):
        load_public_key(tmp_path / "nope.pub")


def test_load_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="is a directory"):
        Identity.load(tmp_path)


def test_load_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Identity.generate("u").save(tmp_path)
    real_open = Path.open

    def deny(self: Path, *args: object, **kwargs: object) -> object:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    # The tests may run as root, for whom chmod 000 does not block reads: simulate the denial.
    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(KeyFileError, match="permission denied"):
        Identity.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"   \n", b"garbage that is not pem", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END"],
)
def test_load_garbage(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "g.key"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match=r"g\.key"):
        Identity.load(path)


def test_load_too_large(tmp_path: Path) -> None:
    path = tmp_path / "big.key"
    path.write_bytes(b"A" * (1024 * 1024))
    with pytest.raises(KeyFileError, match="larger than"):
        Identity.load(path)


def test_load_rsa_key_is_wrong_type(tmp_path: Path) -> None:
    path = _write_private(tmp_path / "rsa.key", rsa.generate_private_key(65537, 2048))
    with pytest.raises(KeyFileError, match=r"RSA.*Ed25519"):
        Identity.load(path)


def test_load_x25519_key_is_wrong_type(tmp_path: Path) -> None:
    path = _write_private(tmp_path / "x.key", x25519.X25519PrivateKey.generate())
    with pytest.raises(KeyFileError, match=r"X25519.*Ed25519"):
        Identity.load(path)
    with pytest.raises(KeyFileError, match="Ed25519"):
        load_public_key(path)


def test_load_encrypted_key_is_refused(tmp_path: Path) -> None:
    path = _write_private(tmp_path / "e.key", Ed25519PrivateKey.generate(), password=b"pw")
    with pytest.raises(KeyFileError, match="encrypted"):
        Identity.load(path)


def test_load_public_key_wrong_type(tmp_path: Path) -> None:
    pub = ec.generate_private_key(ec.SECP256R1()).public_key()
    path = tmp_path / "ec.pub"
    path.write_bytes(
        pub.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(KeyFileError, match="Ed25519"):
        load_public_key(path)
    garbage = tmp_path / "g.pub"
    garbage.write_bytes(b"-----BEGIN PUBLIC KEY-----\nzz\n-----END PUBLIC KEY-----\n")
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        load_public_key(garbage)


def test_key_file_error_is_chaos_and_os_error(tmp_path: Path) -> None:
    with pytest.raises(ChaosError):
        Identity.load(tmp_path / "missing.key")
    with pytest.raises(OSError):
        Identity.load(tmp_path / "missing.key")


def test_load_with_unusual_stem_falls_back_to_party_id(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    path = _write_private(tmp_path / "-odd.key", key)
    loaded = Identity.load(path)
    assert loaded.name == loaded.party_id == party_id_of(_raw_public(key))
    assert Identity.load(path, name="given").name == "given"
