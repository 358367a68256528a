"""The imaging CNN example: a 16-64 MB CNN, non-IID institutions, FedProx inside ChaosStrategy.

The slow test runs the example's one command (``examples/imaging_cnn/run.py``) in simulation for
2 rounds with 3 signed institutions and checks that the accuracy moved and that every party
certified every round's state.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "imaging_cnn"
INSTITUTIONS = 3
ROUNDS = 2
#: Accuracy points the global model must gain over the untrained one in ROUNDS rounds.
MIN_GAIN = 0.1


def _module(name: str, path: Path) -> ModuleType:
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def test_the_cnn_is_16_to_64_mb_and_the_institutions_are_non_iid() -> None:
    task = _module("imaging_cnn_task", EXAMPLE / "imaging_cnn" / "task.py")
    assert 16 <= task.model_megabytes(task.make_model(7, 1536)) <= 64
    slices = [task.institution_indices(i, INSTITUTIONS, 0.8, 7) for i in range(INSTITUTIONS)]
    joined = np.concatenate(slices)
    assert len(np.unique(joined)) == len(joined)  # no sample in two institutions
    for i in range(INSTITUTIONS):
        images, labels = task.load_institution(i, INSTITUTIONS, 0.8, 7)
        assert tuple(images.shape[1:]) == (1, 32, 32)
        home = (labels.numpy() % INSTITUTIONS == i).mean()
        assert 0.7 < home < 0.9, home  # skewed towards its home classes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_runs_in_simulation_and_every_party_certifies(tmp_path: Path) -> None:
    runner = _module("imaging_cnn_run", EXAMPLE / "run.py")
    run = runner.run("simulation", INSTITUTIONS, ROUNDS, tmp_path, 540.0)
    assert run.returncode == 0, run.log[-4000:]
    res = run.results
    print(json.dumps(res, indent=1))  # the figures (pytest -s)
    assert res["mode"] == "chaos" and 16 <= res["model_mb"] <= 64
    acc = {int(r): a for r, a in res["accuracy"].items()}
    assert acc[ROUNDS] >= acc[0] + MIN_GAIN, acc
    parties = {p.stem for p in (tmp_path / "keys").glob("party-*.key")}
    assert len(parties) == INSTITUTIONS
    certified = res["certified_by"]
    for rnd in range(ROUNDS + 1):  # round 0: the initial state
        assert len(certified[str(rnd)]) == INSTITUTIONS, certified
    for i in range(INSTITUTIONS):  # each party holds the last certified state on disk
        replicas = sorted((tmp_path / "state" / f"party-{i}" / "replicas").iterdir())
        assert replicas[-1].name == f"round-{ROUNDS:012d}.replica", replicas
