"""Misconfigured parties stop the ServerApp with one clear error (fake Grid).

A party whose settings are wrong answers with a one-line error reply (no traceback) naming the
setting, its node and partition; the ServerApp raises :class:`PartyConfigError` when no node
could answer or when too few are left to ever train, instead of skipping every round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.errors import ConfigError, PartyConfigError
from chaos_flwr.flower.client import enable
from chaos_flwr.flower.client.settings import CONFIG_ERROR_MARK
from chaos_flwr.flower.keys import charter_path, make_federation
from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        arrays = msg.content["arrays"]
        metrics = MetricRecord({"num-examples": 1})
        return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return enable(app)


def _strategy(tmp: Path, need: int) -> ChaosStrategy:
    keys = make_federation(tmp / "fed", 4, founders=4, seed="loud")
    return ChaosStrategy(
        FedAvg(min_available_nodes=need, min_train_nodes=need, min_evaluate_nodes=need),
        charter=load_charter(charter_path(keys)),
        phases=PhaseSettings(phase_timeout_s=2.0),
    )


def _initial() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.ones((2, 2), np.float32))})


def test_a_misconfigured_party_answers_one_line_naming_the_setting() -> None:
    grid = FakeGrid()
    node = grid.add_node(_app(), node_config={"partition-id": 2})
    msg = Message(RecordDict(), dst_node_id=node.node_id, message_type="query.chaos")
    [mid] = grid.push_messages([msg])
    [reply] = list(grid.pull_messages([mid]))
    assert reply.has_error()
    reason = reply.error.reason
    assert reason.startswith(f"{CONFIG_ERROR_MARK}: node {node.node_id} (partition-id 2): ")
    assert "node_config 'chaos-key' is missing" in reason and "\n" not in reason


def test_the_server_stops_when_every_party_is_misconfigured(tmp_path: Path) -> None:
    grid = FakeGrid()
    app = _app()
    nodes = [grid.add_node(app, node_config={"partition-id": p}) for p in range(3)]
    strategy = _strategy(tmp_path, 3)
    with pytest.raises(PartyConfigError) as info:
        strategy.start(grid, _initial(), num_rounds=3, timeout=10)
    text = str(info.value)
    assert text.startswith("3 of 3 nodes cannot take part because of their configuration")
    assert text.count("node_config 'chaos-key' is missing") == 1  # one reason, its 3 nodes
    assert all(f"node {n.node_id} (partition-id " in text for n in nodes)
    assert sorted(info.value.reasons) == sorted(n.node_id for n in nodes)
    assert isinstance(info.value, ConfigError)
    assert not [r for r in strategy.rounds if r.server_round > 0]  # no round was "skipped"


def test_the_server_stops_when_too_few_parties_are_left_to_train(tmp_path: Path) -> None:
    grid = FakeGrid()
    app = _app()
    strategy = _strategy(tmp_path, 4)
    run_config = {"chaos-keys-dir": str(tmp_path / "fed"), "chaos-state-root": str(tmp_path / "s")}
    for p in range(3):
        grid.add_node(app, node_config={"partition-id": p}, run_config=run_config)
    wrong_key = {
        "partition-id": 3,
        "chaos-key": str(tmp_path / "nope.key"),
        "chaos-charter": str(charter_path(tmp_path / "fed")),
        "chaos-state-dir": str(tmp_path / "s3"),
    }
    bad = grid.add_node(app, node_config=wrong_key)
    with pytest.raises(PartyConfigError) as info:
        strategy.start(grid, _initial(), num_rounds=3, timeout=10)
    text = str(info.value)
    assert text.startswith("1 of 4 nodes cannot take part")
    assert "the inner strategy needs 4 nodes to train" in text
    assert f"node {bad.node_id} (partition-id 3)" in text
    assert "node_config 'chaos-key': no key file at" in text and "nope.key" in text
    assert [r.server_round for r in strategy.rounds] == [-1, 0]
