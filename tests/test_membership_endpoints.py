"""Signed endpoint records (chaos_flwr.membership): decoding, signers, merge, view."""

from __future__ import annotations

import itertools

import pytest
from link_world import FED, endpoint_record, ident, policy, records

from chaos_flwr import codec
from chaos_flwr.errors import DecodeError, PolicyError, SignatureError, UnknownPartyError
from chaos_flwr.membership import (
    Record,
    RecordSet,
    endpoint_body,
    join_body,
    leave_body,
    parse_address,
    validate_record,
)
from chaos_flwr.transport.tls import LinkCredentials

CERT = LinkCredentials.create(ident("a"), FED)


def _ep(seq: int, address: str, who: str = "a", inc: int = 0) -> Record:
    return endpoint_record(ident(who), address, CERT, seq=seq, inc=inc)


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("127.0.0.1:9000", "127.0.0.1", 9000),
        ("[::1]:80", "::1", 80),
        ("[2001:DB8:0:0::1]:443", "2001:db8::1", 443),
        ("Node-1.Example.ORG:65535", "node-1.example.org", 65535),
        ("localhost:1", "localhost", 1),
    ],
)
def test_addresses_parse_to_one_canonical_form(address: str, host: str, port: int) -> None:
    assert parse_address(address) == (host, port)
    body = endpoint_body(FED, ident("a").party_id, 0, 1, address, b"c")
    assert (body["host"], body["port"]) == (host, port)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "::1:80", "[127.0.0.1]:80", "a_b.org:80",
     "-a.org:80", "x" * 300 + ":80", "1.2.3:80", 5, "host:+80", "[::1]:99999", "0.0.0.0:80",
     "[::]:80", "224.0.0.1:80", "[::ffff:10.0.0.1]:80"],
)  # fmt: skip
def test_bad_addresses_are_refused_with_decode_error(address: object) -> None:
    with pytest.raises(DecodeError):
        parse_address(address)


def test_malformed_endpoint_bodies_are_refused_with_decode_error() -> None:
    good = endpoint_body(FED, ident("a").party_id, 0, 1, "10.0.0.1:9000", b"cert")
    sigs = {ident("a").party_id: b"\x00" * 64}
    bad_values = [
        {**good, "host": "10.0.0.01"},  # not canonical
        {**good, "host": "Node.example"},  # not canonical (upper case)
        {**good, "port": 0},
        {**good, "port": True},
        {**good, "seq": -1},
        {**good, "cert": b""},
        {**good, "cert": b"x" * 5000},
        {**good, "cert": "text"},
        {**good, "extra": 1},
        {k: v for k, v in good.items() if k != "seq"},
    ]
    for body in bad_values:
        with pytest.raises(DecodeError):
            Record.from_wire(codec.decode(codec.encode({"body": body, "sigs": sigs})))


def test_an_endpoint_is_signed_by_its_subject_alone() -> None:
    pol = policy()
    a, b, x = ident("a"), ident("b"), ident("x")
    body = endpoint_body(FED, a.party_id, 0, 1, "10.0.0.1:9000", b"cert")
    validate_record(Record.sign(body, [a]), pol)
    with pytest.raises(PolicyError):  # b may not announce where a is
        validate_record(Record.sign(body, [b]), pol)
    with pytest.raises(PolicyError):
        validate_record(Record.sign(body, [a, b]), pol)
    forged = Record(body=body, signatures={a.party_id: x.sign(Record.sign(body, [a]).signed)})
    with pytest.raises(SignatureError):  # a's id, x's key
        validate_record(forged, pol)
    outsider = endpoint_body(FED, x.party_id, 0, 1, "10.0.0.1:9000", b"cert")
    with pytest.raises(UnknownPartyError):
        validate_record(Record.sign(outsider, [x]), pol)
    other_fed = endpoint_body("other", a.party_id, 0, 1, "10.0.0.1:9000", b"cert")
    with pytest.raises(PolicyError):
        validate_record(Record.sign(other_fed, [a]), pol)


def test_the_newest_endpoint_wins_in_any_order_and_converges() -> None:
    recs = [_ep(1, "10.0.0.1:9000"), _ep(2, "[2001:db8::7]:9000"), _ep(3, "node.example:9")]
    views = set()
    for order in itertools.permutations(recs):
        rs = records(list(order))
        ep = rs.endpoint(ident("a").party_id)
        assert ep is not None and (ep.seq, ep.address) == (3, "node.example:9")
        assert ep.cert == CERT.serve_cert_der
        assert len([r for r in rs if r.kind == "endpoint"]) == 1  # the older ones are dropped
        views.add((rs.view().digest, rs.digest()))
    assert len(views) == 1
    rs = records(recs)
    assert rs.add(_ep(2, "10.9.9.9:1")) is False  # superseded: not held, view unchanged
    # equal seq, different address (the party equivocated): one deterministic winner
    x, y = _ep(5, "10.0.0.1:1"), _ep(5, "10.0.0.2:1")
    assert records([x, y]).view().digest == records([y, x]).view().digest


def test_the_view_lists_an_endpoint_only_for_an_active_member_at_its_incarnation() -> None:
    a = ident("a")
    rs = records([_ep(1, "10.0.0.1:9000")])
    assert rs.view().endpoint(a.party_id) is not None
    assert "endpoints" in rs.view().to_value()
    no_ep = records()
    assert "endpoints" not in no_ep.view().to_value()  # views without endpoints hash as before
    rs.add(Record.sign(leave_body(FED, a.party_id, 0), [a]))
    assert rs.endpoint(a.party_id) is None and rs.view().endpoint(a.party_id) is None
    rs.add(Record.sign(join_body(FED, a.party_id, 1, 5.0), [a]))  # rejoined: must announce again
    assert rs.endpoint(a.party_id) is None
    rs.add(_ep(1, "10.0.0.2:9000", inc=1))
    ep = rs.endpoint(a.party_id)
    assert ep is not None and ep.address == "10.0.0.2:9000"
    # an endpoint of a party never joined is held but not listed
    d = ident("d")
    lone = RecordSet(policy())
    lone.add(endpoint_record(d, "10.0.0.3:1", CERT))
    assert len(lone) == 1 and lone.endpoint(d.party_id) is None


def test_endpoint_records_converge_across_peers_and_the_newest_wins_after_a_partition() -> None:
    from test_peer import FED as PEER_FED
    from test_peer import F, J, cluster

    net, _ = cluster(joiners=1)
    f0 = net.peers[F[0].party_id]
    creds = LinkCredentials.create(F[0], PEER_FED)

    def ep(seq: int, address: str) -> Record:
        cert = creds.serve_cert_der
        body = endpoint_body(PEER_FED, F[0].party_id, f0.incarnation, seq, address, cert)
        return Record.sign(body, [F[0]])

    f0.load_records([ep(1, "10.0.0.1:9000").to_wire()], net.now)
    net.tick(rounds=12)  # anti-entropy carries it like any record
    got = {pid: p.view().endpoint(F[0].party_id) for pid, p in net.peers.items()}
    assert all(e is not None and e.address == "10.0.0.1:9000" for e in got.values()), got
    assert len(net.digests()) == 1
    # f0 moves while cut off from half the federation; the newer record wins everywhere
    net.partition([F[0].party_id, F[1].party_id], [F[2].party_id, J[0].party_id])
    f0.load_records([ep(2, "[2001:db8::1]:9000").to_wire()], net.now)
    net.tick(rounds=4)
    assert net.peers[F[2].party_id].view().endpoint(F[0].party_id).address == "10.0.0.1:9000"  # type: ignore[union-attr]
    net.heal()
    net.tick(rounds=12)
    addrs = {p.view().endpoint(F[0].party_id).address for p in net.live()}  # type: ignore[union-attr]
    assert addrs == {"[2001:db8::1]:9000"} and len(net.digests()) == 1
