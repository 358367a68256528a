"""The planner against an exact MILP (``scipy.optimize.milp``, HiGHS) on random instances.

For one shard count ``K`` the MILP is the model in DESIGN.md written out honestly:

    minimise T
    s.t.  sum_u k_u = K
          k_u <= K * y_u                         (y_u binary: donor u is used)
          T >= a_u * y_u + c_u * k_u              (C_u = 0 when k_u = 0, else a_u + k_u c_u)
          k_u integer in [0, K], y_u in {0, 1}, T >= 0

with ``a_u = ready + latency`` and ``c_u = ceil(W / K) / b_u + overhead``. HiGHS is asked for a
zero relative gap; its integer solution is then re-costed in exact model arithmetic and compared
with the planner's makespan (relative 1e-9), so solver tolerances cannot hide a difference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from chaos_flwr.planner import Donor, plan_transfer

optimize = pytest.importorskip("scipy.optimize")

REL = 1e-9


def milp_makespan(total: int, donors: Sequence[Donor], k: int) -> float:
    m = len(donors)
    s = -(-total // k)
    a = [d.ready + d.latency for d in donors]
    c = [s / d.bandwidth + d.overhead for d in donors]
    n = 2 * m + 1  # k_0..k_{m-1}, y_0..y_{m-1}, T
    cost = np.zeros(n)
    cost[-1] = 1.0
    rows = []
    lo = []
    hi = []
    row = np.zeros(n)
    row[:m] = 1.0
    rows.append(row)
    lo.append(k)
    hi.append(k)
    for u in range(m):
        row = np.zeros(n)
        row[u] = 1.0
        row[m + u] = -float(k)
        rows.append(row)
        lo.append(-np.inf)
        hi.append(0.0)
        row = np.zeros(n)
        row[u] = c[u]
        row[m + u] = a[u]
        row[-1] = -1.0
        rows.append(row)
        lo.append(-np.inf)
        hi.append(0.0)
    integrality = np.array([1] * (2 * m) + [0])
    bounds = optimize.Bounds(np.zeros(n), np.array([float(k)] * m + [1.0] * m + [np.inf]))
    res = optimize.milp(
        cost,
        constraints=optimize.LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=bounds,
        options={"mip_rel_gap": 0.0, "time_limit": 30.0},
    )
    assert res.status == 0, res.message
    counts = [round(x) for x in res.x[:m]]
    assert sum(counts) == k
    recosted = max(a[u] + counts[u] * c[u] for u in range(m) if counts[u])
    assert recosted == pytest.approx(res.x[-1], rel=1e-6, abs=1e-6)
    return recosted


def random_instance(rng: random.Random) -> tuple[int, list[Donor]]:
    m = rng.randint(1, 8)
    donors = []
    for i in range(m):
        donors.append(
            Donor(
                id=f"u{i}",
                bandwidth=10 ** rng.uniform(5, 8),  # 100 kB/s .. 100 MB/s
                latency=rng.uniform(0.0, 0.2),
                ready=rng.choice([0.0, rng.uniform(0.0, 3.0)]),
                overhead=rng.choice([0.0, rng.uniform(0.0, 0.05)]),
            )
        )
    return rng.randint(1, 10**9), donors


@pytest.mark.parametrize("seed", range(6))
def test_fixed_k_matches_milp(seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(50):
        total, donors = random_instance(rng)
        k = rng.randint(1, 64)
        plan = plan_transfer(total, donors, chain=[k], max_shards=64, min_shard_bytes=1)
        assert plan.num_shards == k
        assert plan.makespan == pytest.approx(milp_makespan(total, donors, k), rel=REL, abs=0.0)


@pytest.mark.parametrize("seed", range(2))
def test_chain_matches_min_of_milps(seed: int) -> None:
    rng = random.Random(2000 + seed)
    chain = [1, 2, 4, 8, 16, 32, 64]
    for _ in range(15):
        total, donors = random_instance(rng)
        plan = plan_transfer(total, donors, chain=chain, max_shards=64, min_shard_bytes=1)
        best = min(milp_makespan(total, donors, k) for k in chain)
        assert plan.makespan == pytest.approx(best, rel=REL, abs=0.0)


def test_milp_oracle_sees_the_zero_term() -> None:
    # A donor that is far too late must cost nothing when unused: the y_u term is what lets the
    # MILP leave it out. Without it the MILP would report 1000 s.
    donors = [Donor("near", 1e6), Donor("far", 1e6, ready=1000.0)]
    assert milp_makespan(10**6, donors, 4) == pytest.approx(1.0)
    plan = plan_transfer(10**6, donors, chain=[4], min_shard_bytes=1)
    assert plan.makespan == pytest.approx(1.0)
