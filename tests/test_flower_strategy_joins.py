"""Several joiners in one round get the certified state concurrently: pulled from its holders,
or from the ServerApp in one message each (fake Grid, signed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.flower.client import default_party_factory, enable, party_for
from chaos_flwr.flower.keys import charter_path, load_federation, make_federation
from chaos_flwr.flower.server import (
    ChaosStrategy,
    JoinLog,
    JoinSettings,
    PhaseSettings,
    RoundLog,
    certified_digest,
)
from chaos_flwr.store import ReplicaStore


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


FOUNDERS = 3


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(9)
    return ArrayRecord(
        {
            "w": Array(rng.normal(size=(3, 4096)).astype(np.float32)),
            "b": Array(np.zeros(3, np.float32)),
        }
    )


class World:
    """``FOUNDERS`` founders train; ``joiners`` allowlisted SuperNodes appear in round 2."""

    def __init__(self, tmp: Path, joiners: int) -> None:
        n = FOUNDERS + joiners
        self.keys = make_federation(tmp / "fed", n, founders=FOUNDERS, seed="joins")
        self.fed = load_federation(self.keys)
        self.charter = load_charter(charter_path(self.keys))
        self.state_root = tmp / "state"
        self.grid = FakeGrid()
        self.nodes: dict[int, FakeNode] = {}
        self.app = self._app(joiners)
        for p in range(FOUNDERS):
            self.add(p)

    def add(self, p: int) -> FakeNode:
        self.nodes[p] = self.grid.add_node(
            self.app,
            node_config={"partition-id": p},
            run_config={"chaos-keys-dir": str(self.keys), "chaos-state-root": str(self.state_root)},
        )
        return self.nodes[p]

    def _app(self, joiners: int) -> ClientApp:
        app = ClientApp()
        pending = {2: list(range(FOUNDERS, FOUNDERS + joiners))}

        @app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            for p in pending.pop(rnd, []):  # the joiners' SuperNodes appear mid-training
                self.add(p)
            k = int(ctx.node_config["partition-id"]) + 1
            out = {
                n: Array((a.numpy() * (1 - 0.01 * k) + 0.01 * k * rnd).astype(np.float32))
                for n, a in msg.content["arrays"].items()
            }
            return Message(
                RecordDict(
                    {"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": k})}
                ),
                reply_to=msg,
            )

        @app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            s = float(msg.content["arrays"]["w"].numpy().sum())
            return Message(
                RecordDict({"metrics": MetricRecord({"s": s, "num-examples": 1})}), reply_to=msg
            )

        enable(app, party_factory=default_party_factory)
        return app

    def run(self, source: str = "peers") -> tuple[ChaosStrategy, dict[int, int]]:
        """Run 5 rounds; return the strategy and the exchanges each round's join phase used."""
        strategy = ChaosStrategy(
            FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=2.0),
            joins=JoinSettings(source=source),
        )
        exchanges: dict[int, int] = {}
        count = {"n": 0}
        real_exchange, real_pulls = strategy.courier.exchange, strategy.join_relay.pull

        def counting_exchange(*a: Any, **kw: Any) -> Any:
            count["n"] += 1
            return real_exchange(*a, **kw)

        def counted_pulls(grid: Any, rnd: int, digest: bytes, rlog: RoundLog, *rest: Any) -> float:
            before = count["n"]
            out = real_pulls(grid, rnd, digest, rlog, *rest)
            exchanges[rlog.server_round] = count["n"] - before
            return out

        strategy.courier.exchange = counting_exchange  # type: ignore[method-assign]
        strategy.join_relay.pull = counted_pulls  # type: ignore[method-assign]
        strategy.start(self.grid, _initial(), num_rounds=5, timeout=10)
        return strategy, exchanges


def _joins(strategy: ChaosStrategy) -> list[tuple[RoundLog, JoinLog]]:
    return [(r, j) for r in strategy.rounds for j in r.joins]


def test_two_joiners_in_one_round_pull_together_in_the_exchanges_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    one = World(tmp_path / "one", 1)
    s1, ex1 = one.run()
    ((r1, j1),) = _joins(s1)
    assert j1.ok

    two = World(tmp_path / "two", 2)
    s2, ex2 = two.run()
    joins = _joins(s2)
    assert len(joins) == 2 and joins[0][0] is joins[1][0]  # both pulled in the same round
    rlog = joins[0][0]
    jids = sorted(two.fed.party_ids[p] for p in (FOUNDERS, FOUNDERS + 1))
    assert sorted(j.party for _, j in joins) == jids
    founders = {two.fed.party_ids[p] for p in range(FOUNDERS)}
    by_node = sorted(joins, key=lambda rj: rj[1].node)
    for p, (_, j) in zip((FOUNDERS, FOUNDERS + 1), by_node, strict=True):
        # each got the verified state, from >= 2 donors, by its own plan
        assert j.ok and j.error == "" and j.digest == rlog.digest
        assert len(j.bytes_per_donor) >= 2 and set(j.bytes_per_donor) <= founders
        assert sum(j.bytes_per_donor.values()) == j.total_bytes
        pulled = ReplicaStore(two.state_root / f"party-{p}" / "replicas").get(j.server_round)
        assert pulled.digest() == rlog.digest
        party = party_for(two.nodes[p].context, two.app)
        assert certified_digest(party.held_arrays, party.held_round) == party.held_digest
        # and trains from the next round on
        later = [r for r in s2.rounds if r.server_round > rlog.server_round]
        assert later and all(two.nodes[p].node_id in r.trained for r in later)
    # the two pulls shared their exchanges: as many as one joiner's pull, not twice as many
    # (one exchange carried their join requests to the sponsors, then the relay steps)
    steps = max(j.steps for _, j in joins)
    assert ex2[rlog.server_round] == ex1[r1.server_round] == 1 + 2 * steps - 1
    assert steps == j1.steps
    assert sorted(s2.rounds[-1].members["active"]) == sorted([*founders, *jids])


def test_two_joiners_take_the_state_from_the_server_in_one_exchange(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    two = World(tmp_path, 2)
    strategy, exchanges = two.run(source="auto")  # relay only: the server's copy
    joins = _joins(strategy)
    assert len(joins) == 2 and joins[0][0] is joins[1][0]
    rlog = joins[0][0]
    # they were asked while the round trained (their join requests reached the sponsors with
    # its certify messages); one message to each joiner with the state, in one exchange
    assert exchanges[rlog.server_round] == 1
    assert all(n == 0 for r, n in exchanges.items() if r != rlog.server_round)
    for p in (FOUNDERS, FOUNDERS + 1):
        (j,) = [j for _, j in joins if j.node == two.nodes[p].node_id]
        assert j.ok and j.source == "server" and j.steps == 1 and j.bytes_per_donor == {}
        held = ReplicaStore(two.state_root / f"party-{p}" / "replicas").get(j.server_round)
        assert held.digest() == rlog.digest and j.total_bytes == len(held.to_bytes())
        later = [r for r in strategy.rounds if r.server_round > rlog.server_round]
        assert later and all(two.nodes[p].node_id in r.trained for r in later)
