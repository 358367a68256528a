"""Real protocol peers (signed envelopes, signed receipts) talking through ChaosStrategy's relay."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.flower.client import Party, enable
from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings, keyring_verifier
from chaos_flwr.identity import Identity
from chaos_flwr.peer import Peer


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


FOUNDERS = [Identity.from_seed(f"flower-founder-{i}".encode(), name=f"f{i}") for i in range(3)]
JOINER = Identity.from_seed(b"flower-joiner-0", name="j0")


def _charter() -> Any:
    """A charter-shaped object, as tests/test_peer.py builds it (the charter layer is separate)."""
    members = [*FOUNDERS, JOINER]
    ring = {i.party_id: i.public_key for i in members}
    founder_ids = {i.party_id for i in FOUNDERS}
    return SimpleNamespace(
        federation="fed-flower-test",
        founders=[SimpleNamespace(party_id=i.party_id) for i in FOUNDERS],
        keyring=lambda: dict(ring),
        admission=SimpleNamespace(sponsors_required=1),
        failure_quorum=2,
        heartbeat_interval_s=1.0,
        suspicion_timeout_s=30.0,
        is_founder=lambda pid: pid in founder_ids,
    )


def everyone_sorted() -> list[str]:
    return sorted(i.party_id for i in [*FOUNDERS, JOINER])


def _app(peers: dict[str, Peer]) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        arrays = {
            k: Array((v.numpy() + 0.1 * int(ctx.node_config["k"])).astype(np.float32))
            for k, v in msg.content["arrays"].items()
        }
        metrics = MetricRecord({"num-examples": 1 + int(ctx.node_config["k"])})
        return Message(
            RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg
        )

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        return Message(
            RecordDict({"metrics": MetricRecord({"acc": 0.5, "num-examples": 1})}), reply_to=msg
        )

    charter = _charter()
    ticks = iter(range(10**9))

    def clock() -> float:  # parties' shared virtual clock: 0.25 s per message handled
        return 1_000.0 + 0.25 * next(ticks)

    by_name = {i.name: i for i in [*FOUNDERS, JOINER]}

    def factory(ctx: Context) -> Party:
        ident = by_name[str(ctx.node_config["who"])]
        peer = Peer(ident, charter)
        peers[ident.party_id] = peer
        party = Party(party_id=ident.party_id, peer=peer, signer=ident.sign, clock=clock)
        now = clock()
        if charter.is_founder(ident.party_id):
            party.pending.extend(peer.bootstrap(now))
        # a non-founder asks for a sponsored join by itself when it first hears from the relay
        return party

    enable(app, party_factory=factory)
    return app


def test_signed_peers_converge_and_a_joiner_is_admitted_and_trained_through_the_relay() -> None:
    peers: dict[str, Peer] = {}
    grid = FakeGrid()
    app = _app(peers)
    for k, f in enumerate(FOUNDERS, start=1):
        grid.add_node(app, node_config={"k": k, "who": f.name})
    keyring = {i.party_id: i.public_key for i in [*FOUNDERS, JOINER]}
    strategy = ChaosStrategy(  # signing parties take a certify only with its proof, which
        FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),  # names the
        charter=_charter(),  # federation: their ServerApp has the charter
        receipt_verifier=keyring_verifier(keyring),
        phases=PhaseSettings(phase_timeout_s=2.0),
    )
    init = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    strategy.start(grid, init, num_rounds=3, timeout=5)
    founder_ids = sorted(f.party_id for f in FOUNDERS)
    views = {pid: p.view() for pid, p in peers.items()}
    assert sorted(views) == founder_ids
    assert all(v.active() == founder_ids for v in views.values())
    assert len({v.digest for v in views.values()}) == 1  # one view, reached through the relay
    assert all(p.rejections == [] for p in peers.values())
    assert strategy.rounds[-1].holders == founder_ids  # signed receipts, verified
    assert strategy.rounds[-1].unsigned_receipts == []

    # the ServerApp is killed; a new run (no checkpoint) rebuilds the state from the parties'
    # replicas, checked against their signed receipts, while a joiner's SuperNode appears
    joiner_node = grid.add_node(app, node_config={"k": 9, "who": JOINER.name})
    restarted = ChaosStrategy(
        FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
        charter=_charter(),  # a server-side view from the relayed records
        phases=PhaseSettings(phase_timeout_s=2.0),
    )
    result = restarted.start(grid, init, num_rounds=7, timeout=5)
    hello = restarted.rounds[0]
    assert hello.server_round == 3 and hello.holders == founder_ids
    assert [r.server_round for r in restarted.rounds[1:]] == [4, 5, 6, 7]
    assert sorted(result.train_metrics_clientapp) == [4, 5, 6, 7]
    # the joiner's join request came with its hello reply; the sponsors' envelopes were
    # carried at once, so it was admitted and took the resumed state from the ServerApp (one
    # message) before the first round: it is eligible from round 4 on
    assert joiner_node.node_id in restarted.rounds[1].eligible
    joins = [j for r in restarted.rounds for j in r.joins if j.party == JOINER.party_id]
    assert joins and joins[0].ok and joins[0].source == "server" and joins[0].server_round == 3
    (admitted,) = [e for r in restarted.rounds for e in r.events if e.kind == "join"]
    assert admitted.subject == JOINER.party_id and admitted.settle_s is not None
    assert joins[0].server_round >= admitted.server_round  # pulled only once admitted
    assert restarted.rounds[-1].members == {"active": everyone_sorted()}
    strategy = restarted
    everyone = sorted([*founder_ids, JOINER.party_id])
    assert all(p.view().active() == everyone for p in peers.values())
    assert len({p.view().digest for p in peers.values()}) == 1
    assert JOINER.party_id in strategy.rounds[-1].holders
    assert joiner_node.node_id in strategy.rounds[-1].trained
