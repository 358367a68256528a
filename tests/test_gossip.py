"""Gossip between parties without the relay (:mod:`chaos_flwr.gossip`, sans-I/O): records a
relay withheld reach a party through a neighbour, silent daemons are voted failed at quorum,
and nothing a peer sends is held unless the charter signs it.

The daemons doing this over real links are tested in ``test_flower_gossip.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chaos_flwr import codec
from chaos_flwr.charter import load_charter
from chaos_flwr.defaults import GOSSIP_MAX_RECORDS
from chaos_flwr.errors import DecodeError, PolicyError, StoreError
from chaos_flwr.flower.gossipfile import GOSSIP_FILE, read_heard, write_heard
from chaos_flwr.flower.keys import charter_path, key_path, make_federation
from chaos_flwr.gossip import Gossip
from chaos_flwr.identity import Identity
from chaos_flwr.membership import FAILED, LEFT, Record, fail_body, signing_bytes
from chaos_flwr.peer import Peer
from chaos_flwr.transport.tls import LinkCredentials


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_federation(tmp_path_factory.mktemp("fed"), 3, founders=3, seed="gossip")


def _peers(fed: Path) -> list[Peer]:
    """Three founders that exchanged their genesis records and announced endpoints."""
    charter = load_charter(charter_path(fed))
    peers = [Peer(Identity.load(key_path(fed, i)), charter, incarnation=1) for i in range(3)]
    outs = [o for p in peers for o in p.bootstrap(1.0)]
    for p in peers:
        for o in outs:
            if o.to == p.party_id:
                p.handle(o.data, 1.0)
    for i, p in enumerate(peers):
        cert = LinkCredentials.create(p.identity, p.policy.federation).serve_cert_der
        for o in p.announce_endpoint(f"10.9.0.{i + 1}:9300", cert, 2.0):
            next(q for q in peers if q.party_id == o.to).handle(o.data, 2.0)
    assert all(len(p.view().active()) == 3 for p in peers)
    return peers


def _gossip(peer: Peer, **kw: Any) -> Gossip:
    g = Gossip(peer.party_id, peer.identity.sign, peer.policy, **kw)
    assert g.take(list(peer.records)) == len(peer.records)
    return g


def _exchange(asker: Gossip, answerer: Gossip, now: float) -> int:
    """One exchange over the wire's encoding, as the daemons make it."""
    req = codec.decode(codec.encode(asker.request()))
    reply = codec.decode(codec.encode(answerer.on_request(asker.party_id, req, now)))
    return asker.on_reply(answerer.party_id, reply, now)


def test_a_record_the_relay_withheld_reaches_a_party_through_a_neighbour(fed: Path) -> None:
    a, b, c = _peers(fed)
    leave = c.leave(3.0)
    for o in leave:  # the relay hands C's leave to A only
        if o.to == a.party_id:
            a.handle(o.data, 3.0)
    ga, gb = _gossip(a), _gossip(b)
    assert ga.view().members[c.party_id].status == LEFT
    assert gb.view().is_active(c.party_id)
    assert ga.records.digest() != gb.records.digest()
    assert _exchange(gb, ga, 4.0) == 1
    assert gb.view().members[c.party_id].status == LEFT
    assert gb.view().digest == ga.view().digest
    # converged: the next exchange carries no records at all
    assert "records" not in ga.on_request(b.party_id, gb.request(), 5.0)
    assert _exchange(gb, ga, 5.0) == 0


def test_an_asker_brings_its_own_endpoint_and_only_its_own(fed: Path) -> None:
    a, b, c = _peers(fed)
    ga, gc = _gossip(a), _gossip(c)
    ep_rec = next(r for r in gc.records if r.kind == "endpoint" and r.subject == c.party_id)
    ga.records = type(ga.records)(a.policy)  # A never got C's endpoint from the relay
    ga.take([r for r in a.records if r.record_id != ep_rec.record_id])
    assert ga.view().endpoint(c.party_id) is None
    with pytest.raises(PolicyError, match="own endpoint"):
        ga.on_request(b.party_id, gc.request(), 3.0)  # B cannot pass C's endpoint off
    assert ga.view().endpoint(c.party_id) is None
    ga.on_request(c.party_id, gc.request(), 3.0)
    ep = ga.view().endpoint(c.party_id)
    assert ep is not None and ep.address == "10.9.0.3:9300"
    assert c.party_id in [p for p, _ in ga.targets() + ga.targets()]


def test_targets_are_members_with_endpoints_in_turn(fed: Path) -> None:
    a, b, c = _peers(fed)
    g = _gossip(a, fanout=1)
    seen = [g.targets()[0][0] for _ in range(4)]
    assert seen == [b.party_id, c.party_id, b.party_id, c.party_id] or seen == [
        c.party_id, b.party_id, c.party_id, b.party_id]  # fmt: skip
    assert {ep.address for _, ep in _gossip(a).targets()} == {"10.9.0.2:9300", "10.9.0.3:9300"}
    outsider = Gossip(a.party_id, a.identity.sign, a.policy)  # holds no view: not a member
    assert outsider.targets() == []


def test_a_silent_daemon_is_voted_failed_at_quorum_and_the_record_spreads(fed: Path) -> None:
    a, b, c = _peers(fed)
    ga, gb = _gossip(a, suspect_after_s=30.0), _gossip(b, suspect_after_s=30.0)
    ga.on_request(c.party_id, {"gossip": b""}, 10.0)  # C's daemon was heard by A ...
    for _ in range(3):
        ga.missed(c.party_id)  # ... then three asks in a row got no answer
    assert ga.tick(39.0) == 0  # not suspected within the silence allowed
    gb.missed(c.party_id)
    assert gb.tick(100.0) == 0  # B never heard C's daemon: it never suspects it
    assert ga.tick(41.0) == 1 and ga.suspects() == [c.party_id]
    assert ga.view().is_active(c.party_id)  # one vote is below the quorum of 2
    gb.on_request(c.party_id, {"gossip": b""}, 10.0)
    gb.missed(c.party_id)
    gb.missed(c.party_id)
    assert gb.tick(41.0) == 0  # silent, but only two asks missed: a slow peer is not a dead one
    gb.missed(c.party_id)
    assert gb.tick(41.0) == 1
    # B's vote reaches A by gossip: A holds the quorum and the fail record
    assert _exchange(ga, gb, 42.0) >= 1
    assert ga.view().members[c.party_id].status == FAILED
    fail = next(r for r in ga.records if r.kind == "fail")
    assert set(fail.signatures) == {a.party_id, b.party_id}
    # ... and every other party takes the record as any other
    gb2 = _gossip(b)
    assert _exchange(gb2, ga, 43.0) >= 1 and gb2.view().members[c.party_id].status == FAILED
    # the incarnation is over: no vote is kept or cast on it any more
    assert ga.tick(50.0) == 0 and ga.suspects() == []


def test_forged_and_malformed_votes_and_records_are_refused(fed: Path) -> None:
    a, b, c = _peers(fed)
    ga = _gossip(a)
    body = fail_body(a.policy.federation, c.party_id, c.incarnation)
    good = b.identity.sign(signing_bytes(body))
    votes = [
        {"body": body, "signer": b.party_id, "sig": bytes(64)},  # does not verify
        {"body": body, "signer": c.party_id, "sig": c.identity.sign(signing_bytes(body))},  # own
        {"body": body, "signer": "nobody", "sig": good},  # not a charter party
        {"body": {**body, "kind": "leave"}, "signer": b.party_id, "sig": good},  # not a fail
        {"body": body, "signer": b.party_id},  # malformed
    ]
    forged = Record(body=body, signatures={b.party_id: good, "x": bytes(64)})
    reply = {"digest": b"d", "votes": votes, "records": [forged.to_wire(), {"no": 1}]}
    assert ga.on_reply(b.party_id, reply, 5.0) == 0
    assert ga.view().is_active(c.party_id) and ga.suspects() == []
    assert sum(ga.refused.values()) == 7, ga.refused
    assert {"SignatureError", "UnknownPartyError", "PolicyError", "DecodeError"} <= set(ga.refused)
    with pytest.raises(DecodeError, match="records"):
        ga.on_reply(b.party_id, {"digest": b"", "records": [{}] * (GOSSIP_MAX_RECORDS + 1)}, 5.0)
    with pytest.raises(DecodeError):
        ga.on_reply(b.party_id, {"digest": "not bytes"}, 6.0)
    with pytest.raises(DecodeError):
        ga.on_request(b.party_id, {"gossip": 3}, 6.0)
    assert ga.heard(b.party_id) == 5.0  # only well-formed exchanges count as heard
    # a record or vote whose kind is not even a string is a typed refusal, not a crash
    odd = {"body": {**body, "kind": ["fail"]}, "sigs": {b.party_id: good}}
    vote = {"body": {**body, "kind": {}}, "signer": b.party_id, "sig": good}
    before = sum(ga.refused.values())
    assert ga.on_reply(b.party_id, {"digest": b"", "records": [odd], "votes": [vote]}, 6.0) == 0
    assert sum(ga.refused.values()) == before + 2
    with pytest.raises(DecodeError):
        ga.on_request(c.party_id, {"gossip": b"", "endpoint": odd}, 6.0)


def test_the_gossip_file_round_trips_and_refuses_what_is_not_one(fed: Path, tmp_path: Path) -> None:
    a, _, _ = _peers(fed)
    records = list(a.records)
    write_heard(tmp_path, records)
    assert [r.record_id for r in read_heard(tmp_path)] == [r.record_id for r in records]
    assert read_heard(tmp_path / "absent") == []
    (tmp_path / GOSSIP_FILE).write_bytes(codec.encode({"version": 9, "records": []}))
    with pytest.raises(StoreError, match="version-1"):
        read_heard(tmp_path)
    (tmp_path / GOSSIP_FILE).write_bytes(b"\xff" * 10)
    with pytest.raises(StoreError):
        read_heard(tmp_path)


def test_votes_are_current_suspicions_not_history(fed: Path) -> None:
    # a vote not renewed within the suspicion time is dropped, and hearing the suspect drops
    # every vote about it: two short silences weeks apart never add up to a fail record
    a, b, c = _peers(fed)
    ga, gb = _gossip(a, suspect_after_s=30.0), _gossip(b, suspect_after_s=30.0)
    body = fail_body(a.policy.federation, c.party_id, c.incarnation)
    vote_b = {"body": body, "signer": b.party_id, "sig": b.identity.sign(signing_bytes(body))}
    assert ga.on_reply(b.party_id, {"digest": b"", "votes": [vote_b]}, 0.0) == 0
    assert ga.suspects() == [c.party_id]
    ga.tick(31.0)  # B's vote was not renewed: gone
    assert ga.suspects() == []
    assert ga.on_reply(b.party_id, {"digest": b"", "votes": [vote_b]}, 100.0) == 0
    ga.on_request(c.party_id, {"gossip": b""}, 101.0)  # C answers A: alive
    assert ga.suspects() == []
    # A's own vote goes too once it hears C again, and a new incarnation is heard afresh
    for _ in range(3):
        ga.missed(c.party_id)
    assert ga.tick(140.0) == 1 and ga.suspects() == [c.party_id]
    ga.on_request(c.party_id, {"gossip": b""}, 141.0)
    assert ga.suspects() == [] and ga.tick(150.0) == 0
    # a copy of B's vote that another party passes on does not renew it: only B does
    assert ga.on_reply(b.party_id, {"digest": b"", "votes": [vote_b]}, 200.0) == 0
    assert ga.on_reply("p-another", {"digest": b"", "votes": [vote_b]}, 220.0) == 0
    assert ga.suspects() == [c.party_id]
    ga.tick(231.0)
    assert ga.suspects() == []  # 31 s after B itself last sent it
    # a vote signed by a charter party that is not an active member is refused
    d_body = {**body}
    assert gb.on_reply(a.party_id, {"digest": b"", "votes": [
        {"body": d_body, "signer": "nobody-active", "sig": bytes(64)}]}, 1.0) == 0  # fmt: skip
    assert "UnknownPartyError" in gb.refused
