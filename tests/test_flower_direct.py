"""Direct grpc links for joiner pulls (chaos_flwr.flower.direct) and per-donor rate estimates.

Real grpc servers on 127.0.0.1, stopped at the end of each test; the relay is a small loop
that answers the joiner's relay requests with ``serve_request`` over each donor's bytes. The
pull tests run twice: over authenticated links (``signed``: donors are charter members with
signed endpoint records, mutual TLS) and over the legacy loopback links.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord
from link_world import access, endpoint_record, ident, records

from chaos_flwr.errors import ConfigError, StoreError
from chaos_flwr.flower.client.donor import serve_request
from chaos_flwr.flower.client.joiner import JoinerPull
from chaos_flwr.flower.direct import (
    BytesSource,
    DirectServer,
    check_address,
    fetch_ranges,
)
from chaos_flwr.state import TrainingState
from chaos_flwr.store import ReplicaStore
from chaos_flwr.transport.shaping import Shaper, parse_profile

ROUND = 4


def _state() -> TrainingState:
    rng = np.random.default_rng(7)
    return TrainingState({"w": rng.standard_normal(40_000).astype(np.float32)}, ROUND)


STATE = _state()
DATA = STATE.to_bytes()
DIGEST = STATE.digest()


class Relay:
    """The relay path: each named donor answers from its bytes; ``dead`` ones are lost."""

    def __init__(self, addrs: Mapping[str, str], dead: set[str] | None = None) -> None:
        self.addrs = dict(addrs)
        self.dead = dead if dead is not None else set()
        self.shard_bytes: dict[str, int] = {}
        self.steps = 0

    def run(self, pull: JoinerPull) -> str:
        status, reqs = pull.start(0.0)
        while status == "want":
            self.steps += 1
            assert self.steps < 20
            replies: dict[str, ConfigRecord] = {}
            lost: set[str] = set()
            for donor, req in reqs.items():
                if donor in self.dead:
                    lost.add(donor)
                    continue
                rep = serve_request(DATA, req, direct_addr=self.addrs.get(donor, ""))
                if req.get("op") == "shards":
                    got = rep.get("data")
                    assert isinstance(got, list)
                    self.shard_bytes[donor] = self.shard_bytes.get(donor, 0) + sum(
                        len(x) for x in got if isinstance(x, bytes)
                    )
                replies[donor] = rep
            status, reqs = pull.step(replies, lost, float(self.steps))
        return status


class Net:
    """Donor servers and the joiner's pull, over signed (authenticated) or legacy links.

    Donors are named ``a``..``d`` (charter members of tests/link_world.py); :meth:`pid` gives
    the id a pull uses (the party id when signed, the name itself when legacy).
    """

    def __init__(self, signed: bool) -> None:
        self.signed = signed
        self.records = records()
        self.started: list[DirectServer] = []

    def pid(self, name: str) -> str:
        return ident(name).party_id if self.signed else name

    def serve(self, name: str, data: bytes = DATA, shaper: Shaper | None = None) -> DirectServer:
        from chaos_flwr.transport.tls import LinkCredentials

        creds = LinkCredentials.create(ident(name), "link-fed") if self.signed else None
        link = access(name, self.records, creds) if creds is not None else None
        server = DirectServer(BytesSource(ROUND, DIGEST, data), shaper=shaper, link=link)
        address = server.start()
        self.started.append(server)
        if creds is not None:
            self.records.add(endpoint_record(ident(name), address, creds))
        return server

    def pull(self, names: list[str], **kw: object) -> JoinerPull:
        link = access("e", self.records) if self.signed else None  # e joins through the pull
        return JoinerPull(ROUND, DIGEST, [self.pid(n) for n in names], link=link, **kw)  # type: ignore[arg-type]

    def relay(self, addrs: Mapping[str, str], dead: set[str] | None = None) -> Relay:
        return Relay({self.pid(n): a for n, a in addrs.items()}, dead)


@pytest.fixture(params=["signed", "legacy"])
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    n = Net(request.param == "signed")
    yield n
    for server in n.started:
        server.stop()


def _check(pull: JoinerPull, status: str) -> None:
    assert status == "done", pull.error
    assert pull.state is not None
    assert pull.state.digest() == DIGEST
    assert pull.state.same_as(STATE)


def test_two_direct_donors_and_one_relay_donor_pull_the_certified_state(net: Net) -> None:
    a, b = net.serve("a"), net.serve("b")
    assert a.address and b.address
    relay = net.relay({"a": a.address, "b": b.address})
    pull = net.pull(["a", "b", "c"])
    _check(pull, relay.run(pull))
    pa, pb, pc = net.pid("a"), net.pid("b"), net.pid("c")
    stats = pull.stats()
    assert stats["direct-donors"] == sorted([pa, pb])
    assert pull.direct_bytes[pa] > 0 and pull.direct_bytes[pb] > 0
    # every direct byte the joiner counted left a direct server (plus the probes)
    assert a.bytes_served >= pull.direct_bytes[pa]
    assert b.bytes_served >= pull.direct_bytes[pb]
    assert pa not in relay.shard_bytes and pb not in relay.shard_bytes
    planned = dict(zip(stats["plan-donors"], stats["plan-bytes"], strict=True))  # type: ignore[arg-type]
    assert planned[pc] > 0
    assert pull.received[pc] == relay.shard_bytes[pc] == planned[pc]
    assert pc not in pull.direct_bytes
    assert sum(pull.received.values()) == len(DATA)
    rates = dict(zip(stats["rate-donors"], stats["rate-bps"], strict=True))  # type: ignore[arg-type]
    assert set(rates) == {pa, pb, pc} and all(r > 0 for r in rates.values())
    assert a.refusals() == {} and b.refusals() == {}


def test_a_donor_that_dies_mid_direct_transfer_is_replanned_via_the_others(net: Net) -> None:
    a, b = net.serve("a"), net.serve("b")
    assert a.address and b.address
    relay = net.relay({"a": a.address, "b": b.address})
    pa, pb = net.pid("a"), net.pid("b")
    reads = 0

    class Dying(BytesSource):
        def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
            nonlocal reads
            reads += 1
            if reads > 2:  # the probe and one shard range, then the donor is gone
                relay.dead.add(pa)  # gone from the relay too
                threading.Thread(target=a.stop).start()
                raise StoreError("donor crashed")
            return super().read(server_round, digest, start, end)

    a.source = Dying(ROUND, DIGEST, DATA)
    pull = net.pull(["a", "b", "c"], direct_batch_bytes=1)
    _check(pull, relay.run(pull))
    assert pull.direct_bytes[pa] > 0  # it sent some shards before it died
    assert pa in pull.direct_failed and pa in pull.lost
    assert pull.direct_bytes[pb] > 0
    assert sum(pull.received.values()) == len(DATA)


def test_a_donor_advertising_a_bad_address_falls_back_to_the_relay(net: Net) -> None:
    a = net.serve("a")
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert a.address
    relay = net.relay({"a": a.address, "b": closed, "c": "10.1.2.3:9000"})
    pull = net.pull(["a", "b", "c"])
    _check(pull, relay.run(pull))
    pa, pb, pc = net.pid("a"), net.pid("b"), net.pid("c")
    assert sorted(pull.direct_failed) == sorted([pb, pc])  # c is never dialled
    if net.signed:  # neither b nor c signed an endpoint: the relay's addresses are refused
        assert all("EndpointError" in pull.direct_failed[d] for d in (pb, pc))
    else:
        assert "not loopback" in pull.direct_failed[pc]
    assert pull.lost == []
    assert relay.shard_bytes[pb] == pull.received[pb] > 0
    assert pull.direct_bytes[pa] == pull.received[pa] > 0


def test_a_relay_pointing_a_donor_elsewhere_is_refused_and_bypassed(net: Net) -> None:
    a, b = net.serve("a"), net.serve("b")
    assert a.address and b.address
    # the relay swaps the two donors' addresses: legacy links dial them (and the manifest
    # check still catches nothing wrong, the bytes are the same); signed links refuse both
    relay = net.relay({"a": b.address, "b": a.address})
    pull = net.pull(["a", "b"])
    _check(pull, relay.run(pull))
    if net.signed:
        assert sorted(pull.direct_failed) == sorted([net.pid("a"), net.pid("b")])
        assert all("EndpointError" in e for e in pull.direct_failed.values())
        assert a.requests_served == b.requests_served == 0
        assert sum(relay.shard_bytes.values()) == len(DATA)
    else:
        assert pull.direct_failed == {}


def test_a_donor_sending_a_bad_shard_directly_is_dropped(net: Net) -> None:
    bad = (np.frombuffer(DATA, dtype=np.uint8) ^ 0xFF).tobytes()  # every shard it sends is bad
    a, b = net.serve("a", bad), net.serve("b")
    assert a.address and b.address
    relay = net.relay({"a": a.address, "b": b.address})
    pull = net.pull(["a", "b", "c"], direct_batch_bytes=1)
    _check(pull, relay.run(pull))
    pa = net.pid("a")
    planned = dict(zip(pull.stats()["plan-donors"], pull.stats()["plan-bytes"], strict=True))  # type: ignore[arg-type]
    assert planned[pa] > 0
    assert pa in pull.lost and pa not in pull.received
    assert pa not in relay.shard_bytes  # dropped, not sent to the relay path
    assert sum(pull.received.values()) == len(DATA)


def test_rate_estimates_shift_shares_toward_the_faster_donor(net: Net) -> None:
    profile = parse_profile({"parties": {"replica": {"up_mb_s": 0.5}}})
    slow = net.serve("a", shaper=Shaper(profile, "replica", burst=4096))
    fast = net.serve("b")
    assert slow.address and fast.address
    relay = net.relay({"a": slow.address, "b": fast.address})
    pull = net.pull(["a", "b"])
    _check(pull, relay.run(pull))
    ps, pf = net.pid("a"), net.pid("b")
    stats = pull.stats()
    rates = dict(zip(stats["rate-donors"], stats["rate-bps"], strict=True))  # type: ignore[arg-type]
    assert rates[ps] < 0.6e6  # the probe passed the 0.5 MB/s bucket
    assert rates[ps] < rates[pf]
    planned = dict(zip(stats["plan-donors"], stats["plan-bytes"], strict=True))  # type: ignore[arg-type]
    assert planned.get(ps, 0) < planned[pf]
    assert pull.received.get(ps, 0) < pull.received[pf]
    # without estimates the two would get equal shares
    equal = JoinerPull(ROUND, DIGEST, [ps, pf], direct=False)
    assert Relay({}).run(equal) == "done"
    eq = dict(zip(equal.stats()["plan-donors"], equal.stats()["plan-bytes"], strict=True))  # type: ignore[arg-type]
    assert abs(eq[ps] - eq[pf]) <= len(DATA) // 4


def test_serve_request_names_the_direct_address_and_addresses_are_checked() -> None:
    rec = serve_request(DATA, ConfigRecord({"op": "size"}), direct_addr="127.0.0.1:9")
    assert rec["direct"] == "127.0.0.1:9" and rec["total"] == len(DATA)
    assert "direct" not in serve_request(DATA, ConfigRecord({"op": "size"}))
    assert check_address("localhost:80") == "localhost:80"
    for bad in ("10.0.0.1:80", "127.0.0.1:0", "127.0.0.1", 5, "127.0.0.1:x"):
        with pytest.raises(ConfigError):
            check_address(bad)


def test_serve_replica_daemon_serves_the_store_and_stops_on_sigterm(tmp_path: Path) -> None:
    ReplicaStore(tmp_path / "replicas").put(STATE, certificate=b"cert")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos_flwr.cli", "serve-replica", "--state-dir", str(tmp_path),
         "--listen", addr],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"serving {addr}"
        got = fetch_ranges(
            {"d": addr}, {"d": [(0, 0, 100), (1, 100, len(DATA))]},
            server_round=ROUND, digest=DIGEST, timeout_s=10.0,
        )  # fmt: skip
        assert got["d"].error == ""
        assert b"".join(c for _, c, _ in got["d"].shards) == DATA
        wrong = fetch_ranges(
            {"d": addr}, {"d": [(0, 0, 10)]}, server_round=ROUND, digest=b"x" * 32, timeout_s=10.0
        )
        assert wrong["d"].error and not wrong["d"].shards
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0
        assert f"1 requests, {len(DATA)} bytes served" in out  # the wrong digest was refused
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_party_settings_read_the_direct_address_and_name_a_bad_one(tmp_path: Path) -> None:
    from flwr.app import Context, RecordDict

    from chaos_flwr.flower.client import party_settings

    def ctx(node: dict[str, object]) -> Context:
        return Context(
            run_id=1, node_id=1, node_config=node,  # type: ignore[arg-type]
            state=RecordDict(), run_config={"chaos-unsigned": True},
        )  # fmt: skip

    state = str(tmp_path / "st")
    got = party_settings(ctx({"chaos-state-dir": state, "chaos-direct-addr": "127.0.0.1:9301"}))
    assert got.direct_addr == "127.0.0.1:9301"
    assert party_settings(ctx({"chaos-state-dir": state})).direct_addr == ""
    with pytest.raises(ConfigError, match="node_config 'chaos-direct-addr'"):
        party_settings(ctx({"chaos-state-dir": state, "chaos-direct-addr": "192.168.1.5:80"}))


def test_the_in_process_server_serves_the_party_store_once_per_address(tmp_path: Path) -> None:
    from chaos_flwr.flower.direct import ensure_server, stop_servers

    store = ReplicaStore(tmp_path / "replicas")
    store.put(STATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        server = ensure_server(tmp_path, addr)
        assert ensure_server(tmp_path, addr) is server and server.address == addr
        got = fetch_ranges(
            {"d": addr}, {"d": [(0, 5, 50)]}, server_round=ROUND, digest=DIGEST, timeout_s=10.0
        )
        assert got["d"].shards == [(0, DATA[5:50], got["d"].shards[0][2])]
        other = fetch_ranges(  # a round the store does not hold
            {"d": addr}, {"d": [(0, 0, 8)]}, server_round=ROUND + 1, digest=DIGEST, timeout_s=10.0
        )
        assert "not stored" in other["d"].error
    finally:
        stop_servers()
    after = fetch_ranges(
        {"d": addr}, {"d": [(0, 0, 8)]}, server_round=ROUND, digest=DIGEST, timeout_s=2.0
    )
    assert after["d"].error and not after["d"].shards


def test_a_joiner_that_knows_signed_endpoints_pulls_in_its_first_step() -> None:
    # the donors' endpoints are in the joiner's view and the ServerApp named the size: the
    # manifest, the probes and the shards all go over the links, nothing through the relay
    net = Net(signed=True)
    try:
        a, b = net.serve("a"), net.serve("b")
        relay = net.relay({})
        pull = net.pull(["a", "b"], total_hint=len(DATA))
        _check(pull, relay.run(pull))
        assert relay.steps == 0 and relay.shard_bytes == {}
        assert set(pull.direct_bytes) == {net.pid("a"), net.pid("b")}
        assert sum(pull.direct_bytes.values()) == len(DATA)
        # a manifest, a probe and shard batches: the asked donor served one request more
        assert a.requests_served >= 3 and b.requests_served >= 2
        assert a.refusals() == {} and b.refusals() == {}
    finally:
        for server in net.started:
            server.stop()


def test_a_direct_manifest_that_fails_falls_back_to_the_relay() -> None:
    net = Net(signed=True)
    try:
        other = TrainingState({"w": np.zeros(40_000, np.float32)}, ROUND).to_bytes()
        net.serve("a", data=other)  # holds other bytes under the certified name
        b = net.serve("b")
        assert b.address
        relay = net.relay({"a": "", "b": b.address})
        pull = net.pull(["a", "b"], total_hint=len(DATA))
        _check(pull, relay.run(pull))
        # a's manifest did not name the digest: a was dropped and b's taken through the relay
        assert net.pid("a") in pull.lost and relay.steps >= 1
        assert pull.received == {net.pid("b"): len(DATA)}
    finally:
        for server in net.started:
            server.stop()


def test_a_manifest_request_is_checked_and_refused_with_typed_errors() -> None:
    from chaos_flwr.flower.direct import fetch_manifest
    from chaos_flwr.state import Manifest

    with DirectServer(BytesSource(ROUND, DIGEST, DATA)) as server:
        assert server.address
        addrs = {"d": server.address}

        def ask(shape: tuple[int, int, int], digest: bytes = DIGEST) -> tuple[bytes | None, str]:
            return fetch_manifest(addrs, "d", shape, server_round=ROUND, digest=digest,
                                  timeout_s=10.0)  # fmt: skip

        raw, why = ask((len(DATA), 4096, -(-len(DATA) // 4096)))
        assert why == "" and raw == Manifest.build(DATA, 4096).to_bytes()
        # (a legacy link names the donor's refusal inside a TransportError)
        assert "DecodeError('direct manifest request for" in ask((len(DATA) + 1, 4096, 40))[1]
        assert "RequestTooLargeError" in ask((len(DATA), 4096, 10**6))[1]
        assert "StoreError" in ask((len(DATA), 4096, 40), digest=b"x" * 32)[1]
        assert "does not cut the state" in ask((len(DATA), 1, 3))[1]
        assert server.refusals() == {"DecodeError": 2, "RequestTooLargeError": 1, "StoreError": 1}
