"""The planner benchmark's shape (not its timings: those are read from its JSON, not asserted)."""

from __future__ import annotations

import json
import os

from typer.testing import CliRunner

from chaos_flwr.bench.planner import run_planner_bench, wan_donors
from chaos_flwr.cli import app
from chaos_flwr.planner import plan_transfer


def test_bench_covers_the_grid_and_restores_affinity() -> None:
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    out = run_planner_bench(repeats=1, milp=False)
    if before is not None:
        assert os.sched_getaffinity(0) == before
    grid = [(r["m"], r["max_shards"]) for r in out["results"]]
    assert grid == [(m, k) for m in (4, 16, 100) for k in (64, 1024, 4096)]
    for r in out["results"]:
        assert r["lower_bound_s"] <= r["makespan_s"]
        assert r["num_shards"] <= r["max_shards"]
        assert r["milp"]["status"] == "skipped"
        donors = wan_donors(r["m"])
        plan = plan_transfer(out["total_bytes"], donors, max_shards=r["max_shards"])
        assert plan.makespan == r["makespan_s"]


def test_wan_donors_are_seeded_and_wan_like() -> None:
    a, b = wan_donors(100), wan_donors(100)
    assert a == b
    bws = [d.bandwidth for d in a]
    assert max(bws) / min(bws) >= 8
    assert all(0.010 <= d.latency <= 0.080 for d in a)
    assert any(d.ready > 0 for d in a)


def test_cli_prints_json() -> None:
    res = CliRunner().invoke(app, ["bench", "planner", "--json", "--no-milp", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["benchmark"] == "planner"
    assert len(data["results"]) == 9
