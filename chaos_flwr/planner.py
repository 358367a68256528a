"""The optimal shard planner: how many shards, and which donor sends which.

A joining (or recovering) party needs ``W`` bytes of training state, held by several donors.
Donor ``u`` has bandwidth ``b_u`` (bytes/s), latency ``l_u`` (s), a time ``tau_u`` until it is
free (s) and a per-shard overhead ``o_u`` (s). The state is cut into ``K`` equal shards of
``s = ceil(W / K)`` bytes (every shard is costed at ``s`` in the model, even the short last one);
donor ``u`` sends ``k_u`` of them and finishes at::

    C_u = (tau_u + l_u) + k_u * (s / b_u + o_u)      (C_u = 0 when k_u = 0)

and the plan minimises the makespan ``T = max_u C_u`` subject to ``sum_u k_u = K``, with ``K``
on a divisibility chain ``K_1 | K_2 | ...`` (default: the powers of two up to ``max_shards``),
cut so that ``s >= min_shard_bytes`` and ``K <= max_shards``.

Exactness for one ``K``
-----------------------
Write ``a_u = tau_u + l_u`` and ``c_u = s / b_u + o_u``. For a fixed ``K`` the problem is
"identical unit jobs on uniform machines with ready times": a set of ``K`` items with
``k_u`` items from donor ``u`` costs ``max_u (a_u + k_u c_u)``, so the optimum takes the ``K``
smallest values of the multiset ``{a_u + j c_u : u, j >= 1}`` and its makespan is the ``K``-th
smallest value. Proof sketch: any plan contains, for each donor, the prefix ``j = 1..k_u`` of that
donor's (non-decreasing) sequence, so its makespan is the largest of ``K`` distinct items, which
is at least the ``K``-th smallest item; the ``K`` smallest items themselves form prefixes and
reach that value. The values are evaluated exactly as written, ``a_u + j * c_u`` in IEEE-754
double arithmetic, which is non-decreasing in ``j``, so the statement holds for the floats too.

Ties are broken by the total order ``(value, larger bandwidth, donor id, j)``: the chosen ``K``
items are the ``K`` first items in that order, which is precisely what the earliest-finish greedy
with a heap keyed on ``(next finish, -bandwidth, id)`` pops. We do not pop ``K`` times: a
water-filling step finds the continuous threshold ``T*`` with ``sum_u (T* - a_u)^+ / c_u = K``;
every threshold set ``{items with value < T}`` is a prefix of the total order, and the one at
``T*`` holds more than ``K - m`` and fewer than ``K`` items. Counts per donor at that threshold
are found in O(1) each (a floor, then exact float comparisons), and at most ``m`` heap pops
finish the job. If rounding ever made the threshold set larger than ``K`` the code falls back
to popping from zero, so the result is always the greedy's, never an approximation.

The chain
---------
Along a chain the chosen ``num_shards`` minimises the makespan (ties: fewer shards). With zero
overheads and ``K_max | W`` refining never hurts, so the makespan is non-increasing along the
chain; when ``K`` does not divide ``W`` the rounded shard size ``ceil(W / K)`` can make a finer
``K`` worse, which is why every point is scanned (``O(log K_max)`` points).

Ingress (the joiner's own downlink ``B``)
-----------------------------------------
With ``ingress=B`` the joiner *paces* the donors it uses so that their combined rate never
exceeds ``B``: donor ``u`` in the used set ``U`` is granted the max-min fair share
``r_u = min(b_u, theta)``, where ``theta`` solves ``sum_{u in U} min(b_u, theta) = B``
(``theta = inf`` when ``sum_{u in U} b_u <= B``, i.e. the pipe cannot saturate). Grants are fixed
for the transfer (receiver-side pacing realises them), and each donor is costed on its own link
at its grant::

    C_u = a_u + k_u * (s / r_u + o_u)

This model is physically honest: the pipe never carries more than ``B`` and no donor sends
faster than its own link, so a real transfer can meet these finish times (a work-conserving pipe
that hands a finished donor's share to the others could only be earlier). It implies
``T >= min_u a_u + K s / B >= min_u a_u + W / B`` (every used donor sends ``k_u s`` bytes at
``r_u`` inside ``[min a, T]`` and ``sum r_u <= B``) and ``T`` is at least the water-filling bound
(``r_u <= b_u``), so a plan is never below :func:`lower_bound`.

What is proven: for each ``K`` the planner starts with ``U`` = all donors and repeats "assign
exactly optimally for the grants of ``U``; drop the donors that received no shard" until ``U`` is
stable (at most ``m`` rounds). Each round is exactly optimal for its grants, and the makespan
never increases from one round to the next (the previous assignment is still valid and only got
faster grants). When ``sum_u b_u <= B`` the plan is the unconstrained optimum. Not proven: that the
fixed point is optimal over every possible choice of ``U`` and grant vector.

All functions here are pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .defaults import PLANNER_MAX_SHARDS, PLANNER_MIN_SHARD_BYTES
from .errors import PlanError

__all__ = ["Donor", "TransferPlan", "default_chain", "lower_bound", "plan_transfer"]


@dataclass(frozen=True)
class Donor:
    """A party that holds the state and can send shards of it.

    Parameters
    ----------
    id : str
        The donor's party id (unique within one planning call).
    bandwidth : float
        Bytes per second the donor can send to the joiner (> 0, finite).
    latency : float, optional
        One-way delay before the first byte arrives, in seconds (>= 0, finite).
    ready : float, optional
        Seconds until the donor is free to start sending (>= 0, finite).
    overhead : float, optional
        Fixed cost per shard in seconds (request handling, hashing), >= 0, finite.

    Notes
    -----
    Values are checked when the donor is planned with (:func:`plan_transfer`,
    :func:`lower_bound`), which raise :class:`~chaos_flwr.errors.PlanError` naming the field.
    """

    id: str
    bandwidth: float
    latency: float = 0.0
    ready: float = 0.0
    overhead: float = 0.0


@dataclass(frozen=True)
class TransferPlan:
    """The result of :func:`plan_transfer`.

    Attributes
    ----------
    num_shards : int
        ``K``, the number of shards (0 for an empty transfer).
    shard_bytes : int
        ``ceil(total_bytes / num_shards)``; shard ``i`` covers ``[i*s, min((i+1)*s, W))``.
    assignment : Mapping[str, Sequence[int]]
        Donor id -> the shard indices it sends (a contiguous, ascending run). Together the values
        partition ``range(num_shards)``. Donors that send nothing are absent.
    makespan : float
        ``max(finish_times.values())`` (0.0 for an empty transfer), in seconds.
    finish_times : Mapping[str, float]
        Donor id -> ``ready + latency + k_u * (shard_bytes / rate + overhead)`` for used donors.
    total_bytes : int or None
        ``W``; ``None`` means ``num_shards * shard_bytes`` (for plans built by hand).
    rates : Mapping[str, float]
        Donor id -> the rate in bytes/s the model costs it at: its bandwidth, or its ingress grant
        when an ingress cap is in force. Empty for plans built by hand (bandwidth unknown).
    ingress : float or None
        The joiner's downlink cap the plan was made for, if any.
    """

    num_shards: int
    shard_bytes: int
    assignment: Mapping[str, Sequence[int]]
    makespan: float
    finish_times: Mapping[str, float]
    total_bytes: int | None = None
    rates: Mapping[str, float] = field(default_factory=dict)
    ingress: float | None = None

    def _total(self) -> int:
        if self.total_bytes is None:
            return self.num_shards * self.shard_bytes
        return self.total_bytes

    def shard_range(self, index: int) -> tuple[int, int]:
        """Return the byte range ``[start, end)`` of shard ``index``.

        Parameters
        ----------
        index : int
            A shard index in ``range(num_shards)``.

        Returns
        -------
        tuple of int
            ``(start, end)``; the last shards may be short or, when ``K`` does not divide the
            state evenly, empty (``start == end == total_bytes``).

        Raises
        ------
        PlanError
            If ``index`` is outside ``range(num_shards)``.
        """
        if not 0 <= index < self.num_shards:
            raise PlanError(
                f"index: shard {index} is outside range({self.num_shards}); "
                "ask for a shard of this plan"
            )
        total = self._total()
        start = min(index * self.shard_bytes, total)
        return start, min(start + self.shard_bytes, total)

    def bytes_by_donor(self) -> dict[str, int]:
        """Return donor id -> number of real bytes it sends (short last shards counted short)."""
        out: dict[str, int] = {}
        for donor, shards in self.assignment.items():
            n = 0
            for i in shards:
                start, end = self.shard_range(i)
                n += end - start
            out[donor] = n
        return out

    def shards_of(self, donor_id: str) -> tuple[int, ...]:
        """Return the shard indices ``donor_id`` sends (empty if it sends none)."""
        return tuple(self.assignment.get(donor_id, ()))


# --- validation ------------------------------------------------------------------------------


def _check_time(value: Any, name: str, donor_id: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"{name}: donor {donor_id!r} has {value!r}; give a number of seconds >= 0")
    v = float(value)
    if not math.isfinite(v) or v < 0.0:
        raise PlanError(f"{name}: donor {donor_id!r} has {value!r}; must be finite and >= 0")
    return v


def _check_donors(donors: Sequence[Donor]) -> list[tuple[str, float, float, float, float]]:
    """Validate donors; return ``(id, bandwidth, a = ready + latency, overhead, ready)``."""
    if isinstance(donors, (str, bytes)) or not isinstance(donors, Sequence):
        raise PlanError("donors: expected a sequence of Donor; pass a list of Donor objects")
    if len(donors) == 0:
        raise PlanError("donors: no donors given; at least one party holding the state is needed")
    seen: set[str] = set()
    out: list[tuple[str, float, float, float, float]] = []
    for d in donors:
        if not isinstance(d, Donor):
            raise PlanError(f"donors: {d!r} is not a Donor; build donors with Donor(...)")
        if not isinstance(d.id, str) or not d.id:
            raise PlanError(f"id: donor id {d.id!r} must be a non-empty str")
        if d.id in seen:
            raise PlanError(f"id: duplicate donor id {d.id!r}; each donor must appear once")
        seen.add(d.id)
        bw = d.bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (int, float)):
            raise PlanError(f"bandwidth: donor {d.id!r} has {bw!r}; give bytes/s as a number > 0")
        b = float(bw)
        if not math.isfinite(b) or b <= 0.0:
            raise PlanError(f"bandwidth: donor {d.id!r} has {bw!r}; must be finite and > 0 bytes/s")
        latency = _check_time(d.latency, "latency", d.id)
        ready = _check_time(d.ready, "ready", d.id)
        overhead = _check_time(d.overhead, "overhead", d.id)
        out.append((d.id, b, ready + latency, overhead, ready))
    return out


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        raise PlanError(f"{name}: got a bool; give an int >= {minimum}")
    try:
        v = operator.index(value)
    except TypeError:
        raise PlanError(f"{name}: got {value!r}; give an int >= {minimum}") from None
    if v < minimum:
        raise PlanError(f"{name}: got {v}; must be an int >= {minimum}")
    return v


def _check_ingress(ingress: Any) -> float | None:
    if ingress is None:
        return None
    if isinstance(ingress, bool) or not isinstance(ingress, (int, float)):
        raise PlanError(f"ingress: got {ingress!r}; give the joiner's downlink in bytes/s or None")
    b = float(ingress)
    if not math.isfinite(b) or b <= 0.0:
        raise PlanError(f"ingress: got {ingress!r}; must be finite and > 0 bytes/s (or None)")
    return b


def default_chain(total_bytes: int, max_shards: int, min_shard_bytes: int) -> list[int]:
    """Return the default divisibility chain: powers of two ``<= max_shards``, cut by shard size.

    Parameters
    ----------
    total_bytes : int
        ``W`` (> 0).
    max_shards : int
        Largest shard count (>= 1).
    min_shard_bytes : int
        Smallest allowed ``ceil(W / K)`` (>= 1).

    Returns
    -------
    list of int
        ``[1, 2, 4, ...]``; always at least ``[1]``.
    """
    chain = [1]
    k = 2
    while k <= max_shards and -(-total_bytes // k) >= min_shard_bytes:
        chain.append(k)
        k *= 2
    return chain


def _check_chain(
    chain: Sequence[int], total_bytes: int, max_shards: int, min_shard_bytes: int
) -> list[int]:
    if isinstance(chain, (str, bytes)) or not isinstance(chain, Sequence):
        raise PlanError("chain: expected a sequence of shard counts such as [1, 2, 4, 8]")
    if len(chain) == 0:
        raise PlanError("chain: empty; give at least one shard count, e.g. [1]")
    ks = [_check_int(k, "chain", 1) for k in chain]
    for prev, nxt in itertools.pairwise(ks):
        if nxt <= prev or nxt % prev != 0:
            raise PlanError(
                f"chain: {prev} -> {nxt} breaks the divisibility chain; each count must be a "
                "strictly larger multiple of the one before (K_i | K_(i+1))"
            )
    capped = [k for k in ks if k <= max_shards]
    if not capped:
        raise PlanError(
            f"chain: every count exceeds max_shards={max_shards}; raise max_shards or give "
            "smaller counts"
        )
    cut = [k for k in capped if -(-total_bytes // k) >= min_shard_bytes]
    # The state may be smaller than one minimum shard: keep the coarsest count then.
    return cut if cut else capped[:1]


# --- the core --------------------------------------------------------------------------------


def _fair_grants(bandwidths: Sequence[float], ingress: float) -> list[float]:
    """Max-min fair split of ``ingress`` among flows capped at ``bandwidths`` (same order)."""
    if math.fsum(bandwidths) <= ingress:
        return list(bandwidths)
    order = sorted(range(len(bandwidths)), key=bandwidths.__getitem__)
    left = ingress
    grants = list(bandwidths)
    n = len(order)
    theta = 0.0
    for pos, i in enumerate(order):
        share = left / (n - pos)
        if bandwidths[i] <= share:
            left -= bandwidths[i]
            continue
        theta = share
        for j in order[pos:]:
            grants[j] = theta
        break
    return grants


class _Chooser:
    """Exact K-smallest selection for one donor set (donors pre-sorted by priority)."""

    __slots__ = ("a", "by_a", "m", "over", "rate")

    def __init__(self, a: list[float], rate: list[float], over: list[float]) -> None:
        self.a = a
        self.rate = rate
        self.over = over
        self.m = len(a)
        self.by_a = sorted(range(self.m), key=a.__getitem__)

    def counts(self, k_total: int, shard: int) -> tuple[float, list[int]]:
        """Return ``(makespan, counts)`` of the greedy for ``K = k_total`` shards of ``shard``."""
        a = self.a
        over = self.over
        m = self.m
        c = [shard / r + o for r, o in zip(self.rate, over, strict=True)]
        # Continuous water level: sum over active donors of (T - a_u) / c_u = K.
        by_a = self.by_a
        inv_sum = 0.0
        a_inv_sum = 0.0
        level = 0.0
        for pos in range(m):
            u = by_a[pos]
            inv = 1.0 / c[u]
            inv_sum += inv
            a_inv_sum += a[u] * inv
            level = (k_total + a_inv_sum) / inv_sum
            if pos + 1 == m or level <= a[by_a[pos + 1]]:
                break
        counts = [0] * m
        taken = 0
        for u in range(m):
            au = a[u]
            if au >= level:
                continue
            cu = c[u]
            n = math.ceil((level - au) / cu) - 1
            if n < 0:
                n = 0
            while n > 0 and au + n * cu >= level:
                n -= 1
            while au + (n + 1) * cu < level:
                n += 1
            counts[u] = n
            taken += n
        if taken > k_total:  # rounding pushed the threshold set past K: exact fallback
            counts = [0] * m
            taken = 0
        need = k_total - taken
        if need == 0:
            return max(a[u] + counts[u] * c[u] for u in range(m) if counts[u]), counts
        heap = [(a[u] + (counts[u] + 1) * c[u], u) for u in range(m)]
        heapq.heapify(heap)
        value = 0.0
        while need:
            value, u = heap[0]
            n = counts[u] + 1
            counts[u] = n
            need -= 1
            if need:
                heapq.heapreplace(heap, (a[u] + (n + 1) * c[u], u))
        return value, counts


@dataclass(frozen=True)
class _Choice:
    makespan: float
    num_shards: int
    shard_bytes: int
    members: tuple[int, ...]  # indices into the priority-sorted donor list
    counts: tuple[int, ...]
    rates: tuple[float, ...]


def _plan_one_k(
    k_total: int,
    shard: int,
    info: list[tuple[str, float, float, float, float]],
    chooser: _Chooser | None,
    ingress: float | None,
) -> _Choice:
    if ingress is None:
        assert chooser is not None
        value, counts = chooser.counts(k_total, shard)
        members = tuple(range(len(info)))
        return _Choice(value, k_total, shard, members, tuple(counts), tuple(chooser.rate))
    # Fixed point: grants for the current donor set, exact assignment, drop unused donors.
    # The set only shrinks, so this ends within m rounds; the last round's grants are the
    # max-min fair share of the ingress among exactly the donors that carry shards.
    members = tuple(range(len(info)))
    while True:
        grants = _fair_grants([info[i][1] for i in members], ingress)
        sub = _Chooser([info[i][2] for i in members], grants, [info[i][3] for i in members])
        value, counts = sub.counts(k_total, shard)
        used = tuple(members[j] for j in range(len(members)) if counts[j])
        if len(used) == len(members):
            return _Choice(value, k_total, shard, members, tuple(counts), tuple(grants))
        members = used


def _empty_plan(ingress: float | None) -> TransferPlan:
    return TransferPlan(
        num_shards=0,
        shard_bytes=0,
        assignment={},
        makespan=0.0,
        finish_times={},
        total_bytes=0,
        rates={},
        ingress=ingress,
    )


def plan_transfer(
    total_bytes: int,
    donors: Sequence[Donor],
    *,
    max_shards: int = PLANNER_MAX_SHARDS,
    min_shard_bytes: int = PLANNER_MIN_SHARD_BYTES,
    chain: Sequence[int] | None = None,
    ingress: float | None = None,
) -> TransferPlan:
    """Plan a multi-source transfer of ``total_bytes`` with the least makespan.

    Parameters
    ----------
    total_bytes : int
        ``W``, the size of the state in bytes (>= 0).
    donors : Sequence[Donor]
        The parties that can send it (at least one, unique ids).
    max_shards : int, optional
        Largest shard count considered (>= 1); caps the chain.
    min_shard_bytes : int, optional
        Smallest shard size (>= 1); chain points with ``ceil(W / K) < min_shard_bytes`` are
        dropped, except that the coarsest point is kept when every point would be dropped.
    chain : Sequence[int] or None, optional
        Shard counts to consider, ``K_1 | K_2 | ...`` strictly increasing; ``None`` means the
        powers of two up to ``max_shards``.
    ingress : float or None, optional
        The joiner's own downlink in bytes/s, shared by all donors (see the module docstring for
        the pacing model); ``None`` means no cap.

    Returns
    -------
    TransferPlan
        The plan; for ``total_bytes == 0`` an empty plan with makespan 0.

    Raises
    ------
    PlanError
        Naming the bad field: no donors, non-positive/NaN/infinite bandwidth, negative or
        non-finite times, duplicate ids, ``total_bytes < 0``, a bad chain or limit, bad ingress.
    """
    info = _check_donors(donors)
    w = _check_int(total_bytes, "total_bytes", 0)
    kmax = _check_int(max_shards, "max_shards", 1)
    smin = _check_int(min_shard_bytes, "min_shard_bytes", 1)
    cap = _check_ingress(ingress)
    if chain is not None:
        ks = _check_chain(chain, max(w, 1), kmax, smin)
    else:
        ks = default_chain(max(w, 1), kmax, smin)
    if w == 0:
        return _empty_plan(cap)
    # Priority order: larger bandwidth first, then donor id. Positions in this order are the
    # secondary heap key, so equal finish values resolve exactly as the issue prescribes.
    info.sort(key=lambda t: (-t[1], t[0]))
    chooser = (
        _Chooser([t[2] for t in info], [t[1] for t in info], [t[3] for t in info])
        if cap is None
        else None
    )
    best: _Choice | None = None
    for k in ks:
        shard = -(-w // k)
        choice = _plan_one_k(k, shard, info, chooser, cap)
        if best is None or choice.makespan < best.makespan:
            best = choice
    assert best is not None
    return _plan_of(best, info, w, cap)


def _plan_of(
    best: _Choice,
    info: list[tuple[str, float, float, float, float]],
    total_bytes: int,
    cap: float | None,
) -> TransferPlan:
    """The plan of the chosen shard count: consecutive shard ranges in priority order."""
    assignment: dict[str, tuple[int, ...]] = {}
    finish: dict[str, float] = {}
    rates: dict[str, float] = {}
    start = 0
    for j, idx in enumerate(best.members):
        n = best.counts[j]
        if n == 0:
            continue
        name, _bw, a, over, _ready = info[idx]
        rate = best.rates[j]
        assignment[name] = tuple(range(start, start + n))
        finish[name] = a + n * (best.shard_bytes / rate + over)
        rates[name] = rate
        start += n
    return TransferPlan(
        num_shards=best.num_shards,
        shard_bytes=best.shard_bytes,
        assignment=assignment,
        makespan=max(finish.values()),
        finish_times=finish,
        total_bytes=total_bytes,
        rates=rates,
        ingress=cap,
    )


def lower_bound(total_bytes: int, donors: Sequence[Donor], ingress: float | None = None) -> float:
    """Return the continuous lower bound on any plan's makespan.

    The water level ``T`` with ``sum_u b_u * max(0, T - ready_u - latency_u) = W`` (bytes flow
    continuously, no shard rounding, no overheads), raised to ``min_u(ready_u + latency_u) + W/B``
    when an ingress cap ``B`` is given.

    Parameters
    ----------
    total_bytes : int
        ``W`` (>= 0); the bound is 0.0 for ``W == 0``.
    donors : Sequence[Donor]
        As for :func:`plan_transfer`.
    ingress : float or None, optional
        The joiner's downlink in bytes/s.

    Returns
    -------
    float
        The bound in seconds.

    Raises
    ------
    PlanError
        On the same bad input as :func:`plan_transfer`.
    """
    info = _check_donors(donors)
    w = _check_int(total_bytes, "total_bytes", 0)
    cap = _check_ingress(ingress)
    if w == 0:
        return 0.0
    pts = sorted((t[2], t[1]) for t in info)
    b_sum = 0.0
    ab_sum = 0.0
    level = 0.0
    for pos, (a, b) in enumerate(pts):
        b_sum += b
        ab_sum += a * b
        level = (w + ab_sum) / b_sum
        if pos + 1 == len(pts) or level <= pts[pos + 1][0]:
            break
    if cap is not None:
        level = max(level, pts[0][0] + w / cap)
    return level
