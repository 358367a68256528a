"""A ServerApp killed in the middle of a round's certify, then restarted (fake Grid, signed).

The kill is emulated by a Grid that delivers the certify messages of one round to only ``k`` of
the ``n`` parties and then raises out of ``ChaosStrategy.start`` (the ServerApp process is gone).
The parties keep their state (their SuperNodes did not die); a new ChaosStrategy on the same
Grid must go on without ever showing a party two digests of one round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.flower.client import default_party_factory, enable, party_for
from chaos_flwr.flower.keys import charter_path, load_federation, make_federation
from chaos_flwr.flower.server import (
    ChaosStrategy,
    PhaseSettings,
    ResumeSettings,
    RoundLog,
    certified_digest,
)
from chaos_flwr.lab.launch import free_port
from chaos_flwr.receipts import Receipt
from chaos_flwr.store import ReplicaStore


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


N = 4
KILL_ROUND = 3


class _KilledError(Exception):
    """The ServerApp process died (raised out of ``start``)."""


class _KillMidCertify(FakeGrid):
    """Delivers round ``server_round``'s certify push to the first ``k`` nodes only, then dies."""

    def __init__(self) -> None:
        super().__init__()
        self.server_round = -1
        self.k = 0
        self.delivered: list[int] = []

    def push_messages(self, messages: Any) -> Any:
        msgs = list(messages)
        certify = [
            m
            for m in msgs
            if m.has_content()
            and isinstance(rec := m.content.get("chaos"), ConfigRecord)
            and rec.get("phase") == "certify"
            and rec.get("round") == self.server_round
        ]
        if not certify:
            return super().push_messages(msgs)
        self.server_round = -1  # one kill per test
        ordered = sorted(certify, key=lambda m: m.metadata.dst_node_id)[: self.k]
        self.delivered = [m.metadata.dst_node_id for m in ordered]
        super().push_messages(ordered)
        raise _KilledError


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(5)
    return ArrayRecord(
        {
            "w": Array(rng.normal(size=(3, 512)).astype(np.float32)),
            "b": Array(np.zeros(3, np.float32)),
        }
    )


class World:
    """A signed federation of ``N`` founders on the killing Grid (``direct``: each party
    serves its replicas over authenticated links at a loopback ``chaos-direct-addr``)."""

    def __init__(self, tmp: Path, *, direct: bool = False) -> None:
        self.keys = make_federation(tmp / "fed", N, founders=N, seed="resume")
        self.fed = load_federation(self.keys)
        self.charter = load_charter(charter_path(self.keys))
        self.state_root = tmp / "state"
        self.grid = _KillMidCertify()
        self.trained: dict[int, list[int]] = {}  # round -> partitions that trained it
        self.app = self._app()
        self.nodes: dict[int, FakeNode] = {}
        for p in range(N):
            self.nodes[p] = self.grid.add_node(
                self.app,
                node_config={
                    "partition-id": p,
                    **({"chaos-direct-addr": f"127.0.0.1:{free_port()}"} if direct else {}),
                },
                run_config={
                    "chaos-keys-dir": str(self.keys),
                    "chaos-state-root": str(self.state_root),
                },
            )

    def _app(self) -> ClientApp:
        app = ClientApp()

        @app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            k = int(ctx.node_config["partition-id"]) + 1
            self.trained.setdefault(rnd, []).append(k - 1)
            out = {
                n: Array((a.numpy() * (1 - 0.02 * k) + 0.01 * k * rnd).astype(np.float32))
                for n, a in msg.content["arrays"].items()
            }
            metrics = MetricRecord({"num-examples": 5 * k})
            return Message(
                RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg
            )

        @app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            s = float(msg.content["arrays"]["w"].numpy().sum())
            return Message(
                RecordDict({"metrics": MetricRecord({"s": s, "num-examples": 1})}), reply_to=msg
            )

        enable(app, party_factory=default_party_factory)
        return app

    def strategy(self, **kw: Any) -> ChaosStrategy:
        return ChaosStrategy(
            FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=2.0),
            **kw,
        )

    def party(self, p: int) -> Any:
        return party_for(self.nodes[p].context, self.app)

    def kill_mid_certify(self, k: int) -> bytes:
        """Run until round KILL_ROUND's certify reached ``k`` parties; return that digest."""
        self.grid.server_round, self.grid.k = KILL_ROUND, k
        first = self.strategy()
        with pytest.raises(_KilledError):
            first.start(self.grid, _initial(), num_rounds=KILL_ROUND + 3, timeout=10)
        assert [r.server_round for r in first.rounds if r.server_round >= 0] == [0, 1, 2]
        signed = [p for p in range(N) if self.party(p).held_round == KILL_ROUND]
        assert signed == list(range(k))  # k parties certified the killed round, the rest not
        assert all(self.party(p).held_round == KILL_ROUND - 1 for p in range(k, N))
        return bytes(self.party(0).held_digest)


def _no_evidence(w: World, strategy: ChaosStrategy) -> None:
    for p in range(N):
        party = w.party(p)
        assert party.evidence == [], f"party {p} reports equivocation"
        assert not [e for e in party.errors if "Equivocation" in e], party.errors
    assert all(r.equivocations == [] for r in strategy.rounds)


def _rounds_signed(w: World) -> dict[int, set[bytes]]:
    """Every (round -> digests) any party's replica store holds a signed receipt for."""
    out: dict[int, set[bytes]] = {}
    for p in range(N):
        store = ReplicaStore(w.state_root / f"party-{p}" / "replicas")
        for rnd in store.rounds():
            state = store.get(rnd)
            cert = store.certificate(rnd)
            Receipt(w.fed.party_ids[p], rnd, state.digest(), cert).verify(w.charter.keyring())
            out.setdefault(rnd, set()).add(state.digest())
    return out


def _check_goes_on(w: World, second: ChaosStrategy, hello: RoundLog, first_new: int) -> None:
    rounds = [r.server_round for r in second.rounds[1:]]
    assert rounds == list(range(first_new, KILL_ROUND + 4))
    _no_evidence(w, second)
    every = sorted(n.node_id for n in w.nodes.values())
    for r in second.rounds[1:]:
        assert sorted(r.trained) == every and r.errors == {}  # all parties train again
        assert sorted(r.holders) == sorted(w.fed.party_ids[p] for p in range(N))
    last = second.rounds[-1]
    for p in range(N):
        party = w.party(p)
        assert party.held_round == last.server_round and party.held_digest == last.digest
        assert certified_digest(party.held_arrays, party.held_round) == last.digest
    # no round number was ever signed with two digests, by any party, before or after the kill
    assert all(len(d) == 1 for d in _rounds_signed(w).values())


@pytest.mark.parametrize("k", [1, N - 1], ids=["k=1", "k=n-1"])
def test_a_server_killed_mid_certify_resumes_at_the_killed_round(tmp_path: Path, k: int) -> None:
    w = World(tmp_path)
    killed_digest = w.kill_mid_certify(k)
    second = w.strategy()
    second.start(w.grid, _initial(), num_rounds=KILL_ROUND + 3, timeout=10)
    hello = second.rounds[0]
    # the newest round any verified party holds: the killed round, from its k holders
    assert hello.server_round == KILL_ROUND and hello.digest == killed_digest
    assert hello.holders == sorted(w.fed.party_ids[p] for p in range(k))
    assert second.last_pull is not None
    sharing = [h for h, b in second.last_pull.shares.items() if b > 0]
    assert len(sharing) == 1 if k == 1 else len(sharing) >= 2  # all holders at once
    # the hello told the state's size: the pull asked the manifest at once, then the shards
    assert second.last_pull.exchanges == 2
    # the parties that missed the killed round's certify pulled it from its holders
    assert sorted(j.party for j in hello.joins) == sorted(w.fed.party_ids[p] for p in range(k, N))
    assert all(j.ok and j.digest == killed_digest for j in hello.joins)
    _check_goes_on(w, second, hello, KILL_ROUND + 1)


def test_a_wrong_size_told_in_the_hello_costs_one_exchange_not_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.flower.server import resume

    w = World(tmp_path)
    killed_digest = w.kill_mid_certify(N - 1)
    told: list[int | None] = []
    true_hint = resume.size_hint

    def wrong(sizes: Any, nodes: Any) -> int | None:
        told.append(true_hint(sizes, nodes))
        return (told[-1] or 0) + 4096  # a lie (or a stale hint): the holders' own sizes win

    monkeypatch.setattr(resume, "size_hint", wrong)
    second = w.strategy()
    second.start(w.grid, _initial(), num_rounds=KILL_ROUND + 3, timeout=10)
    hello = second.rounds[0]
    assert told and told[0] == len(w.party(0).held_state.to_bytes())  # the true size was told
    assert hello.server_round == KILL_ROUND and hello.digest == killed_digest
    assert second.last_pull is not None and second.last_pull.exchanges == 3  # asked again
    _check_goes_on(w, second, hello, KILL_ROUND + 1)


def test_a_partial_round_number_is_reused_only_by_parties_that_never_signed_it(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.kill_mid_certify(1)  # one receipt for the killed round: below a quorum of 2
    second = w.strategy(resume=ResumeSettings(min_receipts=2))
    second.start(w.grid, _initial(), num_rounds=KILL_ROUND + 2, timeout=10)
    hello = second.rounds[0]
    assert hello.server_round == KILL_ROUND - 1  # resumed from the quorum-certified state ...
    assert second.round_floor == KILL_ROUND
    # ... and a verified round is its base + 1: the killed number is certified again, by the
    # parties that never signed it; the one that did refuses it (never two digests a round)
    rounds = [r.server_round for r in second.rounds[1:]]
    assert rounds == [KILL_ROUND, KILL_ROUND + 1, KILL_ROUND + 2]
    stale = w.party(0)
    assert any(
        e.startswith(f"ProofError: certify of round {KILL_ROUND}: this party already signed")
        for e in stale.errors
    )
    assert all(len(d) == 1 for d in _rounds_signed(w).values())
    _no_evidence(w, second)
    # it catches up above the number it signed, and everyone trains the last round
    last = second.rounds[-1]
    assert sorted(last.trained) == sorted(n.node_id for n in w.nodes.values())
    assert all(w.party(p).held_digest == last.digest for p in range(N))


def test_when_no_replica_can_be_pulled_a_verified_federation_takes_no_new_initial_state(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.kill_mid_certify(2)
    for p in range(N):  # every replica is damaged in memory; the receipts still verify
        party = w.party(p)
        party.held_state = type(party.held_state)(
            arrays={n: a + 1.0 for n, a in party.held_state.arrays.items()},
            round=party.held_state.round,
        )
        party._bytes_round = -1
    held = {p: (w.party(p).held_round, w.party(p).held_digest) for p in range(N)}
    second = w.strategy()
    second.start(w.grid, _initial(), num_rounds=KILL_ROUND + 3, timeout=10)
    hello, fresh = second.rounds[0], second.rounds[1]
    assert hello.server_round == -1  # nothing verified could be pulled
    # the server may not choose a new initial model for parties that signed rounds: a
    # genesis (no base) is round 0, taken only by a party that holds and signed nothing
    assert fresh.server_round == 0 and fresh.holders == []
    for p in range(N):
        party = w.party(p)
        assert (party.held_round, party.held_digest) == held[p]
        assert any(e.startswith("ProofError: certify of round 0") for e in party.errors)
    assert all(len(d) == 1 for d in _rounds_signed(w).values())


def test_a_restarted_server_pulls_over_the_parties_direct_links(tmp_path: Path) -> None:
    # the parties serve their replicas over authenticated links; the restarted ServerApp is no
    # member, so its hello names a fresh link key that each party grants reads: the resume
    # pull then dials the holders' signed endpoints and needs no exchange of Flower messages
    from chaos_flwr.flower.direct import stop_servers
    from chaos_flwr.flower.grant import RelayGrants

    w = World(tmp_path, direct=True)
    try:
        killed_digest = w.kill_mid_certify(N - 1)
        second = w.strategy()
        second.start(w.grid, _initial(), num_rounds=KILL_ROUND + 3, timeout=10)
    finally:
        stop_servers()
    hello = second.rounds[0]
    assert hello.server_round == KILL_ROUND and hello.digest == killed_digest
    report = second.last_pull
    assert report is not None and report.direct_failed == []
    holders = {w.fed.party_ids[p] for p in range(N - 1)}
    assert set(report.direct) == holders and report.direct == report.shares  # all direct
    assert report.exchanges == 0  # manifest and shards over the links: no relay exchange
    fed = w.charter.federation
    grants = {frozenset(RelayGrants(w.state_root / f"party-{p}", fed)()) for p in range(N)}
    assert len(grants) == 1 and frozenset() not in grants  # every party granted the run key
    _check_goes_on(w, second, hello, KILL_ROUND + 1)
