"""Multi-source state transfer, sans-I/O: the joiner's pull engine and the donor's shard server.

The joiner side is :class:`PullSession`. It is fed a :class:`~chaos_flwr.state.Manifest` (per-shard
SHA-256 for the planned shard size), a :class:`~chaos_flwr.planner.TransferPlan` and the donors'
link estimates, and it is driven by events; every event method returns the actions to carry out
(:class:`ShardRequest` to send, :class:`CancelRequest` to abandon). A driver looks like::

    session = PullSession(manifest, plan, donors, now=clock())
    send_all(session.poll(clock()))
    while not session.done:
        event = wait_for_reply_or_timer()
        if event is a shard:  send_all(session.on_shard(donor, index, data, clock()))
        if a donor vanished:  send_all(session.on_donor_lost(donor, clock()))
        on a timer:           send_all(session.tick(clock()))
    state_bytes = session.assemble()

The same object runs under asyncio, threads, a discrete-event simulator (virtual ``now``) or a
test; it does no I/O and reads no clock.

Scheduling
----------
* Each donor starts with the plan's shards as a queue and keeps up to ``window`` plus its
  bandwidth-delay product (``2 * latency * rate / shard_bytes``, rounded up) requests in
  flight, so a long link never idles for a round trip between shards. ``Donor.latency`` is
  taken as one-way; a request therefore costs one round trip before its first byte, one
  latency more than the planner's model, which a carrier can save by sending the first
  requests together with the join message.
* **Pull queue.** A donor whose queue is empty takes the *tail* of the queue of the donor with
  the latest estimated finish, when it would finish that shard earlier than that donor would;
  once no queued shard is left, it may duplicate the in-flight shard expected last (each shard
  at most twice); the first verified copy wins and the other copy is cancelled.
* **Estimates.** A donor's rate starts at the plan's rate (or its bandwidth) and is smoothed with
  every shard it delivers (``TRANSFER_RATE_EWMA_ALPHA``). The seconds of a shard are counted
  from the donor's previous delivery, or from its request minus the round trip when the link
  was idle, so samples measure the link, not the queue or the latency.
  :meth:`PullSession.observations` returns ``(donor, bytes, seconds)`` for the monitor. A shard
  that is overdue (no delivery for longer than one service time) is expected to take as long
  again as it already has, so a stalled donor looks slower and slower and its shards move.
* **Faults.** A shard that fails verification marks its donor bad (nothing more is taken from
  it). A lost, bad or timed-out donor's missing shards are re-planned over the live donors with
  :func:`~chaos_flwr.planner.plan_transfer` (each donor's current backlog as its ``ready``
  time). A request times out after ``timeout_factor`` times its expected service time (at least
  ``min_timeout_s``); a timed-out donor is treated as lost, though a late shard it still sends
  is accepted if it verifies. With shards missing and no live donor left,
  :class:`~chaos_flwr.errors.TransferError` is raised.
* :meth:`PullSession.assemble` joins the shards and checks the state digest (and the certified
  digest, when given), so a lying manifest cannot make a wrong state accepted.

The donor side is :class:`ShardServer`: it answers byte-range requests from an immutable source
(a :class:`~chaos_flwr.store.Replica` read with ``pread``, or bytes) with at most
``max_concurrent_uploads`` uploads at once and a FIFO queue behind them. It never touches the
donor's training loop: replicas are immutable files, so serving needs no lock and no pause.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .defaults import (
    DONOR_MAX_CONCURRENT_UPLOADS,
    TRANSFER_MIN_TIMEOUT_S,
    TRANSFER_RATE_EWMA_ALPHA,
    TRANSFER_TIMEOUT_FACTOR,
    TRANSFER_WINDOW,
)
from .errors import ShardIntegrityError, TransferError
from .planner import Donor, TransferPlan, plan_transfer
from .state import Manifest, shard_range

#: Marks an arrived shard in ``PullSession._shards`` (its bytes live in the session buffer).
_ARRIVED = b""

__all__ = [
    "Action",
    "CancelRequest",
    "DonorStatus",
    "Observation",
    "Progress",
    "PullSession",
    "RangeSource",
    "ShardRequest",
    "ShardServer",
    "Upload",
]


@dataclass(frozen=True)
class ShardRequest:
    """Ask ``donor`` for shard ``index``, i.e. state bytes ``[start, end)``."""

    donor: str
    index: int
    start: int
    end: int


@dataclass(frozen=True)
class CancelRequest:
    """Tell ``donor`` (or the carrier) that shard ``index`` is no longer needed from it."""

    donor: str
    index: int


Action = ShardRequest | CancelRequest


@dataclass(frozen=True)
class Observation:
    """One delivered shard: ``bytes`` in ``seconds`` from ``donor``, observed at ``at``."""

    donor: str
    bytes: int
    seconds: float
    at: float


@dataclass(frozen=True)
class Progress:
    """A snapshot of a transfer.

    Attributes
    ----------
    bytes_done, total_bytes : int
        Verified bytes received and the state size.
    shards_done, num_shards : int
    bytes_by_donor : Mapping[str, int]
        Verified bytes accepted from each donor.
    eta_s : float or None
        Estimated seconds until done (0.0 when done, None when no live donor remains).
    live_donors : tuple of str
    """

    bytes_done: int
    total_bytes: int
    shards_done: int
    num_shards: int
    bytes_by_donor: Mapping[str, int]
    eta_s: float | None
    live_donors: tuple[str, ...]

    @property
    def fraction(self) -> float:
        """``bytes_done / total_bytes`` (1.0 for an empty state)."""
        return 1.0 if self.total_bytes == 0 else self.bytes_done / self.total_bytes


class DonorStatus:
    """Donor states inside a :class:`PullSession` (plain strings)."""

    LIVE = "live"
    LOST = "lost"
    BAD = "bad"
    TIMED_OUT = "timed_out"


class _Peer:
    __slots__ = (
        "bytes_ok",
        "id",
        "inflight",
        "last_recv",
        "latency",
        "queue",
        "rate",
        "status",
    )

    def __init__(self, donor_id: str, rate: float, latency: float) -> None:
        self.id = donor_id
        self.rate = rate
        self.latency = latency
        self.queue: deque[int] = deque()
        # index -> (sent_at, expected_done, deadline)
        self.inflight: dict[int, tuple[float, float, float]] = {}
        self.last_recv: float | None = None
        self.status = DonorStatus.LIVE
        self.bytes_ok = 0

    def rtt(self) -> float:
        """The round trip to this donor (its latency is one way)."""
        return 2.0 * self.latency


#: Version of :meth:`PullSession.snapshot`'s value; another version is refused on restore.
SNAPSHOT_VERSION = 1

#: Donor statuses a snapshot may name.
_STATUSES = frozenset({"live", "lost", "bad", "timed_out"})


def _is_index(value: object, count: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < count


def _is_time(value: object) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool) and math.isfinite(value)


def _check_fit(
    manifest: Manifest,
    plan: TransferPlan,
    window: int,
    rate_alpha: float,
    expected_digest: bytes | None,
) -> None:
    """Refuse a plan, manifest and settings that do not fit together (the field is named)."""
    if expected_digest is not None:
        manifest.check_certified(expected_digest)
    total = plan.total_bytes if plan.total_bytes is not None else manifest.total_bytes
    if total != manifest.total_bytes:
        raise TransferError(
            f"plan.total_bytes: {total} differs from the manifest's {manifest.total_bytes}; "
            "plan for the certified state size"
        )
    if plan.num_shards and (
        plan.shard_bytes != manifest.shard_bytes or plan.num_shards != manifest.num_shards
    ):
        raise TransferError(
            f"manifest.shard_bytes: manifest has {manifest.num_shards} shards of "
            f"{manifest.shard_bytes} bytes, the plan {plan.num_shards} of {plan.shard_bytes}; "
            "build the manifest with Manifest.build(data, plan.shard_bytes, "
            "num_shards=plan.num_shards)"
        )
    if window < 1:
        raise TransferError(f"window: got {window}; give an int >= 1")
    if not 0.0 < rate_alpha <= 1.0:
        raise TransferError(f"rate_alpha: got {rate_alpha}; must be in (0, 1]")


def _restore_donors(session: PullSession, donors: object) -> None:
    """Take up the donors of a snapshot (typed and bounded: a bad field is a TransferError)."""
    if not isinstance(donors, dict) or not donors:
        raise TransferError("snapshot.donors: must be a non-empty map of donor id -> state")
    n = session.num_shards
    for donor_id, value in donors.items():
        if not isinstance(value, dict) or value.get("status") not in _STATUSES:
            raise TransferError(f"snapshot.donors.{donor_id}: bad donor state")
        rate, latency, last = value.get("rate"), value.get("latency"), value.get("last")
        sent_bytes = value.get("bytes")
        if not isinstance(sent_bytes, int) or isinstance(sent_bytes, bool) or sent_bytes < 0:
            raise TransferError(f"snapshot.donors.{donor_id}.bytes: must be an int >= 0")
        queue, inflight = value.get("queue"), value.get("inflight")
        if not (_is_time(rate) and _is_time(latency) and (last is None or _is_time(last))):
            raise TransferError(f"snapshot.donors.{donor_id}: rate/latency/last must be numbers")
        if not isinstance(queue, list) or not all(_is_index(i, n) for i in queue):
            raise TransferError(f"snapshot.donors.{donor_id}.queue: must list shard indices")
        if not isinstance(inflight, list) or not all(
            isinstance(r, list) and len(r) == 4 and _is_index(r[0], n) and all(map(_is_time, r[1:]))
            for r in inflight
        ):
            raise TransferError(f"snapshot.donors.{donor_id}.inflight: bad request entries")
        assert isinstance(rate, float | int) and isinstance(latency, float | int)
        peer = session._add_peer(donor_id, float(rate), float(latency))
        peer.status = value["status"]
        peer.queue = deque(queue)
        peer.last_recv = None if last is None else float(last)
        peer.bytes_ok = sent_bytes
        for index, sent, expected, deadline in inflight:
            peer.inflight[index] = (float(sent), float(expected), float(deadline))
            session._holders.setdefault(index, set()).add(peer.id)


def _restore_shards(session: PullSession, arrived: object, data: object) -> None:
    """Take up a snapshot's saved shards, each verified against the manifest again."""
    if not isinstance(arrived, list) or not isinstance(data, list) or len(arrived) != len(data):
        raise TransferError("snapshot.arrived/data: must be two lists of one length")
    for index, chunk in zip(arrived, data, strict=True):
        if not _is_index(index, session.num_shards) or not isinstance(chunk, bytes):
            raise TransferError(f"snapshot.arrived: shard {index!r} is not a saved shard")
        if session._shards[index] is not None:
            raise TransferError(f"snapshot.arrived: shard {index} is saved twice")
        session._store.put(index, chunk)


class _ShardBuffer:
    """Verified shards, copied into their place in one buffer as they arrive.

    ``marks[i]`` is ``None`` until shard ``i`` arrived. The state digest is computed over the
    longest verified prefix as shards land, so hashing overlaps the transfer instead of adding a
    full pass at the end. ``np.empty`` leaves the pages untouched until a shard lands
    (``bytearray(n)`` would zero all of them up front).
    """

    def __init__(self, manifest: Manifest, num_shards: int) -> None:
        self.manifest = manifest
        self.num_shards = num_shards
        self.marks: list[bytes | None] = [None] * num_shards
        self.view = np.empty(manifest.total_bytes, dtype=np.uint8).data.cast("B")
        self._hash = hashlib.sha256()
        self._prefix = 0
        self.count = 0
        self.bytes = 0
        for i in range(num_shards):  # empty trailing shards need no round trip
            start, end = shard_range(manifest.total_bytes, manifest.shard_bytes, i)
            if start == end:
                manifest.verify_shard(i, b"")
                self.marks[i] = b""
                self.count += 1

    def put(self, index: int, data: bytes | memoryview) -> int:
        """Verify shard ``index`` (ShardIntegrityError) and take it; return its size."""
        self.manifest.verify_shard(index, data)
        start, end = self.manifest.shard_range(index)
        self.view[start:end] = data
        self.marks[index] = _ARRIVED
        while self._prefix < self.num_shards and self.marks[self._prefix] is not None:
            lo, hi = self.manifest.shard_range(self._prefix)
            self._hash.update(self.view[lo:hi])
            self._prefix += 1
        self.count += 1
        self.bytes += end - start
        return end - start

    def saved(self) -> tuple[list[int], list[bytes]]:
        """Indices and bytes of the shards received (not the empty trailing ones)."""
        indices: list[int] = []
        data: list[bytes] = []
        for i, mark in enumerate(self.marks):
            start, end = self.manifest.shard_range(i)
            if mark is not None and start != end:
                indices.append(i)
                data.append(bytes(self.view[start:end]))
        return indices, data

    def assemble(self, expected: bytes | None) -> memoryview:
        """The verified state (read-only view, no copy); see :meth:`PullSession.assemble`."""
        if self.count != self.num_shards:
            raise TransferError(
                f"assemble: {self.num_shards - self.count} shards are still missing; "
                "keep driving the session until done"
            )
        if self._hash.digest() != self.manifest.state_digest:
            raise ShardIntegrityError(
                "state: SHA-256 of the reassembled state differs from the certified state "
                "digest (the manifest does not describe the certified state); fetch a manifest "
                "from another donor and transfer again"
            )
        if expected is not None:
            self.manifest.check_certified(expected)
        return self.view.toreadonly()


def _queue_plan(peers: Mapping[str, _Peer], plan: TransferPlan, num_shards: int) -> set[int]:
    """Queue the plan's shards at their donors; return the shards assigned."""
    assigned: set[int] = set()
    for donor_id, shards in plan.assignment.items():
        if donor_id not in peers:
            raise TransferError(
                f"plan.assignment: donor {donor_id!r} is not among the donors given"
            )
        for i in shards:
            if i in assigned or not 0 <= i < num_shards:
                raise TransferError(f"plan.assignment: shard {i} is out of range or repeated")
            assigned.add(i)
        peers[donor_id].queue.extend(shards)
    return assigned


class PullSession:
    """The joiner's side of a multi-source pull (sans-I/O).

    Parameters
    ----------
    manifest : Manifest
        Shard digests for ``plan.shard_bytes`` (the joiner checks it names the certified
        digest by passing ``expected_digest``).
    plan : TransferPlan
        From :func:`~chaos_flwr.planner.plan_transfer` over ``donors``.
    donors : Sequence[Donor]
        Every donor that may send (donors the plan left idle are used for stealing).
    now : float
        Current time, seconds.
    expected_digest : bytes or None, optional
        The certified state digest; the manifest must name it and the result must hash to it.
    window : int, optional
        Requests in flight per donor (>= 1).
    timeout_factor, min_timeout_s : float, optional
        A request times out after this many times its expected service time, never sooner.
    rate_alpha : float, optional
        EWMA weight of a new rate sample (0 < alpha <= 1).

    Raises
    ------
    TransferError
        If plan, manifest and donors do not fit together (the message says which field).
    ShardIntegrityError
        If the manifest does not name ``expected_digest``.
    """

    def __init__(
        self,
        manifest: Manifest,
        plan: TransferPlan,
        donors: Sequence[Donor],
        *,
        now: float,
        expected_digest: bytes | None = None,
        window: int = TRANSFER_WINDOW,
        timeout_factor: float = TRANSFER_TIMEOUT_FACTOR,
        min_timeout_s: float = TRANSFER_MIN_TIMEOUT_S,
        rate_alpha: float = TRANSFER_RATE_EWMA_ALPHA,
    ) -> None:
        _check_fit(manifest, plan, window, rate_alpha, expected_digest)
        self._setup(manifest, expected_digest, window, timeout_factor, min_timeout_s, rate_alpha)
        for d in donors:
            self._add_peer(d.id, plan.rates.get(d.id, d.bandwidth), d.latency)
        assigned = _queue_plan(self._peers, plan, self.num_shards)
        for peer in self._peers.values():
            peer.queue = deque(i for i in peer.queue if self._shards[i] is None)
        unassigned = [i for i in range(self.num_shards) if self._shards[i] is None]
        unassigned = [i for i in unassigned if i not in assigned]
        if unassigned:
            self._replan(unassigned, now)

    def _setup(
        self, manifest: Manifest, expected: bytes | None, window: int, *limits: float
    ) -> None:
        """Fields shared by a new session and a restored one (no donors yet)."""
        self.manifest = manifest
        self.total_bytes = manifest.total_bytes
        self.shard_bytes = manifest.shard_bytes
        self.num_shards = manifest.num_shards if self.total_bytes else 0
        self._expected = expected
        self._window = window
        self._timeout_factor, self._min_timeout, self._alpha = limits
        self._peers: dict[str, _Peer] = {}
        self._order: list[str] = []
        self._store = _ShardBuffer(manifest, self.num_shards)
        self._shards = self._store.marks
        self._holders: dict[int, set[str]] = {}
        self._observations: list[Observation] = []
        self._new_obs = 0

    def _add_peer(self, donor_id: str, rate: float, latency: float) -> _Peer:
        if donor_id in self._peers:
            raise TransferError(f"donors: duplicate donor id {donor_id!r}")
        if not (math.isfinite(rate) and rate > 0):
            raise TransferError(f"bandwidth: donor {donor_id!r} has {rate!r}; must be > 0")
        peer = _Peer(donor_id, float(rate), float(latency))
        self._peers[donor_id] = peer
        self._order = sorted(self._peers)
        return peer

    # --- snapshot (a pull that outlives its process) -----------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The session as plain values (codec-encodable), for :meth:`restore` in another process.

        Holds each donor's status, smoothed rate, latency, queue and in-flight requests, and the
        verified shards received so far (index and bytes). Observations are not kept.
        """
        donors = {
            p.id: {
                "status": p.status,
                "rate": p.rate,
                "latency": p.latency,
                "queue": list(p.queue),
                "inflight": [[i, *times] for i, times in p.inflight.items()],
                "last": p.last_recv,
                "bytes": p.bytes_ok,
            }
            for p in self._peers.values()
        }
        arrived, data = self._store.saved()
        return {"v": SNAPSHOT_VERSION, "donors": donors, "arrived": arrived, "data": data}

    @classmethod
    def restore(
        cls,
        manifest: Manifest,
        snapshot: Mapping[str, Any],
        *,
        expected_digest: bytes | None = None,
        window: int = TRANSFER_WINDOW,
        min_timeout_s: float = TRANSFER_MIN_TIMEOUT_S,
    ) -> PullSession:
        """Rebuild a session from :meth:`snapshot` over the same manifest.

        Every saved shard is verified against the manifest again; a snapshot of another version,
        of the wrong shape or with a bad shard raises :class:`~chaos_flwr.errors.TransferError`
        (or :class:`~chaos_flwr.errors.ShardIntegrityError`), and nothing is taken up.
        """
        if snapshot.get("v") != SNAPSHOT_VERSION:
            raise TransferError(
                f"snapshot.v: got {snapshot.get('v')!r}, this version reads {SNAPSHOT_VERSION}; "
                "start the pull again"
            )
        if expected_digest is not None:
            manifest.check_certified(expected_digest)
        session = cls.__new__(cls)
        limits = (TRANSFER_TIMEOUT_FACTOR, min_timeout_s, TRANSFER_RATE_EWMA_ALPHA)
        session._setup(manifest, expected_digest, window, *limits)
        _restore_donors(session, snapshot.get("donors"))
        _restore_shards(session, snapshot.get("arrived"), snapshot.get("data"))
        return session

    # --- queries ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True when every shard has been received and verified."""
        return self._store.count == self.num_shards

    def status(self, donor: str) -> str:
        """Return the :class:`DonorStatus` of ``donor``."""
        return self._peers[donor].status

    def live_donors(self) -> tuple[str, ...]:
        """Donors still used, in id order."""
        return tuple(d for d in self._order if self._peers[d].status == DonorStatus.LIVE)

    def queued(self, donor: str) -> tuple[int, ...]:
        """Shards ``donor`` has not been asked for yet (its queue, in order)."""
        return tuple(self._peers[donor].queue)

    def inflight(self, donor: str) -> tuple[int, ...]:
        """Shards requested from ``donor`` and not yet delivered."""
        return tuple(self._peers[donor].inflight)

    def missing(self) -> tuple[int, ...]:
        """Shards not yet received."""
        return tuple(i for i, s in enumerate(self._shards) if s is None)

    def observations(self) -> tuple[Observation, ...]:
        """Every delivery observed so far (for the monitor's link estimates)."""
        return tuple(self._observations)

    def take_observations(self) -> list[Observation]:
        """Observations since the previous call (feed them to the monitor once each)."""
        out = self._observations[self._new_obs :]
        self._new_obs = len(self._observations)
        return out

    def rate_estimate(self, donor: str) -> float:
        """The current smoothed rate of ``donor`` in bytes/s."""
        return self._peers[donor].rate

    def progress(self, now: float) -> Progress:
        """Return a :class:`Progress` snapshot at ``now``."""
        live = self.live_donors()
        if self.done:
            eta: float | None = 0.0
        else:
            finishes = [
                self._backlog_finish(self._peers[d], now)
                for d in live
                if self._peers[d].queue or self._peers[d].inflight
            ]
            eta = max(0.0, max(finishes) - now) if finishes else None
        return Progress(
            bytes_done=self._store.bytes,
            total_bytes=self.total_bytes,
            shards_done=self._store.count,
            num_shards=self.num_shards,
            bytes_by_donor={d: self._peers[d].bytes_ok for d in self._order},
            eta_s=eta,
            live_donors=live,
        )

    # --- events ----------------------------------------------------------------------------

    def poll(self, now: float) -> list[Action]:
        """Return the requests that can be sent now (call once to start)."""
        return self._fill(now)

    def on_shard(
        self, donor: str, index: int, data: bytes | memoryview, now: float, *, fill: bool = True
    ) -> list[Action]:
        """Consume a shard reply.

        A shard that fails verification marks ``donor`` bad and re-plans its shards; replies
        from unknown or bad donors and duplicates are ignored. With ``fill=False`` no request
        is planned (a carrier feeding many replies at once calls :meth:`poll` after the last).

        Returns
        -------
        list of Action
            Requests to send (and cancellations of now-redundant copies).

        Raises
        ------
        TransferError
            If shards are missing and no live donor remains.
        """
        peer = self._peers.get(donor)
        if peer is None or peer.status == DonorStatus.BAD:
            return []
        actions: list[Action] = []
        sent = peer.inflight.pop(index, None)
        if sent is not None:
            self._holders.get(index, set()).discard(donor)
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < self.num_shards
        ):
            return self._mark_bad(peer, now)
        if self._shards[index] is not None:
            if sent is not None:
                peer.last_recv = now
            return self._fill(now) if fill else []
        try:
            size = self._store.put(index, data)
        except ShardIntegrityError:
            return self._mark_bad(peer, now, also=[index])
        peer.bytes_ok += size
        if sent is not None and size:
            if peer.last_recv is None or sent[0] >= peer.last_recv:
                # The link was idle when this was requested: take the round trip out.
                raw = now - sent[0]
                seconds = max(raw - peer.rtt(), 0.1 * raw)
            else:
                seconds = now - peer.last_recv
            if seconds > 0:
                self._observations.append(Observation(donor, size, seconds, now))
                sample = size / seconds
                peer.rate = (1 - self._alpha) * peer.rate + self._alpha * sample
        peer.last_recv = now
        for other in sorted(self._holders.pop(index, set())):
            self._peers[other].inflight.pop(index, None)
            actions.append(CancelRequest(other, index))
        actions.extend(self._fill(now) if fill else [])
        return actions

    def knows(self, donor: str) -> bool:
        """Whether ``donor`` is one of this session's donors (in any status)."""
        return donor in self._peers

    def withdraw(self, donor: str, index: int) -> None:
        """Forget that ``donor`` was asked for shard ``index`` (its carrier never sent it)."""
        peer = self._peers.get(donor)
        if peer is not None and peer.inflight.pop(index, None) is not None:
            self._holders.get(index, set()).discard(donor)

    def on_donor_lost(self, donor: str, now: float) -> list[Action]:
        """A donor left or crashed: re-plan its missing shards over the live donors.

        Raises
        ------
        TransferError
            If shards are missing and no live donor remains.
        """
        peer = self._peers.get(donor)
        if peer is None or peer.status != DonorStatus.LIVE:
            return []
        return self._retire(peer, DonorStatus.LOST, now)

    def tick(self, now: float) -> list[Action]:
        """Handle request timeouts at ``now``; return requests for re-planned shards.

        Raises
        ------
        TransferError
            If shards are missing and no live donor remains.
        """
        actions: list[Action] = []
        for donor in self._order:
            peer = self._peers[donor]
            if peer.status != DonorStatus.LIVE:
                continue
            if any(deadline <= now for _s, _e, deadline in peer.inflight.values()):
                actions.extend(self._retire(peer, DonorStatus.TIMED_OUT, now))
        actions.extend(self._fill(now))
        return actions

    def next_deadline(self) -> float | None:
        """The earliest request deadline (when the driver should call :meth:`tick`)."""
        deadlines = [
            dl
            for p in self._peers.values()
            if p.status == DonorStatus.LIVE
            for _s, _e, dl in p.inflight.values()
        ]
        return min(deadlines) if deadlines else None

    def assemble(self) -> memoryview:
        """Return the verified state bytes: a read-only view of the session's buffer (no copy).

        Raises
        ------
        TransferError
            If shards are still missing.
        ShardIntegrityError
            If the reassembled state does not hash to the manifest's (or certified) digest.
        """
        return self._store.assemble(self._expected)

    # --- internals -------------------------------------------------------------------------

    def _pace(self, peer: _Peer, now: float) -> tuple[float, float]:
        """Return ``(start, per_shard)``: in-flight shard ``i`` is expected at
        ``start + (i + 1) * per_shard``.

        ``start`` is when the donor's next in-flight shard began to flow (its request's round
        trip, or the previous delivery). On schedule, ``per_shard`` is the service time at the
        estimated rate. When the next shard is overdue it has taken ``now - start`` already and
        is expected to take as long again, so a stalled donor looks slower and slower and its
        shards become worth stealing or duplicating.
        """
        service = self.shard_bytes / peer.rate
        if not peer.inflight:
            return now + peer.rtt() - service, service
        first_sent = next(iter(peer.inflight.values()))[0]
        start = first_sent + peer.rtt()
        if peer.last_recv is not None:
            start = max(start, peer.last_recv)
        if now <= start + service:
            return start, service
        return start, 2.0 * (now - start)

    def _pipeline_free(self, peer: _Peer, now: float) -> float:
        """Estimated arrival of the donor's last in-flight shard."""
        start, per_shard = self._pace(peer, now)
        return start + len(peer.inflight) * per_shard

    def _backlog_finish(self, peer: _Peer, now: float) -> float:
        start, per_shard = self._pace(peer, now)
        return start + (len(peer.inflight) + len(peer.queue)) * per_shard

    def _window_of(self, peer: _Peer) -> int:
        # Enough requests in flight to cover the bandwidth-delay product, never fewer than
        # ``window``: a pull over a long link would otherwise idle for a round trip per shard.
        if self.shard_bytes <= 0:
            return self._window
        bdp = peer.rtt() * peer.rate / self.shard_bytes
        return self._window + math.ceil(bdp)

    def _send(self, peer: _Peer, index: int, now: float) -> ShardRequest:
        expected = max(self._pipeline_free(peer, now), now + peer.rtt()) + (
            self.shard_bytes / peer.rate
        )
        timeout = max(self._min_timeout, self._timeout_factor * (expected - now))
        peer.inflight[index] = (now, expected, now + timeout)
        self._holders.setdefault(index, set()).add(peer.id)
        start, end = shard_range(self.total_bytes, self.shard_bytes, index)
        return ShardRequest(peer.id, index, start, end)

    def _steal(self, thief: _Peer, now: float) -> int | None:
        mine = max(self._pipeline_free(thief, now), now + thief.rtt()) + (
            self.shard_bytes / thief.rate
        )
        victim: _Peer | None = None
        worst = -math.inf
        for donor in self._order:
            p = self._peers[donor]
            if p is thief or p.status != DonorStatus.LIVE or not p.queue:
                continue
            finish = self._backlog_finish(p, now)
            if finish > worst:
                worst, victim = finish, p
        if victim is not None:
            if mine >= worst:
                return None
            while victim.queue:  # skip copies that a re-plan left behind and that are done
                index = victim.queue.pop()
                if self._shards[index] is None and index not in thief.inflight:
                    return index
            return None
        # Endgame: duplicate the in-flight shard expected last, if we would beat it (per donor
        # the last one sent that is neither duplicated nor the thief's: one look per donor).
        best: tuple[float, int] | None = None
        for donor in self._order:
            p = self._peers[donor]
            if p is thief or p.status != DonorStatus.LIVE or not p.inflight:
                continue
            start, per_shard = self._pace(p, now)
            for back, index in enumerate(reversed(p.inflight)):
                if len(self._holders.get(index, ())) > 1 or index in thief.inflight:
                    continue
                eta = start + (len(p.inflight) - back) * per_shard
                if best is None or eta > best[0]:
                    best = (eta, index)
                break
        if best is not None and mine < best[0]:
            return best[1]
        return None

    def _fill(self, now: float) -> list[Action]:
        actions: list[Action] = []
        progress = True
        while progress:
            progress = False
            for donor in self._order:
                peer = self._peers[donor]
                if peer.status != DonorStatus.LIVE or len(peer.inflight) >= self._window_of(peer):
                    continue
                index: int | None = None
                while peer.queue and index is None:
                    candidate = peer.queue.popleft()
                    if self._shards[candidate] is None and candidate not in peer.inflight:
                        index = candidate
                if index is None:
                    index = self._steal(peer, now)
                if index is not None:
                    actions.append(self._send(peer, index, now))
                    progress = True
        return actions

    def _mark_bad(self, peer: _Peer, now: float, also: Sequence[int] = ()) -> list[Action]:
        if peer.status == DonorStatus.LIVE:
            return self._retire(peer, DonorStatus.BAD, now, also=also)
        peer.status = DonorStatus.BAD
        extra = [i for i in also if self._shards[i] is None and not self._held_by_live(i)]
        actions: list[Action] = []
        if extra:
            actions.extend(self._replan(extra, now))
        actions.extend(self._fill(now))
        return actions

    def _held_by_live(self, index: int) -> bool:
        for d in self._holders.get(index, ()):
            if self._peers[d].status == DonorStatus.LIVE:
                return True
        return any(index in p.queue for p in self._peers.values() if p.status == DonorStatus.LIVE)

    def _retire(
        self, peer: _Peer, status: str, now: float, also: Sequence[int] = ()
    ) -> list[Action]:
        peer.status = status
        orphans = [*peer.queue, *peer.inflight, *also]
        peer.queue.clear()
        actions: list[Action] = []
        for index in list(peer.inflight):
            self._holders.get(index, set()).discard(peer.id)
            actions.append(CancelRequest(peer.id, index))
        if status != DonorStatus.TIMED_OUT:
            peer.inflight.clear()  # a timed-out donor's late shard is still welcome
        missing = sorted(
            {i for i in orphans if self._shards[i] is None and not self._held_by_live(i)}
        )
        if missing:
            actions.extend(self._replan(missing, now))
        actions.extend(self._fill(now))
        return actions

    def _replan(self, missing: list[int], now: float) -> list[Action]:
        live = [self._peers[d] for d in self.live_donors()]
        if not live:
            raise TransferError(
                f"donors: {len(missing)} shards are missing and no live donor remains; find "
                "other parties that hold the certified round and start a new transfer"
            )
        donors = [
            Donor(
                id=p.id,
                bandwidth=p.rate,
                latency=0.0,
                ready=max(0.0, self._backlog_finish(p, now) - now),
            )
            for p in live
        ]
        m = len(missing)
        plan = plan_transfer(
            m * self.shard_bytes, donors, chain=[m], max_shards=m, min_shard_bytes=1
        )
        for donor_id, positions in plan.assignment.items():
            self._peers[donor_id].queue.extend(missing[j] for j in positions)
        return []


# --- donor side ------------------------------------------------------------------------------


class RangeSource(Protocol):
    """Anything that serves byte ranges of one immutable serialised state."""

    @property
    def total_bytes(self) -> int:
        """Length of the state."""
        ...

    def read(self, start: int, end: int) -> bytes:
        """Return bytes ``[start, end)``."""
        ...


class _BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(bytes(data) if isinstance(data, bytearray) else data).cast("B")

    @property
    def total_bytes(self) -> int:
        return len(self._view)

    def read(self, start: int, end: int) -> bytes:
        return bytes(self._view[start:end])


@dataclass(frozen=True)
class Upload:
    """A granted upload: send bytes ``[start, end)`` (shard ``index``) to ``requester``."""

    requester: str
    index: int
    start: int
    end: int
    ticket: int


class ShardServer:
    """The donor's side: answers shard requests from an immutable replica, with an upload cap.

    Parameters
    ----------
    source : RangeSource or bytes-like
        A :class:`~chaos_flwr.store.Replica` (reads only the requested range with ``pread``)
        or the serialised state in memory.
    max_concurrent_uploads : int, optional
        Uploads granted at once (>= 1); further requests wait in FIFO order.

    Notes
    -----
    Use: ``for u in server.request(peer, index, start, end): start_upload(u)``; an upload
    task calls ``server.read(u)``, sends it, then ``server.finish(u)`` and starts the uploads
    that returns.
    """

    def __init__(
        self,
        source: RangeSource | bytes | bytearray | memoryview,
        *,
        max_concurrent_uploads: int = DONOR_MAX_CONCURRENT_UPLOADS,
    ) -> None:
        if isinstance(max_concurrent_uploads, bool) or max_concurrent_uploads < 1:
            raise TransferError(
                f"max_concurrent_uploads: got {max_concurrent_uploads!r}; give an int >= 1"
            )
        self.source: RangeSource = (
            _BytesSource(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
        )
        self.max_concurrent_uploads = max_concurrent_uploads
        self._active: dict[int, Upload] = {}
        self._queue: deque[Upload] = deque()
        self._tickets = 0
        self.bytes_served = 0

    @property
    def total_bytes(self) -> int:
        """Length of the served state."""
        return self.source.total_bytes

    @property
    def active(self) -> int:
        """Uploads in progress."""
        return len(self._active)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queue)

    def request(self, requester: str, index: int, start: int, end: int) -> list[Upload]:
        """Accept a shard request; return the uploads to start now (0 or 1).

        Raises
        ------
        TransferError
            If the range is outside the state.
        """
        if not 0 <= start <= end <= self.total_bytes:
            raise TransferError(
                f"range: [{start}, {end}) is outside the state [0, {self.total_bytes}); the "
                "requester planned for another state"
            )
        self._tickets += 1
        upload = Upload(requester, index, start, end, self._tickets)
        self._queue.append(upload)
        return self._grant()

    def read(self, upload: Upload) -> bytes:
        """Read the bytes of a granted upload (only its range)."""
        if upload.ticket not in self._active:
            raise TransferError(f"upload: ticket {upload.ticket} is not active")
        return self.source.read(upload.start, upload.end)

    def finish(self, upload: Upload) -> list[Upload]:
        """Mark an upload sent (or aborted); return the uploads to start next."""
        if self._active.pop(upload.ticket, None) is not None:
            self.bytes_served += upload.end - upload.start
        return self._grant()

    def cancel(self, requester: str, index: int | None = None) -> list[Upload]:
        """Drop queued requests of ``requester`` (for one shard, or all of them)."""
        self._queue = deque(
            u
            for u in self._queue
            if not (u.requester == requester and (index is None or u.index == index))
        )
        return self._grant()

    def manifest(self, shard_bytes: int, *, num_shards: int | None = None) -> Manifest:
        """Build the manifest of the served state for ``shard_bytes`` (reads it all once)."""
        build = getattr(self.source, "manifest", None)
        if callable(build):
            result = build(shard_bytes, num_shards=num_shards)
            assert isinstance(result, Manifest)
            return result
        return Manifest.build(
            self.source.read(0, self.total_bytes), shard_bytes, num_shards=num_shards
        )

    def _grant(self) -> list[Upload]:
        out = []
        while self._queue and len(self._active) < self.max_concurrent_uploads:
            u = self._queue.popleft()
            self._active[u.ticket] = u
            out.append(u)
        return out
