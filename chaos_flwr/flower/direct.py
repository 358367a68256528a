"""Direct links for joiner pulls: a donor's replica server (the fetching side is
:mod:`chaos_flwr.flower.fetch`).

Flower carries no node-to-node traffic, so without direct links a joiner pulls through the
relay (:mod:`chaos_flwr.flower.client.joiner`). A signed party configured with a direct address
(``node_config`` key ``chaos-direct-addr``) announces it in a signed endpoint record
(:mod:`chaos_flwr.flower.client.endpoint`), and a joiner fetches that donor's manifest and
shards straight over the link, from every reachable donor at once. An address gives a donor
nothing: the joiner still checks every shard against the manifest that names the certified
digest, and the assembled state against the digest.

Links are authenticated and encrypted
-------------------------------------
Given the party's :class:`LinkAccess` (its link credentials, policy and view), a
:class:`DirectServer` serves over mutual TLS (:class:`~chaos_flwr.transport.links.LinkServer`):
only to a peer whose certificate is bound to a charter key (:mod:`chaos_flwr.transport.tls`)
and that is an active member of the donor's view (or a newcomer its own signature admits:
:meth:`~chaos_flwr.transport.links.LinkAccess.authorize`), and the joiner's
:func:`~chaos_flwr.flower.fetch.fetch_ranges` dials a donor only
at the endpoint its verified endpoint record names (any host, IPv4, IPv6 or a name), pinning
the certificate that record carries; an address the relay offered that no record signs is
refused with :class:`~chaos_flwr.errors.EndpointError`. Limits (named defaults): requests
served at once, request message size, reply bytes one request may ask for (no amplification)
and reply bytes per peer per window; each refusal is a typed error the dialler raises as such
(:attr:`~chaos_flwr.flower.fetch.DirectResult.exc`). There is no unauthenticated server.

Besides ranges and manifests, a party daemon's server answers gossip requests (``{gossip:
digest, ..}``, :mod:`chaos_flwr.gossip`); other servers refuse them.

Serving process
---------------
The server must outlive one Flower message. On the deployment engine Flower starts a process
per message, so the party daemon serves (``chaos-flwr party``, :mod:`chaos_flwr.flower.daemon`).
In simulation the Ray worker persists, so :func:`ensure_server` (an in-process server thread,
started once per address) does as well. Both read the replica files the party wrote
(:class:`StoreSource`), so neither needs the party's in-memory state.

Wire format (codec maps): request ``{round, digest, start: [..], end: [..]}``, reply
``{data: [bytes, ..]}``; or, for the manifest of a shard shape, request ``{round, digest,
total, shard-bytes, num-shards}``, reply ``{manifest: bytes}`` (the joiner checks it names the
certified digest; the donor counts the state's size against the asker's per-peer window, since
hashing it is the work). A donor that does not hold exactly that ``(round, digest)`` fails the
call.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chaos_flwr import codec
from chaos_flwr.countersign import COUNTERSIGN_KEY
from chaos_flwr.defaults import (
    FLOWER_DIRECT_PROBE_CONNECT_S,
    LINK_MANIFESTS_CACHED,
    LINK_MAX_MANIFEST_SHARDS,
    LINK_MAX_RANGES_PER_REQUEST,
)
from chaos_flwr.errors import (
    ChaosError,
    ConfigError,
    DecodeError,
    NotMemberError,
    ReplyTooLargeError,
    RequestTooLargeError,
    StoreError,
    TransportError,
)
from chaos_flwr.gossip import GOSSIP_KEY
from chaos_flwr.identity import is_party_id
from chaos_flwr.store import Replica, ReplicaStore
from chaos_flwr.transport.links import LinkAccess, LinkLimits, LinkServer, PeerQuota
from chaos_flwr.transport.shaping import Shaper

__all__ = [
    "BytesSource",
    "DirectServer",
    "LinkAccess",
    "LinkLimits",
    "RangeSource",
    "StoreSource",
    "ensure_server",
    "listening",
    "stop_servers",
]


class RangeSource(Protocol):
    """What a :class:`DirectServer` serves: byte ranges of the state ``(round, digest)``."""

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of that state; raises :class:`ChaosError` if not held."""

    def size(self, server_round: int, digest: bytes) -> int:
        """The state's size in bytes; raises :class:`ChaosError` if not held."""


def _manifest_of(source: RangeSource, rnd: int, digest: bytes, shape: tuple[int, int]) -> bytes:
    """The manifest of the held state ``(rnd, digest)`` cut in ``shape`` (shard bytes, count)."""
    from chaos_flwr.state import Manifest

    total = source.size(rnd, digest)
    data = source.read(rnd, digest, 0, total)
    try:
        return Manifest.build(data, shape[0], num_shards=shape[1]).to_bytes()
    except (ChaosError, ValueError) as exc:
        raise DecodeError(
            f"direct manifest request: the shape does not cut the state: {exc}"
        ) from None


@dataclass
class BytesSource:
    """Serve one state held in memory (``data`` is its serialised bytes)."""

    server_round: int
    digest: bytes
    data: bytes

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        self.size(server_round, digest)
        return self.data[start:end]

    def size(self, server_round: int, digest: bytes) -> int:
        if (server_round, digest) != (self.server_round, self.digest):
            raise StoreError(f"round {server_round} with that digest is not held here")
        return len(self.data)


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

    def _replica(self, server_round: int, digest: bytes) -> Replica:
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
        return replica

    def read(self, server_round: int, digest: bytes, start: int, end: int) -> bytes:
        with self._lock:
            replica = self._replica(server_round, digest)
            return replica.read(start, min(end, replica.total_bytes))

    def size(self, server_round: int, digest: bytes) -> int:
        with self._lock:
            return self._replica(server_round, digest).total_bytes

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
    if len(starts) > LINK_MAX_RANGES_PER_REQUEST:
        raise RequestTooLargeError(
            f"direct request names {len(starts)} ranges, above {LINK_MAX_RANGES_PER_REQUEST}"
        )
    out: list[tuple[int, int]] = []
    for s, e in zip(starts, ends, strict=True):
        if not (isinstance(s, int) and isinstance(e, int)) or not 0 <= s <= e:
            raise DecodeError("direct request ranges must be ints with 0 <= start <= end")
        out.append((s, e))
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
    link:
        The party's link access: whom it serves, with which credentials (module docstring).
    limits:
        The donor's limits.
    clock:
        Monotonic clock of the per-peer windows.
    gossip:
        Answers gossip requests (the party daemon's :meth:`Gossiper.answer`); without it they
        are refused.
    readers:
        The non-member link keys also served (the relay's read grant,
        :class:`~chaos_flwr.flower.grant.RelayGrants`): ranges and manifests only, never
        gossip (:class:`~chaos_flwr.errors.NotMemberError`).
    countersign:
        Answers a charter party's request to countersign its own join (the party daemon's
        :meth:`Gossiper.countersign`). With it, any charter party is let into a call
        (:meth:`~chaos_flwr.transport.links.LinkAccess.may_ask`), and every other request is
        checked against the view as it is read; without it, such requests are refused.

    Attributes
    ----------
    refused : dict[str, int]
        Requests refused, by error class name.
    """

    def __init__(
        self,
        source: RangeSource,
        listen: str = "127.0.0.1:0",
        *,
        link: LinkAccess,
        shaper: Shaper | None = None,
        limits: LinkLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        gossip: Callable[[str, dict[str, Any]], bytes] | None = None,
        readers: Callable[[], Mapping[bytes, str]] | None = None,
        countersign: Callable[[str, dict[str, Any]], bytes] | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"listen address must be 'host:port', got {listen!r}")
        self.source = source
        self._host, self._port, self._shaper = host, int(port), shaper
        self.link, self.gossip, self.readers = link, gossip, readers
        self.countersign = countersign
        self.limits = limits if limits is not None else LinkLimits()
        self._quota = PeerQuota(self.limits, clock)
        self.address: str | None = None
        self.bytes_served = 0
        self.requests_served = 0
        self.refused: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._carrier: LinkServer | None = None
        self._stopped = threading.Event()
        self._manifests: dict[tuple[int, bytes, int, int], bytes] = {}
        self._manifest_lock = asyncio.Lock()

    def _refuse(self, exc: ChaosError) -> ChaosError:
        name = type(exc).__name__
        self.refused[name] = self.refused.get(name, 0) + 1
        return exc

    async def _handle(self, src: str, data: bytes) -> bytes:
        try:
            if len(data) > self.limits.max_request_bytes:
                raise RequestTooLargeError(
                    f"direct request of {len(data)} bytes, above {self.limits.max_request_bytes}"
                )
            value = codec.decode(data, max_bytes=self.limits.max_request_bytes)
            if not isinstance(value, dict):
                raise DecodeError("direct request must be a map")
            if COUNTERSIGN_KEY in value:
                self._quota.charge(src, len(data))
                reply = await self._daemon(src, value, self.countersign, "countersign joins")
                self.requests_served += 1
                return reply
            if self.countersign is not None and is_party_id(src):
                self.link.authorize(src)  # the call let any charter party in: members only here
            if GOSSIP_KEY in value:
                reply = await self._daemon(src, value, self.gossip, "gossip")
                self._quota.charge(src, len(reply))
                return reply
            rnd, digest = value.get("round"), value.get("digest")
            if not isinstance(rnd, int) or not isinstance(digest, bytes):
                raise DecodeError("direct request needs 'round' (int) and 'digest' (bytes)")
            if "num-shards" in value:
                return await self._manifest(src, rnd, digest, value)
            ranges = _ranges(value)
            asked = sum(e - s for s, e in ranges)
            if asked > self.limits.max_reply_bytes:
                raise ReplyTooLargeError(
                    f"direct request asks {asked} bytes, above {self.limits.max_reply_bytes} "
                    "per request; ask smaller ranges"
                )
            self._quota.charge(src, asked)
            chunks = [self.source.read(rnd, digest, s, e) for s, e in ranges]
        except ChaosError as exc:
            raise self._refuse(exc) from None
        self.requests_served += 1
        self.bytes_served += sum(len(c) for c in chunks)
        return codec.encode({"data": chunks})

    async def _daemon(
        self, src: str, value: dict[str, Any], call: Callable[[str, Any], bytes] | None, what: str
    ) -> bytes:
        """The reply to a request only a party daemon answers (gossip, countersign), from a
        party (not a relay's read grant); called inside :meth:`_handle`'s refusal guard."""
        if not is_party_id(src):
            raise NotMemberError(f"{src[:40]} reads certified states only, no {what}")
        if call is None:
            raise DecodeError(f"this link server does not {what} (no party daemon)")
        loop = asyncio.get_running_loop()  # off the loop: it takes the view's lock
        return await loop.run_in_executor(None, call, src, value)

    async def _manifest(self, src: str, rnd: int, digest: bytes, value: dict[str, Any]) -> bytes:
        """Reply to a manifest request (called inside :meth:`_handle`'s refusal guard)."""
        shape = (value.get("shard-bytes"), value.get("num-shards"))
        total = value.get("total")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (*shape, total)):
            raise DecodeError("direct manifest request needs int total/shard-bytes/num-shards")
        held = self.source.size(rnd, digest)
        if total != held:
            raise DecodeError(f"direct manifest request for {total} bytes; the state has {held}")
        size, num = int(shape[0]), int(shape[1])  # type: ignore[arg-type]
        if not 0 < num <= LINK_MAX_MANIFEST_SHARDS:
            raise RequestTooLargeError(f"a manifest of {num} shards; at most "
                                       f"{LINK_MAX_MANIFEST_SHARDS}")  # fmt: skip
        if size < 1 or size * num < held:
            raise DecodeError(f"direct manifest request: {num} shards of {size} bytes do not "
                              f"cover a state of {held} bytes")  # fmt: skip
        key = (rnd, digest, size, num)
        raw = self._manifests.get(key)
        if raw is None:
            # hashing the state is the work asked: charged (up to one window), one at a time
            self._quota.charge(src, min(held, self.limits.peer_window_bytes))
            async with self._manifest_lock:
                loop = asyncio.get_running_loop()
                raw = await loop.run_in_executor(
                    None, _manifest_of, self.source, rnd, digest, (size, num)
                )
            while len(self._manifests) >= LINK_MANIFESTS_CACHED:
                self._manifests.pop(next(iter(self._manifests)))
            self._manifests[key] = raw
        self.requests_served += 1
        return codec.encode({"manifest": raw})

    def _make_carrier(self) -> LinkServer:
        link = self.link
        return LinkServer(
            link.creds,
            lambda: link.policy.keyring,
            link.may_ask if self.countersign is not None else link.authorize,
            f"{self._host}:{self._port}",
            max_concurrent=self.limits.max_concurrent,
            max_request_bytes=self.limits.max_request_bytes,
            shaper=self._shaper,
            readers=self.readers,
        )

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
            carrier = self._make_carrier()
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

    def refusals(self) -> dict[str, int]:
        """Every refusal so far by error class name (the link layer's and the handler's)."""
        if self._carrier is not None:
            return dict(self._carrier.refused)  # it saw the handler's refusals too
        return dict(self.refused)

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


def ensure_server(state_dir: str | Path, listen: str, *, link: LinkAccess) -> DirectServer:
    """The in-process replica server for ``listen`` (started once per process and address).

    For the simulation engine, whose worker processes outlive one message. It serves
    ``<state_dir>/replicas`` over the party's authenticated links (and to the relay while the
    party's grant holds, :mod:`chaos_flwr.flower.grant`).
    """
    from chaos_flwr.flower.grant import RelayGrants

    with _SERVERS_LOCK:
        server = _SERVERS.get(listen)
        if server is None:
            source = StoreSource(Path(state_dir) / "replicas")
            readers = RelayGrants(Path(state_dir), link.creds.federation)
            server = DirectServer(source, listen, link=link, readers=readers)
            server.start()
            _SERVERS[listen] = server
        return server


def listening(address: str, timeout_s: float = FLOWER_DIRECT_PROBE_CONNECT_S) -> bool:
    """Whether something accepts TCP connections at ``address`` (a party daemon already
    serving there: a ClientApp process then starts no server of its own)."""
    import socket

    from chaos_flwr.membership import parse_address

    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (ChaosError, OSError):
        return False


def stop_servers() -> None:
    """Stop every server :func:`ensure_server` started in this process."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.stop()
        if isinstance(server.source, StoreSource):
            server.source.close()


def on_signals(stop: threading.Event, signals: Sequence[int]) -> Callable[[], None]:
    """Set ``stop`` on each of ``signals``; returns a function that restores the old handlers."""
    import signal as _signal

    old = {s: _signal.signal(s, lambda *_: stop.set()) for s in signals}

    def restore() -> None:
        for s, h in old.items():
            _signal.signal(s, h)

    return restore
