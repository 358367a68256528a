"""Pull engine and shard server: a discrete-event simulation of multi-source transfers."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from chaos_flwr.errors import ShardIntegrityError, TransferError
from chaos_flwr.planner import Donor, plan_transfer
from chaos_flwr.state import Manifest
from chaos_flwr.transfer import (
    CancelRequest,
    DonorStatus,
    Progress,
    PullSession,
    ShardRequest,
    ShardServer,
)

JOINER = "joiner"


@dataclass
class SimDonor:
    """A donor in the simulation: a serial link of ``bandwidth`` bytes/s and one-way latency."""

    id: str
    bandwidth: float
    latency: float
    dies_at: float = math.inf  # stops answering (silently) from this time on
    corrupt: bool = False  # flips a byte in every shard it sends
    server: ShardServer | None = None


@dataclass
class SimResult:
    session: PullSession
    finish: float
    cancels: list[CancelRequest] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)


def simulate(
    data: bytes,
    sim: list[SimDonor],
    *,
    planned: list[Donor] | None = None,
    lost_notice: dict[str, float] | None = None,
    tick_every: float = 0.05,
    max_time: float = 600.0,
    **session_kw: Any,
) -> SimResult:
    """Drive a PullSession against simulated donors in virtual time; return when done."""
    planned = planned or [Donor(d.id, d.bandwidth, d.latency) for d in sim]
    plan = plan_transfer(len(data), planned, max_shards=64, min_shard_bytes=1024)
    manifest = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    by_id = {d.id: d for d in sim}
    for d in sim:
        d.server = ShardServer(data, max_concurrent_uploads=1)
    session = PullSession(
        manifest,
        plan,
        planned,
        now=0.0,
        expected_digest=hashlib.sha256(data).digest(),
        **session_kw,
    )
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    result = SimResult(session, math.nan)

    def push(t: float, kind: str, arg: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, arg))

    def start_uploads(d: SimDonor, uploads: list[Any], now: float) -> None:
        for u in uploads:
            if now >= d.dies_at:
                continue
            push(now + (u.end - u.start) / d.bandwidth, "sent", (d.id, u))

    def act(actions: list[Any], now: float) -> None:
        for a in actions:
            d = by_id[a.donor]
            if isinstance(a, ShardRequest):
                push(now + d.latency, "arrive", a)
            else:
                result.cancels.append(a)
                assert d.server is not None
                d.server.cancel(JOINER, a.index)

    for donor_id, t in (lost_notice or {}).items():
        push(t, "lost", donor_id)
    push(tick_every, "tick", None)
    act(session.poll(0.0), 0.0)
    now = 0.0
    while not session.done:
        assert events, "simulation ran dry before the transfer finished"
        now, _, kind, arg = heapq.heappop(events)
        assert now <= max_time, "simulated transfer did not finish in time"
        if kind == "arrive":
            d = by_id[arg.donor]
            assert d.server is not None
            if now < d.dies_at:
                start_uploads(d, d.server.request(JOINER, arg.index, arg.start, arg.end), now)
        elif kind == "sent":
            donor_id, upload = arg
            d = by_id[donor_id]
            assert d.server is not None
            if now >= d.dies_at:
                continue
            payload = d.server.read(upload)
            if d.corrupt and payload:
                payload = bytes([payload[0] ^ 1]) + payload[1:]
            push(now + d.latency, "deliver", (donor_id, upload.index, payload))
            start_uploads(d, d.server.finish(upload), now)
        elif kind == "deliver":
            donor_id, index, payload = arg
            act(session.on_shard(donor_id, index, payload, now), now)
            result.progress.append(session.progress(now))
        elif kind == "lost":
            act(session.on_donor_lost(arg, now), now)
        elif kind == "tick":
            act(session.tick(now), now)
            push(now + tick_every, "tick", None)
    result.finish = now
    return result


def _data(n: int = 2_000_000, seed: int = 0) -> bytes:
    return hashlib.shake_256(seed.to_bytes(4, "big")).digest(n)


def _fleet() -> list[SimDonor]:
    return [
        SimDonor("a", 1e6, 0.01),
        SimDonor("b", 2e6, 0.02),
        SimDonor("c", 4e6, 0.03),
        SimDonor("d", 8e6, 0.04),
    ]


def test_end_to_end_transfer_follows_the_plan_and_verifies() -> None:
    data = _data()
    fleet = _fleet()
    res = simulate(data, fleet, window=2)
    s = res.session
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
    plan = plan_transfer(len(data), [Donor(d.id, d.bandwidth, d.latency) for d in fleet],
                         max_shards=64, min_shard_bytes=1024)  # fmt: skip
    # Estimates were right: the transfer ends close to the planned makespan.
    # (a pull pays one extra one-way latency for the requests themselves).
    assert res.finish <= plan.makespan + max(d.latency for d in fleet) + 0.01
    final = s.progress(res.finish)
    assert final.bytes_done == len(data) and final.eta_s == 0.0 and final.fraction == 1.0
    assert sum(final.bytes_by_donor.values()) == len(data)
    assert final.bytes_by_donor["d"] > final.bytes_by_donor["a"]
    # Progress only grows.
    done = [p.bytes_done for p in res.progress]
    assert done == sorted(done)
    # Rates fed back to the monitor match the links (pipelined shards measure the link).
    obs = s.observations()
    assert sum(o.bytes for o in obs) == len(data)
    for d in fleet:
        rates = sorted(o.bytes / o.seconds for o in obs if o.donor == d.id)
        assert len(rates) >= 3
        assert rates[len(rates) // 2] == pytest.approx(d.bandwidth, rel=0.02)
        assert rates[-1] <= d.bandwidth * 1.02  # idle gaps can only make a sample slower
        assert s.rate_estimate(d.id) == pytest.approx(d.bandwidth, rel=0.5)
    assert s.take_observations() == list(obs)
    assert s.take_observations() == []


def test_donor_lost_mid_transfer_is_replanned_and_finishes() -> None:
    data = _data()
    fleet = _fleet()
    fleet[3].dies_at = 0.1  # the fastest donor crashes ...
    res = simulate(data, fleet, lost_notice={"d": 0.12})  # ... and membership says so
    s = res.session
    assert s.status("d") == DonorStatus.LOST
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
    got = s.progress(res.finish).bytes_by_donor
    assert 0 < got["d"] < len(data) * 8 / 15  # it sent part of its planned share
    assert sum(got.values()) == len(data)
    assert s.live_donors() == ("a", "b", "c")


def test_silently_dead_donor_does_not_hang_the_transfer() -> None:
    data = _data()
    fleet = _fleet()
    fleet[2].dies_at = 0.03  # before its first shard arrives; nobody announces it
    res = simulate(data, fleet, min_timeout_s=0.1, timeout_factor=2.0)
    s = res.session
    assert s.status("c") in (DonorStatus.TIMED_OUT, DonorStatus.LIVE)
    assert s.progress(res.finish).bytes_by_donor["c"] == 0
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
    assert res.finish < 0.6  # its shards were re-fetched (timeout or overdue duplicate)
    assert all(s.status(d) == DonorStatus.LIVE for d in ("a", "b", "d"))


def test_tick_times_out_a_silent_donor_and_accepts_its_late_shard() -> None:
    data = _data(64 * 1024)
    donors = [Donor("a", 1e6, 0.01), Donor("b", 1e6, 0.01)]
    plan = plan_transfer(len(data), donors, max_shards=4, min_shard_bytes=1024)
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)

    def piece(i: int) -> bytes:
        start, end = m.shard_range(i)
        return data[start:end]

    silent = PullSession(m, plan, donors, now=0.0, min_timeout_s=1.0, timeout_factor=2.0)
    silent.poll(0.0)
    deadline = silent.next_deadline()
    assert deadline is not None and deadline >= 1.0
    assert silent.tick(deadline - 1e-6) == []
    with pytest.raises(TransferError, match="no live donor"):
        silent.tick(deadline + 1e-6)  # both donors silent: nobody is left

    s = PullSession(m, plan, donors, now=0.0, min_timeout_s=1.0, timeout_factor=2.0)
    first = s.poll(0.0)
    late = next(r for r in first if r.donor == "a")
    for r in first:
        if r.donor == "b":
            s.on_shard("b", r.index, piece(r.index), 0.1)
    dl = s.next_deadline()
    assert dl is not None
    actions = s.tick(dl + 1e-6)
    assert s.status("a") == DonorStatus.TIMED_OUT and s.status("b") == DonorStatus.LIVE
    assert CancelRequest("a", late.index) in actions
    assert set(plan.assignment["a"]) <= set(s.queued("b")) | set(s.inflight("b"))
    s.on_shard("a", late.index, piece(late.index), dl + 0.1)  # late, but it verifies
    assert late.index not in s.missing()
    assert s.progress(dl + 0.1).bytes_by_donor["a"] == late.end - late.start
    while not s.done:
        for index in s.inflight("b"):
            s.on_shard("b", index, piece(index), dl + 0.2)
    assert s.assemble() == data


def test_bad_shards_mark_the_donor_bad_and_are_refetched() -> None:
    data = _data()
    fleet = _fleet()
    fleet[2].corrupt = True
    res = simulate(data, fleet)
    s = res.session
    assert s.status("c") == DonorStatus.BAD
    assert s.progress(res.finish).bytes_by_donor["c"] == 0
    assert s.queued("c") == () and s.inflight("c") == ()
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()


def test_slow_donor_has_its_shards_stolen() -> None:
    data = _data()
    fleet = _fleet()
    planned = [Donor(d.id, d.bandwidth, d.latency) for d in fleet]
    fleet[3].bandwidth = 1e6  # "d" was planned at 8 MB/s but delivers 1 MB/s
    res = simulate(data, fleet, planned=planned, timeout_factor=50.0, min_timeout_s=30.0)
    s = res.session
    assert all(s.status(d.id) == DonorStatus.LIVE for d in fleet)
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
    plan = plan_transfer(len(data), planned, max_shards=64, min_shard_bytes=1024)
    planned_d = plan.bytes_by_donor()["d"]
    got_d = s.progress(res.finish).bytes_by_donor["d"]
    assert got_d < planned_d / 2  # most of its queue moved to others
    # Without stealing, "d" alone would need planned_d / 1e6 seconds.
    assert res.finish < 0.75 * planned_d / 1e6
    # Re-estimated: the engine learned the slow link.
    assert s.rate_estimate("d") == pytest.approx(1e6, rel=0.2)


def test_idle_donor_outside_the_plan_helps_and_endgame_duplicates_are_cancelled() -> None:
    data = _data(500_000)
    fleet = [SimDonor("fast", 4e6, 0.01), SimDonor("slow", 4e6, 0.01)]
    planned = [Donor("fast", 4e6, 0.01), Donor("slow", 4e6, 0.01)]
    fleet[1].bandwidth = 2e5  # the second donor turns out 20x slower
    res = simulate(data, fleet, planned=planned, window=1, timeout_factor=100.0,
                   min_timeout_s=60.0)  # fmt: skip
    s = res.session
    assert hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
    assert s.progress(res.finish).bytes_by_donor["fast"] > len(data) * 0.8
    # The slow donor's last in-flight shard was duplicated to the fast one; the loser is
    # cancelled once the first verified copy lands.
    assert any(c.donor == "slow" for c in res.cancels)


def test_all_donors_lost_raises_transfer_error() -> None:
    data = _data(200_000)
    donors = [Donor("a", 1e6), Donor("b", 1e6)]
    plan = plan_transfer(len(data), donors, max_shards=8, min_shard_bytes=1024)
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    s = PullSession(m, plan, donors, now=0.0)
    first = s.poll(0.0)
    assert {a.donor for a in first} == {"a", "b"}
    actions = s.on_donor_lost("a", 0.1)
    cancels = [a for a in actions if isinstance(a, CancelRequest)]
    assert cancels == [CancelRequest("a", a.index) for a in first if a.donor == "a"]
    assert set(s.queued("b")) | set(s.inflight("b")) == set(range(plan.num_shards))
    assert s.on_donor_lost("zzz", 0.1) == []
    with pytest.raises(TransferError, match="no live donor remains"):
        s.on_donor_lost("b", 0.2)
    with pytest.raises(TransferError, match="still missing"):
        s.assemble()


def test_initial_requests_respect_the_window_and_cover_manifest_ranges() -> None:
    data = _data(300_000)
    donors = [Donor("a", 1e6, 0.05), Donor("b", 3e6, 0.05), Donor("idle", 1e3, 5.0)]
    plan = plan_transfer(len(data), donors, max_shards=32, min_shard_bytes=1024)
    assert "idle" not in plan.assignment
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    s = PullSession(m, plan, donors, now=0.0, window=3)
    reqs = s.poll(0.0)
    per: dict[str, int] = {}
    for r in reqs:
        assert isinstance(r, ShardRequest)
        assert (r.start, r.end) == m.shard_range(r.index)
        assert r.index in plan.assignment[r.donor]
        per[r.donor] = per.get(r.donor, 0) + 1
    # Each planned donor fills its window (window + the link's bandwidth-delay product in
    # shards) from its own queue; the very slow idle donor does not steal.
    expected = {
        d.id: min(
            len(plan.assignment[d.id]),
            3 + math.ceil(2 * d.latency * d.bandwidth / plan.shard_bytes),
        )
        for d in donors[:2]
    }
    assert per == expected
    p = s.progress(0.0)
    assert p.bytes_done == 0 and p.eta_s is not None and p.eta_s > 0
    assert s.poll(0.0) == []  # nothing more until a reply comes back


def test_unknown_donor_and_bad_index_are_handled() -> None:
    data = _data(100_000)
    donors = [Donor("a", 1e6), Donor("b", 1e6)]
    plan = plan_transfer(len(data), donors, max_shards=4, min_shard_bytes=1024)
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    s = PullSession(m, plan, donors, now=0.0)
    s.poll(0.0)
    assert s.on_shard("mallory", 0, data[: plan.shard_bytes], 0.1) == []
    s.on_shard("a", 99, b"x", 0.1)
    assert s.status("a") == DonorStatus.BAD
    assert s.missing() == tuple(range(plan.num_shards))
    # b now holds every shard: drive it to completion by hand.
    while not s.done:
        (index,) = s.inflight("b")[:1]
        start, end = m.shard_range(index)
        s.on_shard("b", index, data[start:end], 0.2)
    assert s.assemble() == data


def test_manifest_and_plan_must_fit_and_certified_digest_is_enforced() -> None:
    data = _data(100_000)
    donors = [Donor("a", 1e6)]
    plan = plan_transfer(len(data), donors, max_shards=4, min_shard_bytes=1024)
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    with pytest.raises(TransferError, match="shard_bytes"):
        PullSession(Manifest.build(data, 1000), plan, donors, now=0.0)
    with pytest.raises(TransferError, match="assignment"):
        PullSession(m, plan, [Donor("other", 1e6)], now=0.0)
    with pytest.raises(ShardIntegrityError, match="certified"):
        PullSession(m, plan, donors, now=0.0, expected_digest=hashlib.sha256(b"x").digest())
    # A manifest whose shards match but which claims another (certified) state digest.
    claimed = hashlib.sha256(b"certified round").digest()
    liar = Manifest(m.total_bytes, m.shard_bytes, m.shard_hashes, claimed)
    s = PullSession(liar, plan, donors, now=0.0, expected_digest=claimed)
    s.poll(0.0)
    while not s.done:
        for index in s.inflight("a"):
            start, end = m.shard_range(index)
            s.on_shard("a", index, data[start:end], 1.0)
    with pytest.raises(ShardIntegrityError, match="certified state digest"):
        s.assemble()


def test_empty_state_and_empty_trailing_shards() -> None:
    empty = b""
    plan = plan_transfer(0, [Donor("a", 1e6)])
    s = PullSession(Manifest.build(empty, 1), plan, [Donor("a", 1e6)], now=0.0)
    assert s.done and s.poll(0.0) == [] and s.assemble() == b""
    data = b"y" * 9
    from chaos_flwr.planner import TransferPlan

    hand = TransferPlan(4, 3, {"a": (0, 1, 2, 3)}, 1.0, {"a": 1.0}, total_bytes=9)
    s = PullSession(Manifest.build(data, 3, num_shards=4), hand, [Donor("a", 1e6)], now=0.0)
    reqs = [r for r in s.poll(0.0) if isinstance(r, ShardRequest)]
    assert 3 not in [r.index for r in reqs]  # the empty shard needs no request


def test_shard_server_caps_concurrent_uploads_and_reads_only_the_range() -> None:
    reads: list[tuple[int, int]] = []
    data = os.urandom(10_000)

    class Source:
        total_bytes = len(data)

        def read(self, start: int, end: int) -> bytes:
            reads.append((start, end))
            return data[start:end]

    server = ShardServer(Source(), max_concurrent_uploads=2)
    granted = []
    for i in range(5):
        granted += server.request(f"j{i % 2}", i, i * 1000, (i + 1) * 1000)
    assert [u.index for u in granted] == [0, 1]
    assert server.active == 2 and server.queued == 3
    assert server.read(granted[0]) == data[0:1000]
    assert reads == [(0, 1000)]
    nxt = server.finish(granted[0])
    assert [u.index for u in nxt] == [2]
    assert server.cancel("j1") == []  # drops queued index 3, keeps active upload 1
    assert server.queued == 1
    assert [u.index for u in server.finish(granted[1])] == [4]
    assert server.bytes_served == 2000
    with pytest.raises(TransferError, match="range"):
        server.request("j0", 9, 0, 10_001)
    with pytest.raises(TransferError, match="not active"):
        server.read(granted[0])
    m = server.manifest(4096)
    assert m == Manifest.build(data, 4096)
    with pytest.raises(TransferError, match="max_concurrent_uploads"):
        ShardServer(data, max_concurrent_uploads=0)


# --- over loopback: asyncio + TCP on 127.0.0.1 -----------------------------------------------


async def _serve_donor(
    data: bytes, *, corrupt: bool, stop_after: int | None
) -> tuple[Any, int, dict[str, int]]:
    """A tiny donor: lines ``index start end`` in, ``index length`` + bytes out."""
    import asyncio

    server_state = {"served": 0}
    shard_server = ShardServer(data, max_concurrent_uploads=2)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()

        async def upload(u: Any) -> None:
            payload = shard_server.read(u)
            if corrupt and payload:
                payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            async with lock:
                writer.write(f"{u.index} {len(payload)}\n".encode() + payload)
                await writer.drain()
            server_state["served"] += 1
            for nxt in shard_server.finish(u):
                tasks.add(asyncio.ensure_future(upload(nxt)))

        tasks: set[Any] = set()
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if stop_after is not None and server_state["served"] >= stop_after:
                    break  # the donor "crashes": drop the connection
                index, start, end = (int(x) for x in line.split())
                for u in shard_server.request("joiner", index, start, end):
                    tasks.add(asyncio.ensure_future(upload(u)))
        finally:
            for t in tasks:
                t.cancel()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, port, server_state


@pytest.mark.timeout(60)
def test_pull_over_loopback_with_a_bad_and_a_crashing_donor() -> None:
    import asyncio
    import time

    data = _data(3_000_000, seed=5)
    digest = hashlib.sha256(data).digest()

    async def main() -> PullSession:
        specs = {"good": (False, None), "liar": (True, None), "crash": (False, 3)}
        servers, conns = [], {}
        for name, (corrupt, stop_after) in specs.items():
            server, port, _ = await _serve_donor(data, corrupt=corrupt, stop_after=stop_after)
            servers.append(server)
            conns[name] = await asyncio.open_connection("127.0.0.1", port)
        donors = [Donor(n, 50e6, 0.001) for n in specs]
        plan = plan_transfer(len(data), donors, max_shards=64, min_shard_bytes=16 * 1024)
        manifest = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
        clock = time.monotonic
        session = PullSession(manifest, plan, donors, now=clock(), expected_digest=digest)
        changed = asyncio.Event()

        def act(actions: list[Any]) -> None:
            for a in actions:
                if isinstance(a, ShardRequest):
                    writer = conns[a.donor][1]
                    if not writer.is_closing():
                        writer.write(f"{a.index} {a.start} {a.end}\n".encode())
            changed.set()

        async def reader_loop(name: str) -> None:
            reader = conns[name][0]
            try:
                while True:
                    head = await reader.readline()
                    if not head:
                        break
                    index, n = (int(x) for x in head.split())
                    payload = await reader.readexactly(n)
                    act(session.on_shard(name, index, payload, clock()))
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            if not session.done:
                act(session.on_donor_lost(name, clock()))  # the carrier saw the link drop

        readers = [asyncio.ensure_future(reader_loop(n)) for n in specs]
        act(session.poll(clock()))
        deadline = clock() + 30
        while not session.done and clock() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), 0.05)
            except TimeoutError:
                act(session.tick(clock()))
        for r in readers:
            r.cancel()
        for _, writer in conns.values():
            writer.close()
        for server in servers:
            server.close()
            await server.wait_closed()
        return session

    session = asyncio.run(main())
    assert session.done
    assert hashlib.sha256(session.assemble()).digest() == digest
    assert session.status("liar") == DonorStatus.BAD
    assert session.status("crash") == DonorStatus.LOST
    got = session.progress(0.0).bytes_by_donor
    assert got["liar"] == 0 and got["good"] > 0


def test_replies_fed_without_fill_plan_nothing_until_polled() -> None:
    # a carrier delivering a whole direct fetch feeds every shard with fill=False, then polls
    # once: the state is the same as feeding them one by one, and no request is planned per
    # shard (the endgame is not run thousands of times over shards already in hand)
    data = _data(400_000)
    donors = [Donor("a", 4e6), Donor("b", 1e6)]
    plan = plan_transfer(len(data), donors, max_shards=64, min_shard_bytes=1024)
    m = Manifest.build(data, plan.shard_bytes, num_shards=plan.num_shards)
    s = PullSession(m, plan, donors, now=0.0, window=plan.num_shards)
    sent = s.poll(0.0)
    assert len(sent) == plan.num_shards
    mine = [r for r in sent if r.donor == "a"]
    for r in mine:
        assert s.on_shard("a", r.index, data[r.start : r.end], 0.5, fill=False) == []
    assert s.inflight("a") == ()
    stolen = s.poll(0.5)  # now "a" is idle and takes copies of what "b" still owes
    assert stolen and all(isinstance(x, ShardRequest) and x.donor == "a" for x in stolen)
    for r in sent:
        if r.donor == "b":
            s.on_shard("b", r.index, data[r.start : r.end], 1.0, fill=False)
    assert s.done and hashlib.sha256(s.assemble()).digest() == hashlib.sha256(data).digest()
