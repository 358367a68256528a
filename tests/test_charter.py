"""Tests of chaos_flwr.charter and the keygen / charter CLI commands."""

from __future__ import annotations

import base64
import hashlib
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import chaos_flwr.charter as charter_mod
from chaos_flwr import codec
from chaos_flwr.charter import CHARTER_DOMAIN, Charter, Member, load_charter
from chaos_flwr.cli import app
from chaos_flwr.errors import CharterError
from chaos_flwr.identity import Identity, load_public_key, verify_signature

ALICE = Identity.from_seed(b"charter-alice", name="alice")
BOB = Identity.from_seed(b"charter-bob", name="bob")
CAROL = Identity.from_seed(b"charter-carol", name="carol")
DAVE = Identity.from_seed(b"charter-dave", name="dave")


def _charter(**kwargs: Any) -> Charter:
    return Charter.create("hospitals-eu", [ALICE, BOB], [CAROL], **kwargs)


def _data(ch: Charter) -> dict[str, Any]:
    loaded = yaml.safe_load(ch.to_yaml())
    assert isinstance(loaded, dict)
    return loaded


def _refused(data: dict[str, Any], *fragments: str) -> CharterError:
    with pytest.raises(CharterError) as info:
        Charter.from_yaml(yaml.safe_dump(data))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


# --- building, digest, signatures ------------------------------------------------------------


def test_create_signs_with_every_founder_and_verifies() -> None:
    ch = _charter()
    ch.verify()
    assert ch.is_verified
    assert set(ch.signatures) == {ALICE.party_id, BOB.party_id}
    assert ch.required_signatures == 2
    assert ch.missing_signatures() == []


def test_digest_is_sha256_of_canonical_body() -> None:
    ch = _charter(failure_quorum=1, sponsors_required=2, replicas=4, keep_rounds=3)
    body = {
        "version": 1,
        "federation": "hospitals-eu",
        "founders": [
            {"name": "alice", "public_key": base64.b64encode(ALICE.public_key).decode()},
            {"name": "bob", "public_key": base64.b64encode(BOB.public_key).decode()},
        ],
        "allowlist": [{"name": "carol", "public_key": base64.b64encode(CAROL.public_key).decode()}],
        "admission": {"sponsors_required": 2},
        "failure_quorum": 1,
        "heartbeat_interval_s": 1.0,
        "suspicion_timeout_s": 5.0,
        "replication": {"replicas": 4, "keep_rounds": 3},
        "founder_signatures_required": None,
    }
    encoded = codec.encode(body)
    assert ch.digest == hashlib.sha256(encoded).digest()
    assert len(ch.digest) == 32
    sig = base64.b64decode(ch.signatures[ALICE.party_id])
    verify_signature(ALICE.public_key, sig, CHARTER_DOMAIN + encoded)


def test_digest_ignores_yaml_layout_and_int_floats() -> None:
    ch = _charter()
    data = _data(ch)
    data["heartbeat_interval_s"] = 1  # an int in YAML is the same value
    reordered = dict(reversed(list(data.items())))
    text = "# a comment\n" + yaml.safe_dump(reordered, default_flow_style=True, sort_keys=False)
    again = Charter.from_yaml(text)  # signatures still verify
    assert again.digest == ch.digest
    assert again == ch


def test_digest_changes_with_any_policy_field() -> None:
    base = _charter().digest
    assert _charter(failure_quorum=1).digest != base
    assert _charter(keep_rounds=5).digest != base
    assert Charter.create("hospitals-eu", [ALICE, BOB], []).digest != base


def test_sign_returns_new_charter_and_refuses_non_founders() -> None:
    unsigned = _charter(sign=False)
    assert unsigned.signatures == {}
    one = unsigned.sign(ALICE)
    assert unsigned.signatures == {}  # unchanged
    assert set(one.signatures) == {ALICE.party_id}
    assert one.missing_signatures() == [m for m in one.founders if m.name == "bob"]
    with pytest.raises(CharterError, match=r"carol .*not a founder"):
        one.sign(CAROL)
    assert one.sign(BOB).is_verified


def test_missing_founder_signature_is_refused_naming_the_founder() -> None:
    one = _charter(sign=False).sign(ALICE)
    with pytest.raises(CharterError, match=r"1 of the 2 .*missing: bob \(" + BOB.party_id):
        one.verify()
    one.verify(complete=False)  # the signature present is fine
    with pytest.raises(CharterError, match="0 of the 2"):
        _charter(sign=False).verify()


def test_founder_signatures_required_can_lower_the_bar() -> None:
    ch = Charter.create("f", [ALICE, BOB, DAVE], founder_signatures_required=2, sign=False)
    with pytest.raises(CharterError, match="1 of the 2"):
        ch.sign(ALICE).verify()
    ch.sign(ALICE).sign(DAVE).verify()
    with pytest.raises(CharterError, match="founder_signatures_required"):
        Charter.create("f", [ALICE], founder_signatures_required=2)


def test_tampered_charter_is_refused_naming_the_signature() -> None:
    data = _data(_charter())
    data["failure_quorum"] = 1
    err = _refused(data, "does not verify")
    assert f"signatures.{min(ALICE.party_id, BOB.party_id)}" in str(err)
    data = _data(_charter())
    data["allowlist"].append({"name": "dave", "public_key": DAVE.public_key_b64})
    _refused(data, "does not verify")


def test_signature_by_a_non_founder_is_refused() -> None:
    ch = _charter()
    data = _data(ch)
    # Carol (allowlisted, not a founder) signs the very same bytes.
    data["signatures"][CAROL.party_id] = base64.b64encode(CAROL.sign(ch.signing_bytes)).decode()
    _refused(data, f"signatures.{CAROL.party_id}", "not a founder")


def test_charter_signed_by_the_wrong_founders_is_refused() -> None:
    # A charter naming Alice and Bob, whose signatures were made by other keys.
    forged = _charter(sign=False)
    data = _data(forged)
    data["signatures"] = {
        ALICE.party_id: base64.b64encode(DAVE.sign(forged.signing_bytes)).decode(),
        BOB.party_id: base64.b64encode(CAROL.sign(forged.signing_bytes)).decode(),
    }
    _refused(data, "does not verify")
    # A signature over another federation's charter does not transfer.
    other = Charter.create("other-fed", [ALICE, BOB], [CAROL])
    data = _data(_charter(sign=False))
    data["signatures"] = dict(other.signatures)
    _refused(data, "does not verify")


# --- policy lookups ----------------------------------------------------------------------------


def test_keyring_founders_and_members() -> None:
    ch = _charter()
    assert ch.keyring() == {
        ALICE.party_id: ALICE.public_key,
        BOB.party_id: BOB.public_key,
        CAROL.party_id: CAROL.public_key,
    }
    assert ch.is_founder(ALICE.party_id)
    assert not ch.is_founder(CAROL.party_id)
    assert not ch.is_founder(DAVE.party_id)
    member = ch.member(CAROL.party_id)
    assert member is not None
    assert member.name == "carol"
    assert member.key == CAROL.public_key
    assert ch.member(DAVE.party_id) is None
    ch.keyring().clear()  # a copy: the charter keeps its keyring
    assert len(ch.keyring()) == 3


def test_members_from_raw_keys_are_named_by_party_id() -> None:
    ch = Charter.create("f", [ALICE.public_key], [Member.of(CAROL, name="c")], sign=False)
    assert ch.founders[0].name == ALICE.party_id
    assert ch.allowlist[0].name == "c"
    assert ch.sign(ALICE).is_verified


def test_membership_policy_reads_the_charter() -> None:
    from chaos_flwr.membership import Policy

    ch = _charter(sponsors_required=1, failure_quorum=2)
    policy = Policy.from_charter(ch)
    assert policy.federation == "hospitals-eu"
    assert dict(policy.keyring) == ch.keyring()
    assert policy.sponsors_required == 1
    assert policy.failure_quorum == 2


# --- schema ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda d: d.update(colour="red"), ("colour", "unknown field")),
        (lambda d: d["admission"].update(sponsors=1), ("admission.sponsors", "unknown field")),
        (lambda d: d["founders"][0].update(email="x"), ("founders.0.email", "unknown field")),
        (lambda d: d["replication"].update(replicas=0), ("replication.replicas",)),
        (lambda d: d["replication"].update(keep_rounds=-1), ("replication.keep_rounds",)),
        (lambda d: d["admission"].update(sponsors_required=-1), ("admission.sponsors_required",)),
        (lambda d: d.update(failure_quorum=0), ("failure_quorum",)),
        (lambda d: d.update(failure_quorum=True), ("failure_quorum", "integer")),
        (lambda d: d.update(failure_quorum=2.0), ("failure_quorum",)),
        (lambda d: d.update(heartbeat_interval_s="1"), ("heartbeat_interval_s",)),
        (lambda d: d.update(heartbeat_interval_s=0.0), ("heartbeat_interval_s",)),
        (lambda d: d.update(heartbeat_interval_s=float("inf")), ("heartbeat_interval_s",)),
        (lambda d: d.update(suspicion_timeout_s=0.5), ("suspicion_timeout_s", "larger than")),
        (lambda d: d.update(founders=[]), ("founders",)),
        (lambda d: d["founders"][1].update(public_key="AAAA"), ("founders.1.public_key",)),
        (
            # the identity point: a small-order key whose "signatures" anyone could forge
            lambda d: d["allowlist"][0].update(public_key="AQ" + "A" * 41 + "="),
            ("allowlist.0.public_key", "not a valid Ed25519 key"),
        ),
        (lambda d: d["founders"][0].update(name="a b"), ("founders.0.name",)),
        (lambda d: d["allowlist"][0].update(name="alice"), ("allowlist.0.name", "unique")),
        (
            lambda d: d["allowlist"][0].update(public_key=d["founders"][0]["public_key"]),
            ("allowlist.0.public_key", "founders.0"),
        ),
        (lambda d: d.update(federation="bad name!"), ("federation",)),
        (lambda d: d.pop("federation"), ("federation", "required")),
        (lambda d: d.update(version=2), ("version",)),
        (lambda d: d.update(signatures={"alice": "AAAA"}), ("signatures", "party id")),
        (lambda d: d.update(signatures=[]), ("signatures",)),
    ],
)
def test_bad_fields_are_refused_naming_the_path(edit: Any, fragments: tuple[str, ...]) -> None:
    data = _data(_charter())
    edit(data)
    _refused(data, "invalid charter", *fragments)


def test_bad_signature_encoding_is_refused() -> None:
    data = _data(_charter())
    data["signatures"][ALICE.party_id] = "not base64!!"
    _refused(data, "signatures", "base64")
    data["signatures"][ALICE.party_id] = base64.b64encode(b"x" * 63).decode()
    _refused(data, "signatures", "64 bytes")


def test_create_with_bad_values_names_the_field() -> None:
    with pytest.raises(CharterError, match=r"replication\.replicas"):
        _charter(replicas=0)
    with pytest.raises(CharterError, match="federation"):
        Charter.create("", [ALICE])


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("- a\n- b\n", "mapping"),
        ("federation: [unclosed\n", "not valid YAML"),
        ("federation: a\nfederation: b\n", "duplicate key 'federation'"),
        ("admission:\n  sponsors_required: 1\n  sponsors_required: 2\n", "duplicate key"),
        ("heartbeat_interval_s: .nan\n", "heartbeat_interval_s"),
    ],
)
def test_malformed_yaml_is_refused(text: str, fragment: str) -> None:
    with pytest.raises(CharterError, match=fragment):
        Charter.from_yaml(text)


# --- files -------------------------------------------------------------------------------------


def test_save_and_load_roundtrip(tmp_path: Path) -> None:
    ch = _charter()
    path = ch.save(tmp_path / "charter.yaml")
    loaded = load_charter(path)
    assert loaded == ch
    assert loaded.digest == ch.digest
    assert ch.digest.hex() in path.read_text()  # the header names the digest
    assert [p.name for p in tmp_path.iterdir()] == ["charter.yaml"]


def test_load_charter_refuses_bad_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CharterError, match="no charter file"):
        load_charter(tmp_path / "missing.yaml")
    with pytest.raises(CharterError, match="cannot read"):
        load_charter(tmp_path)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CharterError, match="UTF-8"):
        load_charter(binary)
    path = _charter().save(tmp_path / "c.yaml")
    monkeypatch.setattr(charter_mod, "CHARTER_MAX_FILE_BYTES", 100)
    with pytest.raises(CharterError, match="larger than 100"):
        load_charter(path)


def test_load_unsigned_needs_verify_false(tmp_path: Path) -> None:
    path = _charter(sign=False).save(tmp_path / "c.yaml")
    with pytest.raises(CharterError, match=str(path)):
        load_charter(path)
    assert load_charter(path, verify=False).signatures == {}


# --- CLI ---------------------------------------------------------------------------------------

runner = CliRunner()


def _keygen(out: Path, name: str, *extra: str) -> Any:
    return runner.invoke(app, ["keygen", "--out", str(out), "--name", name, *extra])


def test_cli_keygen(tmp_path: Path) -> None:
    result = _keygen(tmp_path / "k", "alice")
    assert result.exit_code == 0, result.output
    key = tmp_path / "k" / "alice.key"
    ident = Identity.load(key)
    assert ident.party_id in result.output
    assert str(key) in result.output
    assert str(tmp_path / "k" / "alice.pub") in result.output
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    again = _keygen(tmp_path / "k", "alice")
    assert again.exit_code == 1
    assert "already exists" in again.output
    assert Identity.load(key).party_id == ident.party_id  # untouched
    forced = _keygen(tmp_path / "k", "alice", "--force")
    assert forced.exit_code == 0
    assert Identity.load(key).party_id != ident.party_id


def test_cli_keygen_default_name_is_party_id(tmp_path: Path) -> None:
    result = runner.invoke(app, ["keygen", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (key,) = tmp_path.glob("*.key")
    assert key.stem == Identity.load(key).party_id
    bad = runner.invoke(app, ["keygen", "--out", str(tmp_path), "--name", "../x"])
    assert bad.exit_code == 1
    assert "identity name" in bad.output


def test_cli_charter_init_sign_verify(tmp_path: Path) -> None:
    for name in ("alice", "bob", "carol"):
        assert _keygen(tmp_path, name).exit_code == 0
    out = tmp_path / "charter.yaml"
    init = runner.invoke(
        app,
        [
            "charter",
            "init",
            "--federation",
            "fed",
            "--founder",
            str(tmp_path / "alice.pub"),
            "--founder",
            str(tmp_path / "bob.pub"),
            "--allow",
            str(tmp_path / "carol.pub"),
            "--failure-quorum",
            "1",
            "--out",
            str(out),
        ],
    )
    assert init.exit_code == 0, init.output
    unsigned = load_charter(out, verify=False)
    assert [m.name for m in unsigned.founders] == ["alice", "bob"]
    assert unsigned.allowlist[0].key == load_public_key(tmp_path / "carol.pub")
    assert unsigned.failure_quorum == 1
    assert unsigned.digest.hex() in init.output

    refused = runner.invoke(app, ["charter", "verify", str(out)])
    assert refused.exit_code == 1
    assert "missing: alice" in refused.output

    again = runner.invoke(
        app,
        [
            *("charter", "init", "--federation", "fed"),
            *("--founder", str(tmp_path / "alice.pub"), "--out", str(out)),
        ],
    )
    assert again.exit_code == 1
    assert "already exists" in again.output

    before = out.read_bytes()
    intruder = runner.invoke(
        app, ["charter", "sign", str(out), "--key", str(tmp_path / "carol.key")]
    )
    assert intruder.exit_code == 1
    assert "not a founder" in intruder.output
    assert out.read_bytes() == before

    first = runner.invoke(app, ["charter", "sign", str(out), "--key", str(tmp_path / "alice.key")])
    assert first.exit_code == 0, first.output
    assert "1 of 2" in first.output
    assert "bob" in first.output
    second = runner.invoke(app, ["charter", "sign", str(out), "--key", str(tmp_path / "bob.key")])
    assert second.exit_code == 0, second.output
    assert "complete" in second.output

    ok = runner.invoke(app, ["charter", "verify", str(out)])
    assert ok.exit_code == 0, ok.output
    assert load_charter(out).digest.hex() in ok.output

    out.write_text(out.read_text().replace("failure_quorum: 1", "failure_quorum: 2"))
    tampered = runner.invoke(app, ["charter", "verify", str(out)])
    assert tampered.exit_code == 1
    assert "does not verify" in tampered.output
    # signing a tampered file is refused too (its existing signatures are checked first)
    resign = runner.invoke(app, ["charter", "sign", str(out), "--key", str(tmp_path / "alice.key")])
    assert resign.exit_code == 1


def test_cli_errors_for_bad_inputs(tmp_path: Path) -> None:
    garbage = tmp_path / "g.pub"
    garbage.write_text("nonsense")
    init = runner.invoke(
        app,
        [
            *("charter", "init", "--federation", "f"),
            *("--founder", str(garbage), "--out", str(tmp_path / "c.yaml")),
        ],
    )
    assert init.exit_code == 1
    assert "not a PEM public key" in init.output
    missing = runner.invoke(app, ["charter", "verify", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 1
    assert "no charter file" in missing.output
    ch = _charter(sign=False).save(tmp_path / "c.yaml")
    badkey = runner.invoke(app, ["charter", "sign", str(ch), "--key", str(garbage)])
    assert badkey.exit_code == 1
    assert "not a PEM private key" in badkey.output
