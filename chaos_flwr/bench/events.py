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
the record is measured with ``time.perf_counter`` (``CLOCK_MONOTONIC``: one clock for every
process of the machine); the JSON reports p50/p99 per type. Link events also report
``ends_p50_ms``/``ends_p99_ms``: until both ends of the link applied it.

Placement
---------
The peers are spread round-robin over ``workers`` *hosts*. With the ``grpc`` carrier each host is
an OS process (one per core by default) with one :class:`~chaos_flwr.transport.GrpcCarrier` on
127.0.0.1, and **every** envelope, also between two peers of one host, crosses a real HTTP/2
connection: one persistent push stream per pair of hosts carries the envelopes queued for that
host in batches (:meth:`~chaos_flwr.transport.GrpcCarrier.push`). Each worker process, with the
threads grpc starts in it, is pinned to a CPU of its own (``pin``, on by default; ``--no-pin``):
unpinned, Linux may queue a host woken by a batch behind the other host's busy thread on one
CPU while the other CPU idles, and the whole event then waits for that host's batch (measured
here at 64 peers: leave p99 11.7 ms unpinned, a median of 7.0 ms over three pinned runs).
With the ``memory`` carrier the hosts live in this process and a FIFO router delivers. A
coordinator (this process) triggers the events over pipes; the peers' ``now`` is a virtual
clock it sets (they are sans-I/O).

Security is not traded for speed: every peer opens (verifies) every envelope addressed to it and
verifies every record signature itself (each peer has its own signature cache: a cache hit is
only ever a signature that *this* peer verified before, or made itself).

Floor and deployment figure
---------------------------
``verify_us`` is the measured cost of one Ed25519 verification on this machine. For each event
the hosts count the signature checks their peers actually made in the window (``verifies_p50``:
misses of each peer's own signature cache, from arming until the host's last affected peer
applied the record). A record its broadcaster signs travels in an ``own`` envelope whose
signature is also that record signature (see :mod:`chaos_flwr.membership`, "Proofs"), so a leave
or link_down costs each receiver one check, a link_up or fail two. ``floor_p50_ms`` is that
count times ``verify_us`` divided by the cores in use: this protocol, with per-peer
verification, cannot settle the event faster on this machine (``floor_quiet_p50_ms`` uses
``verify_min_us``, the fastest timing round: the floor on cores nobody else is using).
``hop_p50_ms``/``hop_p99_ms`` are measured, not modelled: from the trigger until the *first*
peer outside the event's own parties (the leaver, the link's ends, the suspect's watchers)
applied the record: the event's protocol steps, then one seal, one loopback hop, one
verify-and-apply. In a deployment every peer has its own cores and verifies in parallel, so each
peer's delay is about that (plus the sender's per-destination sends, not measured here).

Between events every host sleeps in its event loop, and on a shared virtual machine its caches
are cold when the next batch arrives: ``seal_warm_us`` and ``seal_after_idle_us`` time one small
seal back to back and right after a short idle pause, so that penalty is on record with the
figures it inflates (the first deliveries of every event, and the trigger itself).
Each host works off a delivered batch in order and yields to its event loop after every item
whose handling sent something, so a vote, an assembled fail record or a countersigned link
leaves before the rest of the batch is handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..charter import Charter
from ..errors import ConfigError
from ..identity import Identity, verify_signature
from ..peer import AppliedChange, Outgoing, Peer
from ..wire import seal
from .settings import (
    EVENTS_BENCH_CHORDS_PER_PEER,
    EVENTS_BENCH_EVENT_TIMEOUT_S,
    EVENTS_BENCH_FAILURE_QUORUM,
    EVENTS_BENCH_FOUNDERS,
    EVENTS_BENCH_HEARTBEAT_S,
    EVENTS_BENCH_IDLE_PROBE_S,
    EVENTS_BENCH_IDLE_PROBE_SAMPLES,
    EVENTS_BENCH_PIN_WORKERS,
    EVENTS_BENCH_REPEATS,
    EVENTS_BENCH_SEED,
    EVENTS_BENCH_SUSPICION_S,
    EVENTS_BENCH_VERIFY_SAMPLES,
    EVENTS_BENCH_WORKERS,
)

__all__ = ["run_events"]

_FOUNDERS = EVENTS_BENCH_FOUNDERS
_HEARTBEAT_S = EVENTS_BENCH_HEARTBEAT_S
_SUSPICION_S = EVENTS_BENCH_SUSPICION_S
_QUORUM = EVENTS_BENCH_FAILURE_QUORUM
_CHORDS_PER_PEER = EVENTS_BENCH_CHORDS_PER_PEER
_ID_BYTES = 17  # a party id in ASCII
_MAX_DESTS = 255  # destinations one routed item names (its first byte counts them)


def _identities(n: int) -> list[Identity]:
    return [Identity.from_seed(f"bench-events-{i}", name=f"party{i:04d}") for i in range(n)]


def _bench_charter(founders: list[Identity], others: list[Identity]) -> Charter:
    """The bench federation's charter, signed by its founders (deterministic)."""
    return Charter.create(
        "bench-events",
        founders,
        others,
        sponsors_required=1,
        failure_quorum=_QUORUM,
        heartbeat_interval_s=_HEARTBEAT_S,
        suspicion_timeout_s=_SUSPICION_S,
    )


@dataclass
class _Arm:
    """What one host waits for during a timed window."""

    kind: str
    subject: str
    remaining: set[str]
    ends: set[str]
    principals: frozenset[str]
    t_first: float | None = None
    t_recv: float | None = None
    t_hop: float | None = None
    t_last: float | None = None
    t_ends: float | None = None
    t_routed: float | None = None
    verifies: int = 0
    busy: float = 0.0
    cpu0: float = 0.0
    sent: bool = False


@dataclass
class _Host:
    """A share of the peers (those with ``index % hosts == host``) and their deliveries.

    Transport-agnostic: ``send_item(host, item)`` hands an item to the carrier, :meth:`on_item`
    takes each delivered item, ``notify`` reports a finished timed window to the coordinator. An
    item is one envelope and the local peers it is for: a count byte ``n``, ``n`` 17-byte party
    ids, then the envelope. A broadcast (one sealed envelope to many peers) so crosses to each
    host once, as it would be written once per destination machine; each named peer still
    opens and verifies its own copy.
    """

    index: int
    hosts: int
    n: int
    send_item: Callable[[int, bytes], None] = lambda h, item: None
    notify: Callable[[tuple[Any, ...]], None] = lambda msg: None
    lost: Callable[[], int] = lambda: 0
    now: float = 0.0
    sent: int = 0
    delivered: int = 0
    dropped: set[str] = field(default_factory=set)
    arm: _Arm | None = None
    handle_s: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        idents = _identities(self.n)
        self.charter = _bench_charter(idents[:_FOUNDERS], idents[_FOUNDERS:])
        self.idents = {i.party_id: i for i in idents}
        self.owner = {ident.party_id: k % self.hosts for k, ident in enumerate(idents)}
        self._id_bytes = {pid: pid.encode("ascii") for pid in self.owner}
        self.peers: dict[str, Peer] = {}
        for pid, h in self.owner.items():
            if h == self.index:
                self.peers[pid] = self._new_peer(pid, 0)

    def _new_peer(self, pid: str, incarnation: int) -> Peer:
        return Peer(
            self.idents[pid], self.charter, incarnation=incarnation, on_apply=self._hook(pid)
        )

    # --- delivery ----------------------------------------------------------------------------

    def route(self, src: str, outs: Iterable[Outgoing]) -> None:
        if src in self.dropped:
            return
        groups: dict[tuple[int, int], tuple[bytes, list[bytes]]] = {}
        for out in outs:
            if out.to in self.dropped or out.to not in self.owner:
                continue
            self.sent += 1
            key = (self.owner[out.to], id(out.data))
            group = groups.get(key)
            if group is None:
                group = groups[key] = (out.data, [])
            group[1].append(self._id_bytes[out.to])
        for (host, _), (data, dests) in groups.items():
            for i in range(0, len(dests), _MAX_DESTS):
                chunk = dests[i : i + _MAX_DESTS]
                self.send_item(host, bytes([len(chunk)]) + b"".join(chunk) + data)

    def on_item(self, item: bytes) -> bool:
        """Deliver one routed item to the local peers it names; whether anything was sent."""
        if self.arm is not None and self.arm.t_recv is None:
            self.arm.t_recv = time.perf_counter()
        sent = self.sent
        n = item[0]
        start = 1 + n * _ID_BYTES
        data = item[start:]
        for k in range(1, start, _ID_BYTES):
            self._deliver(item[k : k + _ID_BYTES].decode("ascii"), data)
        return self.sent != sent

    def _deliver(self, dst: str, data: bytes) -> None:
        self.delivered += 1
        peer = self.peers.get(dst)
        if peer is not None and dst not in self.dropped:
            if self.arm is None:
                outs = peer.handle(data, self.now)
            else:
                t = time.perf_counter()
                outs = peer.handle(data, self.now)
                dt = time.perf_counter() - t
                self.handle_s.append(dt)
                self.arm.busy += dt
            self.route(dst, outs)

    def _hook(self, pid: str) -> Callable[[AppliedChange], None]:
        def hook(change: AppliedChange) -> None:
            w = self.arm
            if w is None or change.kind != w.kind or change.subject != w.subject:
                return
            if pid not in w.remaining:
                return
            t = time.perf_counter()
            w.remaining.discard(pid)
            if w.t_first is None:
                w.t_first = t
            if w.t_hop is None and pid not in w.principals:
                w.t_hop = t
            if pid in w.ends:
                w.ends.discard(pid)
                if not w.ends:
                    w.t_ends = t
            if not w.remaining:
                w.t_last = t
                self._report()

        return hook

    def _report(self) -> None:
        w = self.arm
        if w is None or w.sent:
            return
        w.sent = True
        gc.enable()
        cpu = time.thread_time() - w.cpu0
        # Every signature check this host's peers made in the window (cache misses: each peer
        # has its own cache, so a miss is a real Ed25519 verification).
        w.verifies = self._checks() - w.verifies
        self.notify(
            (
                "done",
                self.index,
                w.t_first,
                w.t_hop,
                w.t_last,
                w.t_ends,
                w.verifies,
                w.busy,
                cpu,
                w.t_recv,
                w.t_routed,
            )
        )

    # --- commands (the coordinator's calls) --------------------------------------------------

    def cmd_set_now(self, now: float) -> None:
        self.now = now

    def cmd_counts(self) -> tuple[int, int]:
        return self.sent, self.delivered + self.lost()

    def cmd_act(self, pid: str, action: str, args: tuple[Any, ...]) -> float:
        """Run ``peer.<action>(now, ...)`` (or ``connect/disconnect(other, now)``); trigger time."""
        peer = self.peers[pid]
        t = time.perf_counter()
        if action in ("connect", "disconnect"):
            outs = getattr(peer, action)(args[0], self.now)
        else:
            outs = getattr(peer, action)(self.now, *args)
        self.route(pid, outs)
        if self.arm is not None:
            self.arm.t_routed = time.perf_counter()
        return t

    def cmd_connect_many(self, pairs: list[tuple[str, str]]) -> None:
        for a, b in pairs:
            if a in self.peers:
                self.route(a, self.peers[a].connect(b, self.now))

    def cmd_tick(self, pids: list[str] | None, skip: list[str]) -> float:
        t = time.perf_counter()
        chosen = sorted(self.peers) if pids is None else [p for p in pids if p in self.peers]
        for pid in chosen:
            if pid not in skip:
                self.route(pid, self.peers[pid].tick(self.now))
        if self.arm is not None:
            self.arm.t_routed = time.perf_counter()
        return t

    def cmd_drop(self, pid: str, on: bool) -> None:
        if on:
            self.dropped.add(pid)
        else:
            self.dropped.discard(pid)

    def cmd_restart(self, pid: str) -> None:
        old = self.peers[pid]
        self.peers[pid] = self._new_peer(pid, old.incarnation + 1)

    def cmd_info(self, pid: str, watched: str | None) -> dict[str, Any]:
        peer = self.peers[pid]
        view = peer.view()
        return {
            "active": view.active(),
            "links": [(ln.a, ln.b) for ln in view.links.values() if ln.live],
            "is_member": peer.is_member,
            "watchers": list(view.watchers(watched, _QUORUM)) if watched else [],
        }

    def cmd_arm(
        self, kind: str, subject: str, affected: list[str], ends: list[str], principals: list[str]
    ) -> None:
        local = {p for p in affected if p in self.peers}
        self.arm = _Arm(
            kind, subject, local, {e for e in ends if e in local}, frozenset(principals)
        )
        # Collected before the window and disabled inside it, as timeit does. What survives is
        # frozen, so the next window's pass walks only what is new: a pass over the whole
        # heap right before the trigger swept every peer's state out of the CPU caches.
        gc.collect()
        gc.freeze()
        gc.disable()
        self.arm.verifies = self._checks()  # the count at arming; _report takes the difference
        self.arm.cpu0 = time.thread_time()
        if not local:
            self._report()

    def _checks(self) -> int:
        return sum(p.records.cache.checks for p in self.peers.values())

    def cmd_disarm(self) -> None:
        self.arm = None
        gc.enable()

    def cmd_cpus(self) -> list[int] | None:
        return _affinity()

    def cmd_stats(self) -> dict[str, Any]:
        members = [p for p in self.peers.values() if p.is_member]
        return {
            "rejections": sum(len(p.rejections) for p in self.peers.values()),
            "digests": sorted({p.view().digest.hex() for p in members}),
            "handle_s": list(self.handle_s),
        }

    def dispatch(self, name: str, args: tuple[Any, ...]) -> Any:
        return getattr(self, "cmd_" + name)(*args)


# --- hosts as the coordinator sees them --------------------------------------------------------


class _LocalHosts:
    """All hosts in this process; a FIFO router delivers items (the ``memory`` carrier)."""

    name = "memory"

    def __init__(self, n: int, workers: int, on_done: Callable[[tuple[Any, ...]], None]) -> None:
        self._queue: deque[tuple[int, bytes]] = deque()
        self._pumping = False
        self.hosts = [_Host(i, workers, n) for i in range(workers)]
        for h in self.hosts:
            h.send_item = self._enqueue
            h.notify = on_done

    def _enqueue(self, host: int, item: bytes) -> None:
        self._queue.append((host, item))

    def _pump(self) -> None:
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._queue:
                host, item = self._queue.popleft()
                self.hosts[host].on_item(item)
        finally:
            self._pumping = False

    async def start(self) -> None:
        return None

    async def call(self, host: int, name: str, *args: Any) -> Any:
        result = self.hosts[host].dispatch(name, args)
        self._pump()
        return result

    async def close(self) -> None:
        return None


def _pin(cpu: int | None) -> None:
    """Keep this process (and every thread it starts from now on) on ``cpu``, if it can."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})


def _affinity() -> list[int] | None:
    """The CPUs this process may run on (``None`` where the OS does not say)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def _worker_main(conn: Any, index: int, hosts: int, n: int, cpu: int | None) -> None:
    """Entry point of one worker process (the ``grpc`` carrier), pinned to ``cpu`` if given.

    Pinned before grpc starts its threads, so they stay on the worker's CPU too.
    """
    _pin(cpu)
    asyncio.run(_worker(conn, index, hosts, n))


async def _worker(conn: Any, index: int, hosts: int, n: int) -> None:
    from ..transport.grpc_carrier import GrpcCarrier

    host = _Host(index, hosts, n)
    carrier = GrpcCarrier(f"host{index}")

    async def no_requests(src: str, data: bytes) -> bytes:
        return b""

    # Delivered batches are worked off by a task that yields to the event loop after every
    # item whose handling sent something, so a reply (a vote, the assembled fail record, a
    # countersigned link) goes out at once instead of after the rest of the batch.
    inbox: deque[bytes] = deque()
    draining: list[asyncio.Task[None]] = []

    async def drain() -> None:
        while inbox:
            if host.on_item(inbox.popleft()):
                await asyncio.sleep(0)
        draining.clear()

    def on_push(src: str, items: list[bytes]) -> None:
        inbox.extend(items)
        if not draining:
            draining.append(asyncio.get_running_loop().create_task(drain()))

    await carrier.start(no_requests, push_handler=on_push)
    host.send_item = lambda h, item: carrier.push(f"host{h}", item)
    host.notify = conn.send
    host.lost = lambda: carrier.push_lost
    stop = asyncio.Event()

    def on_command() -> None:
        while conn.poll():
            name, args = conn.recv()
            if name == "stop":
                stop.set()
                return
            try:
                if name == "directory":
                    for h, address in args[0].items():
                        carrier.add_peer(f"host{h}", address)
                    result: Any = None
                elif name == "end_pushes":
                    ending.add(loop.create_task(carrier.end_pushes()))
                    result = None
                else:
                    result = host.dispatch(name, args)
                conn.send(("ok", result))
            except Exception as exc:  # reported to the coordinator, which raises
                conn.send(("error", f"{name}: {exc!r}"))

    loop = asyncio.get_running_loop()
    ending: set[asyncio.Task[None]] = set()
    conn.send(("ready", carrier.address))
    loop.add_reader(conn.fileno(), on_command)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        for task in ending:
            await task
        await carrier.close()
        conn.send(("stopped", None))


class _ProcessHosts:
    """One worker process per host, each with a grpc carrier (the ``grpc`` carrier)."""

    name = "grpc"

    def __init__(
        self,
        n: int,
        workers: int,
        on_done: Callable[[tuple[Any, ...]], None],
        pin: bool = False,
    ) -> None:
        self._n = n
        self._workers = workers
        self._on_done = on_done
        self._pin = pin
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._replies: list[asyncio.Queue[tuple[str, Any]]] = []

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no grpc state inherited through fork
        cpus = (_affinity() or []) if self._pin else []
        for i in range(self._workers):
            parent, child = ctx.Pipe()
            cpu = cpus[i % len(cpus)] if cpus else None
            proc = ctx.Process(
                target=_worker_main, args=(child, i, self._workers, self._n, cpu), daemon=True
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._replies.append(asyncio.Queue())
        loop = asyncio.get_running_loop()
        for i, conn in enumerate(self._conns):
            loop.add_reader(conn.fileno(), self._reader(i))
        addresses = {}
        for i in range(self._workers):
            tag, address = await self._reply(i, "start")
            if tag != "ready":
                raise ConfigError(f"bench worker {i} did not start: {address}")
            addresses[i] = address
        for i in range(self._workers):
            await self.call(i, "directory", addresses)

    def _reader(self, i: int) -> Callable[[], None]:
        conn = self._conns[i]

        def read() -> None:
            while True:
                try:
                    if not conn.poll():
                        return
                    msg = conn.recv()
                except (EOFError, OSError):
                    # The worker is gone: stop watching its pipe (a closed pipe stays readable,
                    # so the callback would spin) and let the waiting call fail with its name.
                    asyncio.get_running_loop().remove_reader(conn.fileno())
                    self._replies[i].put_nowait(("error", f"bench worker {i} exited"))
                    return
                if msg[0] == "done":
                    self._on_done(msg)
                else:
                    self._replies[i].put_nowait((msg[0], msg[1]))

        return read

    async def _reply(self, i: int, name: str) -> tuple[str, Any]:
        try:
            return await asyncio.wait_for(self._replies[i].get(), EVENTS_BENCH_EVENT_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(
                f"bench worker {i} did not answer {name!r} within "
                f"{EVENTS_BENCH_EVENT_TIMEOUT_S} s (EVENTS_BENCH_EVENT_TIMEOUT_S)"
            ) from None

    async def call(self, host: int, name: str, *args: Any) -> Any:
        try:
            self._conns[host].send((name, args))
        except OSError:
            raise ConfigError(f"bench worker {host} failed: bench worker {host} exited") from None
        tag, result = await self._reply(host, name)
        if tag != "ok":
            raise ConfigError(f"bench worker {host} failed: {result}")
        return result

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for i in range(len(self._conns)):  # every stream ends before any server stops
            with contextlib.suppress(OSError, ConfigError):
                await self.call(i, "end_pushes")
        for i, conn in enumerate(self._conns):
            try:
                conn.send(("stop", ()))
                await self._reply(i, "stop")
            except (OSError, ConfigError):
                pass
            loop.remove_reader(conn.fileno())
        for proc in self._procs:
            proc.join(EVENTS_BENCH_EVENT_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()


# --- the coordinator ---------------------------------------------------------------------------


@dataclass
class _Timing:
    total: float
    hop: float | None
    ends: float | None
    verifies: int
    busy: float
    cpu: float
    recv: float | None = None
    recv_last: float | None = None
    trigger: float | None = None


class _Cluster:
    def __init__(self, n: int, workers: int, carrier: str, pin: bool = False) -> None:
        self.n = n
        self.workers = workers
        self._done: list[tuple[Any, ...]] = []
        self._done_event: asyncio.Event | None = None
        self.hosts: Any = (
            _LocalHosts(n, workers, self._on_done)
            if carrier == "memory"
            else _ProcessHosts(n, workers, self._on_done, pin)
        )
        idents = _identities(n)
        self.ids = sorted(i.party_id for i in idents)
        self.owner = {ident.party_id: k % workers for k, ident in enumerate(idents)}
        self.founders = [i.party_id for i in idents[:_FOUNDERS]]
        self.now = 0.0

    def _on_done(self, msg: tuple[Any, ...]) -> None:
        self._done.append(msg)
        if self._done_event is not None and len(self._done) >= self.workers:
            self._done_event.set()

    async def call(self, pid: str, name: str, *args: Any) -> Any:
        return await self.hosts.call(self.owner[pid], name, *args)

    async def all(self, name: str, *args: Any) -> list[Any]:
        # Every host gets the command before any reply is awaited (they run it in parallel).
        calls = [self.hosts.call(h, name, *args) for h in range(self.workers)]
        return list(await asyncio.gather(*calls))

    async def settle(self) -> None:
        """Wait until no item is in flight: two equal counter rounds with sent == delivered."""
        previous: list[Any] | None = None
        deadline = time.perf_counter() + EVENTS_BENCH_EVENT_TIMEOUT_S
        while True:
            counts = await self.all("counts")
            if counts == previous and sum(c[0] for c in counts) == sum(c[1] for c in counts):
                return
            previous = counts
            if time.perf_counter() > deadline:
                raise ConfigError(
                    f"the bench cluster did not settle within {EVENTS_BENCH_EVENT_TIMEOUT_S} s"
                )
            await asyncio.sleep(0)

    async def set_now(self, now: float) -> None:
        self.now = now
        await self.all("set_now", now)

    async def act(self, pid: str, action: str, *args: Any) -> float:
        t: float = await self.call(pid, "act", pid, action, args)
        return t

    async def info(self, watched: str | None = None) -> dict[str, Any]:
        f0 = self.founders[0]
        result: dict[str, Any] = await self.call(f0, "info", f0, watched)
        return result

    async def heartbeat_round(self, dt: float, skip: Iterable[str] = ()) -> None:
        await self.set_now(self.now + dt)
        skipped = list(skip)
        await self.all("tick", None, skipped)
        await self.settle()

    async def measure(
        self,
        kind: str,
        subject: str,
        affected: Iterable[str],
        principals: Iterable[str],
        trigger: Callable[[], Any],
    ) -> _Timing:
        ends = subject.split("|") if "|" in subject else []
        self._done = []
        self._done_event = asyncio.Event()
        gc.collect()
        gc.freeze()
        for h in range(self.workers):
            await self.hosts.call(h, "arm", kind, subject, list(affected), ends, list(principals))
        gc.disable()
        try:
            t0 = await trigger()
            if len(self._done) < self.workers:
                await asyncio.wait_for(self._done_event.wait(), EVENTS_BENCH_EVENT_TIMEOUT_S)
        except TimeoutError as exc:
            raise ConfigError(
                f"{kind} of {subject} was not applied everywhere within "
                f"{EVENTS_BENCH_EVENT_TIMEOUT_S} s (EVENTS_BENCH_EVENT_TIMEOUT_S)"
            ) from exc
        finally:
            gc.enable()
            self._done_event = None
        await self.all("disarm")
        await self.settle()
        lasts = [m[4] for m in self._done if m[4] is not None]
        hops = [m[3] for m in self._done if m[3] is not None]
        end_times = [m[5] for m in self._done if m[5] is not None]
        recvs = [m[9] for m in self._done if m[9] is not None]
        routed = [m[10] for m in self._done if m[10] is not None]
        return _Timing(
            total=(max(lasts) - t0) * 1000.0,
            hop=(min(hops) - t0) * 1000.0 if hops else None,
            ends=(max(end_times) - t0) * 1000.0 if len(ends) and end_times else None,
            verifies=sum(int(m[6]) for m in self._done),
            busy=max(float(m[7]) for m in self._done) * 1000.0,
            cpu=max(float(m[8]) for m in self._done) * 1000.0,
            recv=(min(recvs) - t0) * 1000.0 if recvs else None,
            recv_last=(max(recvs) - t0) * 1000.0 if len(recvs) == len(self._done) else None,
            trigger=(max(routed) - t0) * 1000.0 if routed else None,
        )


async def _build(cl: _Cluster, rng: random.Random, progress: Callable[[str], None]) -> None:
    for pid in cl.founders:
        await cl.act(pid, "bootstrap")
    await cl.settle()
    for k, pid in enumerate(p for p in cl.ids if p not in cl.founders):
        sponsor = cl.founders[rng.randrange(_FOUNDERS)]
        await cl.act(pid, "request_join", [sponsor])
        await cl.settle()
        if (k + 1) % 64 == 0:
            progress(f"  {k + 1 + _FOUNDERS} of {cl.n} joined")
    ids = cl.ids
    n = len(ids)
    pairs = {tuple(sorted((ids[i], ids[(i + 1) % n]))) for i in range(n)}
    for a in ids:
        for _ in range(_CHORDS_PER_PEER):
            b = rng.choice(ids)
            if a != b:
                pairs.add(tuple(sorted((a, b))))
    by_first: dict[str, list[tuple[str, str]]] = {}
    for a, b in sorted(pairs):
        by_first.setdefault(a, []).append((a, b))
    # One initiator's links at a time: no single command keeps a worker busy for long.
    for a, links in sorted(by_first.items()):
        await cl.call(a, "connect_many", links)
        await cl.settle()
    await cl.heartbeat_round(_HEARTBEAT_S)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    idx = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[idx]


async def _rejoin(cl: _Cluster, x: str, rng: random.Random) -> None:
    await cl.act(x, "request_join", [rng.choice(cl.founders)])
    await cl.settle()
    view = await cl.call(x, "info", x, None)
    others = [p for p in view["active"] if p != x]
    for b in rng.sample(others, min(2, len(others))):
        if view["is_member"]:
            await cl.act(x, "connect", b)
            await cl.settle()


async def _leave(cl: _Cluster, rng: random.Random) -> _Timing:
    active = (await cl.info())["active"]
    x = rng.choice([p for p in active if p not in cl.founders])
    affected = [p for p in active if p != x]
    timing = await cl.measure("leave", x, affected, [x], lambda: cl.act(x, "leave"))
    await _rejoin(cl, x, rng)
    return timing


async def _link_up(cl: _Cluster, rng: random.Random) -> _Timing:
    info = await cl.info()
    active = info["active"]
    live = {tuple(ln) for ln in info["links"]}
    while True:
        a, b = rng.sample(active, 2)
        if tuple(sorted((a, b))) not in live:
            break
    subject = "|".join(sorted((a, b)))
    return await cl.measure("link_up", subject, active, [a, b], lambda: cl.act(a, "connect", b))


async def _link_down(cl: _Cluster, rng: random.Random) -> _Timing:
    info = await cl.info()
    a, b = rng.choice(sorted(tuple(ln) for ln in info["links"]))
    if rng.random() < 0.5:
        a, b = b, a
    subject = "|".join(sorted((a, b)))
    timing = await cl.measure(
        "link_down", subject, info["active"], [a, b], lambda: cl.act(a, "disconnect", b)
    )
    # Put a link back so the graph does not thin out over the run (untimed).
    await cl.act(a, "connect", b)
    await cl.settle()
    return timing


async def _fail(cl: _Cluster, rng: random.Random) -> _Timing:
    info = await cl.info()
    x = rng.choice([p for p in info["active"] if p not in cl.founders])
    watchers = (await cl.info(x))["watchers"]
    affected = [p for p in info["active"] if p != x]
    # A heartbeat round (everyone hears from its watched parties), then x crashes. Two more
    # rounds follow at +1.5 s and +2.5 s, so at the timeout only x has been silent long enough
    # and no heartbeat is due in the timed window.
    await cl.heartbeat_round(_HEARTBEAT_S)
    crash_at = cl.now
    await cl.all("drop", x, True)
    await cl.heartbeat_round(1.5 * _HEARTBEAT_S, skip=[x])
    await cl.heartbeat_round(_HEARTBEAT_S, skip=[x])
    await cl.set_now(crash_at + _SUSPICION_S + 1e-3)

    async def trigger() -> float:
        # Every host's watchers tick at once (each host gets the command before any reply is
        # awaited); the clock starts at the first of them.
        hosts = sorted({cl.owner[w] for w in watchers})
        times = await asyncio.gather(*(cl.hosts.call(h, "tick", watchers, []) for h in hosts))
        return min(float(t) for t in times)

    timing = await cl.measure("fail", x, affected, watchers, trigger)
    # x restarts as a fresh process with a higher incarnation and rejoins (untimed).
    await cl.call(x, "restart", x)
    await cl.all("drop", x, False)
    await _rejoin(cl, x, rng)
    await cl.heartbeat_round(_HEARTBEAT_S)
    return timing


_EVENTS: dict[str, Callable[[_Cluster, random.Random], Any]] = {
    "leave": _leave,
    "link_up": _link_up,
    "link_down": _link_down,
    "fail": _fail,
}


def _verify_cost_us() -> tuple[float, float]:
    """Median and least cost of one Ed25519 verification of an envelope-sized message, in µs.

    The least of the rounds is what the machine does when nothing else competes for the core.
    """
    ident = Identity.from_seed("bench-events-verify")
    data = bytes(range(256)) * 2
    sig = ident.sign(data)
    key = ident.public_key
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(EVENTS_BENCH_VERIFY_SAMPLES):
            verify_signature(key, sig, data)
        rounds.append((time.perf_counter() - t) / EVENTS_BENCH_VERIFY_SAMPLES)
    return statistics.median(rounds) * 1e6, min(rounds) * 1e6


def _wake_cost_us() -> tuple[float, float]:
    """Median cost of sealing one envelope back to back, and right after an idle pause, in µs.

    A process that sleeps between messages (every host between events) finds its caches cold
    when the next one arrives: on a shared virtual machine other tenants run meanwhile. The
    ratio of the two is that penalty, which every first delivery of an event pays.
    """
    ident = Identity.from_seed("bench-events-wake")
    payload = {"record": {"body": {"kind": "leave", "subject": ident.party_id}, "sigs": {}}}

    def one(seq: int) -> float:
        t = time.perf_counter()
        seal(ident, incarnation=0, seq=seq, timestamp=0.0, kind="own", payload=payload)
        return time.perf_counter() - t

    warm = [one(i) for i in range(10 * EVENTS_BENCH_IDLE_PROBE_SAMPLES)]
    idle = []
    for i in range(EVENTS_BENCH_IDLE_PROBE_SAMPLES):
        time.sleep(EVENTS_BENCH_IDLE_PROBE_S)
        idle.append(one(i))
    return statistics.median(warm) * 1e6, statistics.median(idle) * 1e6


def _row(
    timings: list[_Timing], verify_us: float, verify_min_us: float, cores: int
) -> dict[str, Any]:
    vals = [t.total for t in timings]
    hops = [t.hop for t in timings if t.hop is not None]
    ends = [t.ends for t in timings if t.ends is not None]
    floors = [t.verifies * verify_us / 1000.0 / cores for t in timings]
    quiet = [t.verifies * verify_min_us / 1000.0 / cores for t in timings]
    row: dict[str, Any] = {
        "count": len(vals),
        "p50_ms": round(_percentile(vals, 50), 3),
        "p99_ms": round(_percentile(vals, 99), 3),
        "mean_ms": round(statistics.fmean(vals), 3),
        "max_ms": round(max(vals), 3),
        "verifies_p50": round(_percentile([float(t.verifies) for t in timings], 50)),
        "busy_p50_ms": round(_percentile([t.busy for t in timings], 50), 3),
        "cpu_p50_ms": round(_percentile([t.cpu for t in timings], 50), 3),
        "cpu_p99_ms": round(_percentile([t.cpu for t in timings], 99), 3),
        "floor_p50_ms": round(_percentile(floors, 50), 3),
        "floor_quiet_p50_ms": round(_percentile(quiet, 50), 3),
        "recv_p50_ms": round(_percentile([t.recv for t in timings if t.recv is not None], 50), 3),
        "recv_last_p50_ms": round(
            _percentile([t.recv_last for t in timings if t.recv_last is not None], 50), 3
        ),
        "trigger_p50_ms": round(
            _percentile([t.trigger for t in timings if t.trigger is not None], 50), 3
        ),
        "hop_p50_ms": round(_percentile(hops, 50), 3),
        "hop_p99_ms": round(_percentile(hops, 99), 3),
    }
    if ends:
        row["ends_p50_ms"] = round(_percentile(ends, 50), 3)
        row["ends_p99_ms"] = round(_percentile(ends, 99), 3)
    return row


@dataclass(frozen=True)
class _Options:
    """One run's choices, as ``run_events`` validated them."""

    peers: int
    repeats: int
    seed: int
    carrier: str
    workers: int
    pin: bool


@dataclass(frozen=True)
class _Costs:
    """Costs of this machine measured before the cluster starts, in microseconds."""

    verify_us: float
    verify_min_us: float
    seal_warm_us: float
    seal_idle_us: float


@dataclass(frozen=True)
class _Measured:
    """What one cluster run produced: the timings and the hosts' end-of-run reports."""

    carrier: str
    setup_s: float
    samples: dict[str, list[_Timing]]
    stats: list[dict[str, Any]]
    host_cpus: list[Any]


#: The result's fixed explanations of its figures (see the module docstring).
_NOTES: dict[str, str] = {
    "gc": (
        "collected before and disabled inside each timed window (as timeit does); the "
        "survivors frozen (gc.freeze), so each pass walks only what is new"
    ),
    "affected": "every active member (membership and neighbour graph are in every view)",
    "floor": (
        "floor_p50_ms = signature checks the peers made in the window (each peer's own "
        "cache misses, counted per event: verifies_p50) x verify_us / cores_used: the least "
        "this protocol with per-peer verification needs on this machine as loaded now; "
        "floor_quiet_p50_ms the same with verify_min_us (the least round: a quiet core)"
    ),
    "busy": (
        "busy_p50_ms: the busiest host's time inside Peer.handle during the window (the "
        "rest of p50_ms is transport, event loop and waiting for a core)"
    ),
    "cpu": (
        "cpu_p50_ms/cpu_p99_ms: the busiest host's main-thread CPU time from arming the "
        "window to its last apply (time.thread_time: excludes time other processes held "
        "the core, and grpc's own threads); on a machine nobody else loads, p50_ms would "
        "be about this plus hop_p50_ms"
    ),
    "recv": (
        "recv_p50_ms: trigger until the first batch of the window reached any host (the "
        "trigger's own steps, one seal, one loopback hop); recv_last_p50_ms: until every "
        "host had its first batch; trigger_p50_ms: the triggering call itself (the "
        "peer's action or the watchers' ticks, and handing the envelopes to the carrier)"
    ),
    "hop": (
        "hop_p50_ms/hop_p99_ms (measured): trigger until the first peer outside the "
        "event's own parties applied it (protocol steps, one seal, one loopback hop, "
        "verify + apply); with a core per peer, as in a deployment, about what every peer "
        "sees (plus the sender's per-destination sends)"
    ),
}


def _placement(opts: _Options, pinned: bool) -> str:
    """The result's ``placement`` line: where the peers ran and how envelopes travelled."""
    return (
        f"peers round-robin over {opts.workers} host(s)"
        + (
            " (one OS process each, one grpc.aio carrier each on 127.0.0.1; every "
            "envelope crosses HTTP/2, batched per destination host on a persistent push "
            "stream"
            + ("; each process and its grpc threads pinned to its own CPU" if pinned else "")
            + ")"
            if opts.carrier == "grpc"
            else " in this process (FIFO in-process router)"
        )
        + "; virtual protocol clock; every peer verifies every envelope and every record "
        "signature itself (one signature cache per peer)"
    )


async def _measure(opts: _Options, progress: Callable[[str], None]) -> _Measured:
    """Build the cluster, trigger ``repeats`` rounds of every event type, collect the hosts."""
    rng = random.Random(opts.seed)
    cl = _Cluster(opts.peers, opts.workers, opts.carrier, opts.pin)
    t_setup = time.perf_counter()
    await cl.hosts.start()
    try:
        progress(
            f"bench events: {opts.peers} peers on {opts.workers} {opts.carrier} host(s), building"
        )
        await _build(cl, rng, progress)
        setup_s = time.perf_counter() - t_setup
        samples: dict[str, list[_Timing]] = {k: [] for k in _EVENTS}
        for r in range(opts.repeats):
            for name, fn in _EVENTS.items():
                samples[name].append(await fn(cl, rng))
            if (r + 1) % 10 == 0 or r + 1 == opts.repeats:
                progress(f"  {opts.peers} peers: {r + 1} of {opts.repeats} rounds of events")
        stats = await cl.all("stats")
        host_cpus = await cl.all("cpus")
    finally:
        await cl.hosts.close()
        gc.unfreeze()
    return _Measured(cl.hosts.name, setup_s, samples, stats, host_cpus)


def _report(
    opts: _Options, costs: _Costs, measured: _Measured, load_before: float
) -> dict[str, Any]:
    """The JSON-ready result of one run."""
    stats = measured.stats
    handle_s = [t for s in stats for t in s["handle_s"]]
    digests = {d for s in stats for d in s["digests"]}
    cores = max(1, min(opts.workers, os.cpu_count() or 1))
    # Pinned as asked only where every worker really ended up on a single CPU.
    pinned = (
        opts.pin
        and opts.carrier == "grpc"
        and all(isinstance(c, list) and len(c) == 1 for c in measured.host_cpus)
    )
    return {
        "peers": opts.peers,
        "carrier": measured.carrier,
        "workers": opts.workers,
        "cores_used": cores,
        "host_cpus": measured.host_cpus,
        "pinned": pinned,
        "placement": _placement(opts, pinned),
        **_NOTES,
        "verify_us": round(costs.verify_us, 2),
        "seal_warm_us": round(costs.seal_warm_us, 2),
        "seal_after_idle_us": round(costs.seal_idle_us, 2),
        "wake": (
            "seal_warm_us: sealing one small envelope back to back; seal_after_idle_us: the "
            f"same right after {EVENTS_BENCH_IDLE_PROBE_S * 1000:g} ms idle (caches gone cold "
            "while the process slept, as every host sleeps between events)"
        ),
        "verify_min_us": round(costs.verify_min_us, 2),
        "loadavg_1min": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "nice": os.nice(0),
        "repeats": opts.repeats,
        "seed": opts.seed,
        "setup_s": round(measured.setup_s, 3),
        "rejections": sum(int(s["rejections"]) for s in stats),
        "views_agree": len(digests) == 1,
        "handle_us_p50": round(_percentile(handle_s, 50) * 1e6, 1),
        "deliveries_in_timed_windows": len(handle_s),
        "events": {
            name: _row(vals, costs.verify_us, costs.verify_min_us, cores)
            for name, vals in measured.samples.items()
        },
    }


async def _run(opts: _Options, progress: Callable[[str], None]) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    verify_us, verify_min_us = _verify_cost_us()
    seal_warm_us, seal_idle_us = _wake_cost_us()
    costs = _Costs(verify_us, verify_min_us, seal_warm_us, seal_idle_us)
    measured = await _measure(opts, progress)
    return _report(opts, costs, measured, load_before)


def run_events(
    peers: int = 64,
    *,
    repeats: int = EVENTS_BENCH_REPEATS,
    seed: int = EVENTS_BENCH_SEED,
    carrier: str = "auto",
    workers: int | None = None,
    pin: bool = EVENTS_BENCH_PIN_WORKERS,
    progress: Callable[[str], None] | None = None,
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
        ``"grpc"`` (worker processes over grpc.aio loopback), ``"memory"`` (in-process), or
        ``"auto"`` (grpc).
    workers
        Hosts to spread the peers over; default ``EVENTS_BENCH_WORKERS`` for grpc (one worker
        process per core), 1 for memory.
    pin
        Pin each grpc worker process, and the grpc threads it starts, to its own CPU (round
        robin over the CPUs this process may use; ignored where the OS cannot). Unpinned, the
        scheduler may queue a host woken by a batch behind the other host's busy thread on one
        CPU while the other sits idle: a whole event late, at random.
    progress
        Called with progress lines; default: print them on stderr.

    Returns
    -------
    dict
        ``{"peers", "carrier", "events": {type: {"count", "p50_ms", "p99_ms", ...}}, ...}``.

    Raises
    ------
    ConfigError
        If ``peers < 8``, ``repeats < 1``, ``workers < 1``, the carrier is unknown, or an event
        does not settle within ``EVENTS_BENCH_EVENT_TIMEOUT_S``.
    """
    if peers < 8:
        raise ConfigError(f"option 'peers' must be >= 8, got {peers}")
    if repeats < 1:
        raise ConfigError(f"option 'repeats' must be >= 1, got {repeats}")
    if carrier == "auto":
        carrier = "grpc"
    if carrier not in ("grpc", "memory"):
        raise ConfigError(f"option 'carrier' must be 'memory' or 'grpc', got {carrier!r}")
    if workers is None:
        workers = EVENTS_BENCH_WORKERS if carrier == "grpc" else 1
    if workers < 1:
        raise ConfigError(f"option 'workers' must be >= 1, got {workers}")

    def to_stderr(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    opts = _Options(peers, repeats, seed, carrier, workers, pin)
    return asyncio.run(_run(opts, progress or to_stderr))
