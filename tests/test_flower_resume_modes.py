"""``chaos-resume``: auto (resume, the default), fresh (ignore replicas, never reuse a round
number) and require (resume or stop), on the fake Grid with signed parties."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.errors import ConfigError, ResumeError
from chaos_flwr.flower.client import enable, party_for
from chaos_flwr.flower.keys import charter_path, make_federation
from chaos_flwr.flower.server import (
    ChaosStrategy,
    PhaseSettings,
    ResumeSettings,
    certified_digest,
    run_options,
)

N = 3


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _initial() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.arange(12, dtype=np.float32).reshape(3, 4))})


def _app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        out = {
            n: Array((a.numpy() * 0.9 + 1).astype(np.float32))
            for n, a in msg.content["arrays"].items()
        }
        metrics = MetricRecord({"num-examples": 4})
        return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return enable(app)


class World:
    """``N`` signed founders on one fake Grid; their state outlives each ServerApp run."""

    def __init__(self, tmp: Path) -> None:
        self.keys = make_federation(tmp / "fed", N, founders=N, seed="modes")
        self.charter = load_charter(charter_path(self.keys))
        self.grid = FakeGrid()
        self.app = _app()
        run_config = {"chaos-keys-dir": str(self.keys), "chaos-state-root": str(tmp / "state")}
        self.nodes = [
            self.grid.add_node(self.app, node_config={"partition-id": p}, run_config=run_config)
            for p in range(N)
        ]

    def run(self, num_rounds: int, mode: str = "auto") -> ChaosStrategy:
        strategy = ChaosStrategy(
            FedAvg(min_available_nodes=N, min_train_nodes=N, min_evaluate_nodes=N),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=2.0),
            resume=ResumeSettings(mode=mode),
        )
        strategy.start(self.grid, _initial(), num_rounds=num_rounds, timeout=10)
        return strategy

    def held(self) -> set[int]:
        return {party_for(n.context, self.app).held_round for n in self.nodes}


def _trained(strategy: ChaosStrategy) -> list[int]:
    return [r.server_round for r in strategy.rounds if r.trained]


def test_auto_resumes_and_num_rounds_is_the_last_round_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(tmp_path)
    first = w.run(2)
    assert _trained(first) == [1, 2] and w.held() == {2}
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)
    second = w.run(2)  # the same num_rounds: round 2 is the last round, nothing is left
    assert second.rounds[0].server_round == 2 and _trained(second) == []
    text = caplog.text
    assert "chaos-resume=auto: resumed at round 2" in text
    assert "no rounds left" in text and "num_rounds=3 or more" in text
    third = w.run(4)  # num_rounds is absolute: rounds 3 and 4
    assert _trained(third) == [3, 4] and w.held() == {4}


def test_fresh_ignores_replicas_and_parties_that_signed_rounds_refuse_the_new_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(tmp_path)
    w.run(2)
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(logging.getLogger("flwr"), "propagate", True)
    fresh = w.run(4, mode="fresh")
    assert fresh.last_pull is None  # nothing was pulled from the parties
    start = fresh.rounds[1]
    # a verified federation: the parties that signed rounds take no new initial state from
    # the server (it holds no authority over the model); they keep theirs
    assert start.server_round == 0 and start.digest == certified_digest(_initial(), 0)
    assert start.holders == [] and _trained(fresh) == [] and w.held() == {2}
    assert "a verified federation starts only at round 0" in caplog.text
    assert "replicas are ignored" in caplog.text


def test_require_stops_when_there_is_nothing_to_resume(tmp_path: Path) -> None:
    w = World(tmp_path)
    with pytest.raises(ResumeError, match="chaos-resume=require: no certified state"):
        w.run(2, mode="require")
    assert w.held() == {-1}  # nothing was certified
    w.run(1)
    resumed = w.run(2, mode="require")
    assert resumed.rounds[0].server_round == 1 and _trained(resumed) == [2]


def test_the_mode_comes_from_the_run_config_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_federation(tmp_path / "fed", 2, founders=2, seed="opts")

    def ctx(run_config: dict[str, Any]) -> Context:
        return Context(
            run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config
        )

    opts = run_options(ctx({"chaos-keys-dir": str(keys), "chaos-resume": "fresh"}))
    assert opts["resume"].mode == "fresh" and opts["charter"].federation
    monkeypatch.setenv("CHAOS_RESUME", "require")
    monkeypatch.setenv("CHAOS_CHARTER", str(charter_path(keys)))
    opts = run_options(ctx({}))
    assert opts["resume"].mode == "require"
    assert opts["charter"].digest == load_charter(charter_path(keys)).digest
    assert (
        run_options(ctx({"chaos-resume": "auto", "chaos-charter": str(charter_path(keys))}))[
            "resume"
        ]
        == ResumeSettings()
    )
    with pytest.raises(ConfigError, match=r"'chaos-resume'\) must be one of auto, fresh, require"):
        run_options(ctx({"chaos-keys-dir": str(keys), "chaos-resume": "maybe"}))
    monkeypatch.delenv("CHAOS_CHARTER")
    with pytest.raises(ConfigError, match=r"'chaos-charter'.*'chaos-keys-dir'.*is missing"):
        run_options(ctx({}))
    assert run_options(ctx({"chaos-unsigned": True}))["charter"] is None
    with pytest.raises(ConfigError, match="use an absolute path"):
        run_options(ctx({"chaos-charter": "no/such/charter.yaml"}))
