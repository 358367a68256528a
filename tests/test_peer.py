"""The protocol peer: every negotiation flow, concurrent events, faults and bad input.

Peers are driven by a small synchronous router (``Net``) that delivers envelopes in FIFO order,
can crash parties, cut links between parties and drop or duplicate traffic.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos_flwr.charter import Charter
from chaos_flwr.errors import (
    CharterError,
    DecodeError,
    FederationMismatchError,
    OversizeError,
    PolicyError,
    ReplayError,
    SignatureError,
    StaleIncarnationError,
    UnknownPartyError,
)
from chaos_flwr.identity import Identity
from chaos_flwr.membership import link_body, signing_bytes
from chaos_flwr.monitor import Resources
from chaos_flwr.peer import AppliedChange, Outgoing, Peer
from chaos_flwr.wire import seal

FED = "fed-peer-test"
HB = 1.0
SUSPECT = 3.0


def ident(name: str) -> Identity:
    return Identity.from_seed(name.encode() * 2, name=name)


def charter(
    founders: list[Identity],
    allow: list[Identity],
    *,
    sponsors: int = 1,
    quorum: int = 2,
    federation: str = FED,
) -> Charter:
    """A charter signed by all its founders."""
    return Charter.create(
        federation,
        founders,
        allow,
        sponsors_required=sponsors,
        failure_quorum=quorum,
        heartbeat_interval_s=HB,
        suspicion_timeout_s=SUSPECT,
    )


class Net:
    """Synchronous FIFO router between peers, with crash / cut / drop / duplicate faults."""

    def __init__(self, peers: Iterable[Peer], seed: int = 0) -> None:
        self.peers: dict[str, Peer] = {p.party_id: p for p in peers}
        self.queue: deque[tuple[str, Outgoing]] = deque()
        self.crashed: set[str] = set()
        self.cut: set[frozenset[str]] = set()
        self.drop = 0.0
        self.dup = 0.0
        self.reorder = False
        self.rng = random.Random(seed)
        self.now = 0.0
        self.delivered = 0

    def add(self, peer: Peer) -> None:
        self.peers[peer.party_id] = peer

    def send(self, src: str, outs: Iterable[Outgoing]) -> None:
        for out in outs:
            self.queue.append((src, out))

    def run(self, limit: int = 200_000) -> None:
        while self.queue:
            limit -= 1
            assert limit > 0, "message storm"
            if self.reorder:
                self.queue.rotate(-self.rng.randrange(len(self.queue)))
            src, out = self.queue.popleft()
            if out.to in self.crashed or src in self.crashed or out.to not in self.peers:
                continue
            if frozenset((src, out.to)) in self.cut:
                continue
            if self.drop and self.rng.random() < self.drop:
                continue
            copies = 2 if self.dup and self.rng.random() < self.dup else 1
            for _ in range(copies):
                self.delivered += 1
                self.send(out.to, self.peers[out.to].handle(out.data, self.now))

    def act(self, pid: str, outs: Iterable[Outgoing]) -> None:
        self.send(pid, outs)
        self.run()

    def tick(self, dt: float = 0.5, rounds: int = 1) -> None:
        for _ in range(rounds):
            self.now += dt
            for pid, peer in sorted(self.peers.items()):
                if pid not in self.crashed:
                    self.send(pid, peer.tick(self.now))
            self.run()

    def partition(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        for a in side_a:
            for b in side_b:
                self.cut.add(frozenset((a, b)))

    def heal(self) -> None:
        self.cut.clear()

    def live(self) -> list[Peer]:
        return [p for pid, p in sorted(self.peers.items()) if pid not in self.crashed]

    def digests(self) -> set[bytes]:
        """View digests of the live parties that are active members (a departed party stops
        following the federation, so its view may lag)."""
        return {p.view().digest for p in self.live() if p.is_member}


F = [ident(f"founder{i}") for i in range(3)]
J = [ident(f"joiner{i}") for i in range(6)]


def cluster(
    *, founders: int = 3, sponsors: int = 1, quorum: int = 2, joiners: int = 0
) -> tuple[Net, Any]:
    ch = charter(F[:founders], J, sponsors=sponsors, quorum=quorum)
    net = Net([Peer(f, ch) for f in F[:founders]])
    for f in F[:founders]:
        net.act(f.party_id, net.peers[f.party_id].bootstrap(net.now))
    for j in J[:joiners]:
        p = Peer(j, ch)
        net.add(p)
        sponsors_ids = [f.party_id for f in F[: max(sponsors, 1)]]
        net.act(j.party_id, p.request_join(net.now, sponsors_ids))
    return net, ch


def statuses(peer: Peer) -> dict[str, str]:
    return {pid: m.status for pid, m in peer.view().members.items()}


# --- flows ---------------------------------------------------------------------------------


def test_founders_bootstrap_to_one_view() -> None:
    net, _ = cluster()
    assert len(net.digests()) == 1
    view = net.peers[F[0].party_id].view()
    assert view.active() == sorted(f.party_id for f in F)
    assert all(p.rejections == [] for p in net.live())


def test_unsigned_charter_is_refused() -> None:
    unsigned = Charter.create(FED, F[:2], J, sign=False)
    with pytest.raises(CharterError, match="not signed"):
        Peer(F[0], unsigned)


def test_non_founder_cannot_bootstrap() -> None:
    _, ch = cluster()
    with pytest.raises(PolicyError, match="not a founder"):
        Peer(J[0], ch).bootstrap(0.0)


def test_scale_out_with_one_sponsor_reaches_everyone() -> None:
    net, _ = cluster(joiners=1)
    j = J[0].party_id
    assert len(net.digests()) == 1
    for p in net.live():
        assert statuses(p)[j] == "active"
        assert [c.kind for c in p.applied if c.subject == j] == ["join"]
    assert net.peers[j].is_member


def test_scale_out_with_two_sponsors_uses_join_sig_and_join_done() -> None:
    net, _ = cluster(sponsors=2, joiners=1)
    j = J[0].party_id
    assert len(net.digests()) == 1
    assert all(statuses(p)[j] == "active" for p in net.live())
    rec = next(r for r in net.peers[F[2].party_id].records if r.subject == j)
    assert set(rec.signatures) == {j, F[0].party_id, F[1].party_id}


def test_join_needs_enough_sponsors_and_waits() -> None:
    net, ch = cluster(sponsors=2)
    p = Peer(J[0], ch)
    net.add(p)
    net.act(p.party_id, p.request_join(net.now, [F[0].party_id]))  # only one of two
    assert not p.is_member
    assert all(J[0].party_id not in p2.view().members for p2 in net.live() if p2 is not p)


def test_lost_join_done_is_sent_again() -> None:
    net, ch = cluster(sponsors=2)
    p = Peer(J[0], ch)
    net.add(p)
    sigs = []
    for out in p.request_join(net.now, [F[0].party_id, F[1].party_id]):
        sigs.extend(net.peers[out.to].handle(out.data, net.now))
    done = [o for s in sigs for o in p.handle(s.data, net.now)]
    assert p.is_member and {o.to for o in done} == {F[0].party_id, F[1].party_id}
    # The join_done envelopes are lost; nobody else knows the joiner yet.
    assert all(p.party_id not in net.peers[f.party_id].view().members for f in F)
    net.send(p.party_id, p.tick(net.now + 1.5))  # retry interval passed
    net.run()
    assert all(statuses(net.peers[f.party_id])[p.party_id] == "active" for f in F)
    p.tick(net.now + 1.6)
    assert p._joins == {}  # the sponsors' sync ended the retries


def test_two_joins_at_once() -> None:
    net, ch = cluster()
    a, b = Peer(J[0], ch), Peer(J[1], ch)
    net.add(a)
    net.add(b)
    net.send(a.party_id, a.request_join(net.now, [F[0].party_id]))
    net.send(b.party_id, b.request_join(net.now, [F[1].party_id]))
    net.run()
    net.tick(rounds=4)
    assert len(net.digests()) == 1
    assert all(statuses(p)[a.party_id] == statuses(p)[b.party_id] == "active" for p in net.live())


def test_scale_in() -> None:
    net, _ = cluster(joiners=1)
    j = J[0].party_id
    net.act(j, net.peers[j].leave(net.now))
    assert len(net.digests()) == 1
    assert all(statuses(p)[j] == "left" for p in net.live())
    assert not net.peers[j].is_member
    assert net.peers[j].tick(net.now + 10.0) == []  # a departed party stays silent
    with pytest.raises(PolicyError, match="not an active member"):
        net.peers[j].leave(net.now)


def test_leave_during_a_join() -> None:
    """A sponsor leaves while the join it signed is in flight: both events settle."""
    net, ch = cluster(sponsors=2)
    p = Peer(J[0], ch)
    net.add(p)
    sponsor_a, sponsor_b = F[0].party_id, F[1].party_id
    net.send(p.party_id, p.request_join(net.now, [sponsor_a, sponsor_b]))
    # Deliver the join requests, then the sponsor leaves before the joiner completes.
    for _ in range(2):
        _src, out = net.queue.popleft()
        net.send(out.to, net.peers[out.to].handle(out.data, net.now))
    net.send(sponsor_a, net.peers[sponsor_a].leave(net.now))
    net.run()
    net.tick(rounds=4)
    assert len(net.digests()) == 1
    st = statuses(net.peers[F[2].party_id])
    assert st[sponsor_a] == "left"
    assert st[p.party_id] == "active"


def test_connect_and_disconnect_links() -> None:
    net, _ = cluster()
    a, b, c = (f.party_id for f in F)
    net.act(a, net.peers[a].connect(b, net.now))
    assert all(p.view().neighbours(a) == (b,) for p in net.live())
    net.act(c, net.peers[c].connect(a, net.now))
    assert net.peers[b].view().neighbours(a) == tuple(sorted([b, c]))
    net.act(b, net.peers[b].disconnect(a, net.now))
    assert all(p.view().neighbours(a) == (c,) for p in net.live())
    net.act(a, net.peers[a].connect(b, net.now))  # reconnect: epoch 2
    link = net.peers[c].records.link(a, b)
    assert link is not None and link.epoch == 2 and link.live
    kinds = [ch.kind for ch in net.peers[c].applied if ch.subject == "|".join(sorted([a, b]))]
    assert kinds == ["link_up", "link_down", "link_up"]
    with pytest.raises(PolicyError, match="no up link"):
        net.peers[c].disconnect(b, net.now)
    with pytest.raises(PolicyError, match="itself"):
        net.peers[c].connect(c, net.now)


def test_link_request_can_be_refused_by_policy() -> None:
    _, ch = cluster()
    peers = [Peer(f, ch, accept_link=lambda other: False) for f in F]
    net = Net(peers)
    for p in peers:
        net.act(p.party_id, p.bootstrap(0.0))
    a, b = F[0].party_id, F[1].party_id
    net.act(a, net.peers[a].connect(b, 0.0))
    assert net.peers[a].view().neighbours(a) == ()
    assert isinstance(net.peers[b].rejections[-1].error, PolicyError)


def _ring_links(net: Net) -> None:
    ids = sorted(net.peers)
    for i, a in enumerate(ids):
        net.act(a, net.peers[a].connect(ids[(i + 1) % len(ids)], net.now))


def test_failure_is_declared_by_a_quorum_of_watchers() -> None:
    net, _ = cluster(joiners=2)
    _ring_links(net)
    victim = J[0].party_id
    net.tick(rounds=2)
    net.crashed.add(victim)
    net.tick(dt=0.5, rounds=int(SUSPECT / 0.5) + 4)
    assert len(net.digests()) == 1
    for p in net.live():
        assert statuses(p)[victim] == "failed"
        assert statuses(p)[J[1].party_id] == "active"
    rec = next(r for r in net.peers[F[0].party_id].records if r.kind == "fail")
    assert len(set(rec.signatures) - {victim}) >= 2
    # The victim's links are gone from everyone's graph.
    assert all(victim not in p.view().neighbours(n) for p in net.live() for n in p.view().active())


def test_failed_party_rejoins_with_a_higher_incarnation() -> None:
    net, ch = cluster(joiners=1)
    victim = J[0].party_id
    net.tick(rounds=2)
    net.crashed.add(victim)
    net.tick(rounds=int(SUSPECT / 0.5) + 4)
    assert statuses(net.peers[F[0].party_id])[victim] == "failed"
    # Restart: a fresh process with a higher incarnation.
    net.crashed.discard(victim)
    fresh = Peer(J[0], ch, incarnation=1)
    net.add(fresh)
    net.act(victim, fresh.request_join(net.now, [F[1].party_id]))
    net.tick(rounds=3)
    assert len(net.digests()) == 1
    m = net.peers[F[2].party_id].view().members[victim]
    assert (m.status, m.incarnation) == ("active", 1)
    # The old incarnation's envelopes are now stale.
    p = net.peers[F[2].party_id]
    old = seal(
        J[0],
        incarnation=0,
        seq=10**6,
        timestamp=net.now,
        kind="hb",
        payload={},
        federation=ch.digest,
    )
    p.handle(old, net.now)
    assert isinstance(p.rejections[-1].error, StaleIncarnationError)


def test_falsely_suspected_party_learns_it_failed_and_rejoins_in_place() -> None:
    net, _ = cluster(joiners=1)
    x = J[0].party_id
    others = [p for p in sorted(net.peers) if p != x]
    net.tick(rounds=2)
    net.partition([x], others)  # alive, but nobody hears it
    net.tick(rounds=int(SUSPECT / 0.5) + 4)
    assert statuses(net.peers[F[0].party_id])[x] == "failed"
    assert net.peers[x].is_member  # it cannot know yet
    net.heal()
    net.tick(rounds=4)  # anti-entropy tells it
    peer = net.peers[x]
    assert not peer.is_member and statuses(peer)[x] == "failed"
    net.act(x, peer.request_join(net.now, [F[1].party_id]))
    assert peer.incarnation == 1 and peer.is_member
    net.tick(rounds=2)
    assert len(net.digests()) == 1
    assert net.peers[F[2].party_id].view().members[x].incarnation == 1


def test_rejoin_at_an_ended_incarnation_is_refused() -> None:
    net, ch = cluster(joiners=1)
    j = J[0].party_id
    net.act(j, net.peers[j].leave(net.now))
    sponsor = net.peers[F[0].party_id]
    same = Peer(J[0], ch, incarnation=0)
    net.add(same)
    before = sponsor.view().digest
    net.act(j, same.request_join(net.now + 0.1, [F[0].party_id]))
    assert not same.is_member
    assert isinstance(sponsor.rejections[-1].error, ReplayError | PolicyError)
    assert sponsor.view().digest == before
    higher = Peer(J[0], ch, incarnation=1)
    net.add(higher)
    net.act(j, higher.request_join(net.now + 0.2, [F[0].party_id]))
    assert higher.is_member
    assert len(net.digests()) == 1


def test_small_cluster_cannot_expel_anyone() -> None:
    """Two members and a quorum of 2: a crash is only suspected, never declared."""
    net, _ = cluster(founders=2, quorum=2)
    a, b = F[0].party_id, F[1].party_id
    net.tick(rounds=2)
    net.crashed.add(b)
    net.tick(rounds=int(SUSPECT / 0.5) + 6)
    assert statuses(net.peers[a])[b] == "active"
    assert b in net.peers[a].monitor.suspected()


def test_link_flap_during_a_failure() -> None:
    net, _ = cluster(joiners=2)
    _ring_links(net)
    victim = J[1].party_id
    a, b = F[0].party_id, F[1].party_id
    net.tick(rounds=2)
    net.crashed.add(victim)
    for step in range(int(SUSPECT / 0.5) + 6):
        net.tick(rounds=1)
        if step % 2 == 0 and net.peers[a].records.link(a, b) is not None:
            link = net.peers[a].records.link(a, b)
            assert link is not None
            if link.live:
                net.act(a, net.peers[a].disconnect(b, net.now))
            else:
                net.act(b, net.peers[b].connect(a, net.now))
        elif step % 2 == 0:
            net.act(a, net.peers[a].connect(b, net.now))
    net.tick(rounds=3)
    assert len(net.digests()) == 1
    view = net.peers[F[2].party_id].view()
    assert view.members[victim].status == "failed"
    flaps = [c for c in net.peers[F[2].party_id].applied if c.kind in ("link_up", "link_down")]
    assert len(flaps) >= 8


def test_views_converge_after_a_partition_heals() -> None:
    net, ch = cluster(joiners=1)
    side_a = [F[0].party_id, F[1].party_id]
    side_b = [F[2].party_id, J[0].party_id]
    net.partition(side_a, side_b)
    net.act(F[0].party_id, net.peers[F[0].party_id].connect(F[1].party_id, net.now))
    net.act(F[2].party_id, net.peers[F[2].party_id].connect(J[0].party_id, net.now))
    late = Peer(J[1], ch)
    net.add(late)
    net.partition([late.party_id], side_b)
    net.act(late.party_id, late.request_join(net.now, [F[0].party_id]))
    assert len(net.digests()) > 1
    net.heal()
    net.tick(rounds=12)
    assert len(net.digests()) == 1
    view = late.view()
    assert view.neighbours(F[2].party_id) == (J[0].party_id,)
    assert view.is_active(late.party_id)


def test_convergence_under_drops_and_duplicates() -> None:
    net, _ch = cluster(joiners=2)
    net.drop, net.dup = 0.2, 0.2
    ids = sorted(net.peers)
    for i in range(len(ids) - 1):
        net.act(ids[i], net.peers[ids[i]].connect(ids[i + 1], net.now))
    net.tick(rounds=30)
    net.drop = net.dup = 0.0
    net.tick(rounds=6)
    assert len(net.digests()) == 1


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_concurrent_events_converge_under_random_delivery_orders(seed: int) -> None:
    """Joins, a leave, link flaps and a crash, all in flight at once, in random order."""
    net, ch = cluster(joiners=2)
    net.rng = random.Random(seed)
    net.reorder = True
    net.dup = 0.1
    a, b, c = (f.party_id for f in F)
    j0, j1 = J[0].party_id, J[1].party_id
    new = [Peer(J[2], ch), Peer(J[3], ch)]
    for p in new:
        net.add(p)
    net.send(new[0].party_id, new[0].request_join(net.now, [a]))
    net.send(new[1].party_id, new[1].request_join(net.now, [b]))
    net.send(j0, net.peers[j0].leave(net.now))
    net.send(a, net.peers[a].connect(b, net.now))
    net.send(c, net.peers[c].connect(j1, net.now))
    net.run()
    net.act(b, net.peers[b].disconnect(a, net.now))
    net.tick(rounds=2)
    net.crashed.add(j1)
    net.tick(rounds=int(SUSPECT / 0.5) + 6)
    net.reorder = False
    net.dup = 0.0
    net.tick(rounds=4)
    assert len(net.digests()) == 1
    st_ = statuses(net.peers[a])
    assert st_[j0] == "left" and st_[j1] == "failed"
    assert st_[new[0].party_id] == st_[new[1].party_id] == "active"
    assert net.peers[c].view().neighbours(a) == ()
    assert all(
        p.rejections == [] or all(isinstance(r.error, ReplayError) for r in p.rejections)
        for p in net.live()
    )


# --- observation, monitor inputs -------------------------------------------------------------


def test_applied_changes_and_callback() -> None:
    seen: list[AppliedChange] = []
    ch = charter(F[:1], J)
    p = Peer(F[0], ch, on_apply=seen.append)
    p.bootstrap(4.0)
    assert seen == p.applied
    assert (seen[0].kind, seen[0].subject, seen[0].at) == ("join", F[0].party_id, 4.0)


def test_probes_give_latency_and_heartbeats_carry_resources() -> None:
    net, _ch = cluster(founders=2)
    a, b = F[0].party_id, F[1].party_id
    net.peers[b].declare_resources(Resources(3.5, 1 << 30, at=0.0))
    net.act(a, net.peers[a].connect(b, net.now))
    net.tick(rounds=3)
    assert net.peers[a].monitor.resources()[b] == Resources(3.5, 1 << 30, 0.0)
    est = net.peers[a].monitor.link(b)
    assert est.latency_s == 0.0  # the synchronous router answers within the same `now`
    assert est.latency_samples >= 1


# --- bad input ------------------------------------------------------------------------------


def _settled() -> tuple[Net, Peer]:
    net, _ = cluster(joiners=1)
    return net, net.peers[F[0].party_id]


def _assert_rejected(peer: Peer, data: bytes, error: type[Exception]) -> None:
    before = (peer.view().digest, len(peer.applied), len(peer.records))
    assert peer.handle(data, 100.0) == []
    assert isinstance(peer.rejections[-1].error, error)
    assert (peer.view().digest, len(peer.applied), len(peer.records)) == before


def test_forged_altered_and_garbage_envelopes_are_rejected() -> None:
    _, p = _settled()
    fed = p.federation_tag
    good = seal(
        F[1],
        incarnation=0,
        seq=10**6,
        timestamp=0.0,
        kind="hb",
        payload={"rd": b"x"},
        federation=fed,
    )
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    _assert_rejected(p, bytes(flipped), Exception)
    assert isinstance(p.rejections[-1].error, SignatureError | DecodeError)
    _assert_rejected(p, b"\x00garbage", DecodeError)
    _assert_rejected(p, good[: len(good) // 2], DecodeError)
    outsider = Identity.from_seed(b"outsider" * 4)
    _assert_rejected(
        p,
        seal(outsider, incarnation=0, seq=1, timestamp=0.0, kind="hb", payload={}, federation=fed),
        Exception,
    )
    assert isinstance(p.rejections[-1].error, UnknownPartyError)


def test_an_envelope_of_another_federation_is_refused_even_from_a_shared_key() -> None:
    """Two charters list the same keys; an envelope sealed for one is refused by the other."""
    net, p = _settled()
    other = charter(F, J, federation="another-federation")
    assert other.digest != p.federation_tag
    stranger = Peer(F[1], other)  # same identity, same keys, another federation
    for data in (
        seal(
            F[1],
            incarnation=0,
            seq=10**6,
            timestamp=net.now,
            kind="probe",
            payload={"nonce": 1},
            federation=other.digest,
        ),
        seal(F[1], incarnation=0, seq=10**6 + 1, timestamp=net.now, kind="probe", payload={}),
    ):
        _assert_rejected(p, data, FederationMismatchError)
    # What the other federation's peer sends is refused the same way, and changes nothing.
    for out in stranger.bootstrap(net.now):
        if out.to == p.party_id:
            _assert_rejected(p, out.data, FederationMismatchError)
    assert "another federation" in str(p.rejections[-1].error)
    # The same probe sealed for this federation is accepted.
    ok = seal(
        F[1],
        incarnation=0,
        seq=10**6 + 2,
        timestamp=net.now,
        kind="probe",
        payload={"nonce": 1},
        federation=p.federation_tag,
    )
    assert len(p.handle(ok, net.now)) == 1


def test_oversized_envelope_is_refused_unparsed() -> None:
    ch = charter(F, J)
    p = Peer(F[0], ch, max_envelope_bytes=512)
    p.bootstrap(0.0)
    big = seal(
        F[1],
        incarnation=0,
        seq=1,
        timestamp=0.0,
        kind="hb",
        payload={"rd": b"x" * 600},
        federation=ch.digest,
    )
    _assert_rejected(p, big, OversizeError)


def test_replayed_envelope_is_rejected() -> None:
    net, p = _settled()
    data = seal(
        J[0],
        incarnation=0,
        seq=10**6,
        timestamp=net.now,
        kind="probe",
        payload={"nonce": 1},
        federation=p.federation_tag,
    )
    assert len(p.handle(data, net.now)) == 1
    _assert_rejected(p, data, ReplayError)


def test_replay_state_survives_a_restart_only_when_the_caller_keeps_it() -> None:
    from chaos_flwr import codec

    net, p = _settled()
    data = seal(
        J[0],
        incarnation=0,
        seq=10**6,
        timestamp=net.now,
        kind="probe",
        payload={"nonce": 7},
        federation=p.federation_tag,
    )
    assert len(p.handle(data, net.now)) == 1
    saved = codec.decode(codec.encode(p.replay_state()))  # what a store would write and read
    ch = p.charter
    # Restarted with the saved state: the old envelope is still a replay.
    restored = Peer(F[0], ch, incarnation=p.incarnation + 1, replay_state=saved)
    _assert_rejected(restored, data, ReplayError)
    # Restarted empty (the state is in memory only): the same bytes are answered again.
    forgetful = Peer(F[0], ch, incarnation=p.incarnation + 1)
    assert len(forgetful.handle(data, net.now)) == 1
    with pytest.raises(DecodeError, match="replay snapshot"):
        Peer(F[0], ch, replay_state={J[0].party_id: [0, 1]})
    with pytest.raises(DecodeError, match="party id"):
        Peer(F[0], ch, replay_state={"nobody": [0, 1, 1]})


def test_policy_violations_inside_valid_envelopes_are_rejected() -> None:
    _net, p = _settled()
    a, b, c = (f.party_id for f in F)
    seq = iter(range(10**6, 10**7))

    def env(
        kind: str, payload: dict[str, Any], who: Identity = F[1], to: str | None = None
    ) -> bytes:
        return seal(
            who,
            incarnation=0,
            seq=next(seq),
            timestamp=0.0,
            kind=kind,
            payload=payload,
            to=to,
            federation=p.federation_tag,
        )

    # A link request naming other ends.
    body = link_body("link_up", FED, (b, 0), (c, 0), 1)
    sig = F[1].sign(signing_bytes(body))
    _assert_rejected(p, env("link_req", {"body": body, "sig": sig}), PolicyError)
    # A vote for one's own failure.
    from chaos_flwr.membership import fail_body

    fb = fail_body(FED, b, 0)
    _assert_rejected(p, env("vote", {"body": fb, "sig": F[1].sign(signing_bytes(fb))}), PolicyError)
    # A vote whose signature is not the sender's.
    fc = fail_body(FED, c, 0)
    _assert_rejected(
        p, env("vote", {"body": fc, "sig": F[2].sign(signing_bytes(fc))}), SignatureError
    )
    # A record missing its required signatures.
    from chaos_flwr.membership import Record, leave_body

    forged_leave = Record(body=leave_body(FED, c, 0), signatures={b: F[1].sign(b"nope")})
    _assert_rejected(p, env("rec", {"records": [forged_leave.to_wire()]}), SignatureError)
    real_sig_wrong_signer = Record.sign(leave_body(FED, c, 0), [F[1]])
    _assert_rejected(p, env("rec", {"records": [real_sig_wrong_signer.to_wire()]}), PolicyError)
    # Misaddressed, unknown kind, malformed payload.
    _assert_rejected(p, env("probe", {"nonce": 1}, to=c), PolicyError)
    _assert_rejected(p, env("gossip", {}), DecodeError)
    _assert_rejected(p, env("hb", {"rd": "not-bytes"}), DecodeError)
    _assert_rejected(p, env("rec", {"records": [{"body": 1}]}), DecodeError)
    # One bad record spoils the whole message: the good one beside it is not applied either.
    good = Record.sign(link_body("link_down", FED, (a, 0), (b, 0), 7), [F[1]])
    _assert_rejected(
        p, env("rec", {"records": [good.to_wire(), forged_leave.to_wire()]}), SignatureError
    )
    assert good.record_id not in p.records
    # A join request for someone else.
    from chaos_flwr.membership import join_body

    jb = join_body(FED, J[3].party_id, 0, 0.0)
    _assert_rejected(
        p, env("join_req", {"body": jb, "sig": J[3].sign(signing_bytes(jb))}), PolicyError
    )


def test_bench_events_settles_every_event_type_on_a_small_cluster() -> None:
    from chaos_flwr.bench.events import run_events
    from chaos_flwr.errors import ConfigError

    result = run_events(8, repeats=2, carrier="memory")
    assert result["peers"] == 8 and result["carrier"] == "memory"
    assert set(result["events"]) == {"leave", "link_up", "link_down", "fail"}
    for row in result["events"].values():
        assert row["count"] == 2
        assert 0.0 < row["p50_ms"] <= row["p99_ms"]
    assert result["views_agree"] and result["rejections"] == 0
    with pytest.raises(ConfigError, match="peers"):
        run_events(4, carrier="memory")
    with pytest.raises(ConfigError, match="carrier"):
        run_events(8, repeats=1, carrier="pigeon")


# --- the in-process carrier ------------------------------------------------------------------


def _memory_cluster(seed: int, drop: float) -> tuple[Any, list[Peer]]:
    from chaos_flwr.transport.memory import MemoryNetwork

    ch = charter(F, J)
    net = MemoryNetwork(seed=seed, drop=drop, duplicate=drop)
    peers = [Peer(f, ch) for f in F] + [Peer(j, ch) for j in J[:2]]
    for p in peers:
        net.attach(p)
    for p in peers[:3]:
        net.send(p.party_id, p.bootstrap(0.0))
    net.run(0.0)
    for p in peers[3:]:
        net.send(p.party_id, p.request_join(0.0, [F[0].party_id]))
    net.run(0.0)
    for t in range(1, 20):
        net.tick(t * 0.5)
    return net, peers


def test_memory_network_is_deterministic_and_converges_under_faults() -> None:
    net1, peers1 = _memory_cluster(seed=7, drop=0.15)
    net2, peers2 = _memory_cluster(seed=7, drop=0.15)
    assert (net1.delivered, net1.dropped) == (net2.delivered, net2.dropped)
    assert net1.dropped > 0
    assert [p.view().digest for p in peers1] == [p.view().digest for p in peers2]
    assert len({p.view().digest for p in peers1}) == 1
    assert all(p.is_member for p in peers1)


def test_memory_network_crash_partition_and_storm() -> None:
    from chaos_flwr.errors import ConfigError, TransportError
    from chaos_flwr.transport.memory import MemoryNetwork

    class Echo:
        def __init__(self, pid: str, to: str) -> None:
            self.party_id, self.to, self.got = pid, to, 0

        def handle(self, data: bytes, now: float) -> list[Outgoing]:
            self.got += 1
            return [Outgoing(self.to, data)]

    net = MemoryNetwork(max_deliveries=50)
    a, b = Echo("a", "b"), Echo("b", "a")
    net.attach(a)
    net.attach(b)
    net.send("a", [Outgoing("b", b"x")])
    with pytest.raises(TransportError, match="max_deliveries"):
        net.run(0.0)
    net = MemoryNetwork()
    a, b = Echo("a", "nobody"), Echo("b", "nobody")
    net.attach(a)
    net.attach(b)
    net.crash("b")
    net.send("a", [Outgoing("b", b"x")])
    assert net.run(0.0) == 0 and b.got == 0
    net.restart("b")
    net.partition(["a"], ["b"])
    net.send("b", [Outgoing("a", b"y")])
    assert net.run(0.0) == 0
    net.heal()
    net.send("b", [Outgoing("a", b"y")])
    assert net.run(0.0) == 1 and a.got == 1
    assert net.dropped == 3  # to crashed b, across the cut, and a's echo to "nobody"
    with pytest.raises(ConfigError, match="drop"):
        MemoryNetwork(drop=1.0)


# --- record proofs: one signature for an own envelope and its record ----------------------------


def _own_leave() -> tuple[Net, Peer, bytes, Any]:
    """A 5-party cluster where J[1] signs its leave; the own envelope is captured, undelivered."""
    net, ch = cluster(joiners=2)
    leaver = net.peers[J[1].party_id]
    outs = leaver.leave(net.now)
    assert len({o.data for o in outs}) == 1 and {o.to for o in outs} == set(net.peers) - {
        leaver.party_id
    }
    return net, leaver, outs[0].data, ch


def test_own_envelope_costs_one_check_and_its_proof_verifies_anywhere_later() -> None:
    from chaos_flwr.membership import Policy, SignatureCache, validate_record
    from chaos_flwr.wire import open_sealed

    net, leaver, data, ch = _own_leave()
    env = open_sealed(data, {leaver.party_id: leaver.identity.public_key})
    assert env.kind == "own" and env.to is None
    p = net.peers[F[0].party_id]
    before = p.records.cache.checks
    assert p.handle(data, net.now) == []
    assert p.records.cache.checks - before == 1  # the envelope's signature, once
    assert statuses(p)[leaver.party_id] == "left"
    (record,) = [r for r in p.records if r.kind == "leave"]
    assert record.signatures == {leaver.party_id: data}  # the proof is the exact envelope
    # A third party that never saw the envelope checks the proof on its own: one verification.
    cache = SignatureCache()
    validate_record(record, Policy.from_charter(ch), cache)
    assert cache.checks == 1
    # Forwarded by anti-entropy, the record (proof included) converges everyone.
    net.tick(HB, rounds=4)
    assert len(net.digests()) == 1
    assert all(statuses(q)[leaver.party_id] == "left" for q in net.live())


def test_forged_proofs_are_refused_and_change_nothing() -> None:
    from chaos_flwr.membership import (
        Policy,
        Record,
        SignatureCache,
        leave_body,
        validate_record,
    )

    net, leaver, data, ch = _own_leave()
    policy = Policy.from_charter(ch)
    body = leave_body(FED, leaver.party_id, leaver.incarnation)

    def refused(sig: bytes, signer: str = leaver.party_id) -> str:
        with pytest.raises(SignatureError) as info:
            validate_record(Record(body=body, signatures={signer: sig}), policy, SignatureCache())
        # A peer handed the record in a rec envelope refuses it whole, holding nothing new.
        p = net.peers[F[2].party_id]
        rec = seal(
            F[1],
            incarnation=0,
            seq=10**6 + len(p.rejections),
            timestamp=net.now,
            kind="rec",
            payload={"records": [{"body": body, "sigs": {signer: sig}}]},
            federation=p.federation_tag,
        )
        _assert_rejected(p, rec, SignatureError)
        return str(info.value)

    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    refused(bytes(flipped))
    refused(data[:-1])  # truncated proof
    refused(data + b"\x00")  # trailing byte
    # An envelope of another kind, signed by the right party, proves nothing.
    hb = seal(
        leaver.identity,
        incarnation=leaver.incarnation,
        seq=10**6,
        timestamp=net.now,
        kind="hb",
        payload={"record": {"body": body, "sigs": {}}},
        federation=leaver.federation_tag,
    )
    assert "only an 'own' envelope" in refused(hb)
    # An own envelope of the leaver carrying another body (an earlier incarnation's leave).
    other = seal(
        leaver.identity,
        incarnation=leaver.incarnation,
        seq=10**6 + 1,
        timestamp=net.now,
        kind="own",
        payload={"record": {"body": leave_body(FED, leaver.party_id, 7), "sigs": {}}},
        federation=leaver.federation_tag,
    )
    assert "another record body" in refused(other)
    # The leaver's genuine proof put under another signer's name (J[0] did not leave).
    body_j0 = leave_body(FED, J[0].party_id, 0)
    with pytest.raises(SignatureError):
        validate_record(Record(body=body_j0, signatures={J[0].party_id: data}), policy)
    # Oversized proofs are refused unread.
    assert "proof envelope of at most" in refused(data + bytes(5000))
    assert all(statuses(q)[leaver.party_id] == "active" for q in net.live() if q is not leaver)


def test_own_envelope_shapes_that_would_nest_proofs_are_refused() -> None:
    from chaos_flwr.membership import leave_body

    net, leaver, data, _ = _own_leave()
    p = net.peers[F[0].party_id]
    body = leave_body(FED, leaver.party_id, leaver.incarnation)
    for seq, sigs in enumerate(
        (
            {leaver.party_id: bytes(64)},  # the sender's own signature does not ride inside
            {F[1].party_id: data},  # no proof inside a proof
            {F[1].party_id: b"short"},
        )
    ):
        bad = seal(
            leaver.identity,
            incarnation=leaver.incarnation,
            seq=10**6 + seq,
            timestamp=net.now,
            kind="own",
            payload={"record": {"body": body, "sigs": sigs}},
            federation=p.federation_tag,
        )
        _assert_rejected(p, bad, DecodeError)
    assert statuses(p)[leaver.party_id] == "active"


def test_replayed_own_envelopes_are_refused_and_never_count_as_signs_of_life() -> None:
    net, leaver, data, _ = _own_leave()
    p, q = net.peers[F[0].party_id], net.peers[F[1].party_id]
    heard = p.monitor.last_heard(leaver.party_id)
    net.now += 5.0
    assert p.handle(data, net.now) == []
    assert statuses(p)[leaver.party_id] == "left"
    assert p.monitor.last_heard(leaver.party_id) == heard  # an own envelope is not a heartbeat
    _assert_rejected(p, data, ReplayError)  # the same bytes again
    # The proof travels on inside the record; extracted and replayed to a party that already
    # took the envelope, it is a replay like any other.
    assert q.handle(data, net.now) == []
    (record,) = [r for r in p.records if r.kind == "leave"]
    _assert_rejected(q, record.signatures[leaver.party_id], ReplayError)


@pytest.mark.parametrize("limit", [None, 1100])
def test_a_fail_record_too_large_for_a_proof_goes_out_with_plain_signatures(
    monkeypatch: pytest.MonkeyPatch, limit: int | None
) -> None:
    """The fail broadcast is an own envelope unless its other votes would not fit a proof."""
    import chaos_flwr.peer_core as peer_mod

    if limit is not None:  # as if the quorum were large: one other vote no longer fits
        monkeypatch.setattr(peer_mod, "MEMBERSHIP_PROOF_MAX_BYTES", limit)
    net, _ = cluster(joiners=2)
    _ring_links(net)
    victim = J[0].party_id
    net.tick(rounds=2)
    net.crashed.add(victim)
    net.tick(dt=0.5, rounds=int(SUSPECT / 0.5) + 4)
    assert len(net.digests()) == 1
    assert all(statuses(p)[victim] == "failed" for p in net.live())
    sig_sizes = {
        len(sig)
        for p in net.live()
        for r in p.records
        if r.kind == "fail"
        for sig in r.signatures.values()
    }
    if limit is None:
        assert max(sig_sizes) > 64  # somebody holds the broadcaster's proof
    else:
        assert sig_sizes == {64}  # everyone holds plain votes only


def test_records_of_the_partys_own_sealed_file_load_without_signature_checks() -> None:
    net, ch = cluster(joiners=2)
    a, b, c = (f.party_id for f in F)
    for _ in range(3):  # link flaps: more records than members
        net.act(a, net.peers[a].connect(b, net.now))
        net.act(b, net.peers[b].disconnect(a, net.now))
    saved = [r.to_wire() for r in net.peers[c].records]
    proofs = [r for r in net.peers[c].records if any(len(s) != 64 for s in r.signatures.values())]
    assert proofs  # the file holds 'own' envelopes as signatures too
    verified, trusted = Peer(F[2], ch), Peer(F[2], ch)
    assert verified.load_records(saved, net.now) == len(saved)
    assert trusted.load_records(saved, net.now, sealed=True) == len(saved)
    assert trusted.records.ids() == verified.records.ids() == net.peers[c].records.ids()
    assert trusted.view().digest == verified.view().digest == net.peers[c].view().digest
    assert verified.records.cache.checks >= len(saved)  # every signature checked
    assert trusted.records.cache.checks == 0  # none: this party verified them before saving
    assert trusted.load_records(saved, net.now, sealed=True) == 0  # held already
    assert trusted.is_member and trusted.incarnation == verified.incarnation


def test_a_sealed_load_still_refuses_another_federation_and_unknown_signers() -> None:
    net, ch = cluster()
    c = F[2].party_id
    saved = [r.to_wire() for r in net.peers[c].records]
    with pytest.raises(PolicyError, match="federation"):
        Peer(F[2], charter(F, J, federation="another-federation")).load_records(
            saved, net.now, sealed=True
        )
    stranger = ident("stranger")
    forged = {"body": saved[0]["body"], "sigs": {stranger.party_id: b"\x00" * 64}}
    fresh = Peer(F[2], ch)
    with pytest.raises(PolicyError, match="charter lacks"):
        fresh.load_records([*saved, forged], net.now, sealed=True)
    assert len(fresh.records) == 0  # nothing applied before the refusal
    with pytest.raises(DecodeError):
        Peer(F[2], ch).load_records([{"body": 1}], net.now, sealed=True)
