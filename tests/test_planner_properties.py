"""Hypothesis properties of the shard planner.

The upper bound tested here ("lower bound + max shard time") in its exact form: for the chosen
``K`` with ``s = ceil(W / K)`` and ``c_u = s / b_u + o_u``, let ``T_c`` solve the continuous
``sum_u (T_c - a_u)^+ / c_u = K``. Then ``makespan <= T_c + max{c_u : a_u < T_c}`` (each donor
active at ``T_c`` finishes ``floor((T_c - a_u) / c_u + c_max / c_u) >= (T_c - a_u) / c_u`` shards
by ``T_c + c_max``, which sums to at least ``K``). With zero overheads ``T_c`` is
``lower_bound(K * s)`` and the extra term is the longest one-shard time ``s / b_u`` of a donor
ready before it; when ``K`` divides ``W`` this is literally
``lower_bound(W) <= makespan <= lower_bound(W) + max shard time``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos_flwr.planner import Donor, TransferPlan, lower_bound, plan_transfer

REL = 1e-9
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def donor_lists(draw: st.DrawFn, *, overheads: bool = True, max_size: int = 10) -> list[Donor]:
    n = draw(st.integers(1, max_size))
    out = []
    for i in range(n):
        out.append(
            Donor(
                id=draw(st.sampled_from(["a", "b", "c", "x", "zz", "m"])) + str(i),
                bandwidth=draw(st.sampled_from([1e3, 1e6]) | st.floats(1.0, 1e9)),
                latency=draw(st.sampled_from([0.0, 0.05]) | st.floats(0.0, 1.0)),
                ready=draw(st.just(0.0) | st.floats(0.0, 10.0)),
                overhead=draw(st.just(0.0) | st.floats(0.0, 0.1)) if overheads else 0.0,
            )
        )
    return out


totals = st.integers(1, 10**10)
max_shards = st.sampled_from([1, 2, 16, 64, 256])


def continuous_level(donors: Sequence[Donor], k: int, s: int) -> tuple[float, float]:
    """(T_c, c_max) by bisection, independently of the planner's water-filling."""
    pts = [(d.ready + d.latency, s / d.bandwidth + d.overhead) for d in donors]

    def units(t: float) -> float:
        return sum(max(0.0, t - a) / c for a, c in pts)

    lo = min(a for a, _ in pts)
    hi = lo + 1.0
    while units(hi) < k:
        hi = lo + 2 * (hi - lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if units(mid) < k:
            lo = mid
        else:
            hi = mid
    return hi, max(c for a, c in pts if a < hi)


def check_partition(plan: TransferPlan, total: int) -> None:
    flat = sorted(i for r in plan.assignment.values() for i in r)
    assert flat == list(range(plan.num_shards))
    for r in plan.assignment.values():
        assert list(r) == list(range(r[0], r[0] + len(r)))
    assert sum(plan.bytes_by_donor().values()) == total


@SETTINGS
@given(total=totals, donors=donor_lists(), kmax=max_shards)
def test_partition_and_finish_times(total: int, donors: list[Donor], kmax: int) -> None:
    plan = plan_transfer(total, donors, max_shards=kmax, min_shard_bytes=1)
    check_partition(plan, total)
    assert 1 <= plan.num_shards <= kmax
    by_id = {d.id: d for d in donors}
    for u, t in plan.finish_times.items():
        d = by_id[u]
        n = len(plan.assignment[u])
        assert t == d.ready + d.latency + n * (plan.shard_bytes / d.bandwidth + d.overhead)
    assert plan.makespan == max(plan.finish_times.values())


@SETTINGS
@given(total=totals, donors=donor_lists(), kmax=max_shards, data=st.data())
def test_deterministic_and_order_free(
    total: int, donors: list[Donor], kmax: int, data: st.DataObject
) -> None:
    first = plan_transfer(total, donors, max_shards=kmax, min_shard_bytes=1)
    again = plan_transfer(total, list(donors), max_shards=kmax, min_shard_bytes=1)
    permuted = data.draw(st.permutations(donors))
    other = plan_transfer(total, permuted, max_shards=kmax, min_shard_bytes=1)
    assert first == again == other


@SETTINGS
@given(
    q=st.integers(1, 10**6),
    donors=donor_lists(overheads=False),
    log_kmax=st.integers(0, 9),
)
def test_monotone_along_chain_without_overheads(q: int, donors: list[Donor], log_kmax: int) -> None:
    # Refining never hurts when every chain point divides W (no shard rounding).
    chain = [2**i for i in range(log_kmax + 1)]
    total = q * chain[-1]
    spans = [
        plan_transfer(total, donors, chain=[k], max_shards=chain[-1], min_shard_bytes=1).makespan
        for k in chain
    ]
    for coarse, fine in itertools.pairwise(spans):
        assert fine <= coarse * (1 + REL)
    best = plan_transfer(total, donors, chain=chain, max_shards=chain[-1], min_shard_bytes=1)
    assert best.makespan == min(spans)


@SETTINGS
@given(total=totals, donors=donor_lists(overheads=False), kmax=max_shards)
def test_bounds_without_overheads(total: int, donors: list[Donor], kmax: int) -> None:
    plan = plan_transfer(total, donors, max_shards=kmax, min_shard_bytes=1)
    s, k = plan.shard_bytes, plan.num_shards
    lb = lower_bound(total, donors)
    assert lb <= plan.makespan * (1 + REL)
    lb_costed = lower_bound(k * s, donors)
    shard_time = max(s / d.bandwidth for d in donors if d.ready + d.latency < lb_costed)
    assert plan.makespan <= (lb_costed + shard_time) * (1 + REL)


@SETTINGS
@given(q=st.integers(1, 10**7), donors=donor_lists(overheads=False), log_k=st.integers(0, 8))
def test_bounds_when_k_divides_w(q: int, donors: list[Donor], log_k: int) -> None:
    k = 2**log_k
    total = q * k
    plan = plan_transfer(total, donors, chain=[k], max_shards=k, min_shard_bytes=1)
    lb = lower_bound(total, donors)
    shard_time = max(plan.shard_bytes / d.bandwidth for d in donors if d.ready + d.latency < lb)
    assert lb * (1 - REL) <= plan.makespan <= (lb + shard_time) * (1 + REL)


@SETTINGS
@given(total=totals, donors=donor_lists(), kmax=max_shards)
def test_bounds_with_overheads(total: int, donors: list[Donor], kmax: int) -> None:
    plan = plan_transfer(total, donors, max_shards=kmax, min_shard_bytes=1)
    assert lower_bound(total, donors) <= plan.makespan * (1 + REL)
    level, c_max = continuous_level(donors, plan.num_shards, plan.shard_bytes)
    assert plan.makespan <= (level + c_max) * (1 + REL)
    assert plan.makespan >= level * (1 - REL)
