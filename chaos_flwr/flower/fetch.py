"""The joiner's side of direct links: fetch byte ranges and manifests from donors' servers.

:func:`fetch_ranges` fetches every donor's planned shards at once over authenticated links
(:mod:`chaos_flwr.flower.direct` is the serving side), a batch of whole shards per request.
It executes the plan as a *pull queue*: a donor that has delivered its own shards takes the
last shards of the donor expected to finish last, when at the rates measured so far it would
deliver them sooner; a donor whose link fails leaves its undelivered shards to the others. So
the fetch ends close to when the links' total rate allows even where the probes' estimates
were off. :func:`fetch_manifest` asks one donor for the manifest of a shard shape.

Both dial a donor only at the endpoint its verified record signs (an address offered some
other way must be that one; else :class:`~chaos_flwr.errors.EndpointError`, never dialled),
run their own event loop in a helper thread (callable from sync code inside or outside a
running loop), and are bounded by their timeout. Bytes are *not* verified here: the caller
checks each shard against the manifest, and the manifest against the certified digest.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_DIRECT_BATCH_BYTES,
    FLOWER_DIRECT_INFLIGHT,
    FLOWER_DIRECT_TIMEOUT_S,
    LINK_MAX_RANGES_PER_REQUEST,
    LINK_MAX_REPLY_BYTES,
    LINK_MAX_REPLY_FRAME_BYTES,
)
from chaos_flwr.errors import ChaosError, DecodeError, EndpointError, TransportError
from chaos_flwr.membership import EndpointInfo
from chaos_flwr.transport.links import LinkAccess, LinkDialer

__all__ = ["DirectResult", "Range", "fetch_manifest", "fetch_ranges"]


@dataclass
class DirectResult:
    """What one donor sent over its direct link.

    Attributes
    ----------
    shards:
        ``(index, bytes, seconds since the fetch began)`` per shard received, in order (with
        the shards it took over from other donors).
    error:
        Why the link failed (empty if every range came back).
    seconds:
        Wall time of this donor's fetch.
    nbytes:
        Bytes received.
    exc:
        The typed error the link failed with (``None`` if it did not), e.g. the class a donor
        refused with.
    """

    shards: list[tuple[int, bytes, float]] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    nbytes: int = 0
    exc: ChaosError | None = None

    def fail(self, exc: ChaosError) -> None:
        """Record ``exc`` as the reason this link stopped."""
        self.exc = exc
        self.error = f"{type(exc).__name__}: {exc}"


Range = tuple[int, int, int]  # (index, start, end)
#: Sends one request to a donor and returns its reply (``timeout`` in seconds).
_Send = Callable[[bytes, float], Awaitable[bytes]]


def _pieces(ranges: Sequence[Range], cap: int) -> list[tuple[int, int, int, bool]]:
    """``ranges`` cut so no piece exceeds ``cap`` bytes: ``(index, start, end, last piece)``."""
    out: list[tuple[int, int, int, bool]] = []
    for i, s, e in ranges:
        at = s
        while True:
            stop = min(e, at + cap)
            out.append((i, at, stop, stop >= e))
            if stop >= e:
                break
            at = stop
    return out


def _requests(batch: Sequence[Range]) -> list[list[tuple[int, int, int, bool]]]:
    """``batch`` as requests within a donor's per-request limits (reply bytes, ranges)."""
    out: list[list[tuple[int, int, int, bool]]] = []
    size = 0
    for piece in _pieces(batch, LINK_MAX_REPLY_BYTES):
        n = piece[2] - piece[1]
        full = bool(out) and len(out[-1]) >= LINK_MAX_RANGES_PER_REQUEST
        if not out or full or size + n > LINK_MAX_REPLY_BYTES:
            out.append([])
            size = 0
        out[-1].append(piece)
        size += n
    return out


class _Queues:
    """The shards each donor still owes in one fetch, and what each delivered how fast."""

    def __init__(self, ranges: Mapping[str, Sequence[Range]], batch_bytes: int, steal: bool):
        self.todo = {d: deque(rs) for d, rs in ranges.items()}
        self.batch_bytes, self.steal = batch_bytes, steal
        self.delivered = dict.fromkeys(ranges, 0)
        self.began: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.stopped: set[str] = set()

    def _rate(self, d: str) -> float | None:
        """Bytes/s ``d`` delivered from its first request to its last delivery (``None``
        before it delivered anything, or once it failed)."""
        busy, got = self.last.get(d, 0.0) - self.began.get(d, 0.0), self.delivered[d]
        return got / busy if busy > 0 and got > 0 and d not in self.stopped else None

    def _left(self, d: str) -> int:
        return sum(e - s for _, s, e in self.todo[d])

    def take(self, me: str) -> list[Range]:
        """The next batch of ``me``: its own first shards, else the last shards of the donor
        expected to finish last, if ``me`` would deliver them sooner (else nothing)."""
        own = self.todo[me]
        if own:
            return self._cut(own, front=True)
        mine = self._rate(me)
        if not self.steal or mine is None:
            return []
        victim, worst = None, 0.0
        for d, q in self.todo.items():
            if d == me or not q:
                continue
            rate = self._rate(d)
            finish = float("inf") if rate is None else self._left(d) / rate
            if victim is None or finish > worst:
                victim, worst = d, finish
        if victim is None:
            return []
        q = self.todo[victim]
        if q[-1][2] - q[-1][1] >= worst * mine:
            return []  # the victim gets to its last shard before this donor could deliver it
        return list(reversed(self._cut(q, front=False)))

    def _cut(self, q: deque[Range], *, front: bool) -> list[Range]:
        """Whole shards from one end of ``q``: up to ``batch_bytes`` (at least one)."""
        pop = q.popleft if front else q.pop
        batch = [pop()]
        size = batch[0][2] - batch[0][1]
        while q and size < self.batch_bytes and len(batch) < LINK_MAX_RANGES_PER_REQUEST:
            nxt = q[0] if front else q[-1]
            if size + nxt[2] - nxt[1] > LINK_MAX_REPLY_BYTES:
                break
            size += nxt[2] - nxt[1]
            batch.append(pop())
        return batch

    def begin(self, me: str) -> None:
        self.began.setdefault(me, time.monotonic())

    def done(self, me: str, nbytes: int) -> None:
        self.delivered[me] += nbytes
        self.last[me] = time.monotonic()

    def stop(self, me: str, undelivered: Sequence[Range]) -> None:
        """``me`` failed: what it did not deliver stays for the others."""
        self.stopped.add(me)
        self.todo[me].extendleft(reversed(undelivered))


async def _fetch_one(
    me: str, send: _Send, queues: _Queues, rnd: int, digest: bytes, deadline: float, t0: float
) -> DirectResult:
    """One donor's fetch: FLOWER_DIRECT_INFLIGHT workers (requests in flight on its link)
    taking batches from the queues until none is left for it."""
    result = DirectResult()
    await asyncio.gather(
        *(_worker(me, send, queues, result, rnd, digest, deadline, t0)
          for _ in range(FLOWER_DIRECT_INFLIGHT))
    )  # fmt: skip
    result.seconds = time.monotonic() - t0
    return result


async def _worker(
    me: str,
    send: _Send,
    queues: _Queues,
    result: DirectResult,
    rnd: int,
    digest: bytes,
    deadline: float,
    t0: float,
) -> None:
    while not result.error and (batch := queues.take(me)):
        queues.begin(me)
        before, whole = result.nbytes, 0
        partial: list[bytes] = []
        try:
            for pieces in _requests(batch):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                req = codec.encode({"round": rnd, "digest": digest,
                                    "start": [s for _, s, _, _ in pieces],
                                    "end": [e for _, _, e, _ in pieces]})  # fmt: skip
                value = codec.decode(await send(req, left), max_bytes=LINK_MAX_REPLY_FRAME_BYTES)
                data = value.get("data") if isinstance(value, dict) else None
                if not isinstance(data, list) or len(data) != len(pieces):
                    raise DecodeError("direct reply must carry one bytes item per range")
                if not all(isinstance(c, bytes) for c in data):
                    raise DecodeError("a direct reply item is not bytes")
                at = time.monotonic() - t0
                for (i, _, _, last), chunk in zip(pieces, data, strict=True):
                    partial.append(chunk)
                    result.nbytes += len(chunk)
                    if last:
                        result.shards.append((i, b"".join(partial), at))
                        partial, whole = [], whole + 1
        except TimeoutError:
            result.error = result.error or "deadline passed"
        except ChaosError as exc:
            if not result.error:
                result.fail(exc)
        except Exception as exc:  # one bad link never loses the bytes of the others
            if not result.error:
                result.fail(TransportError(f"direct fetch from {me}: {exc!r}"))
        if result.error:
            queues.stop(me, batch[whole:])
        else:
            queues.done(me, result.nbytes - before)


def _senders(
    addresses: Mapping[str, str], donors: Sequence[str], link: LinkAccess
) -> tuple[dict[str, _Send], dict[str, DirectResult], Callable[[], Awaitable[None]]]:
    """A send function per dialable donor, the donors refused before dialling, and a closer."""
    refused: dict[str, DirectResult] = {}
    sends: dict[str, _Send] = {}
    dialer = LinkDialer(link.creds)
    for d in donors:
        try:
            ep = link.endpoint(d, addresses.get(d))
        except EndpointError as exc:
            refused[d] = DirectResult()
            refused[d].fail(exc)
            continue
        sends[d] = functools.partial(_link_send, dialer, ep)
    return sends, refused, dialer.close


async def _link_send(dialer: LinkDialer, ep: EndpointInfo, req: bytes, timeout: float) -> bytes:
    return await dialer.request(ep.address, ep.cert, req, timeout=timeout)


def fetch_ranges(
    addresses: Mapping[str, str],
    ranges: Mapping[str, Sequence[Range]],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
    batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES,
    steal: bool = True,
    link: LinkAccess,
) -> dict[str, DirectResult]:
    """Fetch ``ranges[donor]`` from every donor's direct address at once (bounded by
    ``timeout_s`` overall), as a pull queue (module docstring).

    Parameters
    ----------
    addresses
        Donor -> address as offered (by the relay): each must be the address the donor's
        verified endpoint record signs (else that donor fails with
        :class:`~chaos_flwr.errors.EndpointError`, never dialled); a donor with no offered
        address is dialled at its signed endpoint.
    batch_bytes
        Bytes of whole shards per request (at least one shard).
    steal
        Let a donor that is done take over another's last shards (``False``: each donor
        sends exactly its ranges, e.g. link probes).
    link
        This party's credentials and view: authenticated, encrypted links.

    Returns
    -------
    dict
        Donor -> :class:`DirectResult`.
    """
    fetched: dict[str, DirectResult] = {}

    async def main() -> None:
        sends, refused, close = _senders(addresses, list(ranges), link)
        fetched.update(refused)
        queues = _Queues({d: ranges[d] for d in sends}, batch_bytes, steal)
        t0 = time.monotonic()
        try:
            got = await asyncio.gather(
                *(_fetch_one(d, sends[d], queues, server_round, digest, t0 + timeout_s, t0)
                  for d in sends)
            )  # fmt: skip
        finally:
            await close()
        fetched.update(zip(sends, got, strict=True))

    worker = threading.Thread(target=lambda: asyncio.run(main()), name="chaos-direct-fetch",
                              daemon=True)  # fmt: skip
    worker.start()
    worker.join(timeout_s + 5.0)
    # a worker still running past its bound may yet write: its results are not read at all
    out = {} if worker.is_alive() else dict(fetched)
    for d in ranges:
        out.setdefault(d, DirectResult(error="hung"))
    return out


def fetch_manifest(
    addresses: Mapping[str, str],
    donor: str,
    shape: tuple[int, int, int],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
    link: LinkAccess,
) -> tuple[bytes | None, str]:
    """Ask ``donor`` over its direct link for the manifest of ``shape`` (total, shard bytes,
    shard count) of the state ``(server_round, digest)``; bounded by ``timeout_s``.

    Returns ``(manifest bytes, "")``, or ``(None, why)`` (not dialled, refused with a typed
    error, no answer in time, a malformed reply). The manifest is *not* checked here.
    """
    got: list[tuple[bytes | None, str]] = []
    total, shard_bytes, num_shards = shape
    req = codec.encode({"round": server_round, "digest": digest, "total": total,
                        "shard-bytes": shard_bytes, "num-shards": num_shards})  # fmt: skip

    async def main() -> None:
        sends, refused, close = _senders(addresses, [donor], link)
        try:
            if donor in refused:
                got.append((None, refused[donor].error))
                return
            raw = await sends[donor](req, timeout_s)
            value = codec.decode(raw, max_bytes=LINK_MAX_REPLY_BYTES)
            manifest = value.get("manifest") if isinstance(value, dict) else None
            if not isinstance(manifest, bytes):
                raise DecodeError("a direct manifest reply must be {manifest: bytes}")
            got.append((manifest, ""))
        except ChaosError as exc:
            got.append((None, f"{type(exc).__name__}: {exc}"))
        finally:
            await close()

    worker = threading.Thread(target=lambda: asyncio.run(main()), name="chaos-direct-manifest",
                              daemon=True)  # fmt: skip
    worker.start()
    worker.join(timeout_s + 5.0)
    if worker.is_alive() or not got:
        return None, "hung"
    return got[0]
