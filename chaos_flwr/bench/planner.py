"""Benchmark of the shard planner against the exact MILP (``chaos-flwr bench planner``).

For each donor count ``m`` and ``max_shards`` the benchmark plans a fixed-seed, WAN-like
instance many times (median of ``time.perf_counter`` laps, pinned to one core) and, where
``scipy`` is installed and the budget allows, solves the same chain with HiGHS: one MILP per
chain point ``K`` (the model in DESIGN.md, with binary use-variables), taking the minimum. The
MILP time reported is the sum over the chain points, which is what planning the chain costs.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..defaults import PLANNER_MIN_SHARD_BYTES
from ..planner import Donor, TransferPlan, default_chain, lower_bound, plan_transfer
from .settings import (
    PLANNER_BENCH_MILP_BUDGET_S,
    PLANNER_BENCH_MILP_TIME_LIMIT_S,
    PLANNER_BENCH_REPEATS,
    PLANNER_BENCH_SEED,
    PLANNER_BENCH_TOTAL_BYTES,
)

__all__ = ["run_planner_bench", "wan_donors"]

DONOR_COUNTS = (4, 16, 100)
MAX_SHARDS = (64, 1024, 4096)
#: Untimed planning calls before the timed ones of each size.
_WARMUP_CALLS = 10


def wan_donors(m: int, seed: int = PLANNER_BENCH_SEED) -> list[Donor]:
    """Return ``m`` WAN-like donors from a fixed seed.

    Bandwidth log-uniform in 10 Mbit/s .. 1 Gbit/s (100x spread), latency 10-80 ms, a third of
    the donors busy for up to 2 s, per-shard overhead up to 2 ms.
    """
    rng = random.Random(seed * 1000 + m)
    donors = []
    for i in range(m):
        donors.append(
            Donor(
                id=f"donor-{i:03d}",
                bandwidth=10 ** rng.uniform(6.097, 8.097),
                latency=rng.uniform(0.010, 0.080),
                ready=rng.uniform(0.0, 2.0) if rng.random() < 1 / 3 else 0.0,
                overhead=rng.uniform(0.0, 0.002),
            )
        )
    return donors


def _pin_one_core() -> tuple[set[int] | None, int | None]:
    if not hasattr(os, "sched_setaffinity"):
        return None, None
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    return before, core


def _milp_chain(
    total: int, donors: list[Donor], chain: list[int], budget_s: float, limit_s: float
) -> dict[str, Any]:
    import numpy as np
    from scipy import optimize

    m = len(donors)
    a = [d.ready + d.latency for d in donors]
    best = float("inf")
    spent = 0.0
    for solved, k in enumerate(chain):
        if spent >= budget_s:
            return {
                "status": "skipped",
                "reason": f"budget of {budget_s} s spent after "
                f"{solved} of {len(chain)} chain points",
                "time_ms": spent * 1e3,
            }
        s = -(-total // k)
        c = [s / d.bandwidth + d.overhead for d in donors]
        n = 2 * m + 1
        rows = np.zeros((1 + 2 * m, n))
        rows[0, :m] = 1.0
        for u in range(m):
            rows[1 + u, u] = 1.0
            rows[1 + u, m + u] = -float(k)
            rows[1 + m + u, u] = c[u]
            rows[1 + m + u, m + u] = a[u]
            rows[1 + m + u, -1] = -1.0
        lo = np.array([k] + [-np.inf] * (2 * m), dtype=float)
        hi = np.array([k] + [0.0] * (2 * m), dtype=float)
        cost = np.zeros(n)
        cost[-1] = 1.0
        t0 = time.perf_counter()
        res = optimize.milp(
            cost,
            constraints=optimize.LinearConstraint(rows, lo, hi),
            integrality=np.array([1] * (2 * m) + [0]),
            bounds=optimize.Bounds(np.zeros(n), np.array([float(k)] * m + [1.0] * m + [np.inf])),
            options={"mip_rel_gap": 0.0, "time_limit": limit_s},
        )
        spent += time.perf_counter() - t0
        if res.status != 0:
            return {
                "status": "time_limit" if res.status == 1 else f"status {res.status}",
                "reason": str(res.message),
                "time_ms": spent * 1e3,
            }
        counts = [round(x) for x in res.x[:m]]
        best = min(best, max(a[u] + counts[u] * c[u] for u in range(m) if counts[u]))
    return {"status": "optimal", "time_ms": spent * 1e3, "makespan_s": best}


@dataclass(frozen=True)
class _Milp:
    """How the benchmark runs the exact MILP: ``skip`` names why it does not (else ``None``)."""

    skip: str | None
    budget_s: float
    time_limit_s: float


def _milp_skip_reason(milp: bool) -> str | None:
    if not milp:
        return "--no-milp"
    try:
        import scipy  # noqa: F401
    except ImportError:
        return "scipy not installed"
    return None


def _milp_entry(
    total: int,
    donors: list[Donor],
    chain: list[int],
    plan: TransferPlan,
    median_ms: float,
    milp: _Milp,
) -> dict[str, Any]:
    """The MILP figures of one size, compared with the planner's ``plan``."""
    if milp.skip is not None:
        return {"status": "skipped", "reason": milp.skip}
    res = _milp_chain(total, donors, chain, milp.budget_s, milp.time_limit_s)
    if res["status"] == "optimal":
        rel = abs(res["makespan_s"] - plan.makespan) / plan.makespan
        res["makespan_match"] = rel <= 1e-9
        res["relative_difference"] = rel
        res["speedup"] = res["time_ms"] / median_ms
    return res


def _size_entry(
    total: int, donors: list[Donor], kmax: int, repeats: int, milp: _Milp
) -> dict[str, Any]:
    """Time the planner on one size (``len(donors)`` x ``kmax``), then the MILP if asked."""
    for _ in range(_WARMUP_CALLS):
        plan = plan_transfer(total, donors, max_shards=kmax)
    laps = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_transfer(total, donors, max_shards=kmax)
        laps.append(time.perf_counter() - t0)
    median_ms = statistics.median(laps) * 1e3
    chain = default_chain(total, kmax, PLANNER_MIN_SHARD_BYTES)
    entry: dict[str, Any] = {
        "m": len(donors),
        "max_shards": kmax,
        "chain_points": len(chain),
        "num_shards": plan.num_shards,
        "makespan_s": plan.makespan,
        "lower_bound_s": lower_bound(total, donors),
        "median_ms": median_ms,
        "p90_ms": sorted(laps)[int(0.9 * (len(laps) - 1))] * 1e3,
    }
    entry["milp"] = _milp_entry(total, donors, chain, plan, median_ms, milp)
    return entry


def run_planner_bench(
    *,
    repeats: int = PLANNER_BENCH_REPEATS,
    milp: bool = True,
    milp_budget_s: float = PLANNER_BENCH_MILP_BUDGET_S,
    milp_time_limit_s: float = PLANNER_BENCH_MILP_TIME_LIMIT_S,
) -> dict[str, Any]:
    """Run the planner benchmark and return its figures as a JSON-ready dict.

    Parameters
    ----------
    repeats : int, optional
        Timed planning calls per size (the median is reported).
    milp : bool, optional
        Also solve each size with the exact MILP (needs scipy).
    milp_budget_s : float, optional
        Wall-clock budget for all MILP solves of one size; beyond it the size is skipped.
    milp_time_limit_s : float, optional
        HiGHS time limit of one solve.

    Returns
    -------
    dict
        ``results`` (one entry per size) plus the set-up (seed, pinning, targets).
    """
    before, core = _pin_one_core()
    milp_run = _Milp(
        skip=_milp_skip_reason(milp), budget_s=milp_budget_s, time_limit_s=milp_time_limit_s
    )
    total = PLANNER_BENCH_TOTAL_BYTES
    results: list[dict[str, Any]] = []
    try:
        for m in DONOR_COUNTS:
            donors = wan_donors(m)
            results.extend(
                _size_entry(total, donors, kmax, repeats, milp_run) for kmax in MAX_SHARDS
            )
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
    return {
        "benchmark": "planner",
        "seed": PLANNER_BENCH_SEED,
        "total_bytes": total,
        "min_shard_bytes": PLANNER_MIN_SHARD_BYTES,
        "repeats": repeats,
        "timer": f"time.perf_counter, median of repeats after {_WARMUP_CALLS} warm-up calls",
        "pinned_core": core,
        "pinning": "os.sched_setaffinity(0, {core}) for the benchmark process"
        if core is not None
        else "not available on this platform",
        "milp_what": "one HiGHS MILP per chain point K (mip_rel_gap=0, binary use-variables), "
        "summed time, min makespan over the chain; its integer solution re-costed exactly",
        "milp_time_limit_s": milp_time_limit_s,
        "milp_budget_s": milp_budget_s,
        "targets": {"m100_k4096_median_ms_below": 5.0, "speedup_at_least": 100.0},
        "results": results,
    }
