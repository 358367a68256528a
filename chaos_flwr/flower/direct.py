"""Direct grpc links for joiner pulls: a donor's replica server and the joiner's fetcher.

Flower carries no node-to-node traffic, so a joiner pulls through the relay
(:mod:`chaos_flwr.flower.client.joiner`). When a donor is configured with a direct address
(``node_config`` key ``chaos-direct-addr``, ``"127.0.0.1:PORT"``), it names that address in its
relayed size/manifest reply, and the joiner fetches that donor's shards straight over grpc
(:class:`~chaos_flwr.transport.grpc_carrier.GrpcCarrier`), from every reachable donor at once.
An address gives a donor nothing: the joiner still checks every shard against the manifest
that names the certified digest, and the assembled state against the digest.

Serving process
---------------
The server must outlive one Flower message. On the deployment engine Flower starts a process
per message, so a thread would die with it: a small daemon serves the party's replica store
(``chaos-flwr serve-replica --state-dir DIR --listen 127.0.0.1:PORT``, stopped by SIGTERM).
In simulation the Ray worker persists, so :func:`ensure_server` (an in-process server thread,
started once per address) does as well. Both read the replica files the party wrote
(:class:`StoreSource`), so neither needs the party's in-memory state.

Wire format (codec maps): request ``{round, digest, start: [..], end: [..]}``, reply
``{data: [bytes, ..]}``; a donor that does not hold exactly that ``(round, digest)`` fails the
call. Only loopback addresses are dialled (:data:`~chaos_flwr.defaults.FLOWER_DIRECT_HOSTS`):
the address travels through the untrusted relay, which must not make a joiner connect
elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_DIRECT_BATCH_BYTES,
    FLOWER_DIRECT_HOSTS,
    FLOWER_DIRECT_MAX_BYTES,
    FLOWER_DIRECT_TIMEOUT_S,
)
from chaos_flwr.errors import ChaosError, ConfigError, DecodeError, StoreError, TransportError
from chaos_flwr.store import Replica, ReplicaStore
from chaos_flwr.transport.grpc_carrier import GrpcCarrier
from chaos_flwr.transport.shaping import Shaper

__all__ = [
    "BytesSource",
    "DirectResult",
    "DirectServer",
    "RangeSource",
    "StoreSource",
    "check_address",
    "ensure_server",
    "fetch_ranges",
    "stop_servers",
]

_FROM = "joiner"


def check_address(address: object) -> str:
    """Return ``address`` if it is ``host:port`` with a dialable (loopback) host.

    Raises
    ------
    ConfigError
        Not a string ``host:port``, a port outside 1..65535, or a host not in
        :data:`~chaos_flwr.defaults.FLOWER_DIRECT_HOSTS`.
    """
    if not isinstance(address, str) or ":" not in address:
        raise ConfigError(f"direct address must be 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    if host not in FLOWER_DIRECT_HOSTS:
        raise ConfigError(f"direct address host {host!r} is not loopback {FLOWER_DIRECT_HOSTS}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"direct address port must be 1..65535, got {port!r}")
    return address


class RangeSource(Protocol):
    """What a :class:`DirectServer` serves: byte ranges of the state ``(round, digest)``."""

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of that state; raises :class:`ChaosError` if not held."""


@dataclass
class BytesSource:
    """Serve one state held in memory (``data`` is its serialised bytes)."""

    server_round: int
    digest: bytes
    data: bytes

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        if (server_round, digest) != (self.server_round, self.digest):
            raise StoreError(f"round {server_round} with that digest is not held here")
        return self.data[start:end]


class StoreSource:
    """Serve the replicas of a party's :class:`~chaos_flwr.store.ReplicaStore` from disk.

    A request names ``(round, digest)``; the stored file of that round must carry that digest
    (checked from its header, which the store verified when it wrote it). Opened replicas are
    cached; a pruned round fails the call.
    """

    def __init__(self, directory: str | Path) -> None:
        self.store = ReplicaStore(directory)
        self._open: dict[int, Replica] = {}
        self._lock = threading.Lock()

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        with self._lock:
            replica = self._open.get(server_round)
            if replica is None or not replica.path.exists():
                if replica is not None:
                    replica.close()
                replica = self.store.open(server_round, verify=False)
                self._open[server_round] = replica
                for old in [r for r in self._open if r < server_round - 4]:
                    self._open.pop(old).close()
            if replica.state_digest != digest:
                raise StoreError(f"round {server_round} is stored with another digest")
            return replica.read(start, min(end, replica.total_bytes))

    def close(self) -> None:
        """Close every open replica."""
        with self._lock:
            for replica in self._open.values():
                replica.close()
            self._open.clear()


def _ranges(value: Mapping[str, object]) -> list[tuple[int, int]]:
    starts, ends = value.get("start"), value.get("end")
    if not isinstance(starts, list) or not isinstance(ends, list) or len(starts) != len(ends):
        raise DecodeError("direct request 'start'/'end' must be lists of one length")
    out: list[tuple[int, int]] = []
    for s, e in zip(starts, ends, strict=True):
        if not (isinstance(s, int) and isinstance(e, int)) or not 0 <= s <= e:
            raise DecodeError("direct request ranges must be ints with 0 <= start <= end")
        out.append((s, e))
    if sum(e - s for s, e in out) > FLOWER_DIRECT_MAX_BYTES:
        raise DecodeError(f"direct request asks more than {FLOWER_DIRECT_MAX_BYTES} bytes")
    return out


class DirectServer:
    """A grpc server (own thread and event loop) that serves state ranges to joiners.

    Parameters
    ----------
    source:
        Where the bytes come from (:class:`StoreSource`, :class:`BytesSource`).
    listen:
        ``host:port`` to listen on (port 0 picks a free one; see :attr:`address`).
    shaper:
        Optional link shaping of this server's replies (tests, benchmarks).
    """

    def __init__(
        self, source: RangeSource, listen: str = "127.0.0.1:0", *, shaper: Shaper | None = None
    ) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"listen address must be 'host:port', got {listen!r}")
        self.source = source
        self._host, self._port, self._shaper = host, int(port), shaper
        self.address: str | None = None
        self.bytes_served = 0
        self.requests_served = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._carrier: GrpcCarrier | None = None
        self._stopped = threading.Event()

    async def _handle(self, src: str, data: bytes) -> bytes:
        value = codec.decode(data, max_bytes=FLOWER_DIRECT_MAX_BYTES)
        if not isinstance(value, dict):
            raise DecodeError("direct request must be a map")
        rnd, digest = value.get("round"), value.get("digest")
        if not isinstance(rnd, int) or not isinstance(digest, bytes):
            raise DecodeError("direct request needs 'round' (int) and 'digest' (bytes)")
        chunks = [self.source.read(rnd, digest, s, e) for s, e in _ranges(value)]
        self.requests_served += 1
        self.bytes_served += sum(len(c) for c in chunks)
        return codec.encode({"data": chunks})

    def start(self) -> str:
        """Start serving; returns the bound address.

        Raises
        ------
        TransportError
            The port cannot be bound.
        """
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            carrier = GrpcCarrier("replica", port=self._port, host=self._host, shaper=self._shaper)
            try:
                loop.run_until_complete(carrier.start(self._handle))
            except BaseException as exc:  # reported to start()'s caller
                failure.append(exc)
                ready.set()
                loop.close()
                return
            self._carrier = carrier
            self.address = carrier.address
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(carrier.close())
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=run, name="chaos-direct", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise TransportError(f"direct server on {self._host}:{self._port}: {failure[0]}")
        assert self.address is not None
        return self.address

    def stop(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join()

    def __enter__(self) -> DirectServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_SERVERS: dict[str, DirectServer] = {}
_SERVERS_LOCK = threading.Lock()


def ensure_server(state_dir: str | Path, listen: str) -> DirectServer:
    """The in-process replica server for ``listen`` (started once per process and address).

    For the simulation engine, whose worker processes outlive one message. It serves
    ``<state_dir>/replicas``.
    """
    check_address(listen)
    with _SERVERS_LOCK:
        server = _SERVERS.get(listen)
        if server is None:
            server = DirectServer(StoreSource(Path(state_dir) / "replicas"), listen)
            server.start()
            _SERVERS[listen] = server
        return server


def stop_servers() -> None:
    """Stop every server :func:`ensure_server` started in this process."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.stop()
        if isinstance(server.source, StoreSource):
            server.source.close()


@dataclass
class DirectResult:
    """What one donor sent over its direct link.

    Attributes
    ----------
    shards:
        ``(index, bytes, seconds since the fetch began)`` per shard received, in order.
    error:
        Why the link failed (empty if every range came back).
    seconds:
        Wall time of this donor's fetch.
    nbytes:
        Bytes received.
    """

    shards: list[tuple[int, bytes, float]] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0


Range = tuple[int, int, int]  # (index, start, end)


async def _fetch_one(
    carrier: GrpcCarrier,
    donor: str,
    ranges: Sequence[Range],
    server_round: int,
    digest: bytes,
    deadline: float,
    t0: float,
    batch_bytes: int,
) -> DirectResult:
    result = DirectResult()
    batch: list[Range] = []
    todo = list(ranges)
    while todo or batch:
        while todo and (not batch or sum(e - s for _, s, e in batch) < batch_bytes):
            batch.append(todo.pop(0))
        left = deadline - time.monotonic()
        if left <= 0:
            result.error = "deadline passed"
            break
        req = codec.encode(
            {
                "round": server_round,
                "digest": digest,
                "start": [s for _, s, _ in batch],
                "end": [e for _, _, e in batch],
            }
        )
        try:
            raw = await carrier.request(donor, req, timeout=left)
            value = codec.decode(raw, max_bytes=FLOWER_DIRECT_MAX_BYTES + 4096)
            data = value.get("data") if isinstance(value, dict) else None
            if not isinstance(data, list) or len(data) != len(batch):
                raise DecodeError("direct reply must carry one bytes item per range")
        except ChaosError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            break
        at = time.monotonic() - t0
        for (i, _, _), chunk in zip(batch, data, strict=True):
            if not isinstance(chunk, bytes):
                result.error = "DecodeError: a direct reply item is not bytes"
                break
            result.shards.append((i, chunk, at))
            result.nbytes += len(chunk)
        if result.error:
            break
        batch = []
    result.seconds = time.monotonic() - t0
    return result


def fetch_ranges(
    addresses: Mapping[str, str],
    ranges: Mapping[str, Sequence[Range]],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
    batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES,
) -> dict[str, DirectResult]:
    """Fetch ``ranges[donor]`` from every donor's direct address at once (bounded by
    ``timeout_s`` overall). Runs its own event loop in a helper thread, so it may be called
    from sync code inside or outside a running loop.

    Returns
    -------
    dict
        Donor -> :class:`DirectResult` (bytes are *not* verified here: the caller checks each
        shard against its manifest).
    """
    fetched: dict[str, DirectResult] = {}

    async def main() -> None:
        carrier = GrpcCarrier(_FROM, dict(addresses), request_timeout_s=timeout_s)
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        donors = [d for d in ranges if d in addresses]
        try:
            got = await asyncio.gather(
                *(
                    _fetch_one(
                        carrier, d, ranges[d], server_round, digest, deadline, t0, batch_bytes
                    )
                    for d in donors
                )
            )
        finally:
            await carrier.close()
        fetched.update(zip(donors, got, strict=True))

    def run() -> None:
        asyncio.run(main())

    worker = threading.Thread(target=run, name="chaos-direct-fetch", daemon=True)
    worker.start()
    worker.join(timeout_s + 5.0)
    # a worker still running past its bound may yet write: its results are not read at all
    out = {} if worker.is_alive() else dict(fetched)
    for d in ranges:
        out.setdefault(d, DirectResult(error="no direct address" if d not in addresses else "hung"))
    return out


def serve_forever(
    state_dir: str | Path,
    listen: str,
    *,
    stop: threading.Event,
    started: threading.Event | None = None,
) -> DirectServer:
    """Serve ``<state_dir>/replicas`` on ``listen`` until ``stop`` is set (the daemon's body).

    Prints ``serving <address>`` once listening (flushed, for whoever started the daemon) and
    returns the stopped server (its counters).
    """
    source = StoreSource(Path(state_dir) / "replicas")
    server = DirectServer(source, listen)
    address = server.start()
    print(f"serving {address}", flush=True)
    if started is not None:
        started.set()
    try:
        stop.wait()
    finally:
        server.stop()
        source.close()
    return server


def on_signals(stop: threading.Event, signals: Sequence[int]) -> Callable[[], None]:
    """Set ``stop`` on each of ``signals``; returns a function that restores the old handlers."""
    import signal as _signal

    old = {s: _signal.signal(s, lambda *_: stop.set()) for s in signals}

    def restore() -> None:
        for s, h in old.items():
            _signal.signal(s, h)

    return restore
