"""The attack suite: each attack is refused with a typed error, changes nothing, and is logged.

One place that mounts every attack of the threat model (docs/threat-model.md) against the real
code: envelopes (forged, wrong key, replayed, reordered, stale incarnation, oversized,
malformed, another federation), membership records (Sybil join, fail without quorum), state
transfer (tampered and truncated shards, a manifest that does not match the certified digest),
round receipts (forged, outsider, relay equivocation), replica files, and charters signed by
the wrong founders. "Logged" means the refusal is recorded where an operator can see it: the
peer's ``rejections``, the ledger's ``rejections`` / ``equivocations``, the pull session's donor
status.
"""

from __future__ import annotations

import hashlib
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chaos_flwr import codec
from chaos_flwr.charter import Charter
from chaos_flwr.defaults import WIRE_REPLAY_WINDOW
from chaos_flwr.errors import (
    ChaosError,
    CharterError,
    DecodeError,
    EquivocationError,
    FederationMismatchError,
    OversizeError,
    PolicyError,
    ReplayError,
    ShardIntegrityError,
    SignatureError,
    StaleIncarnationError,
    StoreError,
    TransferError,
    UnknownPartyError,
)
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Record, fail_body, join_body, signing_bytes
from chaos_flwr.peer import Outgoing, Peer
from chaos_flwr.planner import Donor, plan_transfer
from chaos_flwr.receipts import Receipt, ReceiptLedger, receipt_signing_bytes
from chaos_flwr.sim.runner import run_scenario
from chaos_flwr.sim.scenario import parse_scenario
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.store import ReplicaStore
from chaos_flwr.transfer import DonorStatus, PullSession, ShardRequest
from chaos_flwr.wire import seal

FED = "fed-attacks"
F = [Identity.from_seed(f"attack-founder-{i}", name=f"f{i}") for i in range(3)]
J = [Identity.from_seed(f"attack-joiner-{i}", name=f"j{i}") for i in range(3)]
MALLORY = Identity.from_seed("attack-mallory", name="mallory")


def _charter(**kw: Any) -> Charter:
    return Charter.create(
        FED,
        F,
        J,
        sponsors_required=kw.pop("sponsors_required", 1),
        failure_quorum=kw.pop("failure_quorum", 2),
        heartbeat_interval_s=1.0,
        suspicion_timeout_s=3.0,
        **kw,
    )


CHARTER = _charter()


def _federation(charter: Charter = CHARTER) -> dict[str, Peer]:
    """Three founders and one joiner, settled by synchronous FIFO delivery."""
    peers = {f.party_id: Peer(f, charter) for f in F}
    queue: deque[tuple[str, Outgoing]] = deque()

    def run() -> None:
        while queue:
            _src, out = queue.popleft()
            peer = peers.get(out.to)
            if peer is not None:
                queue.extend((out.to, o) for o in peer.handle(out.data, 0.0))

    for f in F:
        queue.extend((f.party_id, o) for o in peers[f.party_id].bootstrap(0.0))
        run()
    joiner = Peer(J[0], charter)
    peers[J[0].party_id] = joiner
    queue.extend((J[0].party_id, o) for o in joiner.request_join(0.0, [F[0].party_id]))
    run()
    assert all(p.is_member for p in peers.values())
    assert len({p.view().digest for p in peers.values()}) == 1
    return peers


@pytest.fixture(scope="module")
def victim() -> Peer:
    return _federation()[F[0].party_id]


def _state(peer: Peer) -> tuple[bytes, bytes, int, int]:
    return (peer.view().digest, peer.records.digest(), len(peer.applied), len(peer.records))


def _refused(peer: Peer, data: bytes, error: type[ChaosError], now: float = 0.0) -> None:
    """The attack: refused (typed error in the log), nothing sent back, nothing changed."""
    before = _state(peer)
    logged = len(peer.rejections)
    assert peer.handle(data, now) == []
    assert len(peer.rejections) == logged + 1, "the refusal is logged"
    assert isinstance(peer.rejections[-1].error, error), peer.rejections[-1].error
    assert _state(peer) == before


_SEQ = iter(range(10**6, 10**9))


def _env(
    peer: Peer,
    who: Identity = F[1],
    kind: str = "probe",
    payload: dict[str, Any] | None = None,
    *,
    incarnation: int = 0,
    seq: int | None = None,
) -> bytes:
    return seal(
        who,
        incarnation=incarnation,
        seq=next(_SEQ) if seq is None else seq,
        timestamp=0.0,
        kind=kind,
        payload={"nonce": 1} if payload is None else payload,
        federation=peer.federation_tag,
    )


# --- envelopes ---------------------------------------------------------------------------------


def test_forged_signature(victim: Peer) -> None:
    data = bytearray(_env(victim))
    data[-1] ^= 0x01  # the signature itself
    _refused(victim, bytes(data), SignatureError)


def test_altered_body_breaks_the_signature(victim: Peer) -> None:
    data = bytearray(_env(victim))
    data[30] ^= 0x01
    _refused(victim, bytes(data), ChaosError)
    assert isinstance(victim.rejections[-1].error, SignatureError | DecodeError)


def test_wrong_key_signature_sender_swapped(victim: Peer) -> None:
    """Sealed by F[2] with F[1]'s id in the header: verified under F[1]'s key, and refused."""
    real = _env(victim, who=F[2])
    swapped = real[:5] + F[1].party_id.encode() + real[22:]
    _refused(victim, swapped, SignatureError)


def test_outsider_key(victim: Peer) -> None:
    _refused(victim, _env(victim, who=MALLORY), UnknownPartyError)


def test_replayed_envelope(victim: Peer) -> None:
    data = _env(victim)
    assert len(victim.handle(data, 0.0)) == 1  # a probe is answered once
    _refused(victim, data, ReplayError)


def test_reordered_envelope_older_than_the_window() -> None:
    p = _federation()[F[0].party_id]
    base = 10**9 + 10 * WIRE_REPLAY_WINDOW
    assert len(p.handle(_env(p, seq=base + WIRE_REPLAY_WINDOW + 5), 0.0)) == 1
    _refused(p, _env(p, seq=base), ReplayError)
    # inside the window, out of order is fine once, never twice
    inside = _env(p, seq=base + WIRE_REPLAY_WINDOW)
    assert len(p.handle(inside, 0.0)) == 1
    _refused(p, inside, ReplayError)


def test_stale_incarnation() -> None:
    peers = _federation()
    p = peers[F[0].party_id]
    # F[1] moves to incarnation 1 (the guard remembers it) ...
    assert len(p.handle(_env(p, incarnation=1), 0.0)) == 1
    # ... and an envelope of incarnation 0 is refused as stale.
    _refused(p, _env(p, incarnation=0), StaleIncarnationError)


def test_envelope_of_another_federation(victim: Peer) -> None:
    other = Charter.create("another-federation", F, J)
    data = seal(
        F[1],
        incarnation=0,
        seq=next(_SEQ),
        timestamp=0.0,
        kind="probe",
        payload={"nonce": 1},
        federation=other.digest,
    )
    _refused(victim, data, FederationMismatchError)


def test_oversized_envelope_is_refused_unparsed() -> None:
    p = Peer(F[0], CHARTER, max_envelope_bytes=256)
    p.bootstrap(0.0)
    _refused(p, _env(p, kind="hb", payload={"rd": b"x" * 512}), OversizeError)


@pytest.mark.parametrize(
    "data", [b"", b"\x00", b"CHFE", b"CHFE\x01" + b"p" * 17 + b"\xff\xff\xff\xff", b"x" * 4096]
)
def test_malformed_envelopes(victim: Peer, data: bytes) -> None:
    _refused(victim, data, DecodeError)


def test_truncated_envelope(victim: Peer) -> None:
    data = _env(victim)
    _refused(victim, data[: len(data) - 10], ChaosError)
    assert isinstance(victim.rejections[-1].error, DecodeError | SignatureError)


# --- membership records ----------------------------------------------------------------------


def test_sybil_join_without_sponsors() -> None:
    """A join signed by the joiner alone (the charter wants one sponsor too) is refused."""
    ch = _charter(sponsors_required=1)
    peers = _federation(ch)
    p = peers[F[0].party_id]
    body = join_body(FED, J[1].party_id, 0, 0.0)
    record = Record.sign(body, [J[1]])
    _refused(p, _env(p, kind="rec", payload={"records": [record.to_wire()]}), PolicyError)
    assert J[1].party_id not in p.view().members


def test_sybil_join_of_an_identity_outside_the_charter(victim: Peer) -> None:
    body = join_body(FED, MALLORY.party_id, 0, 0.0)
    record = Record.sign(body, [MALLORY, F[1]])
    _refused(victim, _env(victim, kind="rec", payload={"records": [record.to_wire()]}), ChaosError)
    assert isinstance(victim.rejections[-1].error, PolicyError | UnknownPartyError)
    assert MALLORY.party_id not in victim.view().members


def test_fail_record_without_the_quorum() -> None:
    """failure_quorum=2: a fail record with one voter's signature is refused; J[0] stays."""
    peers = _federation()
    p = peers[F[0].party_id]
    body = fail_body(FED, J[0].party_id, 0)
    record = Record.sign(body, [F[1]])
    _refused(p, _env(p, kind="rec", payload={"records": [record.to_wire()]}), PolicyError)
    assert p.view().members[J[0].party_id].status == "active"


def test_vote_signed_by_someone_else(victim: Peer) -> None:
    body = fail_body(FED, J[0].party_id, 0)
    forged = {"body": body, "sig": F[2].sign(signing_bytes(body))}
    _refused(victim, _env(victim, kind="vote", payload=forged), SignatureError)


# --- state transfer ----------------------------------------------------------------------------


def _training_state(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return TrainingState({"w": rng.standard_normal(3000)}, round=5).to_bytes()


def _session(data: bytes, expected: bytes | None = None) -> tuple[PullSession, list[Any]]:
    donors = [Donor("pa", 1e6, 0.01), Donor("pb", 1e6, 0.01)]
    plan = plan_transfer(len(data), donors, max_shards=8, min_shard_bytes=1024)
    manifest = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    session = PullSession(manifest, plan, donors, now=0.0, expected_digest=expected)
    return session, session.poll(0.0)


@pytest.mark.parametrize("how", ["tampered", "truncated"])
def test_tampered_or_truncated_shard(how: str) -> None:
    data = _training_state()
    digest = hashlib.sha256(data).digest()
    session, reqs = _session(data, digest)
    first = next(r for r in reqs if isinstance(r, ShardRequest) and r.donor == "pa")
    piece = bytearray(data[first.start : first.end])
    if how == "tampered":
        piece[0] ^= 0xFF
    else:
        del piece[-7:]
    with pytest.raises(ShardIntegrityError):
        session.manifest.verify_shard(first.index, bytes(piece))
    missing = session.missing()
    actions = session.on_shard("pa", first.index, bytes(piece), 0.1)
    assert session.status("pa") == DonorStatus.BAD  # logged: the donor is marked bad
    assert session.missing() == missing  # nothing accepted
    assert all(a.donor == "pb" for a in actions if isinstance(a, ShardRequest))
    # the honest donor still delivers the exact state
    pending = list(actions) + [r for r in reqs if isinstance(r, ShardRequest) and r.donor == "pb"]
    now = 0.2
    while not session.done:
        req = pending.pop(0)
        if isinstance(req, ShardRequest) and req.donor == "pb":
            pending.extend(session.on_shard("pb", req.index, data[req.start : req.end], now))
        now += 0.01
    assert bytes(session.assemble()) == data


def test_manifest_not_matching_the_certified_digest() -> None:
    data = _training_state(1)
    certified = hashlib.sha256(_training_state(2)).digest()
    with pytest.raises(ShardIntegrityError):
        _session(data, certified)
    with pytest.raises(ShardIntegrityError):
        Manifest.build(data, 4096).check_certified(certified)


def test_lying_manifest_cannot_get_a_wrong_state_accepted() -> None:
    """A manifest that claims the certified digest over other shards: assembly refuses it."""
    good = _training_state(3)
    evil = _training_state(4)
    certified = hashlib.sha256(good).digest()
    donors = [Donor("pa", 1e6, 0.0)]
    plan = plan_transfer(len(evil), donors, max_shards=4, min_shard_bytes=1024)
    lie = Manifest.build(evil, plan.shard_bytes, num_shards=plan.num_shards)
    lie = Manifest(lie.total_bytes, lie.shard_bytes, lie.shard_hashes, certified)
    session = PullSession(lie, plan, donors, now=0.0, expected_digest=certified)
    pending = session.poll(0.0)
    with pytest.raises(ShardIntegrityError):
        while pending:
            req = pending.pop(0)
            if isinstance(req, ShardRequest):
                pending.extend(session.on_shard("pa", req.index, evil[req.start : req.end], 0.1))
        session.assemble()


def test_no_live_donor_is_a_typed_error() -> None:
    data = _training_state()
    session, _ = _session(data)
    session.on_donor_lost("pa", 0.1)
    with pytest.raises(TransferError):
        session.on_donor_lost("pb", 0.2)


def test_tampered_replica_file_is_refused(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    state = TrainingState({"w": np.arange(1000, dtype=np.float32)}, round=3)
    path = store.put(state, certificate=b"receipt")
    raw = bytearray(Path(path).read_bytes())
    raw[-10] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(StoreError):
        ReplicaStore(tmp_path).get(3)


# --- receipts and relay equivocation -------------------------------------------------------------

D1 = hashlib.sha256(b"aggregate shown to group 1").digest()
D2 = hashlib.sha256(b"aggregate shown to group 2").digest()


@pytest.mark.parametrize("attack", ["forged", "wrong-key", "outsider"])
def test_forged_receipts(attack: str) -> None:
    led = ReceiptLedger.from_charter(CHARTER)
    led.add(Receipt.sign(F[0], 1, D1))
    if attack == "forged":
        bad = Receipt(F[1].party_id, 1, D2, bytes(64))
    elif attack == "wrong-key":
        bad = Receipt(F[1].party_id, 1, D2, F[2].sign(receipt_signing_bytes(F[1].party_id, 1, D2)))
    else:
        bad = Receipt.sign(MALLORY, 1, D2)
    with pytest.raises(SignatureError):
        led.add(bad)
    assert led.receipts(1) == [Receipt.sign(F[0], 1, D1)] and not led.conflicted(1)
    assert isinstance(led.rejections[-1].error, SignatureError)


def test_relay_equivocation_is_detected_and_no_round_is_accepted() -> None:
    led = ReceiptLedger.from_charter(CHARTER)
    assert led.add(Receipt.sign(F[0], 7, D1)) is None
    assert led.add(Receipt.sign(J[0], 7, D1)) is None
    evidence = led.add(Receipt.sign(F[1], 7, D2))
    assert evidence is not None and evidence.culprit == "relay"
    evidence.verify(CHARTER.keyring())  # transferable
    assert led.certified(7, 1) is None
    with pytest.raises(EquivocationError):
        led.require_certified(7, 1)
    assert led.equivocations[7] == evidence  # logged


def test_relay_equivocation_in_the_simulator() -> None:
    """The relay shows two contributor sets to two halves: detected, reported, not accepted."""
    sc = parse_scenario(
        {
            "name": "equivocation",
            "parties": 6,
            "training": True,
            "settle_s": 14,
            "events": [{"at": 4, "action": "equivocate"}, {"at": 6, "action": "heal"}],
        }
    )
    r = run_scenario(sc, 3)
    assert r["ok"], r["invariants"]
    eq = r["invariants"]["equivocation"]
    assert eq["rounds"] == 1 and eq["detected"] == 1
    assert r["training"]["rounds_certified"] > 3  # training went on afterwards


# --- oversized and malformed input to decoders -------------------------------------------------


def test_codec_oversized_and_malformed() -> None:
    with pytest.raises(OversizeError):
        codec.decode(codec.encode({"x": b"y" * 100}), max_bytes=50)
    for bad in (b"", b"\x09", b"\x05\x00\x00\x00\x05ab", codec.encode(1) + b"\x00"):
        with pytest.raises(DecodeError):
            codec.decode(bad)
    with pytest.raises(DecodeError):
        codec.decode(b"\x07\x00\x00\x00\x01" * 100 + b"\x00")  # nested too deep


def test_manifest_and_receipt_decoders_refuse_garbage() -> None:
    m = Manifest.build(_training_state(), 4096).to_bytes()
    for bad in (m[:-1], m + b"\x00", b"\x00" * 10):
        with pytest.raises(DecodeError):
            Manifest.from_bytes(bad)
    with pytest.raises(DecodeError):
        Receipt.decode(b"\x08\x00\x00\x00\x00")


# --- charters ----------------------------------------------------------------------------------


def test_charter_signed_by_the_wrong_founders() -> None:
    unsigned = Charter.create(FED, F, J, sign=False)
    # signed by the allowlisted parties instead of the founders
    with pytest.raises(CharterError):
        unsigned.sign(J[0])
    # a founder's signature swapped for another key's signature over the same bytes
    good = Charter.create(FED, F, J)
    text = good.to_yaml()
    fake = unsigned.signing_bytes
    import base64

    swapped = text.replace(
        good.signatures[F[1].party_id], base64.b64encode(MALLORY.sign(fake)).decode()
    )
    with pytest.raises(CharterError):
        Charter.from_yaml(swapped)
    # missing a founder's signature
    partial = unsigned.sign(F[0]).sign(F[1])
    with pytest.raises(CharterError):
        partial.verify()
    # a peer refuses to run on an unverified charter
    with pytest.raises(CharterError):
        Peer(F[0], partial)
