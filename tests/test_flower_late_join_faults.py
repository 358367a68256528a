"""Late joiners under faults (fake Grid, signed charter, ``sponsors_required: 0``): a trainer
whose SuperNode restarts while the round trains loses no envelope and is not sent the state
twice; a stream of joiners does not keep the train exchange open past the run's timeout; a
late joiner's train reply is timed, so its next round's deadline follows its history."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.flower.client import default_party_factory, enable
from chaos_flwr.flower.keys import charter_path, make_federation
from chaos_flwr.flower.relay import Relay
from chaos_flwr.flower.server import ChaosStrategy, JoinSettings, PhaseSettings, RoundLog

FOUNDERS = 3
#: The round during whose training the fault comes.
FAULT_IN = 2


@pytest.fixture(autouse=True)
def _env(flower_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py); replicas kept."""
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")


class VClock:
    """A virtual clock whose ``sleep`` advances it and runs the hooks (node arrivals)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.hooks: list[Callable[[], None]] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.0)
        for hook in self.hooks:
            hook()


class Fed:
    """``size`` allowlisted parties of which ``FOUNDERS`` found the federation; ``on_train``
    runs in every train call (``(round, partition)``) to inject the fault."""

    def __init__(self, tmp: Path, size: int, clock: VClock | None = None) -> None:
        self.tmp = tmp
        self.keys = make_federation(
            tmp / "fed", size, founders=FOUNDERS, seed="faults", sponsors_required=0
        )
        self.charter = load_charter(charter_path(self.keys))
        self.clock = clock
        self.grid = FakeGrid(clock=clock)
        self.nodes: dict[int, FakeNode] = {}
        self.on_train: Callable[[int, int], None] = lambda _r, _p: None
        self.app = self._app()
        #: partition -> the address its first node serves its replica at (a direct link)
        self.direct: dict[int, str] = {}

    def add(self, p: int, state_root: str = "state", delay_s: float = 0.0) -> FakeNode:
        root = str(self.tmp / state_root)
        run_config = {"chaos-keys-dir": str(self.keys), "chaos-state-root": root}
        node_config: dict[str, int | float | str] = {"partition-id": p}
        if p in self.direct and p not in self.nodes:
            node_config["chaos-direct-addr"] = self.direct[p]
        self.nodes[p] = self.grid.add_node(self.app, node_config=node_config, run_config=run_config)
        self.nodes[p].delay_s = delay_s
        return self.nodes[p]

    def _app(self) -> ClientApp:
        app = ClientApp()

        @app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            p = int(ctx.node_config["partition-id"])
            self.on_train(rnd, p)
            arrays = msg.content["arrays"].items()
            out = {n: Array((a.numpy() * 0.9).astype(np.float32)) for n, a in arrays}
            content = {"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": p + 1})}
            return Message(RecordDict(content), reply_to=msg)

        @app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

        enable(app, party_factory=default_party_factory)
        return app

    def run(self, rounds: int, timeout: float, phase_timeout_s: float = 2.0) -> ChaosStrategy:
        extra = {} if self.clock is None else {"clock": self.clock, "sleep": self.clock.sleep}
        strategy = ChaosStrategy(
            FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=phase_timeout_s),
            joins=JoinSettings(during_round=True),
            **extra,  # type: ignore[arg-type]
        )
        initial = ArrayRecord({"w": Array(np.ones((2, 8), np.float32))})
        strategy.start(self.grid, initial, num_rounds=rounds, timeout=timeout)
        return strategy


def _round(strategy: ChaosStrategy, rnd: int) -> RoundLog:
    (rlog,) = [r for r in strategy.rounds if r.server_round == rnd]
    return rlog


def _restart_a_trainer(fed: Fed, state_root: str) -> dict[str, int]:
    """While round ``FAULT_IN`` trains, the SuperNode of a trainer whose train message is not
    out yet goes away and comes back as a new node (same party, ``state_root`` its disk)."""
    restarted: dict[str, int] = {}

    def on_train(rnd: int, p: int) -> None:
        if rnd == FAULT_IN and not restarted:
            q = (p + 1) % FOUNDERS
            old = fed.nodes[q].node_id
            fed.grid.remove_node(old)
            restarted.update(old=old, new=fed.add(q, state_root).node_id, partition=q)

    fed.on_train = on_train
    return restarted


def test_envelopes_of_a_trainer_that_restarts_mid_round_go_back_to_its_party(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fed = Fed(tmp_path, FOUNDERS)
    for p in range(FOUNDERS):
        fed.add(p)
    restarted = _restart_a_trainer(fed, "state")  # same disk: the party comes back whole
    given_back: list[tuple[int, int, int]] = []  # (node, envelopes, queued for its party after)
    orig = Relay.give_back

    def give_back(self: Relay, node_id: int, envelopes: Sequence[bytes]) -> None:
        orig(self, node_id, envelopes)
        if node_id == restarted.get("old") and envelopes:
            party = self.party_of[restarted["new"]]
            given_back.append((node_id, len(envelopes), self.pending(party)))

    monkeypatch.setattr(Relay, "give_back", give_back)
    strategy = fed.run(rounds=3, timeout=10)
    rlog = _round(strategy, FAULT_IN)
    assert restarted["old"] in rlog.missing
    # the envelopes its lost train message carried are queued again for its party (now on
    # the new node), none dropped
    assert given_back, "the lost train message carried no envelopes: the test shows nothing"
    assert all(queued >= n for _, n, queued in given_back)
    assert strategy.courier.relay.dropped == 0
    assert _round(strategy, 3).trained and restarted["new"] in _round(strategy, 3).trained


@pytest.mark.parametrize("links", [False, True], ids=["relay", "direct-links"])
def test_a_trainer_that_restarts_without_its_disk_is_not_sent_the_state_during_training(
    tmp_path: Path, links: bool
) -> None:
    # with direct links the question to the new node carries the join's start: the start
    # names the parties that train, so the restarted party fetches nothing during training
    from test_flower_lib_join import free_ports

    from chaos_flwr.flower.direct import stop_servers

    fed = Fed(tmp_path, FOUNDERS)
    if links:
        fed.direct = {p: f"127.0.0.1:{port}" for p, port in enumerate(free_ports(FOUNDERS))}
    for p in range(FOUNDERS):
        fed.add(p)
    restarted = _restart_a_trainer(fed, "fresh")  # its disk is lost
    try:
        strategy = fed.run(rounds=3, timeout=10)
    finally:
        stop_servers()
    rlog = _round(strategy, FAULT_IN)
    new = restarted["new"]
    assert new not in rlog.trained  # its party's train message went to the old node
    sent = [(j.server_round, j.source) for j in rlog.joins if j.node == new]
    # only the state the round certifies, in the round's join: not also the base, for nothing
    assert [r for r, _ in sent] == [FAULT_IN]
    assert sent[0][1] == ("pull" if links else "server")
    assert new in _round(strategy, 3).trained


def test_joiners_that_keep_coming_do_not_hold_the_train_exchange_past_the_timeout(
    tmp_path: Path,
) -> None:
    joiners, timeout, every_s = 6, 20.0, 8.0
    clock = VClock()
    fed = Fed(tmp_path, FOUNDERS + joiners, clock=clock)
    plan: list[tuple[float, int]] = []

    def on_train(rnd: int, _p: int) -> None:
        if rnd == FAULT_IN and not plan:  # one comes every 8 s from 4 s into the training
            plan.extend((clock.t + 4 + every_s * j, FOUNDERS + j) for j in range(joiners))

    def arrivals() -> None:
        while plan and plan[0][0] <= clock.t:
            fed.add(plan.pop(0)[1], delay_s=3.0)

    fed.on_train = on_train
    clock.hooks.append(arrivals)
    for p in range(FOUNDERS):
        fed.add(p, delay_s=5.0)
    strategy = fed.run(rounds=FAULT_IN, timeout=timeout, phase_timeout_s=timeout)
    rlog = _round(strategy, FAULT_IN)
    founders = {fed.nodes[p].node_id for p in range(FOUNDERS)}
    assert set(rlog.trained) > founders, "no joiner trained in the round it came during"
    assert len(rlog.trained) < FOUNDERS + joiners  # the last ones came after the bound
    assert rlog.train_s <= timeout + 1.0


def test_a_late_joiners_train_reply_is_timed_for_its_next_deadline(tmp_path: Path) -> None:
    fed = Fed(tmp_path, FOUNDERS + 1)
    joined: list[int] = []

    def on_train(rnd: int, _p: int) -> None:
        if rnd == FAULT_IN and not joined:
            joined.append(fed.add(FOUNDERS).node_id)

    fed.on_train = on_train
    for p in range(FOUNDERS):
        fed.add(p)
    strategy = fed.run(rounds=FAULT_IN, timeout=10)
    (node,) = joined
    assert node in _round(strategy, FAULT_IN).trained
    samples = strategy.courier.times.samples("relay:train", node)
    assert len(samples) == 1 and 0.0 <= samples[0] < 10.0
