"""Replicas kept per party: one setting (``chaos-keep-replicas``), a default that keeps what a
resume needs, and the disk that follows from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from chaos_flwr.defaults import CHARTER_DEFAULT_KEEP_ROUNDS, STORE_DEFAULT_KEEP_REPLICAS
from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.client.factory import default_party_factory
from chaos_flwr.flower.client.settings import NODE_KEEP_REPLICAS, keep_replicas, party_settings
from chaos_flwr.state import TrainingState
from chaos_flwr.store import ReplicaStore

MIB = 1 << 20


def _state(round_: int, nbytes: int) -> TrainingState:
    w = np.random.default_rng(round_).standard_normal(nbytes // 4).astype(np.float32)
    return TrainingState({"w": w}, round=round_, strategy_state=b"", meta={})


def _ctx(
    node: dict[str, str | int | float] | None = None,
    run: dict[str, str | int | float | bool] | None = None,
) -> Context:
    return Context(
        run_id=1, node_id=7, node_config=dict(node or {}), state=RecordDict(),
        run_config=dict(run or {}),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAOS_KEEP_REPLICAS", raising=False)


def test_the_default_keeps_the_newest_round_and_the_one_before(tmp_path: Path) -> None:
    assert STORE_DEFAULT_KEEP_REPLICAS == CHARTER_DEFAULT_KEEP_ROUNDS == 2
    store = ReplicaStore(tmp_path)
    for r in range(1, 6):
        store.put(_state(r, MIB))
    assert store.rounds() == [4, 5]
    # disk: the kept rounds times the model's size, plus a small header per replica
    used = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert 2 * MIB <= used <= 2 * MIB + 2 * 8192


def test_node_config_then_run_config_then_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert keep_replicas(_ctx()) == STORE_DEFAULT_KEEP_REPLICAS
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "4")
    assert keep_replicas(_ctx()) == 4
    assert keep_replicas(_ctx(run={NODE_KEEP_REPLICAS: 3})) == 3
    assert keep_replicas(_ctx({NODE_KEEP_REPLICAS: "1"}, {NODE_KEEP_REPLICAS: 3})) == 1
    settings = party_settings(
        _ctx({NODE_KEEP_REPLICAS: 5, "chaos-state-dir": str(tmp_path)}, {"chaos-unsigned": True})
    )
    assert settings.keep_replicas == 5


@pytest.mark.parametrize("bad", [0, -2, "two", 1.5, True])
def test_a_bad_value_is_a_config_error_that_names_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=f"node_config '{NODE_KEEP_REPLICAS}'"):
        keep_replicas(_ctx({NODE_KEEP_REPLICAS: bad}))  # type: ignore[dict-item]


def test_the_party_factory_builds_its_store_with_the_setting(tmp_path: Path) -> None:
    ctx = _ctx(
        {NODE_KEEP_REPLICAS: 1, "chaos-state-dir": str(tmp_path / "party")},
        {"chaos-unsigned": True},
    )
    party = default_party_factory(ctx)
    assert party.store is not None and party.store.keep_rounds == 1
    for r in range(1, 4):
        party.store.put(_state(r, 4096))
    assert party.store.rounds() == [3]
