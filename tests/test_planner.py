"""The shard planner: exactness against a reference greedy and brute force, chain, errors.

The MILP oracle lives in ``test_planner_milp.py``, the ingress model in
``test_planner_ingress.py`` and the hypothesis properties in ``test_planner_properties.py``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator, Sequence

import pytest

from chaos_flwr.errors import ChaosError, PlanError
from chaos_flwr.planner import Donor, TransferPlan, lower_bound, plan_transfer

BIG = 10**9  # a max_shards that never cuts a test chain


def fixed_k(total: int, donors: Sequence[Donor], k: int) -> TransferPlan:
    """The planner restricted to one shard count (a one-point chain, no size cut)."""
    return plan_transfer(total, donors, chain=[k], max_shards=BIG, min_shard_bytes=1)


def model_makespan(total: int, donors: Sequence[Donor], k: int, counts: dict[str, int]) -> float:
    """Makespan of a count vector in the DESIGN.md model, written out independently."""
    s = -(-total // k)
    best = 0.0
    for d in donors:
        n = counts.get(d.id, 0)
        if n:
            best = max(best, d.ready + d.latency + n * (s / d.bandwidth + d.overhead))
    return best


def reference_greedy(total: int, donors: Sequence[Donor], k: int) -> tuple[float, dict[str, int]]:
    """The issue's algorithm verbatim: K heap pops, ties to larger bandwidth then donor id."""
    s = -(-total // k)
    heap = []
    for d in donors:
        c = s / d.bandwidth + d.overhead
        heap.append((d.ready + d.latency + c, -d.bandwidth, d.id, 1, c, d.ready + d.latency))
    heapq.heapify(heap)
    counts: dict[str, int] = {}
    value = 0.0
    for _ in range(k):
        value, negb, name, j, c, a = heapq.heappop(heap)
        counts[name] = j
        heapq.heappush(heap, (a + (j + 1) * c, negb, name, j + 1, c, a))
    return value, counts


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def random_donors(rng: random.Random, m: int, *, ties: bool = True) -> list[Donor]:
    out = []
    for i in range(m):
        bw = rng.choice([1000.0, 2000.0]) if ties and rng.random() < 0.4 else rng.uniform(50, 5e4)
        out.append(
            Donor(
                id=f"d{rng.randrange(10**6)}-{i}",
                bandwidth=bw,
                latency=rng.choice([0.0, 0.01, rng.uniform(0, 0.5)]),
                ready=rng.choice([0.0, 0.0, rng.uniform(0, 5)]),
                overhead=rng.choice([0.0, rng.uniform(0, 0.05)]),
            )
        )
    return out


def counts_of(plan: TransferPlan) -> dict[str, int]:
    return {u: len(v) for u, v in plan.assignment.items() if len(v)}


# --- exactness -------------------------------------------------------------------------------


def test_brute_force_tiny_instances() -> None:
    rng = random.Random(11)
    for _ in range(250):
        m = rng.randint(1, 4)
        k = rng.randint(1, 9 if m <= 3 else 7)
        donors = random_donors(rng, m)
        total = rng.randint(1, 50_000)
        plan = fixed_k(total, donors, k)
        best = min(
            model_makespan(total, donors, k, {d.id: n for d, n in zip(donors, c, strict=True)})
            for c in compositions(k, m)
        )
        assert plan.num_shards == k
        assert plan.makespan == pytest.approx(best, rel=1e-12, abs=0.0)
        assert plan.makespan == model_makespan(total, donors, k, counts_of(plan))


def test_counts_equal_the_heap_greedy_with_its_tie_breaks() -> None:
    rng = random.Random(5)
    for _ in range(600):
        donors = random_donors(rng, rng.randint(1, 30))
        k = rng.randint(1, 700)
        total = rng.randint(1, 10**8)
        plan = fixed_k(total, donors, k)
        value, counts = reference_greedy(total, donors, k)
        assert counts_of(plan) == counts
        assert plan.makespan == value


def test_large_k_agrees_with_heap_greedy() -> None:
    rng = random.Random(99)
    for _ in range(5):
        donors = random_donors(rng, 100, ties=False)
        plan = fixed_k(1_500_000_000, donors, 4096)
        value, counts = reference_greedy(1_500_000_000, donors, 4096)
        assert counts_of(plan) == counts
        assert plan.makespan == value


def test_tie_prefers_larger_bandwidth_then_smaller_id() -> None:
    # s = 1 byte: A finishes shards at 1.0, 1.5, 2.0, ...; B at 1.0, 2.0, 3.0, ... (exact floats)
    # The faster donor has the larger id, so an id-only tie rule would give the other answer.
    a = Donor("z-fast", bandwidth=2.0, latency=0.5)
    b = Donor("a-slow", bandwidth=1.0)
    assert counts_of(fixed_k(1, [b, a], 1)) == {"z-fast": 1}
    assert counts_of(fixed_k(3, [b, a], 3)) == {"z-fast": 2, "a-slow": 1}
    assert counts_of(fixed_k(4, [b, a], 4)) == {"z-fast": 3, "a-slow": 1}  # tie at 2.0
    # Equal bandwidth and equal times: the smaller id wins the odd shard.
    x, y = Donor("x", 10.0), Donor("y", 10.0)
    assert counts_of(fixed_k(30, [y, x], 3)) == {"x": 2, "y": 1}


def test_exact_ties_everywhere_match_the_heap_greedy() -> None:
    # Zero start and power-of-two bandwidth ratios make many finish values exactly equal.
    rng = random.Random(13)
    for _ in range(400):
        donors = [
            Donor(f"{rng.randrange(10**6):06d}-{i}", rng.choice([1000.0, 2000.0, 4000.0]))
            for i in range(rng.randint(2, 9))
        ]
        k = rng.randint(1, 100)
        total = k * rng.randint(1, 1000)
        plan = fixed_k(total, donors, k)
        value, counts = reference_greedy(total, donors, k)
        assert counts_of(plan) == counts
        assert plan.makespan == value


def test_degenerate_float_ties_stay_exact() -> None:
    # ready dwarfs the per-shard cost, so a + j*c rounds to a for many j.
    donors = [Donor("late", 1e12, ready=1e6), Donor("slow", 1.0, ready=1e6 - 1e-3)]
    for k in (1, 2, 7, 64):
        plan = fixed_k(1000, donors, k)
        value, counts = reference_greedy(1000, donors, k)
        assert counts_of(plan) == counts
        assert plan.makespan == value


# --- chain -----------------------------------------------------------------------------------


def test_chain_choice_is_min_over_points_with_ties_to_fewer_shards() -> None:
    rng = random.Random(3)
    for _ in range(150):
        donors = random_donors(rng, rng.randint(1, 8))
        total = rng.randint(1, 10**6)
        chain = [1, 2, 4, 8, 24, 48, 96]
        plan = plan_transfer(total, donors, chain=chain, max_shards=BIG, min_shard_bytes=1)
        per_k = {k: fixed_k(total, donors, k).makespan for k in chain}
        best = min(per_k.values())
        assert plan.makespan == best
        assert plan.num_shards == min(k for k, v in per_k.items() if v == best)


def test_zero_overhead_single_donor_prefers_fewest_shards() -> None:
    # Every K costs the same when K | W, so the tie rule picks K = 1.
    plan = plan_transfer(1024, [Donor("a", 100.0)], max_shards=64, min_shard_bytes=1)
    assert plan.num_shards == 1
    assert plan.makespan == 1024 / 100.0


def test_rounding_can_make_a_finer_chain_point_worse() -> None:
    # W = 10, K = 8 gives s = 2 and costs 16 bytes; the planner must not take it.
    d = [Donor("a", 1.0)]
    assert fixed_k(10, d, 8).makespan == 16.0
    assert fixed_k(10, d, 1).makespan == 10.0
    assert plan_transfer(10, d, chain=[1, 8], min_shard_bytes=1).num_shards == 1


def test_overheads_make_the_planner_stop_refining() -> None:
    donors = [Donor("a", 1e6, overhead=0.5), Donor("b", 1e6, overhead=0.5)]
    plan = plan_transfer(10**7, donors, max_shards=1024, min_shard_bytes=1)
    assert plan.num_shards == 2  # one shard each; any finer split only adds overhead
    assert plan.makespan == pytest.approx(5.5)


def test_default_chain_is_cut_by_min_shard_bytes() -> None:
    donors = [Donor(f"d{i}", 1e6 * (i + 1)) for i in range(8)]
    plan = plan_transfer(1 << 20, donors, max_shards=4096, min_shard_bytes=64 * 1024)
    assert plan.num_shards <= 16
    assert plan.shard_bytes >= 64 * 1024
    plan = plan_transfer(1 << 20, donors, chain=[1, 4, 64, 256], min_shard_bytes=64 * 1024)
    assert plan.num_shards in (1, 4)


def test_user_chain_is_cut_by_min_shard_bytes() -> None:
    donors = [Donor(f"d{i}", 1e6) for i in range(64)]
    full = plan_transfer(1 << 20, donors, chain=[1, 4, 64], min_shard_bytes=1)
    assert full.num_shards == 64
    cut = plan_transfer(1 << 20, donors, chain=[1, 4, 64], min_shard_bytes=64 * 1024)
    assert cut.num_shards == 4


def test_state_smaller_than_min_shard_keeps_one_shard() -> None:
    plan = plan_transfer(100, [Donor("a", 10.0), Donor("b", 10.0)], min_shard_bytes=4096)
    assert plan.num_shards == 1
    assert plan.shard_bytes == 100
    plan = plan_transfer(100, [Donor("a", 10.0)], chain=[2, 4], min_shard_bytes=4096)
    assert plan.num_shards == 2


def test_max_shards_caps_the_default_chain() -> None:
    donors = [Donor(f"d{i}", 1e6) for i in range(300)]
    plan = plan_transfer(10**9, donors, max_shards=100, min_shard_bytes=1)
    assert plan.num_shards == 64


# --- plan structure --------------------------------------------------------------------------


def test_plan_partitions_shards_and_bytes() -> None:
    rng = random.Random(8)
    for _ in range(100):
        donors = random_donors(rng, rng.randint(1, 12))
        total = rng.randint(1, 10**7)
        plan = plan_transfer(
            total, donors, max_shards=rng.choice([1, 8, 64, 512]), min_shard_bytes=1
        )
        runs = sorted(plan.assignment.values(), key=lambda r: r[0])
        flat = [i for r in runs for i in r]
        assert flat == list(range(plan.num_shards))
        assert plan.shard_bytes == -(-total // plan.num_shards)
        assert sum(plan.bytes_by_donor().values()) == total
        assert set(plan.finish_times) == set(plan.assignment)
        assert plan.makespan == max(plan.finish_times.values())
        by_id = {d.id: d for d in donors}
        for u, t in plan.finish_times.items():
            d = by_id[u]
            k = len(plan.assignment[u])
            assert t == d.ready + d.latency + k * (plan.shard_bytes / d.bandwidth + d.overhead)


def test_shard_range_covers_the_state_and_rejects_bad_index() -> None:
    plan = plan_transfer(10, [Donor("a", 1.0)], chain=[6], min_shard_bytes=1)
    assert plan.shard_bytes == 2
    ranges = [plan.shard_range(i) for i in range(6)]
    assert ranges == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 10)]
    with pytest.raises(PlanError, match="index"):
        plan.shard_range(6)
    with pytest.raises(PlanError, match="index"):
        plan.shard_range(-1)
    assert plan.shards_of("a") == tuple(range(6))
    assert plan.shards_of("nobody") == ()


def test_zero_bytes_gives_an_empty_plan() -> None:
    plan = plan_transfer(0, [Donor("a", 1.0)])
    assert plan.num_shards == 0
    assert plan.makespan == 0.0
    assert dict(plan.assignment) == {}
    assert dict(plan.finish_times) == {}
    assert plan.bytes_by_donor() == {}
    assert lower_bound(0, [Donor("a", 1.0)]) == 0.0


def test_slow_late_donor_gets_nothing() -> None:
    donors = [Donor("fast", 1e6), Donor("late", 1e6, ready=100.0)]
    plan = plan_transfer(10**6, donors, min_shard_bytes=1)
    assert set(plan.assignment) == {"fast"}
    assert plan.makespan == pytest.approx(1.0)


def test_input_order_does_not_matter() -> None:
    rng = random.Random(21)
    for _ in range(50):
        donors = random_donors(rng, rng.randint(2, 10))
        total = rng.randint(1, 10**7)
        a = plan_transfer(total, donors, min_shard_bytes=1, max_shards=256)
        shuffled = donors[:]
        rng.shuffle(shuffled)
        b = plan_transfer(total, shuffled, min_shard_bytes=1, max_shards=256)
        assert a == b


def test_integer_inputs_are_accepted() -> None:
    plan = plan_transfer(1000, [Donor("a", 10, latency=1, ready=0, overhead=0)], min_shard_bytes=1)
    assert plan.makespan == pytest.approx(101.0)


# --- lower bound -----------------------------------------------------------------------------


def test_lower_bound_water_filling_by_hand() -> None:
    donors = [Donor("a", 100.0), Donor("b", 100.0, ready=2.0), Donor("c", 1.0, ready=1e6)]
    # a alone until t=2 carries 200 bytes; then both: 200 + 200 (T - 2) = 1000 -> T = 6.
    assert lower_bound(1000, donors) == pytest.approx(6.0)
    assert lower_bound(100, donors) == pytest.approx(1.0)
    assert lower_bound(1000, donors, ingress=50.0) == pytest.approx(20.0)
    assert lower_bound(1000, donors, ingress=1e9) == pytest.approx(6.0)


def test_lower_bound_never_exceeds_plan() -> None:
    rng = random.Random(4)
    for _ in range(300):
        donors = random_donors(rng, rng.randint(1, 10))
        total = rng.randint(1, 10**7)
        plan = plan_transfer(total, donors, min_shard_bytes=1, max_shards=rng.choice([1, 64]))
        assert lower_bound(total, donors) <= plan.makespan * (1 + 1e-12)


# --- bad input -------------------------------------------------------------------------------

OK = [Donor("a", 100.0)]


@pytest.mark.parametrize(
    ("donors", "field"),
    [
        ([], "donors"),
        ([Donor("a", 0.0)], "bandwidth"),
        ([Donor("a", -5.0)], "bandwidth"),
        ([Donor("a", math.nan)], "bandwidth"),
        ([Donor("a", math.inf)], "bandwidth"),
        ([Donor("a", "fast")], "bandwidth"),  # type: ignore[arg-type]
        ([Donor("a", True)], "bandwidth"),
        ([Donor("a", 1.0, latency=-1.0)], "latency"),
        ([Donor("a", 1.0, latency=math.nan)], "latency"),
        ([Donor("a", 1.0, latency=math.inf)], "latency"),
        ([Donor("a", 1.0, ready=-0.1)], "ready"),
        ([Donor("a", 1.0, ready=math.inf)], "ready"),
        ([Donor("a", 1.0, overhead=-1e-9)], "overhead"),
        ([Donor("a", 1.0, overhead=math.nan)], "overhead"),
        ([Donor("a", 1.0), Donor("a", 2.0)], "duplicate"),
        ([Donor("", 1.0)], "id"),
        (["a"], "donors"),
    ],
)
def test_bad_donors_raise_plan_error_naming_the_field(donors: list[Donor], field: str) -> None:
    with pytest.raises(PlanError, match=field):
        plan_transfer(1000, donors)
    with pytest.raises(PlanError, match=field):
        lower_bound(1000, donors)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"total_bytes": -1}, "total_bytes"),
        ({"total_bytes": 1.5}, "total_bytes"),
        ({"total_bytes": True}, "total_bytes"),
        ({"max_shards": 0}, "max_shards"),
        ({"min_shard_bytes": 0}, "min_shard_bytes"),
        ({"chain": [2, 3]}, "chain"),
        ({"chain": [4, 2]}, "chain"),
        ({"chain": [2, 2]}, "chain"),
        ({"chain": [1, 2, 6, 12, 36, 100]}, "chain"),
        ({"chain": []}, "chain"),
        ({"chain": [0, 1]}, "chain"),
        ({"chain": [1.0, 2.0]}, "chain"),
        ({"chain": [8192], "max_shards": 4096}, "max_shards"),
        ({"ingress": 0.0}, "ingress"),
        ({"ingress": -1.0}, "ingress"),
        ({"ingress": math.nan}, "ingress"),
        ({"ingress": math.inf}, "ingress"),
    ],
)
def test_bad_arguments_raise_plan_error_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    args: dict[str, object] = {"total_bytes": 1000, "donors": OK, **kwargs}
    with pytest.raises(PlanError, match=field) as info:
        plan_transfer(**args)  # type: ignore[arg-type]
    assert isinstance(info.value, ChaosError)


def test_valid_non_power_of_two_chain_is_accepted() -> None:
    donors = [Donor(f"d{i}", 1.0) for i in range(6)]
    plan = plan_transfer(36, donors, chain=[1, 3, 6, 12, 36], min_shard_bytes=1)
    assert plan.num_shards == 6
    assert plan.makespan == pytest.approx(6.0)


def test_lower_bound_rejects_bad_ingress_and_total() -> None:
    with pytest.raises(PlanError, match="ingress"):
        lower_bound(10, OK, ingress=0.0)
    with pytest.raises(PlanError, match="total_bytes"):
        lower_bound(-1, OK)


def test_determinism_over_repeated_calls() -> None:
    rng = random.Random(77)
    donors = random_donors(rng, 40)
    plans = [plan_transfer(123_456_789, donors) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
