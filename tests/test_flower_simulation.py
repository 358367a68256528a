"""The multi-institution example on Flower's simulation engine (`flwr run`), bounded and cleaned."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from chaos_flwr.errors import ConfigError
from chaos_flwr.lab.processes import alive, descendants
from chaos_flwr.lab.simulation import run_simulation_app

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


@pytest.fixture()
def task(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import multi_institution.task as t

    return t


def test_partitions_are_disjoint_cover_the_pool_and_are_skewed(task) -> None:  # type: ignore[no-untyped-def]
    parts = task.partition_indices(5, 0.5, 42)
    x_pool, y_pool, x_test, _ = task._dataset(42)
    allidx = np.concatenate(parts)
    assert len(allidx) == len(set(allidx.tolist())) == len(y_pool)
    assert all(len(p) >= task.MIN_PARTITION_SAMPLES for p in parts)
    # non-IID: some institution's label histogram is far from the pool's
    pool_hist = np.bincount(y_pool, minlength=10) / len(y_pool)
    tv = [
        0.5 * np.abs(np.bincount(y_pool[p], minlength=10) / len(p) - pool_hist).sum() for p in parts
    ]
    assert max(tv) > 0.2
    # deterministic: a second call with the same seed (cache cleared) gives the same split
    task.partition_indices.cache_clear()
    again = task.partition_indices(5, 0.5, 42)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert len(x_test) + len(x_pool) == 1797


def test_runner_refuses_a_folder_without_an_app(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="app_dir"):
        run_simulation_app(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_chaos_strategy_trains_on_the_simulation_engine_and_leaves_no_process() -> None:
    # processes of earlier tests (e.g. multiprocessing's resource tracker) are not this run's
    before = set(descendants(os.getpid()))
    run = run_simulation_app(
        EXAMPLE,
        run_config={"num-server-rounds": 3, "mode": "chaos", "chaos-unsigned": True},
        timeout_s=120,
    )
    assert run.returncode == 0, run.log[-3000:]
    acc = {int(k): v for k, v in run.results["accuracy"].items()}
    assert sorted(acc) == [0, 1, 2, 3]
    assert acc[3] > acc[0] + 0.2  # it learns: 10 classes start near 0.1
    assert len(run.results["round_wall_s"]) == 3
    # every round: all 5 institutions trained and certified the new state through query.chaos
    rounds = run.results["chaos_rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert all(r["holders"] == 5 and r["missing"] == 0 for r in rounds)
    assert all(r["trained"] == 5 for r in rounds[1:])
    assert all(r["unsigned_receipts"] == 5 for r in rounds)  # and the report says they are
    assert run.pids, "the runner saw no SuperLink process"
    assert not [p for p in run.pids if alive(p)]
    leftover = [p for p in descendants(os.getpid()) if p not in before and alive(p)]
    assert leftover == []
