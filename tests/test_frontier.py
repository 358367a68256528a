"""Compaction: a record set holds only its frontier, and the frontier keeps the view.

The reference semantics is ``_fold_from_scratch`` of ``test_membership`` (written independently
of :class:`RecordSet`); the reference frontier is the pairwise definition over every record
received: the records no other received record supersedes.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_membership import (
    FED,
    FOUNDERS,
    JOINERS,
    _fold_from_scratch,
    _history,
    genesis,
    link,
    make_policy,
)
from test_peer import F, J, charter, cluster

from chaos_flwr import membership as ms
from chaos_flwr.defaults import MEMBERSHIP_MAX_COUNTER
from chaos_flwr.errors import DecodeError, PolicyError, UnknownPartyError
from chaos_flwr.membership import Record, RecordSet, SignatureCache, supersedes
from chaos_flwr.wire import open_sealed, seal

PARTIES = len(FOUNDERS + JOINERS)
#: At most a join and an end per charter party and one record per link.
BOUND = 2 * PARTIES + PARTIES * (PARTIES - 1) // 2


def frontier_ids(records: list[Record]) -> set[str]:
    """The reference frontier: ids of the records no other record of the list supersedes."""
    return {
        r.record_id
        for r in records
        if not any(supersedes(o.body, r.body) for o in records if o.record_id != r.record_id)
    }


def fold(records: list[Record], cache: SignatureCache) -> RecordSet:
    rs = RecordSet(make_policy(), cache)
    for r in records:
        rs.add(r)
    return rs


def view_of(rs: RecordSet) -> tuple[dict, dict]:
    view = rs.view()
    members = {p: (m.status, m.incarnation, m.joined_at) for p, m in view.members.items()}
    links = {k: (v.state, v.epoch, v.inc_a, v.inc_b, v.live) for k, v in view.links.items()}
    return members, links


def anti_entropy(a: RecordSet, b: RecordSet) -> None:
    """One inventory exchange: each side sends the records the other's inventory lacks."""
    give_b = [r for rid in sorted(a.ids() - b.ids()) if (r := a.get(rid)) is not None]
    give_a = [r for rid in sorted(b.ids() - a.ids()) if (r := b.get(rid)) is not None]
    for r in give_b:
        b.add(r)
    for r in give_a:
        a.add(r)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1), parts=st.integers(2, 4))
def test_partitions_merged_by_anti_entropy_reach_the_frontier_of_everything(
    seed: int, parts: int
) -> None:
    rng = random.Random(seed)
    records = _history(rng)
    cache = SignatureCache()
    everything = frontier_ids(records)
    # The frontier keeps the view: the independent fold agrees on both.
    frontier = [r for r in records if r.record_id in everything]
    assert _fold_from_scratch(frontier) == _fold_from_scratch(records)
    # Each partition receives a random part of the records (some twice), in a random order.
    sides: list[list[Record]] = [[] for _ in range(parts)]
    for r in records:
        for side in rng.sample(sides, rng.randint(1, parts)):
            side.append(r)
    sets = []
    for side in sides:
        rng.shuffle(side)
        rs = fold(side, cache)
        assert rs.ids() == frontier_ids(side)
        assert len(rs) <= BOUND
        sets.append(rs)
    # Merge by pairwise anti-entropy in a random order until every pair has met.
    pairs = list(itertools.combinations(range(parts), 2))
    rng.shuffle(pairs)
    for i, j in pairs + pairs:
        anti_entropy(sets[i], sets[j])
    reference = fold(sorted(records, key=lambda r: r.record_id), cache)
    for rs in sets:
        assert rs.ids() == everything == reference.ids()
        assert rs.digest() == reference.digest()
        assert rs.view().digest == reference.view().digest
        assert view_of(rs) == _fold_from_scratch(records)
        assert len(rs) <= BOUND


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_supersedes_is_a_strict_partial_order(seed: int) -> None:
    bodies = [r.body for r in _history(random.Random(seed))]
    for x in bodies:
        assert not supersedes(x, x)
    for x, y in itertools.permutations(bodies, 2):
        if supersedes(x, y):
            assert not supersedes(y, x)
            assert all(supersedes(x, z) for z in bodies if supersedes(y, z))


def test_an_old_fail_arriving_after_a_rejoin_is_not_held() -> None:
    a, b, c = FOUNDERS
    rs = RecordSet(make_policy(quorum=2))
    for f in FOUNDERS:
        rs.add(genesis(f))
    first = genesis(a)
    rs.add(genesis(a, inc=1, at=7.0))
    assert first.record_id not in rs  # the rejoin superseded the first join
    before = (rs.ids(), rs.digest(), rs.view().digest)
    old_fail = Record.sign(ms.fail_body(FED, a.party_id, 0), [b, c])
    assert rs.superseded(old_fail)
    assert not rs.add(old_fail)
    assert old_fail.record_id not in rs and rs.get(old_fail.record_id) is None
    assert (rs.ids(), rs.digest(), rs.view().digest) == before
    assert rs.member(a.party_id).status == "active"  # type: ignore[union-attr]


def test_a_superseded_record_costs_no_signature_check() -> None:
    a, b, _ = FOUNDERS
    cache = SignatureCache()
    rs = RecordSet(make_policy(), cache)
    rs.add(genesis(a))
    rs.add(genesis(b))
    rs.add(link("link_down", a, b, 5, [a]))
    checks = cache.checks
    stale = link("link_down", a, b, 4, [a])
    forged = Record(body=stale.body, signatures={a.party_id: b"\x00" * 64})
    assert not rs.add(forged)  # not even its (bad) signature is looked at
    assert cache.checks == checks


def test_a_link_flap_storm_keeps_one_record_per_link() -> None:
    a, b, _ = FOUNDERS
    rs = RecordSet(make_policy())
    rs.add(genesis(a))
    rs.add(genesis(b))
    for epoch in range(1, 41):
        assert rs.add(link("link_up", a, b, epoch, [a, b]))
        assert rs.add(link("link_down", a, b, epoch, [b]))
        assert len(rs) == 3
    assert not rs.add(link("link_up", a, b, 40, [a, b]))  # the down of its version is held
    info = rs.link(a.party_id, b.party_id)
    assert info is not None and (info.state, info.epoch) == ("down", 40)


def test_a_leave_that_overtakes_its_join_ends_the_member_until_the_join_arrives() -> None:
    a = FOUNDERS[0]
    rs = RecordSet(make_policy())
    rs.add(genesis(a))
    leave1 = Record.sign(ms.leave_body(FED, a.party_id, 1), [a])
    assert rs.add(leave1)
    m = rs.member(a.party_id)
    assert m is not None and (m.status, m.incarnation) == ("left", 0)
    assert rs.ended_at(a.party_id) == 1
    assert len(rs) == 2  # the join of incarnation 0 and the leave of 1
    # A leave of an older incarnation is superseded by the newer end.
    assert not rs.add(Record.sign(ms.leave_body(FED, a.party_id, 0), [a]))
    # The join it overtook arrives: same status, now at incarnation 1; a fail of 1 is
    # superseded by the leave of 1 (a leave over a fail of the same incarnation).
    rs.add(genesis(a, inc=1, at=2.0))
    m = rs.member(a.party_id)
    assert m is not None and (m.status, m.incarnation) == ("left", 1)
    b, c = FOUNDERS[1:]
    assert not rs.add(Record.sign(ms.fail_body(FED, a.party_id, 1), [b, c]))
    # A rejoin above the end makes it active again and drops the end record.
    rs.add(genesis(a, inc=2, at=3.0))
    assert rs.member(a.party_id).status == "active"  # type: ignore[union-attr]
    assert len(rs) == 1


def test_the_least_join_time_of_the_top_incarnation_is_held() -> None:
    a = FOUNDERS[0]
    rs = RecordSet(make_policy())
    late, early = genesis(a, inc=3, at=9.0), genesis(a, inc=3, at=4.0)
    rs.add(late)
    assert rs.add(early)
    assert rs.ids() == {early.record_id}
    assert not rs.add(late)
    assert rs.member(a.party_id).joined_at == 4.0  # type: ignore[union-attr]


@pytest.mark.parametrize("field", ["incarnation", "epoch", "inc_a", "inc_b"])
def test_counters_above_the_maximum_are_refused_on_input(field: str) -> None:
    a, b, _ = FOUNDERS
    if field == "incarnation":
        body = ms.join_body(FED, a.party_id, 0, 1.0)
    else:
        body = ms.link_body("link_down", FED, (a.party_id, 0), (b.party_id, 0), 1)
    Record.from_wire({"body": {**body, field: MEMBERSHIP_MAX_COUNTER}, "sigs": {"x": b"s"}})
    with pytest.raises(DecodeError, match="largest counter"):
        Record.from_wire({"body": {**body, field: MEMBERSHIP_MAX_COUNTER + 1}, "sigs": {"x": b"s"}})


def test_peers_hold_and_inventory_the_frontier_only() -> None:
    net, _ = cluster(joiners=2)
    a, b = F[0].party_id, F[1].party_id
    for _ in range(15):
        net.act(a, net.peers[a].connect(b, net.now))
        net.act(b, net.peers[b].disconnect(a, net.now))
        net.tick()
    peers = net.live()
    assert len({p.records.digest() for p in peers}) == 1
    assert len({p.view().digest for p in peers}) == 1
    for p in peers:
        assert len(p.records) == 6  # five joins and the one a-b link record
        assert p.refused_by == {}
    # A restarted party loads the frontier and reaches the same view.
    again = type(peers[0])(F[2], peers[0].charter, incarnation=5)
    assert again.load_records([r.to_wire() for r in peers[0].records], net.now) == 6
    assert again.view().digest == peers[0].view().digest


def test_covers_tells_held_and_superseded_bodies_from_new_ones() -> None:
    a, b, _ = FOUNDERS
    rs = RecordSet(make_policy())
    rs.add(genesis(a))
    top = link("link_up", a, b, 3, [a, b])
    rs.add(top)
    assert rs.covers(top.body)  # held
    assert rs.covers(link("link_down", a, b, 2, [a]).body)  # superseded
    assert not rs.covers(link("link_down", a, b, 3, [a]).body)  # would supersede the held one
    assert not rs.covers(genesis(b).body)  # about a party with nothing held


def test_applied_keeps_a_bounded_window(monkeypatch: pytest.MonkeyPatch) -> None:
    import chaos_flwr.peer_core as peer_core

    monkeypatch.setattr(peer_core, "PEER_APPLIED_WINDOW", 5)
    net, _ = cluster()
    a, b = F[0].party_id, F[1].party_id
    for _ in range(6):
        net.act(a, net.peers[a].connect(b, net.now))
        net.act(b, net.peers[b].disconnect(a, net.now))
    for p in net.live():
        assert len(p.applied) == 5
        assert [c.kind for c in p.applied][-2:] == ["link_up", "link_down"]


def test_a_party_rejoins_above_an_end_record_that_overtook_its_join() -> None:
    net, _ = cluster()
    p = net.peers[F[0].party_id]
    ahead = Record.sign(ms.leave_body(p.policy.federation, p.party_id, 3), [F[0]])
    assert p.load_records([ahead.to_wire()], net.now) == 1
    m = p.records.member(p.party_id)
    assert m is not None and (m.status, m.incarnation) == ("left", 0)
    net.act(p.party_id, p.bootstrap(net.now))
    assert p.incarnation == 4 and p.is_member
    assert {q.view().members[p.party_id].incarnation for q in net.live()} == {4}


def test_records_naming_parties_outside_the_charter_are_refused() -> None:
    # Else one party could sign link_downs (or, with a quorum of one, fails) to new names
    # without end, and the frontier would have no bound.
    a, b, _ = FOUNDERS
    policy = make_policy(quorum=1)
    ghost = "p" + "0" * 16
    down = ms.link_body("link_down", FED, (a.party_id, 0), (ghost, 0), 1)
    with pytest.raises(UnknownPartyError, match="not a party of the charter"):
        ms.validate_record(Record.sign(down, [a]), policy)
    with pytest.raises(UnknownPartyError, match="not a party of the charter"):
        ms.validate_record(Record.sign(ms.fail_body(FED, ghost, 0), [b]), policy)
    ms.validate_record(Record.sign(ms.fail_body(FED, a.party_id, 0), [b]), policy)


def test_a_link_request_overtaken_by_its_link_down_is_not_sent_again() -> None:
    # The countersigned link_up never reaches the initiator before the link_down of the same
    # version: it is superseded there, never held, and the pending request must still end.
    net, _ = cluster()
    a, b = net.peers[F[0].party_id], net.peers[F[1].party_id]
    (req,) = a.connect(b.party_id, net.now)
    ups = b.handle(req.data, net.now)
    downs = b.disconnect(a.party_id, net.now)
    to_a = [o for o in downs if o.to == a.party_id] + [o for o in ups if o.to == a.party_id]
    for o in to_a:
        a.handle(o.data, net.now)
    info = a.records.link(a.party_id, b.party_id)
    assert info is not None and (info.state, info.epoch) == ("down", 1)
    later = a.tick(net.now + 5.0)
    keys = {a.party_id: a.identity.public_key}
    assert "link_req" not in {open_sealed(o.data, keys).kind for o in later}
    assert a._links == {}


def test_a_link_request_is_countersigned_only_for_the_next_epoch() -> None:
    # A jump (a flooder asking for link_ups at ever higher epochs, each spending the honest
    # end's record budget) is refused; the next epoch is countersigned as before.
    net, _ = cluster()
    a, b = net.peers[F[0].party_id], net.peers[F[1].party_id]
    held = b.records.link(a.party_id, b.party_id)
    nxt = (held.epoch if held is not None else 0) + 1
    for epoch, ok in ((nxt + 5, False), (nxt, True)):
        body = ms.link_body(
            "link_up",
            a.policy.federation,
            (a.party_id, a.incarnation),
            (b.party_id, b.incarnation),
            epoch,
        )
        data = seal(
            F[0],
            incarnation=a.incarnation,
            seq=10**6 + epoch,
            timestamp=net.now,
            kind="link_req",
            payload={"body": body, "sig": F[0].sign(ms.signing_bytes(body))},
            to=b.party_id,
            federation=a.federation_tag,
        )
        before = len(b.rejections)
        out = b.handle(data, net.now)
        info = b.records.link(a.party_id, b.party_id)
        if ok:
            assert out and info is not None and (info.epoch, info.state) == (nxt, "up")
        else:
            assert out == [] and len(b.rejections) == before + 1
            assert isinstance(b.rejections[-1].error, PolicyError)
            assert "countersigns only epoch" in str(b.rejections[-1].error)
            assert b.records.link(a.party_id, b.party_id) == held


def test_the_server_view_settles_an_event_whose_record_was_superseded_on_the_way() -> None:
    # A link_up overtaken by the link_down of its version: parties that got only the down hold
    # the up's effect too, so the up's event settles (it used to wait for ever).
    from chaos_flwr.flower.server.view import ServerView

    ch = charter(F, J)
    view = ServerView(ch, clock=lambda: 0.0)
    fed = ch.federation
    seqs = itertools.count(1)

    def sent_by(who: Any, record: Record) -> bytes:
        data = seal(
            who,
            incarnation=0,
            seq=next(seqs),
            timestamp=0.0,
            kind="rec",
            payload={"records": [record.to_wire()]},
            federation=b"",
        )
        view.sent(data, server_round=1)
        return data

    a, b, c = F[0], F[1], F[2]
    for who in (a, b, c):
        sent_by(who, Record.sign(ms.join_body(fed, who.party_id, 0, 1.0), [who]))
    everyone = {a.party_id, b.party_id, c.party_id}
    view.settle(everyone)
    up = Record.sign(ms.link_body("link_up", fed, (a.party_id, 0), (b.party_id, 0), 1), [a, b])
    down = Record.sign(ms.link_body("link_down", fed, (a.party_id, 0), (b.party_id, 0), 1), [b])
    sent_by(a, up)
    d_env = sent_by(b, down)
    for party in (a.party_id, c.party_id):  # c never receives the up: the down overtook it
        view.delivered(party, [d_env])
    view.settle(everyone)
    by_kind = {e.kind: e for e in view.events}
    assert by_kind["link_down"].settle_s is not None
    assert by_kind["link_up"].settle_s is not None
    assert up.record_id not in view.records and down.record_id in view.records
    # a flood of ever higher link records: each party keeps one applied body per link, and a
    # node claiming an id outside the charter is not tracked
    for epoch in range(2, 202):
        flood = ms.link_body("link_down", fed, (a.party_id, 0), (b.party_id, 0), epoch)
        d_env = sent_by(b, Record.sign(flood, [b]))
        view.delivered(c.party_id, [d_env])
        view.delivered("p" + f"{epoch:016x}", [d_env])
    link = (min(a.party_id, b.party_id), max(a.party_id, b.party_id))
    assert len(view._seen[(c.party_id, link)]) == 1
    assert all(party in {a.party_id, b.party_id, c.party_id} for party, _ in view._seen)
    # a superseded record sent again is screened without a signature check
    checks = view.cache.checks
    sent_by(c, up)
    assert view.cache.checks == checks + 1  # the envelope's own signature only
