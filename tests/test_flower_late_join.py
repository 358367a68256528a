"""A node that comes while a round trains trains in that round when its own signed records
admit it (``JoinSettings.during_round``; fake Grid, signed): its update is in the round's
aggregate, which plain FedAvg would only sample a round later. With a sponsor to wait for
(the members are training) it trains in the next round, as before."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.client import default_party_factory, enable, party_for
from chaos_flwr.flower.keys import charter_path, load_federation, make_federation
from chaos_flwr.flower.server import ChaosStrategy, JoinSettings, PhaseSettings, RoundLog

FOUNDERS = 3
#: The round during whose training the joiner's SuperNode connects.
JOIN_IN = 2
ROUNDS = 3


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"w": rng.normal(size=(2, 512)).astype(np.float32), "b": np.zeros(2, np.float32)}


def _trained(arrays: dict[str, np.ndarray], k: int, rnd: int) -> dict[str, np.ndarray]:
    """What partition ``k - 1`` trains from ``arrays`` in round ``rnd`` (weight ``k``)."""
    return {n: (a * (1 - 0.01 * k) + 0.01 * k * rnd).astype(np.float32) for n, a in arrays.items()}


def _fedavg(arrays: dict[str, np.ndarray], ks: list[int], rnd: int) -> dict[str, np.ndarray]:
    ups = [_trained(arrays, k, rnd) for k in ks]
    return {n: sum(k * u[n] for k, u in zip(ks, ups, strict=True)) / sum(ks) for n in arrays}


class World:
    """``FOUNDERS`` founders; one allowlisted SuperNode connects during round ``JOIN_IN``'s
    training (while the first founder trains)."""

    def __init__(self, tmp: Path, sponsors_required: int, misconfigured: bool = False) -> None:
        self.misconfigured = misconfigured
        self.keys = make_federation(
            tmp / "fed", FOUNDERS + 1, founders=FOUNDERS, seed="late",
            sponsors_required=sponsors_required,
        )  # fmt: skip
        self.fed = load_federation(self.keys)
        self.charter = load_charter(charter_path(self.keys))
        self.state_root = tmp / "state"
        self.grid = FakeGrid()
        self.nodes: dict[int, FakeNode] = {}
        self.trained_by: dict[int, list[int]] = {}
        self.app = self._app()
        for p in range(FOUNDERS):
            self.add(p)

    def add(self, p: int) -> FakeNode:
        self.nodes[p] = self.grid.add_node(
            self.app,
            node_config={"partition-id": p},
            run_config={"chaos-keys-dir": str(self.keys), "chaos-state-root": str(self.state_root)},
        )
        return self.nodes[p]

    def _app(self) -> ClientApp:
        app = ClientApp()

        @app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            p = int(ctx.node_config["partition-id"])
            self.trained_by.setdefault(rnd, []).append(p)
            if rnd == JOIN_IN and FOUNDERS not in self.nodes:
                if self.misconfigured:  # a SuperNode started without its Chaos settings
                    bad = {"partition-id": FOUNDERS}
                    self.nodes[FOUNDERS] = self.grid.add_node(self.app, node_config=bad)
                else:
                    self.add(FOUNDERS)  # the joiner's SuperNode connects mid-training
            arrays = {n: a.numpy() for n, a in msg.content["arrays"].items()}
            out = {n: Array(a) for n, a in _trained(arrays, p + 1, rnd).items()}
            return Message(
                RecordDict(
                    {"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": p + 1})}
                ),
                reply_to=msg,
            )

        @app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

        enable(app, party_factory=default_party_factory)
        return app

    def run(self, during_round: bool = True, fraction_train: float = 1.0) -> ChaosStrategy:
        strategy = ChaosStrategy(
            FedAvg(
                fraction_train=fraction_train,
                min_available_nodes=2,
                min_train_nodes=2,
                min_evaluate_nodes=2,
            ),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=2.0),
            joins=JoinSettings(during_round=during_round),
        )
        initial = ArrayRecord({n: Array(a) for n, a in _initial().items()})
        strategy.start(self.grid, initial, num_rounds=ROUNDS, timeout=10)
        return strategy


def _round(strategy: ChaosStrategy, rnd: int) -> RoundLog:
    (rlog,) = [r for r in strategy.rounds if r.server_round == rnd]
    return rlog


def _expected(trainers: dict[int, list[int]]) -> dict[str, np.ndarray]:
    arrays = _initial()
    for rnd in range(1, ROUNDS + 1):
        arrays = _fedavg(arrays, [p + 1 for p in sorted(trainers[rnd])], rnd)
    return arrays


def test_a_joiner_admitted_by_its_own_records_trains_in_the_round_it_came_during(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    world = World(tmp_path, sponsors_required=0)
    strategy = world.run()
    joiner = world.nodes[FOUNDERS].node_id
    founders = list(range(FOUNDERS))
    rlog = _round(strategy, JOIN_IN)
    # it took round 1's state from the ServerApp during round 2's training, and trained on it
    assert joiner in rlog.trained and joiner not in _round(strategy, 1).trained
    (jl,) = [j for j in rlog.joins if j.node == joiner]
    assert jl.ok and jl.source == "server" and jl.server_round == JOIN_IN - 1
    # asking it during training is timed in the round it came during, and only there
    assert rlog.ask_s > 0.0
    assert all(r.ask_s == 0.0 for r in strategy.rounds if r is not rlog)
    assert sorted(world.trained_by[JOIN_IN]) == [*founders, FOUNDERS]
    # its update is in round 2's aggregate: the run's arrays are FedAvg's with it in round 2
    expected = _expected({1: founders, 2: [*founders, FOUNDERS], 3: [*founders, FOUNDERS]})
    assert strategy.rounds[-1].server_round == ROUNDS
    party = party_for(world.nodes[FOUNDERS].context, world.app)
    assert party.held_round == ROUNDS
    for name, arr in expected.items():
        np.testing.assert_allclose(party.held_arrays[name].numpy(), arr, rtol=1e-5, atol=1e-6)
    joiner_party = world.fed.party_ids[FOUNDERS]
    assert joiner_party in _round(strategy, JOIN_IN).members["active"]
    assert joiner_party in _round(strategy, JOIN_IN).holders  # it holds round 2 as certified


@pytest.mark.parametrize(
    ("sponsors", "during_round"), [(1, True), (0, False)], ids=["sponsor-needed", "turned-off"]
)
def test_otherwise_the_joiner_trains_in_the_next_round_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sponsors: int, during_round: bool
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    world = World(tmp_path, sponsors_required=sponsors)
    strategy = world.run(during_round=during_round)
    joiner = world.nodes[FOUNDERS].node_id
    founders = list(range(FOUNDERS))
    assert joiner not in _round(strategy, JOIN_IN).trained
    assert joiner in _round(strategy, JOIN_IN + 1).trained
    (jl,) = [j for r in strategy.rounds for j in r.joins if j.node == joiner]
    assert jl.ok and jl.server_round == JOIN_IN  # took round 2's state in round 2's join
    assert sorted(world.trained_by[JOIN_IN]) == founders
    expected = _expected({1: founders, 2: founders, 3: [*founders, FOUNDERS]})
    party = party_for(world.nodes[FOUNDERS].context, world.app)
    assert party.held_round == ROUNDS
    for name, arr in expected.items():
        np.testing.assert_allclose(party.held_arrays[name].numpy(), arr, rtol=1e-5, atol=1e-6)


def test_a_strategy_that_samples_a_subset_keeps_its_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    world = World(tmp_path, sponsors_required=0)
    strategy = world.run(fraction_train=0.5)  # FedAvg samples 2 of the 3 founders
    joiner = world.nodes[FOUNDERS].node_id
    rlog = _round(strategy, JOIN_IN)
    assert len(rlog.trained) == 2 and joiner not in rlog.trained
    assert len(world.trained_by[JOIN_IN]) == 2
    # admitted all the same: it takes the round's state in its join, to be sampled from
    (jl,) = [j for j in rlog.joins if j.node == joiner]
    assert jl.ok and jl.server_round == JOIN_IN


def test_a_misconfigured_node_that_comes_during_training_does_not_stop_the_run(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, sponsors_required=0, misconfigured=True)
    strategy = world.run()
    bad = world.nodes[FOUNDERS].node_id
    # asked alone while round 2 trained, it answered that its settings are wrong: the run
    # goes on with the founders (a newcomer-only exchange does not stop it)
    assert [r.server_round for r in strategy.rounds if r.server_round > 0] == [1, 2, 3]
    assert all(r.digest and not r.skipped for r in strategy.rounds if r.server_round > 0)
    assert "node_config 'chaos-key' is missing" in strategy.courier.config_errors[bad]
    assert all(bad not in r.trained for r in strategy.rounds)


def test_no_late_joiner_for_a_differential_privacy_wrapper_or_peers_only() -> None:
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from chaos_flwr.flower.server.latejoin import late_joins_allowed

    fedavg = FedAvg()
    dp = DifferentialPrivacyServerSideFixedClipping(
        fedavg, noise_multiplier=0.1, clipping_norm=1.0, num_sampled_clients=3
    )
    assert late_joins_allowed(fedavg, JoinSettings())
    assert not late_joins_allowed(dp, JoinSettings())  # noise for exactly 3 sampled nodes
    assert not late_joins_allowed(fedavg, JoinSettings(source="peers"))
    assert not late_joins_allowed(fedavg, JoinSettings(during_round=False))
    with pytest.raises(ConfigError, match="during_round must be a bool"):
        JoinSettings(during_round="yes")  # type: ignore[arg-type]
