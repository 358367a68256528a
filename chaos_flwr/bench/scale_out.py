"""``chaos-flwr bench scale-out``: move a real training state to a joiner over shaped sockets.

Setup
-----
* A :class:`~chaos_flwr.state.TrainingState` of random float32 arrays (``state_mib`` MiB) is
  serialised once and written to a file, the donors' certified replica.
* Every donor is a **separate OS process** running a :class:`~chaos_flwr.transport.GrpcCarrier`
  on 127.0.0.1 with a :class:`~chaos_flwr.transport.Shaper` for its own party of the WAN profile
  (uplink token bucket, access latency). It answers shard requests from the replica (``mmap``,
  through a :class:`~chaos_flwr.transfer.ShardServer`), so a donor's serving never shares the
  joiner's event loop. Donors stop when the benchmark closes their stdin, and are killed by pid.
* The joiner runs in this process: its carrier shapes its downlink and its latency.
* Manifests (per-shard SHA-256) are what donors sign in their state receipts ahead of any
  join, so each donor computes them before the timer starts; the joiner still fetches the
  manifest over the network inside the timed window.

Methods
-------
``chaos``
    :func:`~chaos_flwr.planner.plan_transfer` + :class:`~chaos_flwr.transfer.PullSession` (pull
    queue, stealing, re-planning on donor loss).
``uniform``
    Equal contiguous split over all donors, no stealing (Elan-like).
``single``
    The fastest donor sends everything (Autoscaling/EDL-like).
``checkpoint``
    Training stops; the fastest donor writes its replica to a storage file through the storage
    link (``min(donor uplink, storage down)``), the joiner reads it back (``min(storage up,
    joiner down)``), each leg paying the storage latency once; training restarts. Every donor is
    idle the whole time, so ``idle_s = donors * delay_s``.

Link modes
----------
``--wan shaped`` (default) is the setup above. ``--wan netns`` shapes real kernel links
(:func:`~chaos_flwr.transport.netns.star`): each donor process runs inside its own network
namespace (``ip netns exec``) and its server binds only its namespace-local address; every donor
namespace has a veth to a bridge in a hub namespace, and the root namespace (the joiner, this
process) has one veth on that bridge. A donor's egress is shaped by ``tbf`` at its uplink (or
its ``donor -> joiner`` pair cap), the bridge's port toward the joiner at the joiner's downlink,
the joiner's own veth at its uplink; each rate is the wire rate whose TCP payload rate is the
profile's figure (``tbf`` counts Ethernet/IP/TCP headers; veths use ``NETNS_STAR_MTU`` jumbo
frames to keep the packet rate, and the kernel's CPU share, low). Unpaced by a token bucket, a
donor's grpc server would interleave all its in-flight replies over the link; it streams them
one at a time instead (FIFO, as one uplink does and as the pull engine models). netem is not
available, so the kernel adds no latency; the carriers keep the profile's latency model with
every rate removed (:func:`latency_only`). The links as shaped are therefore the profile's
links, and the lower bound is the same. The checkpoint's storage legs stay token buckets on
files in both modes.
Namespaces, veths and donor processes are removed on exit, error or Ctrl-C.

``delay_s`` runs from the join request (planning included) to a verified state (digest checked).
``lower_bound_s`` is :func:`~chaos_flwr.planner.lower_bound` over the donors' modelled links,
with a donor's latency taken as its round trip to the joiner (a pull needs a request before the
first byte) and the joiner's downlink as ingress. ``idle_s`` is 0 for the replica-serving methods:
donors serve from immutable replica files while their training continues.
"""

from __future__ import annotations

import asyncio
import functools
import math
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, TypedDict, Unpack, cast

import grpc
import grpc.aio
import numpy as np
import yaml

from ..defaults import NETNS_STAR_MTU, SHAPING_BURST_BYTES
from ..errors import ConfigError, ShardIntegrityError, TransferError, TransportError
from ..planner import Donor, TransferPlan, lower_bound, plan_transfer
from ..state import Manifest, TrainingState, state_digest
from ..transfer import CancelRequest, Progress, PullSession, ShardRequest, ShardServer
from ..transport import GrpcCarrier, Shaper, TokenBucket, WanProfile, load_profile, parse_profile
from ..transport.netns import NetnsStar, star, tcp_wire_factor, wire_rate_bit_s
from .settings import (
    SCALE_OUT_DONOR_STARTUP_S,
    SCALE_OUT_MIN_TIMEOUT_S,
    SCALE_OUT_PROGRESS_INTERVAL_S,
    SCALE_OUT_RUNS,
    SCALE_OUT_STATE_MIB,
    SCALE_OUT_STORAGE_MB_S,
    SCALE_OUT_SWEEP_DONORS,
    SCALE_OUT_SWEEP_MB_S,
    SCALE_OUT_TIMEOUT_FACTOR,
    SCALE_OUT_TIMEOUT_S,
)

__all__ = [
    "ScaleOutKnobs",
    "ScaleOutSettings",
    "default_profile_path",
    "donors_of",
    "latency_only",
    "main",
    "netns_rates_bit_s",
    "run_scale_out",
]

JOINER = "joiner"
#: Shard requests in flight per donor. Enough to cover the round trip (rate x RTT is about one
#: 512 KiB shard on the default profile) and small, so a slow donor does not hold many shards in
#: its pipeline where the pull queue cannot steal them (6 gave 1.29x the bound, 3 gives 1.18x).
WINDOW = 3
#: Largest shard count planned (1 MiB shards for 1 GiB; 256 KiB for the default 256 MiB).
MAX_SHARDS = 1024
#: Smallest shard planned, in bytes (keeps per-request Python/grpc cost small next to the link).
MIN_SHARD_BYTES = 256 * 1024
#: Chunk size of the checkpoint's storage reads and writes, in bytes.
STORAGE_CHUNK = 1024 * 1024
METHODS = ("chaos", "uniform", "single", "checkpoint")


class ScaleOutKnobs(TypedDict, total=False):
    """The fields of :class:`ScaleOutSettings`, as keywords of :func:`run_scale_out`."""

    profile_path: Path | str | None
    wan: str
    state_mib: int
    runs: int
    methods: Sequence[str]
    extras: bool
    sweep_donors: Sequence[int]


@dataclass(frozen=True)
class ScaleOutSettings:
    """The knobs of one scale-out benchmark (checked when made; see :func:`run_scale_out`).

    Parameters
    ----------
    profile_path : path or None, optional
        WAN profile YAML (a ``joiner`` party and donors); ``None`` = the shipped ``wan8.yaml``.
    wan : str, optional
        ``"shaped"``: token buckets on loopback grpc. ``"netns"``: every donor process runs in
        its own network namespace (``ip netns exec``), bound to its namespace-local address,
        linked to the joiner (this process, root namespace) through a bridge; each donor's
        egress is shaped by ``tbf`` at its uplink, the bridge's port toward the joiner at the
        joiner's downlink (see :func:`netns_rates_bit_s`). The kernel adds no latency (no
        netem): the carriers keep the profile's latency model with all rates removed
        (:func:`latency_only`), so the lower bound is the same formula over the same figures.
        Needs root; the main comparison only (``extras=False``).
    state_mib : int, optional
        State size in MiB (>= 1).
    runs : int, optional
        Runs of ``chaos`` (its median is reported); the baselines run once.
    methods : sequence of str, optional
        Which methods to run.
    extras : bool, optional
        Also run the donor sweep, the donor-death run and the joiner-bottleneck run.
    sweep_donors : sequence of int, optional
        Donor counts of the sweep.

    Raises
    ------
    ConfigError
        Bad option (the message names it).
    """

    profile_path: Path | str | None = None
    wan: str = "shaped"
    state_mib: int = SCALE_OUT_STATE_MIB
    runs: int = SCALE_OUT_RUNS
    methods: Sequence[str] = METHODS
    extras: bool = True
    sweep_donors: Sequence[int] = SCALE_OUT_SWEEP_DONORS

    def __post_init__(self) -> None:
        if self.wan not in ("shaped", "netns"):
            raise ConfigError(f"wan: {self.wan!r} is not a link mode; use 'shaped' or 'netns'")
        if self.wan == "netns" and self.extras:
            raise ConfigError(
                "wan: 'netns' runs the main comparison only (the sweep, donor-death and "
                "joiner-bottleneck runs are not wired to namespaces yet); pass extras=False "
                "(--no-extras)"
            )
        mib = self.state_mib
        if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
            raise ConfigError(f"state_mib: give an int >= 1, got {mib!r}")
        if self.runs < 1:
            raise ConfigError(f"runs: give an int >= 1, got {self.runs!r}")
        for m in self.methods:
            if m not in METHODS:
                raise ConfigError(f"methods: unknown method {m!r}; use {', '.join(METHODS)}")

    @property
    def chaos_extras(self) -> bool:
        """Whether the extra runs (sweep, donor death, joiner bottleneck) are due."""
        return self.extras and "chaos" in self.methods


def default_profile_path() -> Path:
    """The shipped default profile ``chaos_flwr/bench/profiles/wan8.yaml``."""
    return Path(str(resources.files("chaos_flwr.bench") / "profiles" / "wan8.yaml"))


def donors_of(profile: WanProfile) -> list[str]:
    """The donor parties of a profile (every party except ``joiner``), sorted."""
    if JOINER not in profile.parties:
        raise ConfigError("parties: a scale-out profile needs a party named 'joiner'")
    names = sorted(p for p in profile.parties if p != JOINER)
    if not names:
        raise ConfigError("parties: a scale-out profile needs at least one donor besides 'joiner'")
    return names


def _planner_donors(profile: WanProfile, names: Sequence[str]) -> list[Donor]:
    out = []
    for name in names:
        bps = profile.path_bps(name, JOINER)
        if not np.isfinite(bps):
            raise ConfigError(f"parties.{name}.up_mb_s: a donor needs a finite uplink")
        out.append(Donor(name, bps, latency=2 * profile.one_way_s(JOINER, name)))
    return out


def _ingress(profile: WanProfile) -> float | None:
    return profile.link(JOINER).down_bps


# --- the donor process -----------------------------------------------------------------------


class _MmapSource:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - lives as long as the donor process
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def total_bytes(self) -> int:
        return len(self._map)

    def read(self, start: int, end: int) -> bytes:
        return self._map[start:end]


class _HostCarrier(GrpcCarrier):
    """A :class:`GrpcCarrier` whose server binds ``host`` (a namespace-local address) instead
    of 127.0.0.1; used only inside a donor's own network namespace in ``--wan netns`` mode."""

    def __init__(self, party_id: str, host: str, *, shaper: Shaper | None = None) -> None:
        super().__init__(party_id, host=host, shaper=shaper)
        self._send_lock = asyncio.Lock()

    async def _serve(
        self, request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        """Stream replies one at a time (FIFO), as a single uplink does.

        Unpaced by a token bucket, grpc would queue every in-flight reply at once and
        interleave them over the kernel link, so each shard would finish only when all of them
        do; the pull engine (and the shaped mode) model a donor's uplink as a FIFO.
        """
        stream = cast(AsyncGenerator[bytes, None], super()._serve(request, context))
        first = True
        try:
            async for chunk in stream:
                if first:
                    await self._send_lock.acquire()
                    first = False
                yield chunk
        finally:
            if not first:
                self._send_lock.release()
            await stream.aclose()


def latency_only(profile: WanProfile) -> WanProfile:
    """``profile`` with every rate removed: only the access latencies remain.

    In ``--wan netns`` mode the kernel links (``tbf``) carry the bandwidth; the carriers' shapers
    add only the latency model (netem is not available to do it in the kernel).
    """
    return parse_profile(
        {
            "name": f"{profile.name}-latency",
            "parties": {p: {"latency_ms": link.latency_ms} for p, link in profile.parties.items()},
        }
    )


async def _donor(party: str, profile_path: Path, state_path: Path, host: str | None = None) -> None:
    profile = load_profile(profile_path)
    source = _MmapSource(state_path)
    server = ShardServer(source)
    waiters: dict[tuple[str, int], asyncio.Event] = {}
    grants: dict[tuple[str, int], Any] = {}
    manifests: dict[tuple[int, int], bytes] = {}
    stop = asyncio.Event()

    def granted(uploads: Sequence[Any]) -> None:
        for u in uploads:
            grants[(u.requester, u.index)] = u
            ev = waiters.get((u.requester, u.index))
            if ev is not None:
                ev.set()

    async def handle(src: str, data: bytes) -> bytes:
        words = data.decode().split()
        if words[0] == "shard":
            index, start, end = (int(w) for w in words[1:4])
            key = (src, index)
            ev = waiters[key] = asyncio.Event()
            granted(server.request(src, index, start, end))
            await ev.wait()
            upload = grants.pop(key)
            try:
                return server.read(upload)
            finally:
                waiters.pop(key, None)
                granted(server.finish(upload))
        if words[0] == "manifest":
            k = (int(words[1]), int(words[2]))
            if k not in manifests:
                manifests[k] = server.manifest(k[0], num_shards=k[1]).to_bytes()
            return manifests[k]
        if words[0] == "checkpoint":
            await _write_checkpoint(profile, party, source, Path(words[1]))
            return b"ok"
        if words[0] == "ping":
            return b"pong"
        if words[0] == "stop":
            stop.set()
            return b"bye"
        raise ValueError(f"unknown request {words[0]!r}")

    carrier: GrpcCarrier
    if host is None:
        carrier = GrpcCarrier(party, shaper=Shaper(profile, party))
    else:
        carrier = _HostCarrier(party, host, shaper=Shaper(latency_only(profile), party))
    await carrier.start(handle)
    print(carrier.address, flush=True)
    try:
        await asyncio.wait_for(stop.wait(), SCALE_OUT_TIMEOUT_S * 20)
    finally:
        await carrier.close()


def _storage_rate(profile: WanProfile, write: bool, party: str) -> tuple[float, float]:
    storage = profile.storage
    default = SCALE_OUT_STORAGE_MB_S * 1e6
    if write:
        store_side = storage.down_bps if storage and storage.down_bps else default
        own = profile.link(party).up_bps
    else:
        store_side = storage.up_bps if storage and storage.up_bps else default
        own = profile.link(party).down_bps
    rate = store_side if own is None else min(store_side, own)
    latency = (storage.latency_s if storage else 0.0) + profile.link(party).latency_s
    return rate, latency


async def _write_checkpoint(
    profile: WanProfile, party: str, source: _MmapSource, path: Path
) -> None:
    rate, latency = _storage_rate(profile, True, party)
    bucket = TokenBucket(rate, SHAPING_BURST_BYTES)
    await asyncio.sleep(latency)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        for start in range(0, source.total_bytes, STORAGE_CHUNK):
            chunk = source.read(start, min(start + STORAGE_CHUNK, source.total_bytes))
            await bucket.acquire(len(chunk))
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> None:
    """Donor process entry: ``python -m chaos_flwr.bench.scale_out PARTY PROFILE STATE [HOST]``.

    With ``HOST`` (netns mode) the donor binds that namespace-local address and its carrier
    shapes latency only (its namespace's ``tbf`` shapes its uplink).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    party, profile_path, state_path = args[:3]
    host = args[3] if len(args) > 3 else None

    def watch_stdin() -> None:  # the parent closing our stdin (or dying) stops us
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    asyncio.run(_donor(party, Path(profile_path), Path(state_path), host))


# --- the joiner side -------------------------------------------------------------------------


class _DonorSet:
    """Donor processes of one profile, started in parallel, stopped by pid."""

    def __init__(
        self,
        names: Sequence[str],
        profile_path: Path,
        state_path: Path,
        topo: NetnsStar | None = None,
    ) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}
        env = dict(os.environ)
        try:
            for name in names:
                argv = [sys.executable, "-m", "chaos_flwr.bench.scale_out", name,
                        str(profile_path), str(state_path)]  # fmt: skip
                if topo is not None:
                    argv = topo.exec_argv(name, [*argv, topo.addresses[name]])
                self.procs[name] = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
        except BaseException:
            self.close()
            raise
        deadline = time.monotonic() + SCALE_OUT_DONOR_STARTUP_S
        try:
            for name, proc in self.procs.items():
                assert proc.stdout is not None
                host = "127.0.0.1" if topo is None else topo.addresses[name]
                line = proc.stdout.readline().strip()
                if not line.startswith(f"{host}:") or time.monotonic() > deadline:
                    raise TransportError(f"donor {name!r} did not start (said {line!r})")
                self.addresses[name] = line
        except BaseException:
            self.close()
            raise

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    assert proc.stdin is not None
                    proc.stdin.close()
                    proc.wait(timeout=3)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait(timeout=10)


async def _joiner(
    profile: WanProfile, donors: _DonorSet, names: Sequence[str], *, netns: bool = False
) -> GrpcCarrier:
    async def refuse(src: str, data: bytes) -> bytes:
        raise ValueError("the joiner serves nothing in this benchmark")

    shaper = Shaper(latency_only(profile) if netns else profile, JOINER)
    carrier = GrpcCarrier(JOINER, shaper=shaper)
    await carrier.start(refuse)
    for name in names:
        carrier.add_peer(name, donors.addresses[name])
    return carrier


async def _prepare(carrier: GrpcCarrier, names: Sequence[str], shard: int, k: int) -> None:
    """Warm the channels and let each donor compute its manifest (receipts exist beforehand)."""
    await asyncio.gather(
        *(carrier.request(n, f"manifest {shard} {k}".encode(), timeout=120) for n in names)
    )


async def _fetch_manifest(carrier: GrpcCarrier, donor: str, shard: int, k: int) -> Manifest:
    return Manifest.from_bytes(await carrier.request(donor, f"manifest {shard} {k}".encode()))


class _ChaosPull:
    """The requests of one ``chaos`` pull: a :class:`PullSession`'s actions as grpc requests."""

    def __init__(
        self, carrier: GrpcCarrier, session: PullSession, clock: Callable[[], float]
    ) -> None:
        self.carrier = carrier
        self.session = session
        self.clock = clock
        self.tasks: dict[asyncio.Task[bytes], tuple[str, int]] = {}
        self.by_key: dict[tuple[str, int], asyncio.Task[bytes]] = {}
        self.info: dict[str, Any] = {"lost": [], "cancelled": 0}
        self.last_at: dict[str, float] = {}
        self.t_begin = clock()

    def launch(self, actions: Sequence[ShardRequest | CancelRequest]) -> None:
        for a in actions:
            if isinstance(a, ShardRequest):
                req = f"shard {a.index} {a.start} {a.end}".encode()
                t = asyncio.ensure_future(self.carrier.request(a.donor, req))
                self.tasks[t] = (a.donor, a.index)
                self.by_key[(a.donor, a.index)] = t
            else:
                old = self.by_key.pop((a.donor, a.index), None)
                if old is not None:
                    old.cancel()
                    self.tasks.pop(old, None)
                    self.info["cancelled"] += 1

    async def step(self) -> None:
        """Wait for a reply (or the session's next deadline) and hand the session the news."""
        session, clock = self.session, self.clock
        if not self.tasks:
            raise TransferError("no shard request in flight and shards missing")
        dl = session.next_deadline()
        timeout = None if dl is None else max(0.0, dl - clock())
        done, _ = await asyncio.wait(
            self.tasks.keys(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for t in done:
            entry = self.tasks.pop(t, None)
            if entry is None:  # cancelled by an action earlier in this batch
                continue
            donor, index = entry
            if self.by_key.get(entry) is t:
                del self.by_key[entry]
            if t.cancelled():
                continue
            exc = t.exception()
            if exc is not None:
                if donor not in self.info["lost"]:
                    self.info["lost"].append(donor)
                self.launch(session.on_donor_lost(donor, clock()))
            else:
                self.launch(session.on_shard(donor, index, t.result(), clock()))
                self.last_at[donor] = clock() - self.t_begin
        self.launch(session.tick(clock()))

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()


async def _pull_chaos(
    carrier: GrpcCarrier,
    manifest: Manifest,
    plan: Any,
    donors: Sequence[Donor],
    expected: bytes,
    *,
    kill_at: float | None = None,
    kill: Callable[[], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[bytes | memoryview, dict[str, int], dict[str, Any]]:
    loop = asyncio.get_running_loop()
    clock = loop.time
    session = PullSession(
        manifest,
        plan,
        donors,
        now=clock(),
        expected_digest=expected,
        window=WINDOW,
        timeout_factor=SCALE_OUT_TIMEOUT_FACTOR,
        min_timeout_s=SCALE_OUT_MIN_TIMEOUT_S,
    )
    pull = _ChaosPull(carrier, session, clock)
    info = pull.info
    pull.launch(session.poll(clock()))
    killed = False
    last_shown = -math.inf
    try:
        while not session.done:
            await pull.step()
            snapshot = session.progress(clock())
            fraction = snapshot.fraction
            if on_progress is not None and (
                session.done or clock() - last_shown >= SCALE_OUT_PROGRESS_INTERVAL_S
            ):
                on_progress(snapshot)
                last_shown = clock()
            if kill is not None and not killed and kill_at is not None and fraction >= kill_at:
                kill()
                killed = True
                info["killed_at_fraction"] = fraction
        info["pull_s"] = clock() - pull.t_begin
        data = session.assemble()
        info["assemble_s"] = clock() - pull.t_begin - info["pull_s"]
        info["last_shard_at_s"] = dict(sorted(pull.last_at.items()))
        info["donor_status"] = {d.id: session.status(d.id) for d in donors}
    finally:
        pull.cancel()
    return data, dict(session.progress(clock()).bytes_by_donor), info


async def _pull_static(
    carrier: GrpcCarrier,
    manifest: Manifest,
    assignment: Mapping[str, Sequence[int]],
    expected: bytes,
) -> tuple[bytes, dict[str, int]]:
    buf = bytearray(manifest.total_bytes)
    sent: dict[str, int] = {d: 0 for d in assignment}

    async def worker(donor: str, queue: list[int]) -> None:
        while queue:
            index = queue.pop(0)
            start, end = manifest.shard_range(index)
            data = await carrier.request(donor, f"shard {index} {start} {end}".encode())
            manifest.verify_shard(index, data)
            buf[start:end] = data
            sent[donor] += len(data)

    jobs: list[Any] = []
    for donor, shards in assignment.items():
        queue = list(shards)
        jobs.extend(worker(donor, queue) for _ in range(WINDOW))
    await asyncio.gather(*jobs)
    if state_digest(buf) != expected:
        raise ShardIntegrityError("assembled state does not match the certified digest")
    return bytes(buf), sent


async def _checkpoint(
    profile: WanProfile, carrier: GrpcCarrier, writer: str, path: Path, expected: bytes
) -> int:
    await carrier.request(writer, f"checkpoint {path}".encode(), timeout=SCALE_OUT_TIMEOUT_S)
    rate, latency = _storage_rate(profile, False, JOINER)
    bucket = TokenBucket(rate, SHAPING_BURST_BYTES)
    await asyncio.sleep(latency)
    parts = []
    with open(path, "rb") as fh:
        while chunk := fh.read(STORAGE_CHUNK):
            await bucket.acquire(len(chunk))
            parts.append(chunk)
    data = b"".join(parts)
    if state_digest(data) != expected:
        raise ShardIntegrityError(f"{path}: checkpoint does not match the certified digest")
    return len(data)


def _baseline_shards(total: int, plan_shards: int, donors: int) -> tuple[int, int]:
    """Shard size and count of the uniform/single baselines.

    The chaos plan's shard count, but at least 64 shards per donor (capped by ``MAX_SHARDS`` and
    ``MIN_SHARD_BYTES``), so an equal split reaches every donor even when the planner picked few
    large shards (as it does when the joiner's downlink caps the transfer).
    """
    k = max(plan_shards, min(MAX_SHARDS, 64 * donors, -(-total // MIN_SHARD_BYTES)), 1)
    shard = max(1, -(-total // k))
    return shard, -(-total // shard)


def _split(k: int, names: Sequence[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    base, extra = divmod(k, len(names))
    pos = 0
    for i, name in enumerate(names):
        n = base + (1 if i < extra else 0)
        out[name] = list(range(pos, pos + n))
        pos += n
    return out


class _Run(NamedTuple):
    """One timed transfer of a session: its label, method, the links it sees, when to kill."""

    label: str
    method: str
    #: The profile as the joiner sees it (the session's, or one with a tighter joiner link).
    profile: WanProfile
    #: Fraction of the state after which the fastest donor is killed (``None``: never).
    kill_at: float | None


@dataclass(frozen=True)
class _Replica:
    """The certified replica every donor serves (file, size, digest) and the scratch folder."""

    path: Path
    total: int
    expected: bytes
    workdir: Path


@dataclass(frozen=True)
class _Links:
    """The joiner's modelled links to the donors of one run, and what they bound."""

    donors: list[Donor]
    ingress: float | None
    fastest: str
    bound: float

    @classmethod
    def of(cls, profile: WanProfile, names: Sequence[str], total: int) -> _Links:
        donors = _planner_donors(profile, names)
        ingress = _ingress(profile)
        bound = lower_bound(total, donors, ingress=ingress)
        fastest = max(donors, key=lambda d: (d.bandwidth, -d.latency, d.id)).id
        return cls(donors, ingress, fastest, bound)

    def plan(self, total: int) -> TransferPlan:
        return plan_transfer(
            total,
            self.donors,
            max_shards=MAX_SHARDS,
            min_shard_bytes=MIN_SHARD_BYTES,
            ingress=self.ingress,
        )


#: What one method's transfer returns: the state it got, bytes per donor, its own figures.
_Moved = tuple[bytes | memoryview, Mapping[str, int], dict[str, Any]]


async def _by_chaos(
    run: _Run,
    carrier: GrpcCarrier,
    links: _Links,
    replica: _Replica,
    donor_set: _DonorSet | None,
    on_progress: Callable[[Progress], None] | None,
) -> _Moved:
    plan = links.plan(replica.total)
    manifest = await _fetch_manifest(carrier, links.fastest, plan.shard_bytes, plan.num_shards)
    kill = None
    victim = None
    if run.kill_at is not None and donor_set is not None:
        victim = links.fastest

        def kill() -> None:
            donor_set.kill(links.fastest)

    data, by_donor, info = await _pull_chaos(
        carrier,
        manifest,
        plan,
        links.donors,
        replica.expected,
        kill_at=run.kill_at,
        kill=kill,
        on_progress=on_progress,
    )
    bound = links.bound
    extra = {
        "num_shards": plan.num_shards,
        "shard_bytes": plan.shard_bytes,
        "planned_makespan_s": plan.makespan,
        "lost_donors": info["lost"],
        "cancelled_requests": info["cancelled"],
        "pull_s": info["pull_s"],
        "pull_ratio_to_bound": info["pull_s"] / bound if bound > 0 else None,
        "assemble_s": info["assemble_s"],
        "last_shard_at_s": info["last_shard_at_s"],
        "donor_status": info["donor_status"],
    }
    if victim is not None:
        extra["killed_donor"] = victim
        extra["killed_at_fraction"] = info.get("killed_at_fraction")
    return data, by_donor, extra


async def _by_static(
    method: str, carrier: GrpcCarrier, names: Sequence[str], links: _Links, replica: _Replica
) -> _Moved:
    total = replica.total
    plan = links.plan(total)
    shard, k = _baseline_shards(total, plan.num_shards, len(names))
    manifest = await _fetch_manifest(carrier, links.fastest, shard, k)
    fastest = links.fastest
    assignment = _split(k, names) if method == "uniform" else {fastest: list(range(k))}
    data, by_donor = await _pull_static(carrier, manifest, assignment, replica.expected)
    return data, by_donor, {"num_shards": k, "shard_bytes": shard}


async def _by_checkpoint(
    profile: WanProfile, carrier: GrpcCarrier, links: _Links, replica: _Replica
) -> _Moved:
    path = replica.workdir / "checkpoint.bin"
    n = await _checkpoint(profile, carrier, links.fastest, path, replica.expected)
    path.unlink(missing_ok=True)
    return b"", {links.fastest: n}, {"writer": links.fastest}


async def _run_method(
    run: _Run,
    carrier: GrpcCarrier,
    names: Sequence[str],
    replica: _Replica,
    *,
    donor_set: _DonorSet | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> dict[str, Any]:
    method = run.method
    links = _Links.of(run.profile, names, replica.total)
    t0 = time.monotonic()
    if method == "chaos":
        data, by_donor, extra = await _by_chaos(
            run, carrier, links, replica, donor_set, on_progress
        )
    elif method in ("uniform", "single"):
        data, by_donor, extra = await _by_static(method, carrier, names, links, replica)
    elif method == "checkpoint":
        data, by_donor, extra = await _by_checkpoint(run.profile, carrier, links, replica)
    else:
        raise ConfigError(f"method: unknown method {method!r}; use one of {', '.join(METHODS)}")
    delay = time.monotonic() - t0
    if method == "checkpoint":
        idle = delay * len(names)
    else:
        idle = 0.0
        assert len(data) == replica.total
    bound = links.bound
    return {
        "delay_s": delay,
        "lower_bound_s": bound,
        "ratio_to_bound": delay / bound if bound > 0 else None,
        "idle_s": idle,
        "bytes_by_donor": {d: int(by_donor.get(d, 0)) for d in names},
        "digest_ok": True,
        **extra,
    }


def _make_state(state_mib: int) -> tuple[bytes, bytes]:
    rng = np.random.default_rng(20250512)
    total = state_mib * 1024 * 1024
    sizes = [total // 2, total // 4, total // 8]
    sizes.append(max(1, total - sum(sizes) - 4096))
    arrays = {
        f"layer{i}.weight": rng.standard_normal(n // 4, dtype=np.float32)
        for i, n in enumerate(sizes)
    }
    state = TrainingState(arrays=arrays, round=7, strategy_state=b"fedavg", meta={"bench": 1})
    data = state.to_bytes()
    return data, state_digest(data)


def _write_profile(profile: WanProfile, path: Path) -> Path:
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json")), encoding="utf-8")
    return path


async def _session(
    profile: WanProfile,
    profile_path: Path,
    replica: _Replica,
    plan: Sequence[_Run],
    on_transfer: Callable[[str, Progress], None] | None = None,
    topo: NetnsStar | None = None,
    procs: list[subprocess.Popen[str]] | None = None,
) -> list[tuple[str, dict[str, Any]]]:
    """Start one donor set for ``profile`` (serving ``replica``) and run the ``plan``'s runs.

    With ``topo`` (netns mode) every donor runs inside its own namespace of the star; the pids
    donor processes are appended to ``procs`` (so a caller can make sure they are gone).
    """
    names = donors_of(profile)
    total = replica.total
    results: list[tuple[str, dict[str, Any]]] = []
    donor_set = await asyncio.to_thread(_DonorSet, names, profile_path, replica.path, topo)
    if procs is not None:
        procs.extend(donor_set.procs.values())
    try:
        for run in plan:
            carrier = await _joiner(run.profile, donor_set, names, netns=topo is not None)
            try:
                p = plan_transfer(
                    total,
                    _planner_donors(run.profile, names),
                    max_shards=MAX_SHARDS,
                    min_shard_bytes=MIN_SHARD_BYTES,
                    ingress=_ingress(run.profile),
                )
                live = [n for n in names if donor_set.procs[n].poll() is None]
                await _prepare(carrier, live, p.shard_bytes, p.num_shards)
                if run.method in ("uniform", "single"):
                    await _prepare(
                        carrier, live, *_baseline_shards(total, p.num_shards, len(names))
                    )
                result = await asyncio.wait_for(
                    _run_method(
                        run,
                        carrier,
                        names,
                        replica,
                        donor_set=donor_set,
                        on_progress=(
                            None
                            if on_transfer is None
                            else functools.partial(on_transfer, run.label)
                        ),
                    ),
                    SCALE_OUT_TIMEOUT_S,
                )
                results.append((run.label, result))
            finally:
                await carrier.close()
    finally:
        await asyncio.to_thread(donor_set.close)
    return results


def netns_rates_bit_s(profile: WanProfile) -> tuple[dict[str, int], int | None, int | None]:
    """The ``tbf`` rates (bit/s) of the netns star for ``profile``.

    Returns ``(donor -> rate of its link to the joiner, joiner downlink, joiner uplink)``. A
    donor's rate is its uplink, or its ``donor -> joiner`` pair cap if lower; every rate is the
    wire rate whose TCP payload rate equals the profile's figure
    (:func:`~chaos_flwr.transport.netns.wire_rate_bit_s`), so the planner's links and the lower
    bound keep the profile's numbers.
    """
    rates: dict[str, int] = {}
    for name in donors_of(profile):
        up = profile.link(name).up_bps
        cap = profile.pair_cap_bps(name, JOINER)
        known = [r for r in (up, cap) if r is not None]
        if not known:
            raise ConfigError(f"parties.{name}.up_mb_s: a donor needs a finite uplink")
        rates[name] = wire_rate_bit_s(min(known), NETNS_STAR_MTU)
    joiner = profile.link(JOINER)
    down = None if joiner.down_bps is None else wire_rate_bit_s(joiner.down_bps, NETNS_STAR_MTU)
    up = None if joiner.up_bps is None else wire_rate_bit_s(joiner.up_bps, NETNS_STAR_MTU)
    return rates, down, up


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rows = sorted(rows, key=lambda r: r["delay_s"])
    mid = dict(rows[len(rows) // 2])
    if len(rows) > 1:
        mid["runs_delay_s"] = [r["delay_s"] for r in rows]
        mid["median_ratio_to_bound"] = statistics.median(
            r["ratio_to_bound"] for r in rows if r["ratio_to_bound"] is not None
        )
    return mid


def _summary(methods: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    chaos = methods["chaos"]["delay_s"]
    out: dict[str, Any] = {
        "chaos_ratio_to_bound": methods["chaos"].get(
            "median_ratio_to_bound", methods["chaos"]["ratio_to_bound"]
        )
    }
    for other in ("single", "uniform", "checkpoint"):
        if other in methods:
            out[f"speedup_vs_{other}"] = methods[other]["delay_s"] / chaos
    out["targets"] = {
        "ratio_to_bound_le_1.15": out["chaos_ratio_to_bound"] <= 1.15,
        "speedup_vs_single_ge_3": out.get("speedup_vs_single", 0.0) >= 3.0,
        "speedup_vs_uniform_ge_1.5": out.get("speedup_vs_uniform", 0.0) >= 1.5,
    }
    return out


def _kill_leftovers(procs: Sequence[subprocess.Popen[str]]) -> None:
    """Kill (by pid) any donor process still running, before its namespace is deleted."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _sweep_profile(n: int, mb_s: float, joiner: Any) -> WanProfile:
    parties: dict[str, Any] = {JOINER: joiner.model_dump()}
    for i in range(n):
        parties[f"s{i + 1:02d}"] = {"up_mb_s": mb_s, "latency_ms": 20.0}
    return parse_profile({"name": f"sweep{n}", "parties": parties})


@dataclass(frozen=True)
class _Bench:
    """One benchmark's fixed inputs: the profile and its file, the replica, the callbacks."""

    profile: WanProfile
    profile_path: Path
    replica: _Replica
    say: Callable[[str], None]
    on_transfer: Callable[[str, Progress], None] | None


def _bottleneck_profile(profile: WanProfile, names: Sequence[str]) -> tuple[WanProfile, float]:
    """``profile`` with the joiner's downlink at a third of the donors' sum, and that cap."""
    joiner = profile.link(JOINER)
    agg = sum(profile.path_bps(n, JOINER) for n in names)
    cap = round(agg / 3e6, 3)  # the joiner's downlink at a third of the donors' sum
    tight = parse_profile(
        {
            **profile.model_dump(mode="json"),
            "parties": {
                **profile.model_dump(mode="json")["parties"],
                JOINER: {**joiner.model_dump(mode="json"), "down_mb_s": cap},
            },
        }
    )
    return tight, cap


def _main_plan(settings: ScaleOutSettings, profile: WanProfile) -> list[_Run]:
    """The runs of the main session: every method (chaos ``runs`` times), then the bottleneck."""
    main_plan: list[_Run] = []
    for m in settings.methods:
        for r in range(settings.runs if m == "chaos" else 1):
            main_plan.append(_Run(f"{m}#{r}", m, profile, None))
    if settings.chaos_extras:
        tight, _ = _bottleneck_profile(profile, donors_of(profile))
        main_plan.append(_Run("bottleneck#chaos", "chaos", tight, None))
        main_plan.append(_Run("bottleneck#uniform", "uniform", tight, None))
        main_plan.append(_Run("bottleneck#single", "single", tight, None))
    return main_plan


def _netns_result(topo: NetnsStar, donor_procs: Sequence[subprocess.Popen[str]]) -> dict[str, Any]:
    """The result's ``netns`` entry: the star as built, and the donor processes in it."""
    return {
        "hub": topo.hub,
        "namespaces": sorted(topo.namespaces.values()),
        "donor_addresses": topo.addresses,
        "joiner_address": topo.joiner_address,
        "tbf_rate_bit_s": topo.rates_bit_s,
        "joiner_down_tbf_bit_s": topo.joiner_down_bit_s,
        "joiner_up_tbf_bit_s": topo.joiner_up_bit_s,
        "mtu": topo.mtu,
        "tcp_wire_factor": tcp_wire_factor(topo.mtu),
        "latency": "carrier latency model (profile latencies, no rates); the kernel "
        "links add none (no netem)",
        "donor_pids": [p.pid for p in donor_procs],
    }


def _main_result(
    settings: ScaleOutSettings, bench: _Bench, grouped: Mapping[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The result of the main comparison (one row per method, the median of its runs)."""
    methods = settings.methods
    methods_out = {m: _median_row(grouped[m]) for m in methods}
    result: dict[str, Any] = {
        "profile": bench.profile.name,
        "profile_path": str(bench.profile_path),
        "wan": settings.wan,
        "state_bytes": bench.replica.total,
        "donors": len(donors_of(bench.profile)),
        "lower_bound_s": methods_out[methods[0]]["lower_bound_s"],
        "methods": methods_out,
        "process_model": "donors: one OS process each; joiner: this process (asyncio)",
        "window_per_donor": WINDOW,
        "cpu_count": os.cpu_count(),
    }
    if "chaos" in methods:
        result["summary"] = _summary(methods_out)
    return result


def _extras_result(
    settings: ScaleOutSettings, bench: _Bench, grouped: Mapping[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The joiner-bottleneck figures (already run), then the donor-death run and the sweep."""
    profile, replica, say = bench.profile, bench.replica, bench.say
    _, cap = _bottleneck_profile(profile, donors_of(profile))
    out: dict[str, Any] = {
        "joiner_bottleneck": {
            "down_mb_s": cap,
            "methods": {
                k.split("#")[1]: grouped[k][0] for k in grouped if k.startswith("bottleneck")
            },
        }
    }
    death = asyncio.run(
        _session(
            profile,
            bench.profile_path,
            replica,
            [_Run("death#chaos", "chaos", profile, 0.5)],
            bench.on_transfer,
        )
    )
    out["donor_death"] = death[0][1]
    say(f"donor death: {death[0][1]['delay_s']:.2f} s")
    sweep: dict[str, Any] = {}
    for n in settings.sweep_donors:
        sp = _sweep_profile(n, SCALE_OUT_SWEEP_MB_S, profile.link(JOINER))
        sp_path = _write_profile(sp, replica.workdir / f"sweep{n}.yaml")
        got = asyncio.run(
            _session(
                sp, sp_path, replica, [_Run(f"sweep{n}", "chaos", sp, None)], bench.on_transfer
            )
        )
        row = got[0][1]
        sweep[str(n)] = {
            "delay_s": row["delay_s"],
            "lower_bound_s": row["lower_bound_s"],
            "ratio_to_bound": row["ratio_to_bound"],
        }
        say(f"sweep {n} donors: {row['delay_s']:.2f} s")
    out["donor_sweep"] = {"link_mb_s": SCALE_OUT_SWEEP_MB_S, "by_donors": sweep}
    return out


def run_scale_out(
    settings: ScaleOutSettings | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    on_transfer: Callable[[str, Progress], None] | None = None,
    **knobs: Unpack[ScaleOutKnobs],
) -> dict[str, Any]:
    """Run the scale-out benchmark and return its JSON-ready result.

    Parameters
    ----------
    settings : ScaleOutSettings or None, optional
        The benchmark's knobs (``None``: the defaults).
    progress : callable or None, optional
        Called with a line of text as each run finishes.
    on_transfer : callable or None, optional
        Called as ``on_transfer(run_label, snapshot)`` with the pull engine's
        :class:`~chaos_flwr.transfer.Progress` (bytes, per donor, ETA) while a ``chaos`` run
        transfers, at most every ``SCALE_OUT_PROGRESS_INTERVAL_S`` seconds and once when done.
    **knobs
        Fields of :class:`ScaleOutSettings` (``profile_path``, ``wan``, ``state_mib``,
        ``runs``, ``methods``, ``extras``, ``sweep_donors``) set over ``settings``.

    Raises
    ------
    ConfigError
        Bad option or profile (the message names it).
    """
    settings = replace(settings or ScaleOutSettings(), **knobs)
    say = progress or (lambda _line: None)
    path = (
        Path(settings.profile_path) if settings.profile_path is not None else default_profile_path()
    )
    profile = load_profile(path)
    donors_of(profile)  # refuses a profile without a joiner or donors before any work
    data, expected = _make_state(settings.state_mib)
    total = len(data)
    topo: NetnsStar | None = None
    donor_procs: list[subprocess.Popen[str]] = []
    with ExitStack() as stack:
        if settings.wan == "netns":
            rates, j_down, j_up = netns_rates_bit_s(profile)
            topo = stack.enter_context(star(rates, joiner_down_bit_s=j_down, joiner_up_bit_s=j_up))
            stack.callback(_kill_leftovers, donor_procs)
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-scale-")))
        replica = _Replica(workdir / "replica.bin", total, expected, workdir)
        replica.path.write_bytes(data)
        del data
        bench = _Bench(profile, path, replica, say, on_transfer)
        main_plan = _main_plan(settings, profile)
        t_start = time.monotonic()
        rows = asyncio.run(
            _session(profile, path, replica, main_plan, on_transfer, topo, donor_procs)
        )
        for label, row in rows:
            say(f"{label}: {row['delay_s']:.2f} s (bound {row['lower_bound_s']:.2f} s)")
        grouped: dict[str, list[dict[str, Any]]] = {}
        for label, row in rows:
            key = label if label.startswith("bottleneck") else label.split("#")[0]
            grouped.setdefault(key, []).append(row)
        result = _main_result(settings, bench, grouped)
        if topo is not None:
            result["process_model"] = (
                "donors: one OS process each, each in its own network namespace "
                "(ip netns exec); joiner: this process (asyncio, root namespace)"
            )
            result["netns"] = _netns_result(topo, donor_procs)
        if settings.chaos_extras:
            result.update(_extras_result(settings, bench, grouped))
        result["wall_s"] = time.monotonic() - t_start
    return result


if __name__ == "__main__":
    main()
