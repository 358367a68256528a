"""Membership records, their validation, and the view they fold into."""

from __future__ import annotations

import hashlib
import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos_flwr.errors import DecodeError, PolicyError, SignatureError, UnknownPartyError
from chaos_flwr.membership import (
    Policy,
    Record,
    RecordSet,
    SignatureCache,
    fail_body,
    join_body,
    leave_body,
    link_body,
    record_id_of,
    signing_bytes,
    validate_record,
)

FED = "fed-test"


class Signer:
    """A minimal signer (membership only needs ``party_id`` and ``sign``)."""

    def __init__(self, seed: str) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed.encode()).digest())
        self.public_key = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.party_id = "p" + hashlib.sha256(self.public_key).hexdigest()[:16]

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


FOUNDERS = [Signer(f"founder-{i}") for i in range(3)]
JOINERS = [Signer(f"joiner-{i}") for i in range(3)]
OUTSIDER = Signer("outsider")


def make_policy(sponsors: int = 1, quorum: int = 2) -> Policy:
    return Policy(
        federation=FED,
        keyring={s.party_id: s.public_key for s in FOUNDERS + JOINERS},
        founders=frozenset(s.party_id for s in FOUNDERS),
        sponsors_required=sponsors,
        failure_quorum=quorum,
    )


def genesis(s: Signer, inc: int = 0, at: float = 1.0) -> Record:
    return Record.sign(join_body(FED, s.party_id, inc, at), [s])


def link(kind: str, x: Signer, y: Signer, epoch: int, signers: list[Signer]) -> Record:
    return Record.sign(link_body(kind, FED, (x.party_id, 0), (y.party_id, 0), epoch), signers)


def test_founders_bootstrap_with_their_own_signature() -> None:
    rs = RecordSet(make_policy())
    for i, f in enumerate(FOUNDERS):
        assert rs.add(genesis(f, at=float(i)))
    view = rs.view()
    assert view.active() == sorted(f.party_id for f in FOUNDERS)
    assert view.members[FOUNDERS[2].party_id].joined_at == 2.0
    assert view.members[FOUNDERS[2].party_id].incarnation == 0


def test_joiner_needs_sponsors_and_its_own_signature() -> None:
    policy = make_policy(sponsors=2)
    j = JOINERS[0]
    body = join_body(FED, j.party_id, 0, 5.0)
    with pytest.raises(PolicyError, match="sponsors_required"):
        validate_record(Record.sign(body, [j, FOUNDERS[0]]), policy)
    with pytest.raises(PolicyError, match="joiner's own signature"):
        validate_record(Record.sign(body, [FOUNDERS[0], FOUNDERS[1]]), policy)
    validate_record(Record.sign(body, [j, FOUNDERS[0], FOUNDERS[1]]), policy)


def test_outsider_cannot_join_or_sign() -> None:
    policy = make_policy()
    with pytest.raises(UnknownPartyError, match="not a party of the charter"):
        validate_record(genesis(OUTSIDER), policy)
    body = join_body(FED, JOINERS[0].party_id, 0, 1.0)
    with pytest.raises(UnknownPartyError):
        validate_record(Record.sign(body, [JOINERS[0], OUTSIDER]), policy)


def test_altered_body_or_signature_is_refused_and_changes_nothing() -> None:
    rs = RecordSet(make_policy())
    good = genesis(FOUNDERS[0])
    altered = Record(body={**good.body, "at": 99.0}, signatures=good.signatures)
    before = rs.view().digest
    with pytest.raises(SignatureError):
        rs.add(altered)
    sig = bytearray(good.signatures[FOUNDERS[0].party_id])
    sig[0] ^= 1
    with pytest.raises(SignatureError):
        rs.add(Record(body=good.body, signatures={FOUNDERS[0].party_id: bytes(sig)}))
    assert len(rs) == 0
    assert rs.view().digest == before


def test_other_federation_is_refused() -> None:
    record = Record.sign(join_body("other", FOUNDERS[0].party_id, 0, 1.0), [FOUNDERS[0]])
    with pytest.raises(PolicyError, match="federation"):
        validate_record(record, make_policy())


def test_required_signatures_per_kind() -> None:
    policy = make_policy(quorum=2)
    a, b, c = FOUNDERS
    with pytest.raises(PolicyError, match="leaver"):
        validate_record(Record.sign(leave_body(FED, a.party_id, 0), [b]), policy)
    validate_record(Record.sign(leave_body(FED, a.party_id, 0), [a]), policy)
    with pytest.raises(PolicyError, match="failure_quorum"):
        validate_record(Record.sign(fail_body(FED, a.party_id, 0), [a, b]), policy)
    validate_record(Record.sign(fail_body(FED, a.party_id, 0), [b, c]), policy)
    with pytest.raises(PolicyError, match="both ends"):
        validate_record(link("link_up", a, b, 1, [a, c]), policy)
    validate_record(link("link_up", a, b, 1, [a, b]), policy)
    with pytest.raises(PolicyError, match="end 'a' or end 'b'"):
        validate_record(link("link_down", a, b, 1, [c]), policy)
    validate_record(link("link_down", a, b, 1, [b]), policy)


def test_malformed_records_raise_decode_error() -> None:
    good = genesis(FOUNDERS[0]).to_wire()
    with pytest.raises(DecodeError, match="unknown fields"):
        Record.from_wire({"body": {**good["body"], "extra": 1}, "sigs": good["sigs"]})
    with pytest.raises(DecodeError, match="sigs"):
        Record.from_wire({"body": good["body"], "sigs": {}})
    with pytest.raises(DecodeError, match="kind"):
        Record.from_wire({"body": {**good["body"], "kind": "promote"}, "sigs": good["sigs"]})
    with pytest.raises(DecodeError, match="a < b"):
        body = link_body("link_up", FED, ("pa", 0), ("pb", 0), 1)
        Record.from_wire({"body": {**body, "a": "pb", "b": "pa"}, "sigs": {"pa": b"x"}})
    with pytest.raises(DecodeError):
        Record.from_wire([1, 2])


def test_fail_and_rejoin_with_higher_incarnation() -> None:
    a, b, c = FOUNDERS
    rs = RecordSet(make_policy(quorum=2))
    for f in FOUNDERS:
        rs.add(genesis(f))
    rs.add(Record.sign(fail_body(FED, a.party_id, 0), [b, c]))
    assert rs.view().members[a.party_id].status == "failed"
    assert not rs.view().is_active(a.party_id)
    rs.add(genesis(a, inc=1, at=7.0))
    m = rs.view().members[a.party_id]
    assert (m.status, m.incarnation, m.joined_at) == ("active", 1, 7.0)
    # Records about the old incarnation cannot kill the new one...
    rs.add(Record.sign(leave_body(FED, a.party_id, 0), [a]))
    assert rs.view().members[a.party_id].status == "active"
    # ...nor can an old join resurrect a left one.
    rs.add(Record.sign(leave_body(FED, a.party_id, 1), [a]))
    rs.add(genesis(a, inc=0, at=0.5))
    assert rs.view().members[a.party_id].status == "left"


def test_link_flaps_follow_the_highest_version() -> None:
    a, b, _ = FOUNDERS
    rs = RecordSet(make_policy())
    rs.add(genesis(a))
    rs.add(genesis(b))
    rs.add(link("link_up", a, b, 1, [a, b]))
    assert rs.view().neighbours(a.party_id) == (b.party_id,)
    rs.add(link("link_down", a, b, 1, [a]))
    assert rs.view().neighbours(a.party_id) == ()
    rs.add(link("link_up", a, b, 2, [a, b]))
    assert rs.view().neighbours(b.party_id) == (a.party_id,)
    # A stale down (epoch 1) arriving again changes nothing; the epoch-2 down does.
    assert not rs.add(link("link_down", a, b, 1, [a]))
    rs.add(link("link_down", a, b, 2, [b]))
    info = rs.view().links[tuple(sorted([a.party_id, b.party_id]))]  # type: ignore[index]
    assert (info.state, info.epoch, info.live) == ("down", 2, False)


def test_link_dies_with_an_end_and_does_not_revive_on_rejoin() -> None:
    a, b, c = FOUNDERS
    rs = RecordSet(make_policy(quorum=1))
    for f in FOUNDERS:
        rs.add(genesis(f))
    rs.add(link("link_up", a, b, 1, [a, b]))
    rs.add(Record.sign(fail_body(FED, a.party_id, 0), [c]))
    assert rs.view().neighbours(b.party_id) == ()
    rs.add(genesis(a, inc=1, at=3.0))
    assert rs.view().neighbours(b.party_id) == ()  # the link named incarnation 0


def test_duplicate_body_is_one_record_whatever_its_signatures() -> None:
    a, b, c = FOUNDERS
    rs = RecordSet(make_policy(quorum=1))
    assert rs.add(Record.sign(fail_body(FED, a.party_id, 0), [b]))
    assert not rs.add(Record.sign(fail_body(FED, a.party_id, 0), [c]))
    assert len(rs) == 1


def test_watchers_top_up_sparse_graphs_in_ring_order() -> None:
    rs = RecordSet(make_policy(quorum=2))
    for f in FOUNDERS:
        rs.add(genesis(f))
    view = rs.view()
    ids = view.active()
    # No links: each party is watched by the next two in ring order.
    assert view.watchers(ids[0], 2) == (ids[1], ids[2])
    assert view.watchers(ids[2], 2) == (ids[0], ids[1])
    assert view.watchers(ids[1], 5) == (ids[0], ids[2])  # fewer members than the quorum


def test_signature_cache_verifies_once_and_still_refuses_bad() -> None:
    cache = SignatureCache()
    r = genesis(FOUNDERS[0])
    data = signing_bytes(r.body)
    sig = r.signatures[FOUNDERS[0].party_id]
    cache.verify(FOUNDERS[0].public_key, sig, data)
    cache.verify(FOUNDERS[0].public_key, sig, data)
    with pytest.raises(SignatureError):
        cache.verify(FOUNDERS[1].public_key, sig, data)
    with pytest.raises(SignatureError, match="64"):
        cache.verify(FOUNDERS[0].public_key, sig[:10], data)


def test_record_id_is_a_function_of_the_body_only() -> None:
    body = join_body(FED, FOUNDERS[0].party_id, 0, 1.0)
    assert record_id_of(body) == record_id_of(dict(reversed(list(body.items()))))
    assert record_id_of(body) != record_id_of({**body, "at": 2.0})


def _corpus() -> list[Record]:
    """A history with joins, a fail, a rejoin, a leave and link flaps."""
    a, b, c = FOUNDERS
    j0, j1, _ = JOINERS
    out = [genesis(f, at=float(i)) for i, f in enumerate(FOUNDERS)]
    out.append(Record.sign(join_body(FED, j0.party_id, 0, 4.0), [j0, a]))
    out.append(Record.sign(join_body(FED, j1.party_id, 0, 4.5), [j1, b]))
    out.append(link("link_up", a, b, 1, [a, b]))
    out.append(link("link_down", a, b, 1, [b]))
    out.append(link("link_up", a, b, 2, [a, b]))
    out.append(link("link_up", b, c, 1, [b, c]))
    out.append(Record.sign(fail_body(FED, c.party_id, 0), [a, b]))
    out.append(genesis(c, inc=1, at=9.0))
    out.append(Record.sign(leave_body(FED, j1.party_id, 0), [j1]))
    a_j0 = link_body("link_up", FED, (a.party_id, 0), (j0.party_id, 0), 1)
    out.append(Record.sign(a_j0, [a, j0]))
    return out


CORPUS = _corpus()


def _reference_digest() -> bytes:
    rs = RecordSet(make_policy())
    for r in sorted(CORPUS, key=lambda r: r.record_id):
        rs.add(r)
    return rs.view().digest


REFERENCE = _reference_digest()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), dups=st.integers(0, 20))
def test_view_is_independent_of_order_and_duplicates(seed: int, dups: int) -> None:
    rng = random.Random(seed)
    deliveries = list(CORPUS) + [rng.choice(CORPUS) for _ in range(dups)]
    rng.shuffle(deliveries)
    rs = RecordSet(make_policy())
    for r in deliveries:
        rs.add(r)
    # The frontier: the epoch-1 link flap and c's fail at incarnation 0 (c rejoined at 1) are
    # superseded; the other nine records are held.
    assert len(rs) == len(CORPUS) - 4 == 9
    assert rs.view().digest == REFERENCE
    assert rs.digest() == RecordSet_digest_of(CORPUS)


def RecordSet_digest_of(records: list[Record]) -> bytes:  # noqa: N802
    rs = RecordSet(make_policy())
    for r in records:
        rs.add(r)
    return rs.digest()


def test_reference_view_has_the_expected_shape() -> None:
    rs = RecordSet(make_policy())
    for r in CORPUS:
        rs.add(r)
    view = rs.view()
    a, b, c = (f.party_id for f in FOUNDERS)
    status = {pid: m.status for pid, m in view.members.items()}
    assert status[JOINERS[1].party_id] == "left"
    assert view.members[c].incarnation == 1 and status[c] == "active"
    assert view.neighbours(a) == tuple(sorted([b, JOINERS[0].party_id]))
    assert view.neighbours(c) == ()  # b-c named incarnation 0 of c
    assert len(view.digest) == 32


def test_different_record_sets_give_different_digests() -> None:
    full = RecordSet(make_policy())
    part = RecordSet(make_policy())
    for r in CORPUS:
        full.add(r)
    for r in CORPUS[:-1]:
        part.add(r)
    assert full.view().digest != part.view().digest
    assert full.digest() != part.digest()


# --- the incremental fold against a fold from scratch ------------------------------------------


def _fold_from_scratch(records: list[Record]) -> tuple[dict[str, tuple[str, int, float]], dict]:
    """The view's semantics, written independently of RecordSet: members and links."""
    members: dict[str, tuple[str, int, float]] = {}
    subjects = {r.body["subject"] for r in records if "subject" in r.body}
    for pid in subjects:
        mine = [r.body for r in records if r.body.get("subject") == pid]
        joins = [b for b in mine if b["kind"] == "join"]
        if not joins:
            continue
        inc = max(b["incarnation"] for b in joins)
        at = min(b["at"] for b in joins if b["incarnation"] == inc)
        # The highest end record (a leave over a fail of the same incarnation) ends the member
        # when it is of its incarnation or a later one.
        ends = [(b["incarnation"], b["kind"] == "leave") for b in mine if b["kind"] != "join"]
        end = max(ends, default=None)
        status = "active"
        if end is not None and end[0] >= inc:
            status = "left" if end[1] else "failed"
        members[pid] = (status, inc, at)
    links: dict[tuple[str, str], tuple[str, int, int, int, bool]] = {}
    keys = {(r.body["a"], r.body["b"]) for r in records if "a" in r.body}
    for key in keys:
        mine = [r.body for r in records if (r.body.get("a"), r.body.get("b")) == key]
        top = max((b["epoch"], b["inc_a"], b["inc_b"]) for b in mine)
        down = any(
            b["kind"] == "link_down" and (b["epoch"], b["inc_a"], b["inc_b"]) == top for b in mine
        )
        ma, mb = members.get(key[0]), members.get(key[1])
        live = (
            not down
            and ma is not None
            and mb is not None
            and ma[0] == "active" == mb[0]
            and (ma[1], mb[1]) == (top[1], top[2])
        )
        links[key] = ("down" if down else "up", *top, live)
    return members, links


def _history(rng: random.Random) -> list[Record]:
    """Random joins, leaves, fails, rejoins and link flaps over several incarnations."""
    parties = FOUNDERS + JOINERS
    inc = {p.party_id: 0 for p in parties}
    out = [genesis(f, at=float(i)) for i, f in enumerate(FOUNDERS)]
    for j in JOINERS:
        out.append(Record.sign(join_body(FED, j.party_id, 0, 3.0), [j, FOUNDERS[0]]))
    epoch: dict[tuple[str, str], int] = {}
    for step in range(25):
        x, y = rng.sample(parties, 2)
        roll = rng.random()
        if roll < 0.45:
            body = link_body(
                rng.choice(["link_up", "link_down"]),
                FED,
                (x.party_id, inc[x.party_id]),
                (y.party_id, inc[y.party_id]),
                epoch.setdefault(tuple(sorted((x.party_id, y.party_id))), rng.randint(1, 3)),
            )
            out.append(Record.sign(body, [x, y]))
        elif roll < 0.6 and x in JOINERS:
            out.append(Record.sign(leave_body(FED, x.party_id, inc[x.party_id]), [x]))
        elif roll < 0.75:
            voters = [p for p in parties if p is not x][:2]
            out.append(Record.sign(fail_body(FED, x.party_id, inc[x.party_id]), voters))
        else:
            inc[x.party_id] += 1
            sponsor = [FOUNDERS[0]] if x in JOINERS else []
            at = 10.0 + step + rng.choice([0.0, 0.5])
            out.append(Record.sign(join_body(FED, x.party_id, inc[x.party_id], at), [x, *sponsor]))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_the_incremental_fold_matches_a_fold_from_scratch_after_every_record(seed: int) -> None:
    # Reads (active, link, member, view) interleave with adds, so every lazily refolded entry
    # is checked at every step, whatever order the records arrive in.
    rng = random.Random(seed)
    records = _history(rng)
    rng.shuffle(records)
    rs = RecordSet(make_policy())
    held: list[Record] = []
    ids = sorted(p.party_id for p in FOUNDERS + JOINERS)
    for record in records:
        if rs.add(record):
            held.append(record)
        members, links = _fold_from_scratch(held)
        if rng.random() < 0.5:
            assert rs.active() == sorted(p for p, m in members.items() if m[0] == "active")
        a, b = sorted(rng.sample(ids, 2))
        got = rs.link(a, b)
        want = links.get((a, b))
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert (got.state, got.epoch, got.inc_a, got.inc_b, got.live) == want
        m = rs.member(a)
        assert ((m.status, m.incarnation, m.joined_at) if m is not None else None) == (
            members.get(a)
        )
        if rng.random() < 0.3:
            view = rs.view()
            assert {p: (v.status, v.incarnation, v.joined_at) for p, v in view.members.items()} == (
                members
            )
            assert {
                k: (v.state, v.epoch, v.inc_a, v.inc_b, v.live) for k, v in view.links.items()
            } == links
    fresh = RecordSet(make_policy())
    for record in sorted(held, key=lambda r: r.record_id):
        fresh.add(record)
    assert rs.view().digest == fresh.view().digest
