"""``chaos-flwr bench events``: how fast membership events settle across a cluster.

Builds a cluster of ``peers`` :class:`~chaos_flwr.peer.Peer` objects (3 founders, the rest
joined with one sponsor), links them in a ring plus random chords, and then triggers each event
type ``repeats`` times:

``leave``
    a random non-founder leaves (it rejoins with a higher incarnation afterwards, untimed);
``link_up`` / ``link_down``
    a random non-adjacent pair connects / a random live link is taken down;
``fail``
    a random non-founder is crashed (its traffic dropped), its watchers are brought up to the
    moment of suspicion (a heartbeat round just before the timeout, untimed), and the clock is
    started when the watchers' ``tick`` runs at the timeout: the moment the failure is
    suspected. Votes then flow and every party assembles the fail record.

For each event the wall-clock time from the trigger until **every active member** (every party
whose view changes: membership and the neighbour graph are both part of every view) has applied
the record is measured with ``time.perf_counter``; the JSON reports p50/p99 per type. Link
events also report ``ends_p50_ms``/``ends_p99_ms``: until both ends of the link applied it.

All peers run in this one process, on one thread; peers' ``now`` is a virtual clock (they are
sans-I/O), the measured times are wall-clock. Carriers:

``memory``
    a FIFO in-process router: ``handle`` is called directly for each delivery.
``grpc``
    :mod:`chaos_flwr.transport` grpc.aio loopback links (if that carrier is available): every
    envelope crosses a real HTTP/2 connection on 127.0.0.1 between per-party servers hosted on
    one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..charter import Charter
from ..defaults import (
    EVENTS_BENCH_CHORDS_PER_PEER,
    EVENTS_BENCH_EVENT_TIMEOUT_S,
    EVENTS_BENCH_FAILURE_QUORUM,
    EVENTS_BENCH_FOUNDERS,
    EVENTS_BENCH_HEARTBEAT_S,
    EVENTS_BENCH_REPEATS,
    EVENTS_BENCH_SEED,
    EVENTS_BENCH_SUSPICION_S,
)
from ..errors import ConfigError, TransportError
from ..identity import Identity
from ..membership import SignatureCache
from ..peer import AppliedChange, Outgoing, Peer

__all__ = ["run_events"]

_FOUNDERS = EVENTS_BENCH_FOUNDERS
_HEARTBEAT_S = EVENTS_BENCH_HEARTBEAT_S
_SUSPICION_S = EVENTS_BENCH_SUSPICION_S
_QUORUM = EVENTS_BENCH_FAILURE_QUORUM
_CHORDS_PER_PEER = EVENTS_BENCH_CHORDS_PER_PEER


def _bench_charter(founders: list[Identity], others: list[Identity]) -> Charter:
    """The bench federation's charter, signed by its founders."""
    return Charter.create(
        "bench-events",
        founders,
        others,
        sponsors_required=1,
        failure_quorum=_QUORUM,
        heartbeat_interval_s=_HEARTBEAT_S,
        suspicion_timeout_s=_SUSPICION_S,
    )


class _MemoryCarrier:
    """FIFO in-process delivery; ``deliver`` is the host's handler."""

    name = "memory"

    def __init__(self) -> None:
        self._queue: deque[tuple[str, Outgoing]] = deque()
        self._pumping = False
        self.deliver: Callable[[str, str, bytes], list[Outgoing]] = lambda s, d, b: []
        self.dropped: set[str] = set()

    async def start(self, party_ids: Iterable[str]) -> None:
        return None

    async def send(self, src: str, outs: Iterable[Outgoing]) -> None:
        self._queue.extend((src, o) for o in outs)
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._queue:
                s, out = self._queue.popleft()
                if out.to in self.dropped or s in self.dropped:
                    continue
                self._queue.extend((out.to, o) for o in self.deliver(s, out.to, out.data))
        finally:
            self._pumping = False

    async def settle(self) -> None:
        return None

    async def close(self) -> None:
        return None


class _GrpcCarrier:
    """Every peer gets its own :class:`~chaos_flwr.transport.grpc_carrier.GrpcCarrier` server
    on 127.0.0.1; every envelope is one unary-stream call over a real HTTP/2 connection. All
    servers and clients share this process's asyncio event loop."""

    name = "grpc"

    def __init__(self) -> None:
        from ..transport.grpc_carrier import GrpcCarrier

        self._factory = GrpcCarrier
        self._carriers: dict[str, Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.deliver: Callable[[str, str, bytes], list[Outgoing]] = lambda s, d, b: []
        self.dropped: set[str] = set()
        self.errors = 0

    async def start(self, party_ids: Iterable[str]) -> None:
        for pid in party_ids:
            carrier = self._factory(pid)
            await carrier.start(self._handler_for(pid))
            self._carriers[pid] = carrier
        directory = {pid: c.address for pid, c in self._carriers.items()}
        for carrier in self._carriers.values():
            for pid, address in directory.items():
                if pid != carrier.party_id:
                    carrier.add_peer(pid, address)

    def _handler_for(self, pid: str) -> Callable[[str, bytes], Any]:
        async def handler(src: str, data: bytes) -> bytes:
            if pid not in self.dropped and src not in self.dropped:
                self._spawn(pid, self.deliver(src, pid, data))
            return b""

        return handler

    def _spawn(self, src: str, outs: Iterable[Outgoing]) -> None:
        if src in self.dropped:
            return
        for out in outs:
            if out.to in self.dropped or out.to not in self._carriers:
                continue
            task = asyncio.get_running_loop().create_task(self._send(src, out))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, src: str, out: Outgoing) -> None:
        try:
            await self._carriers[src].send(out.to, out.data)
        except TransportError:
            self.errors += 1

    async def send(self, src: str, outs: Iterable[Outgoing]) -> None:
        self._spawn(src, list(outs))

    async def settle(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.settle()
        for carrier in self._carriers.values():
            await carrier.close()


@dataclass
class _Wait:
    kind: str
    subject: str
    remaining: set[str]
    ends: set[str]
    t0: float
    done: asyncio.Event
    t1: float = 0.0
    t_ends: float = 0.0


@dataclass
class _Cluster:
    peers: dict[str, Peer]
    idents: dict[str, Identity]
    charter: Any
    carrier: Any
    founders: list[str]
    now: float = 0.0
    wait: _Wait | None = None
    cache: SignatureCache = field(default_factory=SignatureCache)
    handle_s: list[float] = field(default_factory=list)
    ends_ms: dict[str, list[float]] = field(default_factory=dict)

    def on_apply(self, pid: str) -> Callable[[AppliedChange], None]:
        def hook(change: AppliedChange) -> None:
            w = self.wait
            if w is not None and change.kind == w.kind and change.subject == w.subject:
                w.remaining.discard(pid)
                if pid in w.ends:
                    w.ends.discard(pid)
                    if not w.ends:
                        w.t_ends = time.perf_counter()
                if not w.remaining and not w.done.is_set():
                    w.t1 = time.perf_counter()
                    w.done.set()

        return hook

    def deliver(self, src: str, dst: str, data: bytes) -> list[Outgoing]:
        peer = self.peers.get(dst)
        if peer is None:
            return []
        if self.wait is None:
            return peer.handle(data, self.now)
        t = time.perf_counter()
        out = peer.handle(data, self.now)
        self.handle_s.append(time.perf_counter() - t)
        return out

    def active(self) -> list[str]:
        return self.peers[self.founders[0]].view().active()

    async def act(self, pid: str, outs: list[Outgoing]) -> None:
        await self.carrier.send(pid, outs)

    async def measure(
        self, kind: str, subject: str, affected: Iterable[str], trigger: Callable[[], Any]
    ) -> float:
        """Run ``trigger`` (an async callable) and return ms until all ``affected`` applied."""
        ends = set(subject.split("|")) if "|" in subject else set()
        w = _Wait(kind, subject, set(affected), set(ends), 0.0, asyncio.Event())
        gc.collect()
        gc.disable()  # as timeit does: no collector pause inside a timed window
        self.wait = w
        w.t0 = time.perf_counter()
        try:
            await trigger()
            await asyncio.wait_for(w.done.wait(), EVENTS_BENCH_EVENT_TIMEOUT_S)
        except TimeoutError as exc:
            raise ConfigError(
                f"{kind} of {subject} was not applied by {sorted(w.remaining)[:5]} within "
                f"{EVENTS_BENCH_EVENT_TIMEOUT_S} s (EVENTS_BENCH_EVENT_TIMEOUT_S)"
            ) from exc
        finally:
            self.wait = None
            gc.enable()
        await self.carrier.settle()
        if "|" in subject:
            self.ends_ms.setdefault(kind, []).append((w.t_ends - w.t0) * 1000.0)
        return (w.t1 - w.t0) * 1000.0

    async def heartbeat_round(self, dt: float, skip: Iterable[str] = ()) -> None:
        self.now += dt
        skip_set = set(skip)
        for pid, peer in sorted(self.peers.items()):
            if pid not in skip_set:
                await self.carrier.send(pid, peer.tick(self.now))
        await self.carrier.settle()


async def _build(n: int, carrier: Any, rng: random.Random) -> _Cluster:
    idents = [Identity.from_seed(f"bench-events-{i}", name=f"party{i:04d}") for i in range(n)]
    ch = _bench_charter(idents[:_FOUNDERS], idents[_FOUNDERS:])
    cl = _Cluster(
        peers={},
        idents={i.party_id: i for i in idents},
        charter=ch,
        carrier=carrier,
        founders=[i.party_id for i in idents[:_FOUNDERS]],
    )
    for ident in idents:
        cl.peers[ident.party_id] = Peer(
            ident, ch, signature_cache=cl.cache, on_apply=cl.on_apply(ident.party_id)
        )
    carrier.deliver = cl.deliver
    await carrier.start(list(cl.peers))
    for pid in cl.founders:
        await cl.act(pid, cl.peers[pid].bootstrap(cl.now))
    await carrier.settle()
    for ident in idents[_FOUNDERS:]:
        sponsor = cl.founders[rng.randrange(_FOUNDERS)]
        await cl.act(ident.party_id, cl.peers[ident.party_id].request_join(cl.now, [sponsor]))
        await carrier.settle()
    ids = sorted(cl.peers)
    pairs = {tuple(sorted((ids[i], ids[(i + 1) % n]))) for i in range(n)}
    for a in ids:
        for _ in range(_CHORDS_PER_PEER):
            b = rng.choice(ids)
            if a != b:
                pairs.add(tuple(sorted((a, b))))
    for a, b in sorted(pairs):
        await cl.act(a, cl.peers[a].connect(b, cl.now))
        await carrier.settle()
    await cl.heartbeat_round(_HEARTBEAT_S)
    return cl


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    idx = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[idx]


async def _leave(cl: _Cluster, rng: random.Random) -> float:
    candidates = [p for p in cl.active() if p not in cl.founders]
    x = rng.choice(candidates)
    affected = [p for p in cl.active() if p != x]
    peer = cl.peers[x]

    async def trigger() -> None:
        await cl.act(x, peer.leave(cl.now))

    ms = await cl.measure("leave", x, affected, trigger)
    await _rejoin(cl, x, rng)
    return ms


async def _rejoin(cl: _Cluster, x: str, rng: random.Random) -> None:
    peer = cl.peers[x]
    sponsor = rng.choice(cl.founders)
    await cl.act(x, peer.request_join(cl.now, [sponsor]))
    await cl.carrier.settle()
    view = peer.view()
    others = [p for p in view.active() if p != x]
    for b in rng.sample(others, min(2, len(others))):
        if x in cl.peers and peer.is_member:
            await cl.act(x, peer.connect(b, cl.now))
            await cl.carrier.settle()


async def _link_up(cl: _Cluster, rng: random.Random) -> float:
    view = cl.peers[cl.founders[0]].view()
    active = view.active()
    while True:
        a, b = rng.sample(active, 2)
        if b not in view.neighbours(a):
            break
    subject = "|".join(sorted((a, b)))

    async def trigger() -> None:
        await cl.act(a, cl.peers[a].connect(b, cl.now))

    return await cl.measure("link_up", subject, active, trigger)


async def _link_down(cl: _Cluster, rng: random.Random) -> float:
    view = cl.peers[cl.founders[0]].view()
    live = [(ln.a, ln.b) for ln in view.links.values() if ln.live]
    a, b = rng.choice(live)
    if rng.random() < 0.5:
        a, b = b, a
    subject = "|".join(sorted((a, b)))

    async def trigger() -> None:
        await cl.act(a, cl.peers[a].disconnect(b, cl.now))

    ms = await cl.measure("link_down", subject, view.active(), trigger)
    # Put a link back so the graph does not thin out over the run (untimed).
    await cl.act(a, cl.peers[a].connect(b, cl.now))
    await cl.carrier.settle()
    return ms


async def _fail(cl: _Cluster, rng: random.Random) -> float:
    view = cl.peers[cl.founders[0]].view()
    candidates = [p for p in view.active() if p not in cl.founders]
    x = rng.choice(candidates)
    watchers = view.watchers(x, _QUORUM)
    affected = [p for p in view.active() if p != x]
    # A heartbeat round (everyone hears from its watched parties), then x crashes. Two more
    # rounds follow at +1.5 s and +2.5 s, so at the timeout only x has been silent long enough
    # and no heartbeat is due in the timed window.
    await cl.heartbeat_round(_HEARTBEAT_S)
    crash_at = cl.now
    cl.carrier.dropped.add(x)
    await cl.heartbeat_round(1.5 * _HEARTBEAT_S, skip=[x])
    await cl.heartbeat_round(_HEARTBEAT_S, skip=[x])
    suspect_at = crash_at + _SUSPICION_S + 1e-3

    async def trigger() -> None:
        cl.now = suspect_at
        for w in watchers:
            await cl.act(w, cl.peers[w].tick(cl.now))

    ms = await cl.measure("fail", x, affected, trigger)
    # x restarts as a fresh process with a higher incarnation and rejoins (untimed).
    old = cl.peers[x]
    cl.peers[x] = Peer(
        cl.idents[x],
        cl.charter,
        incarnation=old.incarnation + 1,
        signature_cache=cl.cache,
        on_apply=cl.on_apply(x),
    )
    cl.carrier.dropped.discard(x)
    await _rejoin(cl, x, rng)
    await cl.heartbeat_round(_HEARTBEAT_S)
    return ms


_EVENTS: dict[str, Callable[[_Cluster, random.Random], Any]] = {
    "leave": _leave,
    "link_up": _link_up,
    "link_down": _link_down,
    "fail": _fail,
}


def _make_carrier(kind: str) -> Any:
    if kind == "memory":
        return _MemoryCarrier()
    if kind == "grpc":
        return _GrpcCarrier()
    raise ConfigError(f"option 'carrier' must be 'memory' or 'grpc', got {kind!r}")


async def _run(peers: int, repeats: int, seed: int, carrier_kind: str) -> dict[str, Any]:
    rng = random.Random(seed)
    carrier = _make_carrier(carrier_kind)
    t_setup = time.perf_counter()
    cl = await _build(peers, carrier, rng)
    setup_s = time.perf_counter() - t_setup
    samples: dict[str, list[float]] = {k: [] for k in _EVENTS}
    try:
        for _ in range(repeats):
            for name, fn in _EVENTS.items():
                samples[name].append(await fn(cl, rng))
        rejected = sum(len(p.rejections) for p in cl.peers.values())
        digests = {cl.peers[p].view().digest for p in cl.active()}
    finally:
        await carrier.close()
    return {
        "peers": peers,
        "carrier": carrier.name,
        "placement": (
            "all peers in one process, one thread (asyncio); virtual protocol clock; each peer "
            "verifies every envelope signature itself, record signatures are verified once per "
            "process (a SignatureCache shared by the co-hosted peers)"
        ),
        "gc": "collected before and disabled inside each timed window (as timeit does)",
        "affected": "every active member (membership and neighbour graph are in every view)",
        "repeats": repeats,
        "seed": seed,
        "setup_s": round(setup_s, 3),
        "rejections": rejected,
        "views_agree": len(digests) == 1,
        "handle_us_p50": round(_percentile(cl.handle_s, 50) * 1e6, 1),
        "deliveries_in_timed_windows": len(cl.handle_s),
        "events": {
            name: {
                "count": len(vals),
                "p50_ms": round(_percentile(vals, 50), 3),
                "p99_ms": round(_percentile(vals, 99), 3),
                "mean_ms": round(statistics.fmean(vals), 3),
                "max_ms": round(max(vals), 3),
                **(
                    {
                        "ends_p50_ms": round(_percentile(cl.ends_ms[name], 50), 3),
                        "ends_p99_ms": round(_percentile(cl.ends_ms[name], 99), 3),
                    }
                    if name in cl.ends_ms
                    else {}
                ),
            }
            for name, vals in samples.items()
        },
    }


def run_events(
    peers: int = 64,
    *,
    repeats: int = EVENTS_BENCH_REPEATS,
    seed: int = EVENTS_BENCH_SEED,
    carrier: str = "auto",
) -> dict[str, Any]:
    """Run the events benchmark and return its JSON-ready result.

    Parameters
    ----------
    peers
        Cluster size (>= 8).
    repeats
        Events of each type to trigger.
    seed
        Seed of the random choices (who leaves, which links flap, who fails).
    carrier
        ``"grpc"``, ``"memory"``, or ``"auto"`` (grpc when the carrier is available).

    Returns
    -------
    dict
        ``{"peers", "carrier", "events": {type: {"count", "p50_ms", "p99_ms", ...}}, ...}``.

    Raises
    ------
    ConfigError
        If ``peers < 8``, ``repeats < 1``, the carrier is unknown, or an event does not settle
        within ``EVENTS_BENCH_EVENT_TIMEOUT_S``.
    """
    if peers < 8:
        raise ConfigError(f"option 'peers' must be >= 8, got {peers}")
    if repeats < 1:
        raise ConfigError(f"option 'repeats' must be >= 1, got {repeats}")
    if carrier == "auto":
        try:
            _make_carrier("grpc")
            carrier = "grpc"
        except ImportError:
            carrier = "memory"
    return asyncio.run(_run(peers, repeats, seed, carrier))
