"""Flood resistance: per-signer record budgets, the charter's limits, and refusals in the peer."""

from __future__ import annotations

import itertools

import pytest
from test_peer import HB, F, J, Net, charter

from chaos_flwr.charter import Charter
from chaos_flwr.defaults import (
    FLOOD_RECORD_BURST_BASE,
    FLOOD_RECORD_BURST_PER_PARTY,
    FLOOD_RECORDS_PER_MINUTE,
)
from chaos_flwr.errors import FloodError, PolicyError
from chaos_flwr.flood import RecordBudget, limits_of
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Record, link_body
from chaos_flwr.peer import Peer

#: Digest of this charter as the code before the ``limits`` section computed it.
GOLDEN_DIGEST = "4ae044b8d42211180bb08fec01628604d855348ea87bffca2741a41b76fbd998"


def golden_charter() -> Charter:
    """A charter built the same way by the code before and after the ``limits`` section."""
    founders = [Identity.from_seed(b"golden-founder-%d" % i * 2, name=f"f{i}") for i in range(2)]
    joiner = Identity.from_seed(b"golden-joiner" * 2, name="j0")
    return Charter.create("golden-fed", founders, [joiner])


def limited(rate: float, burst: int, founders: int = 3) -> Charter:
    """The test charter with a ``limits`` section, signed again by its founders."""
    base = charter(F[:founders], J)
    data = {**base.model_dump(), "limits": {"records_per_minute": rate, "record_burst": burst}}
    out = Charter.from_dict({**data, "signatures": {}}, verify=False)
    for f in F[:founders]:
        out = out.sign(f)
    return out


def started(ch: Charter, founders: int = 3) -> Net:
    net = Net([Peer(f, ch) for f in F[:founders]])
    for f in F[:founders]:
        net.act(f.party_id, net.peers[f.party_id].bootstrap(net.now))
    return net


def downs(flooder: Peer, other: str, epochs: range) -> list[Record]:
    """Valid link_down records the flooder signs alone, one per epoch."""
    other_end = (other, 0)
    mine = (flooder.party_id, flooder.incarnation)
    return [
        Record.sign(link_body("link_down", flooder.policy.federation, mine, other_end, e), [F[2]])
        for e in epochs
    ]


# --- the budget ---------------------------------------------------------------------------------


def test_a_bucket_refuses_past_its_burst_and_refills_at_its_rate() -> None:
    budget = RecordBudget(["a", "b"], rate_per_minute=60.0, burst=3)
    for _ in range(3):
        assert budget.allows(["a"], 0.0)
        budget.charge(["a"], 0.0)
    assert not budget.allows(["a"], 0.0)
    assert not budget.allows(["a"], 0.5)
    assert budget.allows(["a"], 1.0)  # one token a second
    budget.charge(["a"], 1.0)
    assert not budget.allows(["a"], 1.0)
    assert budget.refused_by == {"a": 3}
    # A record several parties signed is refused only when every signer is out of budget.
    assert budget.allows(["a", "b"], 1.0)
    budget.charge(["a", "b"], 1.0)
    assert budget.tokens() == {"a": 0.0, "b": 2.0}
    # Signers outside the charter are validation's business: allowed, never counted.
    assert budget.allows(["zed"], 1.0)
    assert budget.refused_by == {"a": 3}
    assert budget.allows(["a"], 1000.0) and budget.tokens()["a"] == 3.0  # capped at the burst


def test_bad_limits_are_refused() -> None:
    with pytest.raises(PolicyError, match="records_per_minute"):
        RecordBudget(["a"], rate_per_minute=0.0, burst=10)
    with pytest.raises(PolicyError, match="record_burst"):
        RecordBudget(["a"], rate_per_minute=1.0, burst=0)


def test_limits_come_from_the_charter_or_the_defaults() -> None:
    ch = charter(F, J)
    parties = len(ch.keyring())
    burst = FLOOD_RECORD_BURST_BASE + FLOOD_RECORD_BURST_PER_PARTY * parties
    assert limits_of(ch, parties) == (FLOOD_RECORDS_PER_MINUTE, burst)
    assert limits_of(limited(30.0, 7), parties) == (30.0, 7.0)
    assert limits_of(object(), 2) == (FLOOD_RECORDS_PER_MINUTE, FLOOD_RECORD_BURST_BASE + 8)


# --- the charter section ------------------------------------------------------------------------


def test_a_charter_without_limits_keeps_its_digest_and_file() -> None:
    ch = golden_charter()
    assert ch.limits is None
    assert ch.digest.hex() == GOLDEN_DIGEST
    assert "limits" not in ch.body() and "limits" not in ch.to_yaml()
    explicit = Charter.from_yaml(ch.to_yaml() + "limits: null\n")
    assert explicit.digest == ch.digest and explicit.is_verified


def test_a_charter_with_limits_is_signed_over_them_and_round_trips() -> None:
    ch = limited(120.0, 50)
    assert ch.digest != charter(F[:3], J).digest
    again = Charter.from_yaml(ch.to_yaml())
    assert again.digest == ch.digest and again.is_verified
    assert again.limits is not None and again.limits.record_burst == 50
    tampered = ch.to_yaml().replace("record_burst: 50", "record_burst: 5000")
    with pytest.raises(Exception, match="signature"):
        Charter.from_yaml(tampered)


# --- the peer -----------------------------------------------------------------------------------


def test_a_flood_in_one_batch_is_cut_at_the_budget_and_names_the_flooder() -> None:
    net = started(limited(60.0, 5))
    victim, flooder = net.peers[F[0].party_id], net.peers[F[2].party_id]
    flood = downs(flooder, victim.party_id, range(1, 51))
    checks = victim.records.cache.checks
    data = flooder._send(victim.party_id, "rec", {"records": [r.to_wire() for r in flood]}, 1.0)
    assert victim.handle(data.data, 1.0) == []
    error = victim.rejections[-1].error
    assert isinstance(error, FloodError) and error.signers == (flooder.party_id,)
    assert error.refused == 45 and flooder.party_id in str(error)
    assert victim.refused_by == {flooder.party_id: 45}
    # Five records were checked and taken, each superseding the last: one link record held.
    assert victim.records.cache.checks - checks == 1 + 5
    held = victim.records.link(victim.party_id, flooder.party_id)
    assert held is not None and (held.state, held.epoch) == ("down", 5)
    assert len(victim.records) == 4


def test_an_honest_forwarders_batch_is_taken_apart_from_the_flooders_records() -> None:
    net = started(limited(60.0, 2))
    victim, honest, flooder = (net.peers[f.party_id] for f in F[:3])
    flood = downs(flooder, victim.party_id, range(1, 4))
    mine = Record.sign(
        link_body("link_down", honest.policy.federation, (F[1].party_id, 0), (F[0].party_id, 0), 3),
        [F[1]],
    )
    batch = [r.to_wire() for r in [*flood, mine]]
    out = honest._send(victim.party_id, "rec", {"records": batch}, 1.0)
    victim.handle(out.data, 1.0)
    assert mine.record_id in victim.records
    assert flood[1].record_id in victim.records and flood[2].record_id not in victim.records
    last = victim.rejections[-1]
    assert isinstance(last.error, FloodError) and last.sender == honest.party_id
    assert victim.refused_by == {flooder.party_id: 1}


def test_own_envelopes_past_the_budget_are_refused_one_by_one() -> None:
    net = started(limited(60.0, 3))
    victim, flooder = net.peers[F[0].party_id], net.peers[F[2].party_id]
    for record in downs(flooder, victim.party_id, range(1, 11)):
        _, outs = flooder._broadcast_own([victim.party_id], record.body, {}, 2.0)
        victim.handle(outs[0].data, 2.0)
    refusals = [r for r in victim.rejections if isinstance(r.error, FloodError)]
    # the first refusal opens the envelope (the budget is not yet spent when it arrives), the
    # others are refused unopened (no sender: nothing was verified)
    assert len(refusals) == 7 and {r.sender for r in refusals} <= {flooder.party_id, None}
    assert [r.sender for r in refusals].count(None) >= 6
    # The log keeps the errors without their tracebacks (whose frames hold the envelopes).
    assert all(r.error.__traceback__ is None for r in refusals)
    assert victim.refused_by == {flooder.party_id: 7}
    assert victim.records.link(victim.party_id, flooder.party_id).epoch == 3  # type: ignore[union-attr]


def test_views_converge_once_the_flood_stops() -> None:
    net = started(limited(60.0, 4))
    victim, flooder = net.peers[F[0].party_id], net.peers[F[2].party_id]
    flood = downs(flooder, victim.party_id, range(1, 201))
    for record in flood:
        flooder.records.add(record)
    for i in range(0, len(flood), 50):
        wire = [r.to_wire() for r in flood[i : i + 50]]
        out = flooder._send(victim.party_id, "rec", {"records": wire}, 0.0)
        victim.handle(out.data, 0.0)
    # Its genesis join took one token of four: three link_downs of the first batch are taken,
    # its other 47 refused; the next three batches are refused unopened, one count each.
    assert victim.refused_by[flooder.party_id] == 47 + 3
    assert victim.records.digest() != flooder.records.digest()
    net.tick(HB, rounds=6)  # anti-entropy offers the flooder's last record again
    assert len({p.records.digest() for p in net.live()}) == 1
    assert len(net.digests()) == 1
    assert victim.records.link(victim.party_id, flooder.party_id).epoch == 200  # type: ignore[union-attr]


def test_an_honest_federation_with_default_limits_is_never_refused() -> None:
    ch = charter(F, J)
    net = started(ch)
    for j in J[:4]:
        p = Peer(j, ch)
        net.add(p)
        net.act(j.party_id, p.request_join(net.now, [F[0].party_id]))
    ids = sorted(net.peers)
    for a, b in itertools.combinations(ids, 2):
        net.act(a, net.peers[a].connect(b, net.now))
    for _ in range(3):
        net.act(ids[0], net.peers[ids[0]].disconnect(ids[1], net.now))
        net.act(ids[0], net.peers[ids[0]].connect(ids[1], net.now))
        net.tick(HB)
    late = Peer(J[4], ch)
    net.add(late)
    net.act(late.party_id, late.request_join(net.now, [F[1].party_id]))
    net.tick(HB, rounds=3)
    assert len(net.digests()) == 1
    for p in net.live():
        assert p.refused_by == {}
        assert not any(isinstance(r.error, FloodError) for r in p.rejections)
    assert len(late.records) == 8 + len(list(itertools.combinations(ids, 2)))


# --- envelopes: a sender out of record budget is refused unopened --------------------------------


def test_a_flooder_s_envelopes_are_refused_unopened_while_it_is_out_of_record_budget() -> None:
    from chaos_flwr.wire import seal

    ch = limited(rate=60.0, burst=5)
    net = started(ch)
    honest, flooder = net.peers[F[0].party_id], net.peers[F[2].party_id]
    victim_end = F[1].party_id
    seqs = itertools.count(10**6)

    def own(record: Record) -> bytes:
        body = record.body
        return seal(
            F[2],
            incarnation=flooder.incarnation,
            seq=next(seqs),
            timestamp=net.now,
            kind="own",
            payload={"record": {"body": body, "sigs": {}}},
            federation=honest.federation_tag,
        )

    def hb(who: Identity) -> bytes:
        return seal(
            who,
            incarnation=net.peers[who.party_id].incarnation,
            seq=next(seqs),
            timestamp=net.now,
            kind="hb",
            payload={"rd": b"x" * 32, "res": None},
            to=honest.party_id,
            federation=honest.federation_tag,
        )

    # an honest stream of envelopes (no records) is never refused, however long
    for _ in range(2000):
        honest.handle(hb(F[1]), net.now)
    assert not [r for r in honest.rejections if isinstance(r.error, FloodError)]
    # the flooder: its burst of records is taken and verified, then its envelopes are refused
    # before any signature check
    flood = [own(r) for r in downs(flooder, victim_end, range(100, 200))]
    checks = honest.records.cache.checks
    for data in flood:
        honest.handle(data, net.now)
    verified = honest.records.cache.checks - checks
    assert verified <= 5 + 2  # the burst (and the record that found the budget empty)
    assert honest.refused_by[flooder.party_id] >= 100 - 7
    refused = [r for r in honest.rejections if isinstance(r.error, FloodError)]
    assert refused and refused[-1].sender is None  # refused unopened
    # others are still heard meanwhile, and the flooder again once its budget refills
    before = len(honest.rejections)
    honest.handle(hb(F[1]), net.now)
    assert len(honest.rejections) == before
    honest.handle(hb(F[2]), net.now + 60.0)
    assert len(honest.rejections) == before


def test_a_forged_header_costs_a_party_that_is_within_budget_nothing() -> None:
    from chaos_flwr.wire import seal

    net = started(charter(F[:3], J))
    honest = net.peers[F[0].party_id]
    victim = F[1]
    forged = seal(  # signed by someone else, header naming the victim: fails to verify
        F[2],
        incarnation=0,
        seq=1,
        timestamp=net.now,
        kind="hb",
        payload={"rd": b"x" * 32, "res": None},
        federation=honest.federation_tag,
    )
    forged = forged[:5] + victim.party_id.encode() + forged[22:]
    tokens = honest.budget.tokens()[victim.party_id]
    for _ in range(50):
        honest.handle(forged, net.now)
    assert honest.budget.tokens()[victim.party_id] == tokens
    assert victim.party_id not in honest.refused_by


def test_the_flood_and_rebuild_benches_print_their_figures() -> None:
    import json

    from typer.testing import CliRunner

    from chaos_flwr.cli import app

    out = CliRunner().invoke(app, ["bench", "flood", "--records", "1500"])
    assert out.exit_code == 0, out.output
    fig = json.loads(out.output)
    assert fig["records"] == 1500 and fig["held"] <= fig["quiet_held"] + 1
    assert fig["refused"] > 0 and fig["signature_checks"] < 1500
    out = CliRunner().invoke(app, ["bench", "rebuild", "--size", "50", "--repeats", "1"])
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["rows"]
    assert row["sealed"]["signature_checks"] == 0 < row["verified"]["signature_checks"]
    assert row["daemon"]["message_s"] > 0  # the fresh process's relay message, by the daemon
    assert row["daemon_vs_sealed"] == row["daemon"]["message_s"] / row["sealed"]["message_s"]
    bad = CliRunner().invoke(app, ["bench", "flood", "--mode", "loud"])
    assert bad.exit_code != 0 and "--mode" in bad.output
