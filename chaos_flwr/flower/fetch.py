"""The joiner's side of direct links: fetch byte ranges and manifests from donors' servers.

:func:`fetch_ranges` fetches every donor's planned shards at once over authenticated links
(:mod:`chaos_flwr.flower.direct` is the serving side), one request in flight per link. It
executes the plan as a *pull queue* that times every link as it goes (the plan's shares are
where each donor starts, from rates assumed or measured earlier):

- a donor that has delivered its own shards takes the last shards of the donor expected to
  finish last, when at the rates measured so far it would deliver them sooner;
- with nothing left to take (the end game), it asks for the shards of the batch in flight
  expected to arrive last, if it would deliver them sooner; the first copy counts, a shard is
  asked of at most two donors, and the fetch returns as soon as every shard is in (a copy
  still on its way is dropped, its request left to end on its own in the fetch's thread);
- a measured fast link is asked for more per request (FLOWER_DIRECT_BATCH_S of its rate), so a
  request's fixed cost is a smaller part of its time;
- a donor whose link fails leaves its undelivered shards to the others.

So the fetch ends close to when the links' total rate allows, whatever rates the plan assumed.
:func:`fetch_manifest` asks one donor for the manifest of a shard shape.

Both dial a donor only at the endpoint its verified record signs (an address offered some
other way must be that one; else :class:`~chaos_flwr.errors.EndpointError`, never dialled),
run their own event loop in a helper thread (callable from sync code inside or outside a
running loop), and are bounded by their timeout. Bytes are *not* verified here: the caller
checks each shard against the manifest, and the manifest against the certified digest.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_DIRECT_BATCH_BYTES,
    FLOWER_DIRECT_BATCH_S,
    FLOWER_DIRECT_MAX_S,
    FLOWER_DIRECT_MIN_BPS,
    FLOWER_DIRECT_TIMEOUT_S,
    LINK_MAX_RANGES_PER_REQUEST,
    LINK_MAX_REPLY_BYTES,
    LINK_MAX_REPLY_FRAME_BYTES,
)
from chaos_flwr.errors import ChaosError, ConfigError, DecodeError, EndpointError, TransportError
from chaos_flwr.membership import EndpointInfo
from chaos_flwr.pull.negotiation import Decision, LinkResult, PullNegotiation
from chaos_flwr.transport.links import LinkAccess, LinkDialer

__all__ = [
    "FLOWER_LINK_WORKER_GRACE_S",
    "LINKS_HUNG",
    "DirectResult",
    "Range",
    "carry_direct",
    "direct_budget_s",
    "direct_step_wait_s",
    "fetch_manifest",
    "fetch_ranges",
    "run_links",
]

#: What :func:`run_links` returns for a worker still running past its bound.
LINKS_HUNG = "hung"
#: Seconds a worker thread of link calls is waited for beyond the calls' own bound (a worker
#: alive after that is left behind, and its calls count as hung).
FLOWER_LINK_WORKER_GRACE_S: float = 5.0


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
        Time this donor's requests were in flight (the time of its rate sample,
        ``nbytes / seconds``; waits between requests do not count).
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
    """The shards each donor still owes in one fetch, and what each delivered how fast.

    Shard indices are unique across ``ranges`` (a pull's shards): an index delivered once is
    done, whoever sent it. ``clock`` is monotonic (tests pass their own).
    """

    def __init__(
        self,
        ranges: Mapping[str, Sequence[Range]],
        batch_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.todo = {d: deque(rs) for d, rs in ranges.items()}
        self.batch_bytes, self.clock = batch_bytes, clock
        self.delivered = dict.fromkeys(ranges, 0)
        #: Seconds each donor had a request in flight that it answered (its rate's time).
        self.busy_s = dict.fromkeys(ranges, 0.0)
        self.stopped: set[str] = set()
        #: The batch each donor has in flight, and when it was asked for.
        self.flying: dict[str, tuple[list[Range], float]] = {}
        #: Shards nobody delivered yet, and those asked of a second donor.
        self.missing: set[int] = {i for rs in ranges.values() for i, _, _ in rs}
        self.copied: set[int] = set()
        #: Set once every shard was delivered: the fetch ends there.
        self.complete = asyncio.Event()
        #: Set (and replaced) on each delivery or failure: a donor waiting for work looks again.
        self.moved = asyncio.Event()
        #: When a donor waiting in the end game looks again at a batch in flight, if nothing
        #: moved before then.
        self.look_again: dict[str, float] = {}
        #: How long each donor's first request took (its connection set-up included).
        self.first_took: dict[str, float] = {}

    def _rate(self, d: str) -> float | None:
        """Bytes/s ``d`` delivered over the time its answered requests were in flight (idle
        waits between them do not count; ``None`` before it delivered anything, or once it
        failed)."""
        busy, got = self.busy_s[d], self.delivered[d]
        return got / busy if busy > 0 and got > 0 and d not in self.stopped else None

    def _left(self, d: str) -> int:
        return sum(e - s for _, s, e in self.todo[d])

    def take(self, me: str) -> list[Range]:
        """The next batch of ``me``: its own first shards, else the last shards of the donor
        expected to finish last, if ``me`` would deliver them sooner, else a copy of a batch
        in flight (:meth:`_copy`), else nothing."""
        self.look_again.pop(me, None)
        own = self.todo[me]
        if own:
            return self._cut(own, front=True, limit=self._batch(me))
        mine = self._rate(me)
        if mine is None:
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
            return self._copy(me, mine)
        q = self.todo[victim]
        if q[-1][2] - q[-1][1] >= worst * mine:
            return []  # the victim gets to its last shard before this donor could deliver it
        return list(reversed(self._cut(q, front=False, limit=self._batch(me))))

    def _copy(self, me: str, mine: float) -> list[Range]:
        """The end game: nothing is left to take, so ``me`` asks for the undelivered shards of
        the batch in flight expected to arrive last, if it would deliver them sooner and the
        batch has been in flight for as long as ``me`` would take for it, and for twice as
        long as ``me``'s own first request took (that one set its connection up, as the
        other's first request does: a link is not slow for its handshake). Else ``me`` looks
        again then, or when the batch is due at its link's rate (not in by then: stalled).
        The first copy to arrive counts; the fetch ends as soon as every shard is in. A
        shard is asked of at most two donors."""
        best: list[Range] = []
        due = since = 0.0
        for d, (batch, sent) in self.flying.items():
            left = [r for r in batch if r[0] in self.missing and r[0] not in self.copied]
            if d == me or not left:
                continue
            rate = self._rate(d)
            at = float("inf") if rate is None else sent + sum(e - s for _, s, e in batch) / rate
            if at < self.clock():
                at = float("inf")  # later than its own rate allows: the link may have stalled
            if not best or at > due:
                best, due, since = left, at, sent
        if not best:
            return []
        now = self.clock()
        need = sum(e - s for _, s, e in best) / mine
        if now + need >= due:  # due first at its own rate: look again when due (past it, stalled)
            self.look_again[me] = due
            return []
        overdue = since + max(need, 2 * self.first_took.get(me, 0.0))
        if now < overdue:
            self.look_again[me] = overdue
            return []
        self.copied.update(i for i, _, _ in best)
        return best

    def _batch(self, me: str) -> int:
        """Bytes ``me`` is asked for at once: FLOWER_DIRECT_BATCH_S of its measured rate, or
        ``batch_bytes`` before it has one (at least one shard either way)."""
        rate = self._rate(me)
        return int(rate * FLOWER_DIRECT_BATCH_S) if rate else self.batch_bytes

    def _cut(self, q: deque[Range], *, front: bool, limit: int) -> list[Range]:
        """Whole shards from one end of ``q``: up to ``limit`` bytes (at least one shard, if
        any is still missing; shards a copy already delivered are dropped)."""
        pop = q.popleft if front else q.pop
        batch: list[Range] = []
        size = 0
        while q and (not batch or size < limit):
            nxt = q[0] if front else q[-1]
            if nxt[0] not in self.missing:
                pop()
                continue
            if batch and size + nxt[2] - nxt[1] > LINK_MAX_REPLY_BYTES:
                break
            size += nxt[2] - nxt[1]
            batch.append(pop())
        return batch

    def done(self, me: str, nbytes: int) -> None:
        """``me`` delivered its batch in flight (``nbytes``)."""
        now = self.clock()
        _, sent = self.flying.pop(me, ([], now))
        self.first_took.setdefault(me, now - sent)
        self.busy_s[me] += now - sent
        self.delivered[me] += nbytes
        self._move()

    def send(self, me: str, batch: list[Range]) -> None:
        """``me`` asked for ``batch``."""
        self.flying[me] = (batch, self.clock())

    def busy(self, me: str) -> bool:
        """Whether another donor still has shards queued or in flight (work ``me`` might yet
        take over or copy)."""
        return any(d != me and (self.todo[d] or d in self.flying) for d in self.todo)

    def _move(self) -> None:
        self.moved.set()
        self.moved = asyncio.Event()

    def deliver(self, index: int) -> bool:
        """Shard ``index`` arrived; ``False`` if another donor's copy came first."""
        if index not in self.missing:
            return False
        self.missing.discard(index)
        if not self.missing:
            self.complete.set()
            self._move()  # donors waiting for work stop
        return True

    def stop(self, me: str, undelivered: Sequence[Range]) -> None:
        """``me`` failed: what it did not deliver stays for the others."""
        self.stopped.add(me)
        self.flying.pop(me, None)
        left = [r for r in undelivered if r[0] in self.missing]
        self.copied.difference_update(i for i, _, _ in left)  # one more copy may be asked
        self.todo[me].extendleft(reversed(left))
        self._move()


async def _fetch_one(
    me: str,
    send: _Send,
    queues: _Queues,
    result: DirectResult,
    ask: tuple[int, bytes, float, float],
) -> None:
    """One donor's fetch, one request in flight on its link: batches from the queues until
    every shard is in, none is left that it could take, or its link fails (``ask``: round,
    digest, deadline, the fetch's start)."""
    deadline = ask[2]
    while not result.error and not queues.complete.is_set():
        batch = queues.take(me)
        if not batch:
            now = time.monotonic()
            if not queues.busy(me) or now >= deadline:
                return
            wake = min(deadline, queues.look_again.get(me, deadline))
            # a delivery or a failure elsewhere may leave it something to take
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(queues.moved.wait(), timeout=max(wake - now, 0.001))
            continue
        queues.send(me, batch)
        before, sent = result.nbytes, time.monotonic()
        whole = await _ask(me, send, batch, queues, result, ask)
        result.seconds += time.monotonic() - sent
        if result.error:
            queues.stop(me, batch[whole:])
        else:
            queues.done(me, result.nbytes - before)


async def _ask(
    me: str,
    send: _Send,
    batch: list[Range],
    queues: _Queues,
    result: DirectResult,
    ask: tuple[int, bytes, float, float],
) -> int:
    """Ask ``me`` for ``batch`` (in requests within the per-request limits); keep what arrives
    in ``result``; return how many of its shards arrived whole."""
    rnd, digest, deadline, t0 = ask
    whole = 0
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
                    if queues.deliver(i):  # a copy that came second is not kept
                        result.shards.append((i, b"".join(partial), at))
                    partial, whole = [], whole + 1
    except TimeoutError:
        result.error = "deadline passed"
    except ChaosError as exc:
        result.fail(exc)
    except Exception as exc:  # one bad link never loses the bytes of the others
        result.fail(TransportError(f"direct fetch from {me}: {exc!r}"))
    return whole


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
    return await dialer.request(ep.address, ep.cert, req, timeout=timeout, party=ep.party_id)


def fetch_ranges(
    addresses: Mapping[str, str],
    ranges: Mapping[str, Sequence[Range]],
    *,
    server_round: int,
    digest: bytes,
    timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
    batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES,
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
        Bytes of whole shards of a link's first request, before its rate is measured (then
        FLOWER_DIRECT_BATCH_S of its rate); at least one shard.
    link
        This party's credentials and view: authenticated, encrypted links.

    Returns
    -------
    dict
        Donor -> :class:`DirectResult`.
    """
    fetched: dict[str, DirectResult] = {}
    ready = threading.Event()

    async def main() -> None:
        sends, refused, close = _senders(addresses, list(ranges), link)
        queues = _Queues({d: ranges[d] for d in sends}, batch_bytes)
        t0 = time.monotonic()
        ask = (server_round, digest, t0 + timeout_s, t0)
        results = {d: DirectResult() for d in sends}
        tasks = [asyncio.ensure_future(_fetch_one(d, sends[d], queues, results[d], ask))
                 for d in sends]  # fmt: skip
        try:
            ended: asyncio.Future[Any] = asyncio.ensure_future(queues.complete.wait())
            pending: set[asyncio.Future[Any]] = set(tasks)
            while pending and not ended.done():
                _, pending = await asyncio.wait(pending | {ended}, return_when="FIRST_COMPLETED")
                pending.discard(ended)
            ended.cancel()
            # every shard is in: the caller goes on now; a copy still on its way arrives here
            # (its request is not cancelled mid-stream) and is dropped
            fetched.update(refused)
            fetched.update({d: replace(r, shards=list(r.shards)) for d, r in results.items()})
            ready.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await close()

    failed: list[str] = []

    def run() -> None:
        try:
            asyncio.run(main())
        except Exception as exc:  # the fetch itself broke (not one link): every donor fails
            if not ready.is_set():
                failed.append(f"{type(exc).__name__}: {exc}")
        finally:
            ready.set()  # the caller never waits on a thread that is gone

    worker = threading.Thread(target=run, name="chaos-direct-fetch", daemon=True)
    worker.start()
    ready.wait(timeout_s + FLOWER_LINK_WORKER_GRACE_S)
    # a fetch still running past its bound may yet write: its results are not read at all
    out = dict(fetched) if ready.is_set() and not failed else {}
    for d in ranges:
        out.setdefault(
            d, DirectResult(error=f"the fetch failed: {failed[0]}" if failed else "hung")
        )
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

    why = run_links(main, timeout_s, "chaos-direct-manifest")
    if why or not got:
        return None, why or "hung"
    return got[0]


def direct_budget_s(
    total: int | None,
    *,
    fixed_s: float = FLOWER_DIRECT_TIMEOUT_S,
    min_bps: float = FLOWER_DIRECT_MIN_BPS,
) -> float:
    """The bound of one pull step's direct-link work (manifest and fetches) for a state of
    ``total`` bytes: ``fixed_s`` plus ``total`` at ``min_bps``, at most
    :data:`~chaos_flwr.defaults.FLOWER_DIRECT_MAX_S` (or ``fixed_s`` if that is longer).

    Parameters
    ----------
    total
        The state's size in bytes (``None`` before it is known: the fixed part only).
    fixed_s
        The fixed part (connections, handshakes, the manifest); default
        :data:`~chaos_flwr.defaults.FLOWER_DIRECT_TIMEOUT_S`.
    min_bps
        The slowest total rate of the links still waited for; default
        :data:`~chaos_flwr.defaults.FLOWER_DIRECT_MIN_BPS`.

    Raises
    ------
    chaos_flwr.errors.ConfigError
        ``fixed_s`` is negative or ``min_bps`` is not positive.
    """
    if not fixed_s >= 0 or not min_bps > 0:
        raise ConfigError(
            f"a direct-link bound needs fixed_s >= 0 and min_bps > 0 (got {fixed_s}, {min_bps})"
        )
    return max(fixed_s, min(fixed_s + max(total or 0, 0) / min_bps, FLOWER_DIRECT_MAX_S))


def direct_step_wait_s(total: int | None) -> float:
    """How much longer than a joiner's deadline the ServerApp waits for its step that may pull
    ``total`` bytes over direct links: :func:`direct_budget_s` and the grace of its two link
    workers (the manifest's and the fetch's)."""
    return direct_budget_s(total) + 2 * FLOWER_LINK_WORKER_GRACE_S


def run_links(main: Callable[[], Coroutine[Any, Any, None]], timeout_s: float, name: str) -> str:
    """Run the link calls of ``main()`` on an event loop of their own, in a daemon thread (the
    caller may run inside a loop: a ClientApp's), waited for within ``timeout_s`` (their own
    bound) and :data:`FLOWER_LINK_WORKER_GRACE_S`.

    Returns
    -------
    str
        ``""`` when ``main()`` finished; else why not: :data:`LINKS_HUNG` (the thread is left
        behind: nothing it writes may be read), or the error it raised (the thread ended:
        what it wrote before may be read).
    """
    failed: list[str] = []

    def run() -> None:
        try:
            asyncio.run(main())
        except (Exception, asyncio.CancelledError) as exc:  # the calls broke (not one link)
            failed.append(f"{type(exc).__name__}: {exc}")

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s + FLOWER_LINK_WORKER_GRACE_S)
    if worker.is_alive():
        return LINKS_HUNG
    return failed[0] if failed else ""


def carry_direct(
    pull: PullNegotiation,
    decision: Decision,
    link: LinkAccess | None,
    *,
    clock: Callable[[], float],
    batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES,
    timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
    manifest_s: float | None = None,
    phase_s: dict[str, float] | None = None,
) -> Decision:
    """Carry out ``pull``'s direct-link decisions (a manifest, shard fetches) until it asks
    for relay requests or ends, all within ``timeout_s``; the decision it ends at.

    The one executor of a pull's direct links, for a joiner and for a restarted ServerApp's
    resume alike. ``link`` ``None`` (a pull saved with addresses, taken up without
    credentials) fails every link, so the relay carries everything. A manifest request is
    bounded by ``manifest_s`` too, when given (it is small, whatever the state's size).
    Seconds spent per phase (``manifest``, ``fetch``) are added to ``phase_s``.
    """
    until = clock() + timeout_s
    while decision.manifest or decision.direct:
        began = clock()
        left = max(until - began, 0.001)
        if decision.manifest:
            phase, left = "manifest", left if manifest_s is None else min(left, manifest_s)
            ((donor, (addr, ask)),) = decision.manifest.items()
            raw, why = (None, "no link credentials") if link is None else fetch_manifest(
                {donor: addr}, donor, (ask.total, ask.shard_bytes, ask.num_shards),
                server_round=pull.server_round, digest=pull.digest, timeout_s=left, link=link,
            )  # fmt: skip
            decision = pull.on_manifest(donor, raw, why, clock())
        else:
            phase = "fetch"
            ranges = {d: [(r.index, r.start, r.end) for r in rs]
                      for d, (_, rs) in decision.direct.items()}  # fmt: skip
            got = {d: DirectResult(error="no link credentials") for d in ranges}
            if link is not None:
                got = fetch_ranges(
                    {d: a for d, (a, _) in decision.direct.items()}, ranges,
                    server_round=pull.server_round, digest=pull.digest, timeout_s=left,
                    batch_bytes=batch_bytes, link=link,
                )  # fmt: skip
            results = {
                d: LinkResult(tuple(r.shards), nbytes=r.nbytes, seconds=r.seconds, error=r.error)
                for d, r in got.items()
            }
            decision = pull.on_direct(results, clock())
        if phase_s is not None:
            phase_s[phase] = phase_s.get(phase, 0.0) + clock() - began
    return decision
