"""The planner with the joiner's downlink cap (``ingress``): the pacing model of the module doc.

Model: the donors that carry shards are paced to the max-min fair share of ``B``
(``r_u = min(b_u, theta)``, ``sum r_u = B`` when the pipe would saturate), and
``C_u = a_u + k_u * (s / r_u + o_u)``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos_flwr.planner import Donor, TransferPlan, lower_bound, plan_transfer

REL = 1e-12


def fair_share(bandwidths: Sequence[float], cap: float) -> list[float]:
    """Max-min fair split of ``cap`` by bisection on theta (independent of the planner)."""
    if sum(bandwidths) <= cap:
        return list(bandwidths)
    lo, hi = 0.0, max(bandwidths)
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(min(b, mid) for b in bandwidths) < cap:
            lo = mid
        else:
            hi = mid
    return [min(b, hi) for b in bandwidths]


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def check_model(plan: TransferPlan, total: int, donors: Sequence[Donor], cap: float) -> None:
    by_id = {d.id: d for d in donors}
    flat = sorted(i for r in plan.assignment.values() for i in r)
    assert flat == list(range(plan.num_shards))
    assert sum(plan.bytes_by_donor().values()) == total
    assert set(plan.rates) == set(plan.assignment) == set(plan.finish_times)
    used = sorted(plan.assignment)
    # Grants: never above the donor's link, together never above the pipe, max-min fair.
    assert sum(plan.rates.values()) <= cap * (1 + REL)
    expect = fair_share([by_id[u].bandwidth for u in used], cap)
    for u, r in zip(used, expect, strict=True):
        assert plan.rates[u] <= by_id[u].bandwidth
        assert plan.rates[u] == pytest.approx(r, rel=1e-9)
    for u, t in plan.finish_times.items():
        d = by_id[u]
        n = len(plan.assignment[u])
        assert t == d.ready + d.latency + n * (plan.shard_bytes / plan.rates[u] + d.overhead)
    assert plan.makespan == max(plan.finish_times.values())
    assert plan.makespan >= lower_bound(total, donors, ingress=cap) * (1 - REL)
    assert plan.ingress == cap


@st.composite
def instances(draw: st.DrawFn) -> tuple[int, list[Donor], float]:
    n = draw(st.integers(1, 8))
    donors = [
        Donor(
            id=f"d{i}",
            bandwidth=draw(st.floats(1e3, 1e8)),
            latency=draw(st.floats(0.0, 0.1)),
            ready=draw(st.just(0.0) | st.floats(0.0, 3.0)),
            overhead=draw(st.just(0.0) | st.floats(0.0, 0.01)),
        )
        for i in range(n)
    ]
    total = draw(st.integers(1, 10**9))
    cap = sum(d.bandwidth for d in donors) * draw(st.floats(0.01, 1.5))
    return total, donors, cap


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), kmax=st.sampled_from([1, 8, 64, 512]))
def test_ingress_plans_follow_the_model(inst: tuple[int, list[Donor], float], kmax: int) -> None:
    total, donors, cap = inst
    plan = plan_transfer(total, donors, ingress=cap, max_shards=kmax, min_shard_bytes=1)
    check_model(plan, total, donors, cap)
    free = plan_transfer(total, donors, max_shards=kmax, min_shard_bytes=1)
    assert plan.makespan >= free.makespan


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(), k=st.integers(1, 64))
def test_refinement_never_loses_to_sharing_with_everyone(
    inst: tuple[int, list[Donor], float], k: int
) -> None:
    # Round one of the fixed point: every donor granted its fair share, exact assignment.
    total, donors, cap = inst
    grants = fair_share([d.bandwidth for d in donors], cap)
    everyone = [dataclasses.replace(d, bandwidth=g) for d, g in zip(donors, grants, strict=True)]
    first = plan_transfer(total, everyone, chain=[k], max_shards=k, min_shard_bytes=1)
    plan = plan_transfer(total, donors, chain=[k], max_shards=k, ingress=cap, min_shard_bytes=1)
    assert plan.makespan <= first.makespan * (1 + 1e-9)


def test_uncapped_when_the_pipe_cannot_saturate() -> None:
    rng = random.Random(6)
    for _ in range(50):
        donors = [
            Donor(f"d{i}", rng.uniform(1e3, 1e6), rng.uniform(0, 0.1), rng.uniform(0, 1))
            for i in range(rng.randint(1, 10))
        ]
        total = rng.randint(1, 10**8)
        free = plan_transfer(total, donors, min_shard_bytes=1, max_shards=256)
        cap = sum(d.bandwidth for d in donors) * rng.uniform(1.0, 3.0)
        capped = plan_transfer(total, donors, ingress=cap, min_shard_bytes=1, max_shards=256)
        assert dataclasses.replace(capped, ingress=None) == free


def test_assignment_is_exact_for_the_final_grants() -> None:
    rng = random.Random(17)
    for _ in range(120):
        m = rng.randint(1, 4)
        donors = [
            Donor(f"d{i}", rng.uniform(1e3, 1e5), rng.uniform(0, 0.1), rng.choice([0, 1.0]))
            for i in range(m)
        ]
        total = rng.randint(1, 10**6)
        cap = sum(d.bandwidth for d in donors) * rng.uniform(0.05, 1.0)
        k = rng.randint(1, 8)
        plan = plan_transfer(total, donors, chain=[k], ingress=cap, min_shard_bytes=1)
        check_model(plan, total, donors, cap)
        used = sorted(plan.assignment)
        by_id = {d.id: d for d in donors}
        s = plan.shard_bytes
        best = min(
            max(
                by_id[u].ready + by_id[u].latency + n * (s / plan.rates[u] + by_id[u].overhead)
                for u, n in zip(used, counts, strict=True)
                if n
            )
            for counts in compositions(k, len(used))
        )
        assert plan.makespan == pytest.approx(best, rel=1e-12)


def test_tiny_pipe_serialises_the_transfer() -> None:
    donors = [Donor(f"d{i}", 1e6, latency=0.02) for i in range(5)]
    cap = 1000.0
    for k in (1, 7, 64):
        plan = plan_transfer(10**5, donors, chain=[k], ingress=cap, min_shard_bytes=1)
        check_model(plan, 10**5, donors, cap)
        s = plan.shard_bytes
        used = len(plan.assignment)
        # Equal donors share the pipe evenly: at most one shard time (at the grant) above W/B.
        assert plan.makespan >= 0.02 + k * s / cap * (1 - REL)
        assert plan.makespan <= 0.02 + k * s / cap + s * used / cap + 1e-9


def test_late_donor_under_a_shared_pipe_is_dropped_and_its_share_reused() -> None:
    # With all three sharing, each would get B/3; the late one cannot help, so the two early
    # donors end up with B/2 each and the plan says so.
    donors = [Donor("a", 1e6), Donor("b", 1e6), Donor("late", 1e6, ready=1000.0)]
    plan = plan_transfer(10**6, donors, chain=[2], ingress=1e5, min_shard_bytes=1)
    assert set(plan.assignment) == {"a", "b"}
    assert plan.rates == {"a": 5e4, "b": 5e4}
    assert plan.makespan == pytest.approx(10.0)
    assert lower_bound(10**6, donors, ingress=1e5) == pytest.approx(10.0)


def test_ingress_lower_bound_counts_the_earliest_start() -> None:
    donors = [Donor("a", 1e9, latency=0.5, ready=0.5), Donor("b", 1e9, latency=3.0)]
    assert lower_bound(10**6, donors, ingress=1e6) == pytest.approx(2.0)
    plan = plan_transfer(10**6, donors, ingress=1e6, min_shard_bytes=1)
    assert plan.makespan >= 2.0


def test_every_order_and_call_gives_the_same_ingress_plan() -> None:
    rng = random.Random(2)
    donors = [Donor(f"d{i}", rng.uniform(1e5, 1e7), rng.uniform(0, 0.08)) for i in range(12)]
    first = plan_transfer(10**9, donors, ingress=3e6)
    for _ in range(5):
        shuffled = donors[:]
        rng.shuffle(shuffled)
        assert plan_transfer(10**9, shuffled, ingress=3e6) == first
