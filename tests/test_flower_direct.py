"""Direct links for joiner pulls (chaos_flwr.flower.direct) and per-donor rate estimates.

Real grpc servers on 127.0.0.1 over mutual TLS (donors are charter members with signed endpoint
records), stopped at the end of each test; the relay is a small loop that answers the joiner's
relay requests with ``serve_request`` over each donor's bytes. Unless a test says otherwise the
joiner is not told the state's size, so it learns the donors' addresses from their relayed
replies (and checks each against the donor's signed record).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord
from link_world import access, endpoint_record, ident, records
from test_shaping import FakeClock

from chaos_flwr.errors import ChaosError, ConfigError, StoreError
from chaos_flwr.flower.client.donor import serve_request
from chaos_flwr.flower.client.joiner import JoinerPull
from chaos_flwr.flower.direct import BytesSource, DirectServer
from chaos_flwr.flower.fetch import fetch_ranges
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
    """Donor servers and the joiner's pull over authenticated links.

    Donors are named ``a``..``d`` (charter members of tests/link_world.py); :meth:`pid` gives
    the party id a pull uses.
    """

    def __init__(self) -> None:
        self.records = records()
        self.started: list[DirectServer] = []

    def pid(self, name: str) -> str:
        return ident(name).party_id

    def serve(self, name: str, data: bytes = DATA, shaper: Shaper | None = None) -> DirectServer:
        from chaos_flwr.transport.tls import LinkCredentials

        creds = LinkCredentials.create(ident(name), "link-fed")
        link = access(name, self.records, creds)
        server = DirectServer(BytesSource(ROUND, DIGEST, data), shaper=shaper, link=link)
        address = server.start()
        self.started.append(server)
        self.records.add(endpoint_record(ident(name), address, creds))
        return server

    def pull(self, names: list[str], **kw: object) -> JoinerPull:
        link = access("e", self.records)  # e joins through the pull
        return JoinerPull(ROUND, DIGEST, [self.pid(n) for n in names], link=link, **kw)  # type: ignore[arg-type]

    def relay(self, addrs: Mapping[str, str], dead: set[str] | None = None) -> Relay:
        return Relay({self.pid(n): a for n, a in addrs.items()}, dead)


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
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
    # every direct byte the joiner counted left a direct server (plus any end-game copies)
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
            if reads > 1:  # one shard range, then it is gone
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
    assert sorted(pull.direct_failed) == sorted([pb, pc])  # never dialled
    # neither b nor c signed an endpoint: the relay's addresses are refused
    assert all("EndpointError" in pull.direct_failed[d] for d in (pb, pc))
    assert pull.lost == []
    assert relay.shard_bytes[pb] == pull.received[pb] > 0
    assert pull.direct_bytes[pa] == pull.received[pa] > 0


def test_a_relay_pointing_a_donor_elsewhere_is_refused_and_bypassed(net: Net) -> None:
    a, b = net.serve("a"), net.serve("b")
    assert a.address and b.address
    # the relay swaps the two donors' addresses: a joiner that learns addresses from the
    # relayed replies refuses both (they are not the signed ones) and pulls through the relay
    relay = net.relay({"a": b.address, "b": a.address})
    pull = net.pull(["a", "b"], direct=True)
    pull.negotiation.known = frozenset()  # as if the view had not held their records yet
    pull.negotiation.addresses.clear()
    _check(pull, relay.run(pull))
    assert sorted(pull.direct_failed) == sorted([net.pid("a"), net.pid("b")])
    assert all("EndpointError" in e for e in pull.direct_failed.values())
    assert a.requests_served == b.requests_served == 0
    assert sum(relay.shard_bytes.values()) == len(DATA)
    # one whose view holds their signed endpoints ignores the relay's addresses altogether
    again = net.relay({"a": b.address, "b": a.address})
    pull = net.pull(["a", "b"])
    _check(pull, again.run(pull))
    assert pull.direct_failed == {} and again.shard_bytes == {}
    assert pull.direct_bytes == pull.received and sum(pull.received.values()) == len(DATA)


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


def test_the_fetch_times_the_links_and_moves_shares_to_the_faster_donor(net: Net) -> None:
    from chaos_flwr.pull.negotiation import PULL_ASSUMED_BANDWIDTH_BPS

    profile = parse_profile({"parties": {"replica": {"up_mb_s": 0.5}}})
    slow = net.serve("a", shaper=Shaper(profile, "replica", burst=4096))
    fast = net.serve("b")
    assert slow.address and fast.address
    relay = net.relay({"a": slow.address, "b": fast.address})
    pull = net.pull(["a", "b"])
    _check(pull, relay.run(pull))
    ps, pf = net.pid("a"), net.pid("b")
    stats = pull.stats()
    planned = dict(zip(stats["plan-donors"], stats["plan-bytes"], strict=True))  # type: ignore[arg-type]
    # planned as equal halves (nothing measured yet), the fast link took over most of the
    # slow one's: the pull queue, not a probe, follows the rates
    assert abs(planned[ps] - planned[pf]) <= len(DATA) // 4
    assert pull.received.get(ps, 0) < len(DATA) // 2 < pull.received[pf]
    rates = pull.negotiation.rates()  # the fetch's own timing, in the pull's monitor
    assert rates[pf] != PULL_ASSUMED_BANDWIDTH_BPS  # measured, not the prior
    if pull.received.get(ps):  # its first batch may have been copied in the end game
        assert rates[ps] < 0.6e6 < rates[pf]  # the 0.5 MB/s bucket
    assert stats["direct-fetch-s"] > 0


def test_serve_request_names_the_direct_address() -> None:
    rec = serve_request(DATA, ConfigRecord({"op": "size"}), direct_addr="127.0.0.1:9")
    assert rec["direct"] == "127.0.0.1:9" and rec["total"] == len(DATA)
    assert "direct" not in serve_request(DATA, ConfigRecord({"op": "size"}))


def test_party_settings_read_the_direct_address_and_name_a_bad_one(tmp_path: Path) -> None:
    from flwr.app import Context, RecordDict

    from chaos_flwr.flower.client import party_settings

    def ctx(node: dict[str, object]) -> Context:
        return Context(
            run_id=1, node_id=1, node_config=node,  # type: ignore[arg-type]
            state=RecordDict(), run_config={"chaos-unsigned": True},
        )  # fmt: skip

    state = str(tmp_path / "st")
    assert party_settings(ctx({"chaos-state-dir": state})).direct_addr == ""
    # an unsigned party has no keys to authenticate links with: refused, not ignored
    with pytest.raises(ConfigError, match=r"node_config 'chaos-direct-addr'.*unsigned"):
        party_settings(ctx({"chaos-state-dir": state, "chaos-direct-addr": "127.0.0.1:9301"}))
    from chaos_flwr.flower.client.settings import _direct_address

    assert _direct_address("Inst1.Example.ORG:9300", False) == "inst1.example.org:9300"
    assert _direct_address("[2001:DB8::1]:80", False) == "[2001:db8::1]:80"
    for bad in ("10.0.0.1", "10.0.0.1:0", "224.0.0.1:80", 5):
        with pytest.raises(ChaosError):
            _direct_address(bad, False)


def test_the_in_process_server_serves_the_party_store_once_per_address(
    tmp_path: Path, net: Net
) -> None:
    from chaos_flwr.flower.direct import ensure_server, stop_servers
    from chaos_flwr.transport.tls import LinkCredentials

    store = ReplicaStore(tmp_path / "replicas")
    store.put(STATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    creds = LinkCredentials.create(ident("a"), "link-fed")
    net.records.add(endpoint_record(ident("a"), addr, creds))
    pa, joiner = net.pid("a"), access("e", net.records)

    def fetch(rnd: int, ranges: list[tuple[int, int, int]], timeout_s: float = 10.0) -> Any:
        return fetch_ranges({}, {pa: ranges}, server_round=rnd, digest=DIGEST,
                            timeout_s=timeout_s, link=joiner)[pa]  # fmt: skip

    try:
        server = ensure_server(tmp_path, addr, link=access("a", net.records, creds))
        assert ensure_server(tmp_path, addr, link=server.link) is server
        assert server.address == addr
        got = fetch(ROUND, [(0, 5, 50)])
        assert got.shards == [(0, DATA[5:50], got.shards[0][2])]
        other = fetch(ROUND + 1, [(0, 0, 8)])  # a round the store does not hold
        assert "not stored" in other.error and isinstance(other.exc, StoreError)
    finally:
        stop_servers()
    after = fetch(ROUND, [(0, 0, 8)], timeout_s=2.0)
    assert after.error and not after.shards


def test_a_joiner_that_knows_signed_endpoints_pulls_in_its_first_step() -> None:
    # the donors' endpoints are in the joiner's view and the ServerApp named the size: the
    # manifest and the shards all go over the links, nothing through the relay
    net = Net()
    try:
        a, b = net.serve("a"), net.serve("b")
        relay = net.relay({})
        pull = net.pull(["a", "b"], total_hint=len(DATA))
        _check(pull, relay.run(pull))
        assert relay.steps == 0 and relay.shard_bytes == {}
        assert set(pull.direct_bytes) == {net.pid("a"), net.pid("b")}
        assert sum(pull.direct_bytes.values()) == len(DATA)
        # a manifest and shard batches: the asked donor served one request more
        assert a.requests_served >= 2 and b.requests_served >= 1
        assert a.refusals() == {} and b.refusals() == {}
    finally:
        for server in net.started:
            server.stop()


def test_a_direct_manifest_that_fails_falls_back_to_the_relay() -> None:
    net = Net()
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


def test_a_manifest_request_is_checked_and_refused_with_typed_errors(net: Net) -> None:
    from chaos_flwr.flower.fetch import fetch_manifest
    from chaos_flwr.state import Manifest

    server, pa = net.serve("a"), net.pid("a")
    link = access("e", net.records)

    def ask(shape: tuple[int, int, int], digest: bytes = DIGEST) -> tuple[bytes | None, str]:
        return fetch_manifest({}, pa, shape, server_round=ROUND, digest=digest, timeout_s=10.0,
                              link=link)  # fmt: skip

    raw, why = ask((len(DATA), 4096, -(-len(DATA) // 4096)))
    assert why == "" and raw == Manifest.build(DATA, 4096).to_bytes()
    why = ask((len(DATA) + 1, 4096, 40))[1]
    assert why.startswith("DecodeError") and "the state has" in why
    assert ask((len(DATA), 4096, 10**6))[1].startswith("RequestTooLargeError")
    assert ask((len(DATA), 4096, 40), digest=b"x" * 32)[1].startswith("StoreError")
    assert "do not cover a state" in ask((len(DATA), 1, 3))[1]
    assert ask((len(DATA), 4096, -(-len(DATA) // 4096)))[0] == raw  # from the donor's cache
    assert len(server._manifests) == 1
    assert server.refusals() == {"DecodeError": 2, "RequestTooLargeError": 1, "StoreError": 1}
    # a party the view does not list is refused before anything is read
    assert fetch_manifest(
        {}, net.pid("b"), (len(DATA), 4096, 40), server_round=ROUND, digest=DIGEST,
        timeout_s=10.0, link=link,
    )[1].startswith("EndpointError")  # fmt: skip


def test_a_direct_pull_cuts_shards_fine_enough_for_the_measured_rates(net: Net) -> None:
    from chaos_flwr.pull.negotiation import PULL_DIRECT_SHARDS_PER_DONOR, _direct_shards

    # at most PULL_DIRECT_SHARD_BYTES a shard, at least PULL_DIRECT_SHARDS_PER_DONOR per holder
    assert _direct_shards(64 << 20, 4, 1024) == 256
    assert _direct_shards(len(DATA), 3, 1024) == 32 >= 3 * PULL_DIRECT_SHARDS_PER_DONOR
    assert _direct_shards(5000, 4, 1024) == 4  # shards never below the minimum size
    assert _direct_shards(100, 4, 1024) == 1
    # a pull with four equal assumed rates used to fix one shard per holder, so nothing the
    # links showed could change the shares: now the shape is fine
    servers = {n: net.serve(n) for n in "abc"}
    pull = net.pull(list(servers), total_hint=len(DATA))
    assert pull.start(0.0)[0] == "done"
    assert pull.stats()["num-shards"] == _direct_shards(len(DATA), 3, 1024)


def test_a_donor_done_early_takes_over_the_last_shards_of_a_slow_one(net: Net) -> None:
    # the fetch is a pull queue: planned as equal halves, the fast link takes over shards of
    # the slow one's half, every shard arrives once
    profile = parse_profile({"parties": {"replica": {"up_mb_s": 0.2}}})
    slow = net.serve("a", shaper=Shaper(profile, "replica", burst=4096))
    fast = net.serve("b")
    assert slow.address and fast.address
    link = access("e", net.records)
    size = 4000
    shards = [(i, i * size, min(len(DATA), (i + 1) * size)) for i in range(len(DATA) // size)]
    half = len(shards) // 2
    plan = {net.pid("a"): shards[:half], net.pid("b"): shards[half:]}
    got = fetch_ranges({}, plan, server_round=ROUND, digest=DIGEST, batch_bytes=size, link=link)
    a, b = got[net.pid("a")], got[net.pid("b")]
    assert not a.error and not b.error
    indices = sorted(i for r in (a, b) for i, _, _ in r.shards)
    assert indices == [i for i, _, _ in shards]  # each shard once
    for r in (a, b):
        assert all(c == DATA[i * size : i * size + len(c)] for i, c, _ in r.shards)
    assert len(b.shards) > len(shards) - half and len(a.shards) < half  # took over


def test_the_end_game_copies_a_slow_link_s_last_batch_and_returns_without_it(net: Net) -> None:
    # the slow donor's only shard takes 1 s at its rate; the fast one, done with its own,
    # asks for a copy, and the fetch returns with every shard once, the slow copy dropped
    profile = parse_profile({"parties": {"replica": {"up_mb_s": 0.02}}})
    slow = net.serve("a", shaper=Shaper(profile, "replica", burst=4096))
    fast = net.serve("b")
    assert slow.address and fast.address
    size = 20_000
    shards = [(i, i * size, (i + 1) * size) for i in range(6)]
    plan = {net.pid("a"): shards[:1], net.pid("b"): shards[1:]}
    t0 = time.monotonic()
    got = fetch_ranges({}, plan, server_round=ROUND, digest=DIGEST, batch_bytes=size,
                       link=access("e", net.records))  # fmt: skip
    elapsed = time.monotonic() - t0
    a, b = got[net.pid("a")], got[net.pid("b")]
    assert not a.error and not b.error and a.shards == []
    assert sorted(i for i, _, _ in b.shards) == list(range(6))
    assert all(c == DATA[i * size : (i + 1) * size] for i, c, _ in b.shards)
    assert elapsed < size / 0.02e6  # it did not wait for the slow copy


def test_the_pull_queue_copies_a_batch_once_and_only_when_overdue() -> None:
    from chaos_flwr.flower.fetch import _Queues

    clock = FakeClock()
    q = _Queues({"a": [(0, 0, 100)], "b": [(1, 100, 200)], "c": [(2, 200, 300)]}, 100, clock)
    for d in "abc":
        q.send(d, q.take(d))
    assert q.take("b") == [] and q.take("c") == []  # no rate yet: nothing to copy
    clock.t += 0.01
    assert q.deliver(1) and q.deliver(2)
    q.done("b", 10**6)  # fast links: a's batch is overdue at their rates...
    q.done("c", 10**6)
    assert q.take("b") == []  # ...but not yet for twice their first request's time (10 ms)
    assert q.look_again["b"] == pytest.approx(clock.t + 0.01)
    clock.t += 0.011
    assert q.take("b") == [(0, 0, 100)]  # a's batch: no rate, in flight 21 ms
    assert q.take("c") == []  # already asked of a second donor
    assert not q.complete.is_set()
    assert q.deliver(0) and not q.deliver(0)  # the second copy does not count
    assert q.complete.is_set()


def test_a_measured_link_that_stalls_is_copied() -> None:
    # a is timed (10 kB/s) and faster than b: b copies a's next batch only once it is past
    # the time a's own rate allows (a stall), and overdue at b's rate too
    from chaos_flwr.flower.fetch import _Queues

    clock = FakeClock()
    q = _Queues({"a": [(0, 0, 1000), (1, 1000, 2000)], "b": [(2, 2000, 3000)]}, 1000, clock)
    q.send("a", q.take("a"))
    q.send("b", q.take("b"))
    clock.t += 0.1
    assert q.deliver(0)
    q.done("a", 1000)  # 10 kB/s
    q.send("a", q.take("a"))  # its next batch, due at 100.2
    clock.t += 0.05
    assert q.deliver(2)
    q.done("b", 1000)  # 1000 B in 0.15 s
    assert q.take("b") == []  # a would deliver it first: b looks again when it is due
    assert q.look_again["b"] == pytest.approx(100.2)
    clock.t = 100.25  # past due and not in: stalled
    assert q.take("b") == []  # not yet overdue for b (twice its first request: 0.3 s)
    assert q.look_again["b"] == pytest.approx(100.4)
    clock.t = 100.45
    assert q.take("b") == [(1, 1000, 2000)]


def test_the_pull_queue_survives_a_donor_that_delivers_nothing() -> None:
    # a donor that answered with empty bytes has no rate (it was a division by zero that
    # killed the whole fetch): the others take its shards over
    from chaos_flwr.flower.fetch import _Queues

    clock = FakeClock()
    q = _Queues({"a": [(0, 0, 10), (1, 10, 20)], "b": [(2, 20, 30)]}, 10, clock)
    assert q.take("a") == [(0, 0, 10)] and q.take("b") == [(2, 20, 30)]
    q.send("a", [(0, 0, 10)])
    q.send("b", [(2, 20, 30)])
    clock.t += 0.01
    q.done("a", 0)
    assert q.deliver(2)
    q.done("b", 10)
    assert q.take("b") == [(1, 10, 20)]  # taken over from a, which has no rate
    assert q.take("a") == []


def test_a_failed_donor_s_shards_that_a_copy_delivered_are_not_asked_again() -> None:
    from chaos_flwr.flower.fetch import _Queues

    clock = FakeClock()
    q = _Queues({"a": [(0, 0, 10), (1, 10, 20)], "b": [(2, 20, 30)]}, 20, clock)
    q.send("a", q.take("a"))  # both of a's shards in one batch
    q.send("b", q.take("b"))
    clock.t += 0.01
    assert q.deliver(2)
    q.done("b", 10)
    clock.t += 0.05
    assert q.take("b") == [(0, 0, 10), (1, 10, 20)]  # copied: a has no rate
    assert q.deliver(0)  # the copy's first shard arrives, then a fails
    q.stop("a", [(0, 0, 10), (1, 10, 20)])
    assert list(q.todo["a"]) == [(1, 10, 20)]  # only the shard still missing goes back
    q.todo["a"].appendleft((0, 0, 10))  # even if a delivered index were queued again
    assert q.take("b") == [(1, 10, 20)]  # it is dropped, not asked again


def test_a_fetch_that_breaks_before_any_link_returns_at_once(
    net: Net, monkeypatch: pytest.MonkeyPatch
) -> None:
    import chaos_flwr.flower.fetch as fetch

    def broken(*_a: Any) -> Any:
        raise RuntimeError("no dialer")

    monkeypatch.setattr(fetch, "_senders", broken)
    t0 = time.monotonic()
    got = fetch_ranges({}, {net.pid("a"): [(0, 0, 10)]}, server_round=ROUND, digest=DIGEST,
                       timeout_s=5.0, link=access("e", net.records))  # fmt: skip
    assert time.monotonic() - t0 < 2.0  # not the 5 s + 5 s it waited before
    assert got[net.pid("a")].error == "the fetch failed: RuntimeError: no dialer"


@pytest.mark.parametrize("min_bps", [0.02e6, 1e12])
def test_a_direct_fetch_longer_than_the_fixed_bound_ends_over_the_links(
    net: Net, min_bps: float
) -> None:
    # two donors at 0.2 MB/s each: the 160 KB state takes about 0.4 s over their links, past
    # the fixed part of the bound (0.2 s). With the state's bytes at 0.02 MB/s added (8.2 s)
    # every byte comes over the links; a bound that does not grow with the state (the
    # rate's share 0) cuts the links off and the relay carries the rest
    profile = parse_profile({"parties": {"replica": {"up_mb_s": 0.2}}})
    for name in ("a", "b"):
        net.serve(name, shaper=Shaper(profile, "replica", burst=4096))
    relay = net.relay({})
    pull = net.pull(["a", "b"], total_hint=len(DATA), direct_timeout_s=0.2, direct_min_bps=min_bps)
    _check(pull, relay.run(pull))
    direct = sum(pull.direct_bytes.values())
    if min_bps < 1e6:
        assert direct == len(DATA) and relay.shard_bytes == {}
        assert pull.stats()["direct-fetch-s"] > 0.2  # longer than the fixed part alone
    else:
        assert direct < len(DATA) and sum(relay.shard_bytes.values()) >= len(DATA) - direct


def test_the_direct_bound_grows_with_the_state_within_its_cap() -> None:
    from chaos_flwr.defaults import FLOWER_DIRECT_MAX_S, FLOWER_DIRECT_TIMEOUT_S
    from chaos_flwr.flower.fetch import FLOWER_LINK_WORKER_GRACE_S, direct_budget_s
    from chaos_flwr.flower.fetch import direct_step_wait_s as wait

    mib64 = 64 << 20
    assert direct_budget_s(None) == direct_budget_s(0) == FLOWER_DIRECT_TIMEOUT_S
    assert direct_budget_s(mib64) == pytest.approx(10.0 + mib64 / 5e6)  # 23.4 s
    assert direct_budget_s(mib64, fixed_s=1.0, min_bps=1e6) == pytest.approx(1.0 + mib64 / 1e6)
    assert direct_budget_s(16 << 30) == FLOWER_DIRECT_MAX_S  # at most the cap ...
    assert direct_budget_s(16 << 30, fixed_s=400.0) == 400.0  # ... or the fixed part
    assert wait(mib64) == pytest.approx(direct_budget_s(mib64) + 2 * FLOWER_LINK_WORKER_GRACE_S)
    for bad in ({"min_bps": 0.0}, {"min_bps": -1.0}, {"fixed_s": -1.0}, {"min_bps": float("nan")}):
        with pytest.raises(ConfigError, match="direct-link bound"):
            direct_budget_s(1, **bad)  # type: ignore[arg-type]
