"""``chaos-flwr bench direct-pull`` (chaos_flwr.lab.direct_bench): its figures are those of a
real pull (the state it served, shares that follow the paced rates), not timing targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chaos_flwr.errors import ConfigError
from chaos_flwr.lab.direct_bench import measure_direct_pull


def test_the_bench_pulls_from_paced_donors_and_reports_against_the_bound() -> None:
    fig = measure_direct_pull(1.0, [8.0, 1.0], repeats=2)
    assert fig["repeats"] == 2 and len(fig["runs"]) == 2
    assert fig["model_bytes"] > 2**20 and fig["lower_bound_s"] > 0
    for run in fig["runs"]:
        assert run["relay_steps"] == 0 and run["direct_failed"] == []
        fast, slow = run["received_mb"]
        assert fast + slow == pytest.approx(fig["model_bytes"] / 1e6, abs=1e-3)
        assert fast > 2 * slow  # the shares follow the measured rates
        assert run["link_rate_mb_s"][0] > run["link_rate_mb_s"][1]  # timed by the fetch
        assert run["pull_s"] >= fig["lower_bound_s"] * 0.9
    assert fig["median_ratio_to_bound"] == fig["median_pull_s"] / fig["lower_bound_s"]


def test_the_bench_refuses_bad_input() -> None:
    with pytest.raises(ConfigError):
        measure_direct_pull(0.0, [1.0])
    with pytest.raises(ConfigError):
        measure_direct_pull(1.0, [1.0, -2.0])
    out = subprocess.run(
        [sys.executable, "-m", "chaos_flwr.cli", "bench", "direct-pull", "--rates", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "--rates" in out.stderr


def test_the_bench_prints_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chaos_flwr.cli", "bench", "direct-pull", "--model-mib", "0.5",
         "--rates", "4,2", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    fig = json.loads(out.stdout)
    assert fig["bench"] == "direct-pull" and fig["rates_mb_s"] == [4.0, 2.0]
