"""A member's daemon countersigning a joiner's own join over a direct link
(:mod:`chaos_flwr.countersign`, :meth:`chaos_flwr.gossip.Gossip.countersign`, and the link
server's gate): what it signs, what it refuses with a typed error, and that a server that
countersigns still serves nothing else to a non-member.

The whole path on Flower (a sponsored joiner that comes during training trains in that round)
is in ``tests/test_flower_lib_join.py``: ``test_a_joiner_pulls_from_party_daemons_...``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from link_world import DATA, DIGEST, FED, ROUND, access, ident, records

from chaos_flwr import codec
from chaos_flwr.countersign import countersign, countersign_request
from chaos_flwr.errors import (
    DecodeError,
    NotMemberError,
    PolicyError,
    SignatureError,
    UnknownPartyError,
)
from chaos_flwr.flower.direct import BytesSource, DirectServer
from chaos_flwr.gossip import Gossip
from chaos_flwr.identity import Identity
from chaos_flwr.membership import (
    ACTIVE,
    Record,
    RecordSet,
    join_body,
    leave_body,
    signing_bytes,
    validate_record,
)
from chaos_flwr.transport.links import LinkDialer
from chaos_flwr.transport.tls import LinkCredentials


def _ask(who: Identity, inc: int = 1, **body: Any) -> dict[str, Any]:
    """``who``'s request to countersign its join of incarnation ``inc`` (body fields changed
    by ``body``), signed by itself."""
    b = {**join_body(FED, who.party_id, inc, 5.0), **body}
    return countersign_request(b, {who.party_id: who.sign(signing_bytes(b))})


def _gossip(name: str, rs: RecordSet) -> Gossip:
    g = Gossip(ident(name).party_id, ident(name).sign, rs.policy)
    g.take(list(rs))
    return g


def test_a_member_countersigns_a_charter_partys_own_join_and_holds_it_once_complete() -> None:
    a, d = ident("a"), ident("d")
    g = _gossip("a", records())
    req = _ask(d)
    reply, new = g.countersign(d.party_id, req, 0.0)
    # a's signature over the very body asked: with d's own, a record the charter takes ...
    sigs = {d.party_id: req["sigs"][d.party_id], a.party_id: reply["sig"]}
    validate_record(Record(body=req["countersign"], signatures=sigs), g.policy)
    # ... and the record is held: d is an active member in a's view (served from now on)
    assert new and g.view().is_active(d.party_id)
    assert g.view().members[d.party_id].status == ACTIVE
    # asked again for the same incarnation: refused (that join is held)
    with pytest.raises(PolicyError, match="incarnation 1"):
        g.countersign(d.party_id, req, 0.0)


def test_two_sponsors_each_sign_and_the_complete_record_is_held_when_handed_over() -> None:
    b, d = ident("b"), ident("d")
    policy = dataclasses.replace(records().policy, sponsors_required=2)
    ga, gb = (Gossip(ident(n).party_id, ident(n).sign, policy) for n in ("a", "b"))
    for g in (ga, gb):
        g.take(list(records()))
    req = _ask(d)
    sig_a, new_a = ga.countersign(d.party_id, req, 0.0)
    sig_b, new_b = gb.countersign(d.party_id, req, 0.0)
    assert not new_a and not new_b  # one sponsor each: not complete yet
    assert not ga.view().is_active(d.party_id)
    full = dict(req["sigs"])
    full.update({ident("a").party_id: sig_a["sig"], b.party_id: sig_b["sig"]})
    _, new = ga.countersign(d.party_id, countersign_request(req["countersign"], full), 1.0)
    assert new and ga.view().is_active(d.party_id)
    # a forged signature of another sponsor does not make a record complete
    a = ident("a")
    forged = {**req["sigs"], a.party_id: b.sign(signing_bytes(req["countersign"]))}
    done = countersign(gb.records, b.party_id, b.sign, d.party_id,
                       countersign_request(req["countersign"], forged))  # fmt: skip
    assert done.record is None and isinstance(done.reply["sig"], bytes)
    honest = {**req["sigs"], a.party_id: sig_a["sig"]}
    done = countersign(gb.records, b.party_id, b.sign, d.party_id,
                       countersign_request(req["countersign"], honest))  # fmt: skip
    assert done.record is not None and set(done.record.signatures) == {
        a.party_id, b.party_id, d.party_id}  # fmt: skip


def test_a_daemon_countersigns_one_new_join_of_a_party_per_interval() -> None:
    from chaos_flwr.errors import FloodError
    from chaos_flwr.gossip import COUNTERSIGN_INTERVAL_S

    d = ident("d")
    g = _gossip("a", records())
    first = _ask(d, inc=1)
    assert g.countersign(d.party_id, first, 100.0)[1]  # held: d is a member at incarnation 1
    later = 100.0 + COUNTERSIGN_INTERVAL_S / 2
    with pytest.raises(FloodError):  # a second new join (incarnation 2) this soon
        g.countersign(d.party_id, _ask(d, inc=2), later)
    assert g.view().members[d.party_id].incarnation == 1  # nothing held
    _, new = g.countersign(d.party_id, _ask(d, inc=2), 100.0 + COUNTERSIGN_INTERVAL_S)
    assert new and g.view().members[d.party_id].incarnation == 2


def test_what_a_member_refuses_to_countersign() -> None:
    d, e = ident("d"), ident("e")
    rs = records()
    g = _gossip("a", rs)
    cases: list[tuple[str, Any, type[Exception]]] = [
        (e.party_id, _ask(d), PolicyError),  # e asks for d's join
        (d.party_id, _ask(d, federation="other-fed"), PolicyError),
        (d.party_id, _ask(d, kind="leave"), PolicyError),
        (d.party_id, _ask(d, incarnation="1"), DecodeError),
        (d.party_id, {"countersign": [1]}, DecodeError),
        (d.party_id, {**_ask(d), "sigs": {d.party_id: "x"}}, DecodeError),
        (d.party_id, {**_ask(d), "sigs": {f"p{i}": b"" for i in range(9)}}, DecodeError),
        (ident("x").party_id, _ask(ident("x")), UnknownPartyError),  # not on the charter
    ]
    bad_sig = _ask(d)
    bad_sig["sigs"][d.party_id] = ident("b").sign(signing_bytes(bad_sig["countersign"]))
    cases.append((d.party_id, bad_sig, SignatureError))
    for src, req, err in cases:
        with pytest.raises(err):
            g.countersign(src, req, 0.0)
    # a member asking for a join above its own incarnation is a rejoin: signed
    reply, _ = g.countersign(e.party_id, _ask(e, inc=1), 0.0)
    assert isinstance(reply["sig"], bytes)
    # a party that left does not sponsor anyone
    a = ident("a")
    gone = _gossip("a", records([Record.sign(leave_body(FED, a.party_id, 0), [a])]))
    with pytest.raises(PolicyError, match="not an active member"):
        gone.countersign(d.party_id, _ask(d), 0.0)
    assert not g.view().is_active(d.party_id)  # nothing above was held


def test_a_countersigning_server_serves_a_non_member_nothing_but_its_countersign() -> None:
    d = ident("d")
    rs = records()
    gossip = _gossip("a", rs)
    link = access("a", gossip.records)

    def sign(src: str, value: dict[str, Any]) -> bytes:
        return codec.encode(gossip.countersign(src, value, 0.0)[0])

    server = DirectServer(BytesSource(ROUND, DIGEST, DATA), link=link, countersign=sign)
    address = server.start()
    cert = link.creds.serve_cert_der
    ranges = codec.encode({"round": ROUND, "digest": DIGEST, "start": [0], "end": [1024]})

    async def call(who: Identity, req: bytes) -> Any:
        dialer = LinkDialer(LinkCredentials.create(who, FED))
        try:
            return codec.decode(await dialer.request(address, cert, req, timeout=10.0))
        except Exception as exc:  # the typed refusal is the result
            return exc
        finally:
            await dialer.close()

    try:
        before = asyncio.run(call(d, ranges))
        manifest = asyncio.run(call(d, codec.encode({"round": ROUND, "digest": DIGEST,
            "total": len(DATA), "shard-bytes": len(DATA), "num-shards": 1})))  # fmt: skip
        gossip_req = asyncio.run(call(d, codec.encode({"gossip": b"\0" * 32})))
        outsider = asyncio.run(call(ident("x"), codec.encode(_ask(ident("x")))))
        signed = asyncio.run(call(d, codec.encode(_ask(d))))
        after = asyncio.run(call(d, ranges))
    finally:
        server.stop()
    assert isinstance(before, NotMemberError) and isinstance(gossip_req, NotMemberError)
    assert isinstance(manifest, NotMemberError)
    assert isinstance(outsider, NotMemberError)  # no charter key: refused as the call starts
    assert isinstance(signed["sig"], bytes)
    assert after["data"] == [DATA[:1024]]  # its join is held there now: a member, served
    assert server.refused == {"NotMemberError": 3}


def test_a_link_server_without_a_daemon_refuses_a_countersign() -> None:
    d = ident("d")
    rs = records()
    server = DirectServer(BytesSource(ROUND, DIGEST, DATA), link=access("a", rs))
    address = server.start()

    async def call() -> Any:
        dialer = LinkDialer(LinkCredentials.create(d, FED))
        try:
            return await dialer.request(
                address, server.link.creds.serve_cert_der, codec.encode(_ask(d)), timeout=10.0
            )
        except Exception as exc:
            return exc
        finally:
            await dialer.close()

    try:
        got = asyncio.run(call())
    finally:
        server.stop()
    assert isinstance(got, NotMemberError)  # a non-member is not let into a call at all


def test_a_joiner_gathers_two_sponsors_over_their_links_and_each_holds_its_record(
    tmp_path: Path,
) -> None:
    # sponsors_required 2: each daemon's own signature leaves the record incomplete there, so
    # the joiner hands the complete record to each signer in a second call
    import time
    from types import SimpleNamespace

    from chaos_flwr.charter import load_charter
    from chaos_flwr.flower.client.sponsors import ask_sponsors
    from chaos_flwr.flower.keys import charter_path, key_path, make_federation
    from chaos_flwr.peer import Peer
    from chaos_flwr.transport.links import LinkAccess

    fed = make_federation(tmp_path, 4, founders=3, seed="countersign", sponsors_required=2)
    charter = load_charter(charter_path(fed))
    peers = [Peer(Identity.load(key_path(fed, i)), charter, incarnation=1) for i in range(4)]
    founders, joiner = peers[:3], peers[3]
    outs = [o for p in founders for o in p.bootstrap(1.0)]
    for p in founders:
        for o in outs:
            if o.to == p.party_id:
                p.handle(o.data, 1.0)
    servers, gossips = [], []
    for p in founders:
        g = Gossip(p.party_id, p.identity.sign, p.policy)
        creds = LinkCredentials.create(p.identity, p.policy.federation)
        server = DirectServer(
            BytesSource(ROUND, DIGEST, DATA),
            link=LinkAccess(creds, p.policy, g.view),
            countersign=lambda src, v, g=g: codec.encode(g.countersign(src, v, 0.0)[0]),
        )
        address = server.start()
        p.announce_endpoint(address, creds.serve_cert_der, 2.0)
        servers.append(server)
        gossips.append(g)
    try:
        held = [r for p in founders for r in p.records]
        for g in gossips:
            g.take(held)
        joiner.load_records([r.to_wire() for r in held], 3.0)
        with pytest.raises(PolicyError, match="no join pending"):
            joiner.take_join_sig(founders[0].party_id, b"\0" * 64, 3.0)
        # the relay listed one member when it asked; the others it asks over their links
        joiner.request_join(3.0, [founders[0].party_id])
        with pytest.raises(UnknownPartyError):
            joiner.take_join_sig("p" + "0" * 16, b"\0" * 64, 3.0)
        with pytest.raises(SignatureError):
            joiner.take_join_sig(founders[1].party_id, b"\0" * 64, 3.0)
        party = SimpleNamespace(peer=joiner, errors=[], pending=[], clock=time.monotonic)
        creds = LinkCredentials.create(joiner.identity, joiner.policy.federation)
        link = LinkAccess(creds, joiner.policy, joiner.view)
        signed = ask_sponsors(party, link, [p.party_id for p in founders])
    finally:
        for server in servers:
            server.stop()
    assert signed == sorted(p.party_id for p in founders) and party.errors == []
    assert joiner.is_member  # its complete record, applied; join_done queued for its sponsors
    # join_done goes to the two whose signatures completed it (through the relay, as any)
    assert len({o.to for o in party.pending}) == 2 and {o.to for o in party.pending} < set(signed)
    for g in gossips:  # each signer holds the complete record: it serves the joiner now
        assert g.view().is_active(joiner.party_id)


def test_link_calls_that_hang_or_break_are_reported_and_their_results_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the worker thread that runs a joiner's link calls (countersign, manifest) is waited for
    # within its bound: a hung or broken one is an error for every sponsor, not a reply
    from types import SimpleNamespace

    from chaos_flwr.errors import TransportError
    from chaos_flwr.flower import fetch
    from chaos_flwr.flower.client import sponsors
    from chaos_flwr.membership import EndpointInfo

    monkeypatch.setattr(fetch, "FLOWER_LINK_WORKER_GRACE_S", 0.05)

    async def fine() -> None:
        return None

    async def broken() -> None:
        raise RuntimeError("loop broke")

    async def stuck() -> None:
        await asyncio.sleep(3.0)  # ignores its own bound

    assert fetch.run_links(fine, 0.05, "t") == ""
    assert fetch.run_links(broken, 0.05, "t") == "RuntimeError: loop broke"
    assert fetch.run_links(stuck, 0.05, "t") == "hung"

    class StuckDialer:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        async def request(self, *_a: Any, **_k: Any) -> bytes:
            await asyncio.sleep(3.0)
            return codec.encode({"sig": b"\0" * 64})  # too late: never read

        async def close(self) -> None:
            return None

    monkeypatch.setattr(sponsors, "LinkDialer", StuckDialer)
    eps = {
        p: EndpointInfo(party_id=p, incarnation=1, seq=1, host="127.0.0.1", port=1, cert=b"c")
        for p in ("pa", "pb")
    }
    got = sponsors._call_all(SimpleNamespace(creds=None), eps, b"req", 0.05)  # type: ignore[arg-type]
    assert set(got) == {"pa", "pb"}
    assert all(isinstance(v, TransportError) and "hung" in str(v) for v in got.values())
    # a worker that ended with an error after some answers: those are read, the rest fail

    class ClosingBadly(StuckDialer):
        async def request(self, address: str, *_a: Any, **_k: Any) -> bytes:
            if address.endswith(":2"):
                raise RuntimeError("socket gone")  # not a ChaosError: it ends the calls
            return b"reply"

        async def close(self) -> None:
            return None

    monkeypatch.setattr(sponsors, "LinkDialer", ClosingBadly)
    eps["pb"] = dataclasses.replace(eps["pb"], port=2)
    got = sponsors._call_all(SimpleNamespace(creds=None), eps, b"req", 1.0)  # type: ignore[arg-type]
    assert got["pa"] == b"reply"
    assert isinstance(got["pb"], TransportError) and "RuntimeError: socket gone" in str(got["pb"])
