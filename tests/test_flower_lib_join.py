"""Joins, leaves, failures and restarts of signed parties through ChaosStrategy (fake Grid).

Every party here is built by ``default_party_factory`` from a federation folder written by
``make_federation`` (run config ``chaos-keys-dir`` / ``chaos-state-root`` + ``partition-id``),
so these tests also cover the simulation fallback of the party settings.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import MessageType
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.flower.client import (
    Party,
    default_party_factory,
    enable,
    forget_party,
    party_for,
)
from chaos_flwr.flower.keys import charter_path, key_path, load_federation, make_federation
from chaos_flwr.flower.schema import CHAOS_MESSAGE_TYPE, CHAOS_RECORD_KEY
from chaos_flwr.flower.server import (
    ChaosStrategy,
    JoinLog,
    JoinSettings,
    PhaseSettings,
    RoundLog,
    certified_digest,
)
from chaos_flwr.state import TrainingState
from chaos_flwr.store import ReplicaStore


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


#: 3 x 4096 float32 + a bias: ~48 KiB, so a 1 KiB-shard plan spreads over several donors.
SHAPE = (3, 4096)


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(1)
    return ArrayRecord(
        {
            "w": Array(rng.normal(size=SHAPE).astype(np.float32)),
            "b": Array(np.zeros(3, np.float32)),
        }
    )


class World:
    """A federation folder, a fake Grid and one enabled app; nodes by partition id."""

    def __init__(
        self,
        tmp: Path,
        n_parties: int,
        *,
        founders: int = 3,
        factory: Callable[[Context], Party] | None = None,
        **charter: Any,
    ) -> None:
        self.keys = make_federation(
            tmp / "fed", n_parties, founders=founders, seed="lib-join", **charter
        )
        self.fed = load_federation(self.keys)
        self.charter = load_charter(charter_path(self.keys))
        self.state_root = tmp / "state"
        self.grid = FakeGrid()
        self.nodes: dict[int, FakeNode] = {}
        self.hooks: dict[int, Callable[[], None]] = {}  # round -> action, run at its training
        self.app = self._app(factory or default_party_factory)

    def _app(self, factory: Callable[[Context], Party]) -> ClientApp:
        app = ClientApp()

        @app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            hook = self.hooks.pop(rnd, None)
            if hook is not None:
                hook()
            k = int(ctx.node_config["partition-id"]) + 1
            out = {
                name: Array((a.numpy() * (1 - 0.01 * k) + 0.01 * k * rnd).astype(np.float32))
                for name, a in msg.content["arrays"].items()
            }
            metrics = MetricRecord({"num-examples": 10 * k})
            return Message(
                RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg
            )

        @app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            w = msg.content["arrays"]["w"].numpy()
            return Message(
                RecordDict({"metrics": MetricRecord({"s": float(w.sum()), "num-examples": 1})}),
                reply_to=msg,
            )

        enable(app, party_factory=factory)
        return app

    def add(self, partition: int, **node_config: Any) -> FakeNode:
        node = self.grid.add_node(
            self.app,
            node_config={"partition-id": partition, **node_config},
            run_config={"chaos-keys-dir": str(self.keys), "chaos-state-root": str(self.state_root)},
        )
        self.nodes[partition] = node
        return node

    def party(self, partition: int) -> Party:
        return party_for(self.nodes[partition].context, self.app)

    def pid(self, partition: int) -> str:
        return self.fed.party_ids[partition]

    def strategy(self, **kw: Any) -> ChaosStrategy:
        kw.setdefault("phases", PhaseSettings(phase_timeout_s=2.0))
        return ChaosStrategy(
            FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
            charter=self.charter,
            **kw,
        )


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1 (all bound at once, so no two are the same)."""
    import socket
    from contextlib import ExitStack

    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _joins(strategy: ChaosStrategy, party: str) -> list[tuple[RoundLog, JoinLog]]:
    return [(r, j) for r in strategy.rounds for j in r.joins if j.party == party]


def test_make_federation_writes_keys_and_a_founder_signed_charter(tmp_path: Path) -> None:
    folder = make_federation(tmp_path / "f", 4, founders=2, allowlist_extra=2, seed="s")
    fed = load_federation(folder)
    assert sorted(fed.party_ids) == [0, 1, 2, 3, 4, 5]
    assert fed.founders == sorted([fed.party_ids[0], fed.party_ids[1]])
    charter = load_charter(charter_path(folder))  # verifies the founders' signatures
    assert {m.party_id for m in charter.allowlist} == {fed.party_ids[i] for i in range(2, 6)}
    again = load_federation(make_federation(tmp_path / "g", 4, seed="s"))
    assert again.party_ids == {i: fed.party_ids[i] for i in range(4)}  # same seed, same keys


def test_a_joiner_is_sponsored_then_pulls_from_several_donors_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    w = World(tmp_path, 4)
    for p in range(3):
        w.add(p)
    joiner: dict[str, FakeNode] = {}
    w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))  # a SuperNode appears mid-training
    strategy = w.strategy(joins=JoinSettings(source="peers"))  # the multi-source pull
    result = strategy.start(w.grid, _initial(), num_rounds=5, timeout=10)
    founders = sorted(w.pid(p) for p in range(3))
    jp = w.pid(3)

    # admitted by a signed join record (joiner + sponsor), as the server-side view saw it
    (event,) = [e for r in strategy.rounds for e in r.events if e.kind == "join"]
    assert event.subject == jp and event.settle_s is not None and event.settle_s >= 0
    record = next(r for r in strategy.view.records if r.kind == "join" and r.subject == jp)  # type: ignore[union-attr]
    assert len(record.signatures) == 2 and jp in record.signatures

    # pulled the certified state from >= 2 donors in planner-sized shares, digest checked
    ((rlog, join),) = _joins(strategy, jp)
    assert join.ok and join.error == ""
    assert join.server_round == rlog.server_round >= event.server_round
    assert len(join.bytes_per_donor) >= 2 and set(join.donors) <= set(founders)
    assert sum(join.bytes_per_donor.values()) == join.total_bytes
    assert join.bytes_per_donor == join.planned_bytes  # no donor lost: the plan as made
    assert sum(join.planned_shards.values()) == join.num_shards >= 2
    assert join.lower_bound_s > 0 and join.pull_s > 0
    assert join.steps == 3  # size+manifest, shards, done: the donor planned the shape as it did
    assert join.digest == rlog.digest
    pulled = ReplicaStore(w.state_root / "party-3" / "replicas").get(join.server_round)
    assert pulled.digest() == join.digest  # what it assembled is what the holders certified
    assert w.party(3).held_digest == strategy.rounds[-1].digest

    # trains from the next round on; the view lists it active
    n = joiner["n"].node_id
    after = [r for r in strategy.rounds if r.server_round > rlog.server_round]
    assert after and all(n in r.trained for r in after)
    assert all(n not in r.trained for r in strategy.rounds if r.server_round <= rlog.server_round)
    assert strategy.rounds[-1].members == {"active": sorted([*founders, jp])}
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4, 5]


class _BadShards:
    """Wraps a party's serve so that every shard it sends has one byte flipped."""

    def __init__(self, party: Party) -> None:
        self.party = party
        self.inner = party.serve
        self.served = 0

    def __call__(self, record: ConfigRecord, request: ConfigRecord) -> ConfigRecord | None:
        out = self.inner(record, request)
        data = out.get("data") if out is not None else None
        if out is not None and isinstance(data, list) and data:
            self.served += 1
            out["data"] = [bytes([c[0] ^ 0xFF]) + c[1:] if c else c for c in data]
        return out


def test_a_donor_sending_bad_shards_is_dropped_and_its_shares_replanned(tmp_path: Path) -> None:
    liars: dict[int, _BadShards] = {}

    def factory(ctx: Context) -> Party:
        party = default_party_factory(ctx)
        if int(ctx.node_config["partition-id"]) == 1:
            liars[1] = _BadShards(party)
            party.serve = liars[1]  # type: ignore[method-assign]
        return party

    w = World(tmp_path, 4, factory=factory)
    for p in range(3):
        w.add(p)
    w.hooks[1] = lambda: w.add(3) and None
    strategy = w.strategy(joins=JoinSettings(source="peers"))
    strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
    ((rlog, join),) = _joins(strategy, w.pid(3))
    bad = w.pid(1)
    assert liars[1].served >= 1  # it was asked for (and sent) shards
    assert join.ok and join.lost == [bad] and bad not in join.bytes_per_donor
    assert bad in join.planned_bytes  # it had a share in the first plan ...
    assert sum(join.bytes_per_donor.values()) == join.total_bytes  # ... others sent it instead
    assert join.digest == rlog.digest and w.party(3).held_digest == strategy.rounds[-1].digest
    assert w.nodes[3].node_id in strategy.rounds[-1].trained


def test_a_leaver_signs_its_leave_and_is_never_sampled_again(tmp_path: Path) -> None:
    w = World(tmp_path, 4, founders=3)
    for p in range(4):
        w.add(p)
    w.hooks[3] = lambda: w.party(3).leave()
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=6, timeout=10)
    leaver = w.pid(3)
    node = w.nodes[3].node_id
    (left_in,) = [r for r in strategy.rounds if leaver in r.leaves]
    (event,) = [e for e in left_in.events if e.kind == "leave"]
    assert event.subject == leaver and event.settle_s is not None
    assert strategy.rounds[-1].members["left"] == [leaver]
    assert leaver not in strategy.rounds[-1].members["active"]
    later = [r for r in strategy.rounds if r.server_round > left_in.server_round]
    assert later and all(node not in r.eligible and node not in r.trained for r in later)
    assert leaver not in strategy.rounds[-1].holders  # no receipt after leaving
    # every other party's own view agrees
    for p in range(3):
        view = w.party(p).peer.view()  # type: ignore[union-attr]
        assert view.members[leaver].status == "left"
    # leaving is durable: its SuperNode restarts (and the ServerApp too): it stays out
    forget_party(w.nodes[3].context)
    again = w.strategy()
    again.start(w.grid, _initial(), num_rounds=8, timeout=10)
    assert w.party(3).left and not any(e.kind == "join" for r in again.rounds for e in r.events)
    assert again.rounds[-1].members["left"] == [leaver]
    assert all(node not in r.trained for r in again.rounds)


def test_a_crashed_party_is_not_sampled_then_declared_failed_by_its_peers(tmp_path: Path) -> None:
    w = World(tmp_path, 4, founders=4, heartbeat_interval_s=0.02, suspicion_timeout_s=0.25)
    for p in range(4):
        w.add(p)
    victim = w.nodes[3]
    w.hooks[2] = lambda: setattr(victim, "mode", "dead")

    def slow_sleep_train() -> None:  # give the peers' suspicion timers real time to run out
        time.sleep(0.1)

    for rnd in range(3, 9):
        w.hooks[rnd] = slow_sleep_train
    strategy = w.strategy(phases=PhaseSettings(phase_timeout_s=0.3))
    strategy.start(w.grid, _initial(), num_rounds=8, timeout=10)
    crashed = w.pid(3)
    died = next(r for r in strategy.rounds if victim.node_id in r.missing)
    later = [r for r in strategy.rounds if r.server_round > died.server_round]
    assert later and all(victim.node_id not in r.eligible for r in later)
    failed_in = [r for r in strategy.rounds if crashed in r.failures]
    assert failed_in, "the peers' fail record never reached the server-side view"
    assert crashed in strategy.rounds[-1].members["failed"]
    (event,) = [e for e in failed_in[0].events if e.kind == "fail" and e.subject == crashed]
    assert event.settle_s is not None


def test_restarted_parties_with_and_without_their_disks(tmp_path: Path) -> None:
    w = World(tmp_path, 5, founders=3)
    for p in range(5):
        w.add(p)
    first = w.strategy()
    first.start(w.grid, _initial(), num_rounds=3, timeout=10)
    digest3 = first.rounds[-1].digest
    assert all(w.party(p).held_digest == digest3 for p in range(5))
    # the ServerApp dies; SuperNode 3 restarts with its disk, SuperNode 4 without
    old3, old4 = w.party(3), w.party(4)
    for p in (3, 4):
        forget_party(w.nodes[p].context)
    shutil.rmtree(w.state_root / "party-4")
    second = w.strategy()
    second.start(w.grid, _initial(), num_rounds=5, timeout=10)
    new3, new4 = w.party(3), w.party(4)
    assert new3 is not old3 and new4 is not old4
    assert new3.errors == [] and new4.errors == []
    assert new3.peer.incarnation > old3.peer.incarnation  # type: ignore[union-attr]
    hello = second.rounds[0]
    assert hello.server_round == 3 and w.pid(3) in hello.holders  # its replica verified
    assert second.last_pull is not None and len(second.last_pull.shares) >= 2  # in parallel
    assert w.pid(4) not in hello.holders
    assert [j.party for j in hello.joins] == [w.pid(4)]  # only the diskless one joins
    # the resumed ServerApp holds the state it pulled: it sends it in one message
    assert hello.joins[0].ok and hello.joins[0].source == "server" and hello.joins[0].steps == 1
    assert all(w.nodes[p].node_id in second.rounds[-1].trained for p in range(5))
    assert new3.held_digest == new4.held_digest == second.rounds[-1].digest
    assert sorted(second.rounds[-1].members["active"]) == sorted(w.pid(p) for p in range(5))


def test_a_stale_replica_catches_up_by_pulling(tmp_path: Path) -> None:
    w = World(tmp_path, 4, founders=3)
    for p in range(4):
        w.add(p)
    store = ReplicaStore(w.state_root / "party-3" / "replicas")
    w.hooks[3] = lambda: setattr(w.nodes[3], "mode", "dead")  # down for rounds 3-4
    w.hooks[5] = lambda: (forget_party(w.nodes[3].context), setattr(w.nodes[3], "mode", "ok"))
    strategy = w.strategy(phases=PhaseSettings(phase_timeout_s=0.3))
    strategy.start(w.grid, _initial(), num_rounds=7, timeout=10)
    back = w.party(3)
    pulls = _joins(strategy, w.pid(3))
    assert pulls and all(j.ok for _, j in pulls)
    _, join = pulls[0]
    assert join.server_round >= 5 and back.held_round == strategy.rounds[-1].server_round
    assert store.rounds()[-1] == strategy.rounds[-1].server_round
    assert certified_digest(back.held_arrays, back.held_round) == back.held_digest  # type: ignore[arg-type]


def test_a_replica_without_the_partys_own_receipt_is_not_taken_up(tmp_path: Path) -> None:
    w = World(tmp_path, 3, founders=3)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    store = ReplicaStore(w.state_root / "party-2" / "replicas")
    good = store.latest()
    assert good is not None
    forged = TrainingState(arrays={k: v + 1 for k, v in good.arrays.items()}, round=good.round + 1)
    store.put(forged, certificate=b"\x00" * 64)  # a state nobody signed for
    forget_party(w.nodes[2].context)
    party = default_party_factory(w.nodes[2].context)
    assert party.held_round == -1 and party.errors and "signed receipt" in party.errors[0]


def _fedadam() -> Any:
    from flwr.serverapp.strategy import FedAdam

    return FedAdam(
        eta=0.05, eta_l=0.05, min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=3
    )


def _fedadam_run(w: World, rounds: list[int], **kw: Any) -> tuple[ChaosStrategy, ArrayRecord]:
    """Run ChaosStrategy(FedAdam) to each number of rounds in turn, a new ServerApp each time."""
    arrays = _initial()
    strategy = ChaosStrategy(
        _fedadam(), charter=w.charter, phases=PhaseSettings(phase_timeout_s=2.0)
    )
    for n in rounds:
        strategy = ChaosStrategy(
            _fedadam(), charter=w.charter, phases=PhaseSettings(phase_timeout_s=2.0), **kw
        )
        arrays = strategy.start(w.grid, _initial(), num_rounds=n, timeout=10).arrays
    return strategy, arrays


def _close(a: ArrayRecord, b: ArrayRecord) -> bool:
    return all(np.allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-6) for k in a)


def test_fedadam_moments_survive_a_server_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def world(name: str) -> World:
        w = World(tmp_path / name, 3)
        for p in range(3):
            w.add(p)
        return w

    _, straight = _fedadam_run(world("a"), [4])
    resumed_s, resumed = _fedadam_run(world("b"), [2, 4])
    hello = resumed_s.rounds[0]
    assert hello.server_round == 2 and [r.server_round for r in resumed_s.rounds[1:]] == [3, 4]
    assert _close(straight, resumed)
    # the moments really travel with the certified state: every replica holds them ...
    replica = ReplicaStore(tmp_path / "b" / "state" / "party-0" / "replicas").get(4)
    moments = TrainingState.from_bytes(replica.strategy_state)
    assert sorted(moments.arrays) == ["m_t/b", "m_t/w", "v_t/b", "v_t/w"]
    # ... and a restart that dropped them would have trained to a different model
    import chaos_flwr.flower.server.strategy as strategy_mod

    monkeypatch.setattr(strategy_mod, "restore_strategy_state", lambda inner, blob: None)
    _, forgetful = _fedadam_run(world("c"), [2, 4])
    assert not _close(straight, forgetful)


class _TamperingGrid(FakeGrid):
    """A carrier that shows one node a different state in one round's certify message."""

    def __init__(self, victim: int, server_round: int) -> None:
        super().__init__()
        self.victim, self.server_round, self.tampered = victim, server_round, 0

    def push_messages(self, messages: Any) -> Any:
        msgs = list(messages)
        for m in msgs:
            rec = m.content.get("chaos") if m.has_content() else None
            if (
                m.metadata.dst_node_id == self.victim
                and isinstance(rec, ConfigRecord)
                and rec.get("phase") == "certify"
                and rec.get("round") == self.server_round
                and "arrays" in m.content
            ):
                arrays = m.content["arrays"]
                content = RecordDict(dict(m.content.items()))
                content["arrays"] = ArrayRecord(
                    {k: Array(v.numpy() + 0.5) for k, v in arrays.items()}
                )
                # it names the digest of what it shows (a certify whose state does not hash
                # to its digest is refused outright), so the victim signs it
                rec = ConfigRecord(dict(rec.items()))
                sstate = rec.get("strategy-state", b"")
                assert isinstance(sstate, bytes)
                rec["digest"] = certified_digest(content["arrays"], self.server_round, sstate)  # type: ignore[arg-type]
                content["chaos"] = rec
                m.content = content
                self.tampered += 1
        return super().push_messages(msgs)


def test_a_relay_that_shows_two_states_of_a_round_is_caught_by_the_parties(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, 4, founders=4)
    w.grid = _TamperingGrid(victim=1002, server_round=2)
    for p in range(4):
        w.add(p)
    assert w.nodes[1].node_id == 1002
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
    assert w.grid.tampered == 1
    # the victim certified what it was shown, the others what the ServerApp aggregated
    r2 = next(r for r in strategy.rounds if r.server_round == 2)
    assert w.pid(1) not in r2.holders and len(r2.holders) == 3
    (pull,) = r2.joins  # the victim is asked to pull the other state of round 2 ...
    assert pull.party == w.pid(1) and not pull.ok and "EquivocationError" in pull.error
    from chaos_flwr.receipts import Equivocation

    for p in range(4):
        party = w.party(p)
        assert party.evidence, f"party {p} did not notice"
        ev = party.evidence[0]
        assert ev.round == 2 and ev.culprit == "relay"
        ev.verify(w.charter.keyring())  # transferable: anyone with the keyring can check it
        assert any(e.startswith("EquivocationError") for e in party.errors)
    r3 = next(r for r in strategy.rounds if r.server_round == 3)
    assert r3.trained and all(n in r3.errors for n in r3.trained)  # every party refused
    reported = [Equivocation.decode(b) for r in strategy.rounds for b in r.equivocations]
    assert reported and all(e.round == 2 for e in reported)


def test_honest_rounds_give_no_evidence(tmp_path: Path) -> None:
    w = World(tmp_path, 3, founders=3)
    for p in range(3):
        w.add(p)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    assert all(not w.party(p).evidence for p in range(3))
    assert all(r.equivocations == [] and r.errors == {} for r in strategy.rounds)
    assert sorted(strategy.rounds[-1].trained) == sorted(n.node_id for n in w.nodes.values())


def test_members_link_up_and_a_dropped_link_is_a_signed_link_down(tmp_path: Path) -> None:
    w = World(tmp_path, 4, founders=4)
    for p in range(4):
        w.add(p)
    w.hooks[3] = lambda: w.party(0).disconnect(w.pid(1))
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=5, timeout=10)
    ups = [e for r in strategy.rounds for e in r.events if e.kind == "link_up"]
    assert len(ups) == 6  # every pair of the 4 members, each asked once by its lower id
    downs = [(r, e) for r in strategy.rounds for e in r.events if e.kind == "link_down"]
    ((rlog, down),) = downs
    assert down.subject == "|".join(sorted([w.pid(0), w.pid(1)]))
    assert rlog.server_round >= 3 and down.settle_s is not None
    for p in range(4):
        view = w.party(p).peer.view()  # type: ignore[union-attr]
        assert w.pid(1) not in view.neighbours(w.pid(0))
        assert w.pid(2) in view.neighbours(w.pid(0))
    assert sorted(strategy.rounds[-1].trained) == sorted(n.node_id for n in w.nodes.values())


def _ctx(node_config: dict[str, Any], run_config: dict[str, Any]) -> Context:
    return Context(
        run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config=run_config
    )


def test_party_settings_fall_back_to_the_run_config_and_name_what_is_wrong(
    tmp_path: Path,
) -> None:
    from chaos_flwr.errors import ConfigError
    from chaos_flwr.flower.client import party_settings

    keys = make_federation(tmp_path / "fed", 2, founders=1, seed="cfg")
    run = {"chaos-keys-dir": str(keys), "chaos-state-root": str(tmp_path / "st")}
    got = party_settings(_ctx({"partition-id": 1, "num-partitions": 2}, run))
    assert got.key_path == keys / "party-1.key" and got.charter_path == keys / "charter.yaml"
    assert got.state_dir == tmp_path / "st" / "party-1" and not got.unsigned
    # node_config keys win over the fallback
    mine = tmp_path / "elsewhere"
    got = party_settings(_ctx({"partition-id": 1, "chaos-state-dir": str(mine)}, run))
    assert got.state_dir == mine and got.key_path == keys / "party-1.key"
    with pytest.raises(ConfigError, match="node_config 'partition-id'"):
        party_settings(_ctx({}, run))
    with pytest.raises(ConfigError, match=r"run_config 'chaos-keys-dir'.*party-5\.key"):
        party_settings(_ctx({"partition-id": 5}, run))
    with pytest.raises(ConfigError, match=r"run_config 'chaos-keys-dir'.*not a directory"):
        party_settings(_ctx({"partition-id": 0}, {"chaos-keys-dir": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match="node_config 'chaos-state-dir' is missing"):
        party_settings(_ctx({"partition-id": 0}, {"chaos-keys-dir": str(keys)}))
    # a party built from the fallback is the partition's identity
    party = default_party_factory(_ctx({"partition-id": 0}, run))
    assert party.party_id == load_federation(keys).party_ids[0]
    assert party.peer is not None and party.peer.is_member  # type: ignore[attr-defined]


def test_a_party_never_signs_a_second_state_for_a_round_it_certified(tmp_path: Path) -> None:
    # a malicious relay sends a party another state for a round it already signed: the party
    # keeps (and keeps signing) the state it holds, and logs the attempt
    w = World(tmp_path, 3, founders=3)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=2, timeout=10)
    party = w.party(0)
    assert party.held_round == 2 and party.store is not None
    held, stored = party.held_digest, party.store.get(2).digest()
    assert stored == held
    other = ArrayRecord(
        {"w": Array(np.ones(SHAPE, np.float32)), "b": Array(np.ones(3, np.float32))}
    )
    proof = {"phase": "certify", "base-round": 1, "rule": b"", "commits": [], "audits": []}
    base1 = party.store.get(1).digest()

    def certify(rnd: int, arrays: ArrayRecord) -> ConfigRecord:
        digest = certified_digest(arrays, rnd)
        return party.process(
            ConfigRecord({**proof, "round": rnd, "digest": digest, "base-digest": base1}), arrays
        )

    out = certify(2, other)
    assert party.held_digest == held and party.store.get(2).digest() == held
    assert out["receipt-round"] == 2 and out["receipt-digest"] == held
    assert any(
        e.startswith("ProofError: certify of round 2: this party already") for e in party.errors
    )
    # an older round it signed is not re-signed another way either, stored or not
    assert 1 in party.store.rounds()
    certify(1, other)
    assert party.held_round == 2 and party.held_digest == held
    assert any(
        e.startswith("ProofError: certify of round 1: this party already") for e in party.errors
    )
    party.store.path_of(1).unlink()
    certify(1, other)
    assert party.held_round == 2 and party.held_digest == held
    # a certify without its proof is refused before anything is hashed
    n = len(party.errors)
    party.process(ConfigRecord({"phase": "certify", "round": 3}), other)
    assert party.held_round == 2 and party.errors[n].startswith("ProofError: certify field")


def test_a_joiner_pulls_over_the_donors_direct_links_when_they_advertise_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    # two founders serve their replicas on loopback (chaos-direct-addr); the third is relay-only
    from chaos_flwr.flower.direct import stop_servers

    w = World(tmp_path, 4)
    try:
        ports = free_ports(2)
        for p in range(3):
            extra = {"chaos-direct-addr": f"127.0.0.1:{ports[p]}"} if p < 2 else {}
            w.add(p, **extra)
        joiner: dict[str, FakeNode] = {}
        w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))
        # the default source: the ServerApp sees the donors' signed endpoint records and has
        # the joiner pull from them instead of sending the state itself
        strategy = w.strategy()
        strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
        from chaos_flwr.flower.direct import _SERVERS

        servers = dict(_SERVERS)
    finally:
        stop_servers()
    # both donors served over authenticated links, each under the endpoint it signed
    assert len(servers) == 2 and all(s.link is not None for s in servers.values())
    view = strategy.courier.view
    assert view is not None
    for p in (0, 1):
        ep = view.records.endpoint(w.pid(p))
        assert ep is not None and ep.address in servers
        assert ep.cert == servers[ep.address].link.creds.serve_cert_der
    assert view.records.endpoint(w.pid(2)) is None  # relay-only: announced nothing
    jp = w.pid(3)
    ((rlog, join),) = _joins(strategy, jp)
    assert join.ok and join.digest == rlog.digest
    # the joiner knew the signed endpoints: the manifest and the direct shards came over the
    # links in its first step, and only the relay-only donor's share took a second one
    assert join.steps == 2
    direct = {w.pid(0), w.pid(1)}
    # the direct donors' bytes came over their links (one's first batch may be beaten by the
    # other's end-game copy); the relay-only donor's share came through the relay
    assert set(join.direct_bytes) <= direct and join.direct_failed == []
    relayed = join.bytes_per_donor.get(w.pid(2), 0)
    assert sum(join.direct_bytes.values()) == join.total_bytes - relayed > 0
    assert all(join.direct_bytes.get(d, 0) == join.bytes_per_donor.get(d, 0) for d in direct)
    assert w.pid(2) not in join.direct_bytes and join.bytes_per_donor.get(w.pid(2), 0) > 0
    assert set(join.rate_bps) == set(join.donors) and all(r > 0 for r in join.rate_bps.values())
    assert sum(join.bytes_per_donor.values()) == join.total_bytes
    pulled = ReplicaStore(w.state_root / "party-3" / "replicas").get(join.server_round)
    assert pulled.digest() == join.digest
    n = joiner["n"].node_id
    assert all(n in r.trained for r in strategy.rounds if r.server_round > rlog.server_round)


def _late_direct_run(tmp_path: Path, sponsors: int = 0) -> tuple[World, ChaosStrategy, int]:
    """Three founders serving their replicas on loopback (``sponsors_required: sponsors``); a
    fourth party's node comes during round 2's training. Returns the world, the strategy
    after 3 rounds and the joiner's node."""
    from chaos_flwr.flower.direct import stop_servers

    w = World(tmp_path, 4, sponsors_required=sponsors)
    try:
        ports = free_ports(3)
        for p in range(3):
            w.add(p, **{"chaos-direct-addr": f"127.0.0.1:{ports[p]}"})
        joiner: dict[str, FakeNode] = {}
        w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))
        strategy = w.strategy()
        strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    finally:
        stop_servers()
    return w, strategy, joiner["n"].node_id


def test_a_joiner_that_comes_during_training_pulls_over_direct_links_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the joiner, admitted by its own signed join, fetches the round's base state over the
    # links in one step (no message to the training donors) and trains in round 2
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    w, strategy, n = _late_direct_run(tmp_path)
    ((rlog, join),) = _joins(strategy, w.pid(3))
    assert rlog.server_round == 2 and join.ok and join.source != "server"
    assert join.server_round == 1 and join.digest == _round_log(strategy, 1).digest
    assert join.steps == 1 and join.direct_failed == []  # no relay step to the donors
    assert sum(join.direct_bytes.values()) == join.total_bytes > 0
    assert set(join.direct_bytes) <= {w.pid(p) for p in range(3)}
    assert n in rlog.trained and n in _round_log(strategy, 3).trained
    # the question carried the join's start: one Chaos message, then its train message
    assert _before_train(w.grid.node(n).received) == [CHAOS_MESSAGE_TYPE]


def test_a_joiner_whose_join_step_breaks_still_answers_and_takes_the_serverapps_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the question carries the join's start; the joiner's join step breaks (a disk error): its
    # reply still names its party and brings its records, so the ServerApp sends it the
    # state in the same round instead of taking it for a silent node
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    broke: list[str] = []
    real = Party.join_step

    def join_step(self: Party, *a: Any) -> Any:
        if not broke:
            broke.append(self.party_id)
            raise OSError(28, "No space left on device")
        return real(self, *a)

    monkeypatch.setattr(Party, "join_step", join_step)
    w, strategy, n = _late_direct_run(tmp_path)
    assert broke == [w.pid(3)]
    assert strategy.courier.relay.party_of.get(n) == w.pid(3)
    assert n not in strategy.join_relay.silent
    ((rlog, join),) = _joins(strategy, w.pid(3))
    assert rlog.server_round == 2 and join.ok and join.source == "server"
    assert n in rlog.trained
    assert any(e.startswith("join step failed: OSError") for e in w.party(3).errors)


def _one_round(tmp_path: Path) -> tuple[World, ChaosStrategy]:
    """Three founders after one round."""
    w = World(tmp_path, 3)
    for p in range(3):
        w.add(p)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=1, timeout=10)
    return w, strategy


def test_a_join_step_takes_the_messages_news_before_it_looks_at_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a newcomer's first message may be the join's start: before it decides anything, the
    # join step takes the records its daemon heard and the relay's refutations (a held state
    # audited false is rolled back before "already held" is answered)
    from chaos_flwr.flower.client import party as party_mod

    w, _ = _one_round(tmp_path)
    party = w.party(0)
    seen: list[tuple[str, Any]] = []
    heard, refutations = party_mod.gossipfile.take_heard, party_mod.proofs.take_refutations

    def take_heard(p: Any, now: float) -> int:
        seen.append(("heard", p.held_round))
        return heard(p, now)

    def take_refutations(p: Any, record: Any) -> None:
        seen.append(("refuted", record.get("refuted")))
        refutations(p, record)

    monkeypatch.setattr(party_mod.gossipfile, "take_heard", take_heard)
    monkeypatch.setattr(party_mod.proofs, "take_refutations", take_refutations)
    rnd, digest = party.held_round, party.held_digest
    record = ConfigRecord({"round": rnd, "digest": digest, "refuted": [b"an audit"]})
    reply, _ = party.join_step(record, ConfigRecord({"op": "start"}), {})
    assert reply["error"] == "already held"
    assert seen == [("heard", rnd), ("refuted", [b"an audit"])]


def test_a_newcomers_first_message_carries_the_refutations_whatever_its_phase(
    tmp_path: Path,
) -> None:
    # a newcomer's first message may be the join's start: the relay's refutations ride on it,
    # so a party that comes back holding a state audited false rolls back before it pulls
    from chaos_flwr.flower.server.courier import PhaseSpec

    w, strategy = _one_round(tmp_path)
    courier = strategy.courier
    assert courier.proofs is not None
    courier.proofs.refuted[(1, b"x" * 32)] = b"signed audit"
    known = w.nodes[0].node_id
    spec = PhaseSpec("join", 1, b"x" * 32)
    first, _ = courier.message(4242, spec)
    again, _ = courier.message(4242, spec)
    member, _ = courier.message(known, spec)
    refuted = [m.content[CHAOS_RECORD_KEY].get("refuted") for m in (first, again, member)]
    assert refuted == [[b"signed audit"], None, None]


def test_a_joiner_during_training_whose_links_fail_takes_the_serverapps_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the donors' links do not answer: no relay step goes to the training donors; the
    # ServerApp sends the state in the same round, and no envelope is lost on the way
    from chaos_flwr.flower import fetch
    from chaos_flwr.flower.relay import Relay
    from chaos_flwr.flower.server.joins import JoinRelay

    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    monkeypatch.setattr(fetch, "fetch_manifest", lambda *a, **k: (None, "TransportError: down"))
    asked: dict[int, int] = {}  # donor node -> envelopes its (unsent) pull messages took
    back: dict[int, int] = {}
    ask, give_back = JoinRelay._ask_joiners, Relay.give_back

    def ask_joiners(self: JoinRelay, *a: Any, **k: Any) -> Any:
        step = ask(self, *a, **k)
        for node, envs in step.taken.items():
            asked[node] = asked.get(node, 0) + len(envs)
        return step

    def give(self: Relay, node: int, envs: Any) -> None:
        back[node] = back.get(node, 0) + len(envs)
        give_back(self, node, envs)

    monkeypatch.setattr(JoinRelay, "_ask_joiners", ask_joiners)
    monkeypatch.setattr(Relay, "give_back", give)
    w, strategy, n = _late_direct_run(tmp_path)
    ((rlog, join),) = _joins(strategy, w.pid(3))
    assert rlog.server_round == 2 and join.ok and join.source == "server"
    assert join.server_round == 1 and n in rlog.trained
    # the envelopes the joiner's pull requests took for the donors went back to their queues
    assert sum(asked.values()) > 0 and all(back.get(d, 0) >= k for d, k in asked.items())
    assert strategy.courier.relay.dropped == 0


def test_a_joiner_during_training_whose_sponsors_do_not_countersign_trains_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the holders serve over links in their ClientApps, with no daemon to countersign: the
    # joiner's direct step fails (it is no member), so it gets no copy and no train message
    # in round 2; its sponsors countersign through the relay and it trains in round 3
    from chaos_flwr.flower.client import joiner as joiner_mod

    asked: list[tuple[list[str], list[str]]] = []  # (signed, errors) per direct step

    real = joiner_mod.ask_sponsors

    def ask(party: Any, link: Any, sponsors: Any, **kw: Any) -> list[str]:
        got = real(party, link, sponsors, **kw)
        asked.append((got, [e for e in party.errors if e.startswith("countersign")]))
        return got

    monkeypatch.setattr(joiner_mod, "ask_sponsors", ask)
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    w, strategy, n = _late_direct_run(tmp_path, sponsors=1)
    assert len(asked) == 1 and asked[0][0] == []  # one direct step; no daemon signed
    # a link server with no daemon lets no non-member into a call
    assert len(asked[0][1]) == 3 and all("NotMemberError" in e for e in asked[0][1])
    ((rlog, join),) = _joins(strategy, w.pid(3))  # no copy during training: not admitted
    assert rlog.server_round == 2 and join.ok and join.server_round == 2
    assert n not in rlog.trained and n in _round_log(strategy, 3).trained
    assert strategy.courier.relay.dropped == 0


def _before_train(received: list[str]) -> list[str]:
    """The types of the messages a node got before its first train message."""
    return received[: received.index(MessageType.TRAIN)]


def _round_log(strategy: ChaosStrategy, rnd: int) -> RoundLog:
    (rlog,) = [r for r in strategy.rounds if r.server_round == rnd]
    return rlog


def _start_daemon(w: World, partition: int, addr: str) -> Any:
    """A real ``chaos-flwr party`` process for ``partition`` (its first line read)."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos_flwr.cli", "party", "--key",
         str(key_path(w.keys, partition)), "--charter", str(charter_path(w.keys)),
         "--state-dir", str(w.state_root / f"party-{partition}"), "--listen", addr],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith(f"serving {addr} as {w.pid(partition)} (link certificate "), line
    return proc


def test_a_joiner_pulls_from_party_daemons_over_authenticated_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the founders run the party daemon (a real process each, as on the deployment engine);
    # their ClientApps sign the daemon's address and certificate into endpoint records, and a
    # joiner pulls from the daemons over mutual TLS; outsiders are refused with typed errors
    import signal

    from chaos_flwr.errors import NotMemberError, StoreError
    from chaos_flwr.flower.linkfile import read_link_file
    from chaos_flwr.identity import Identity
    from chaos_flwr.transport.links import LinkDialer
    from chaos_flwr.transport.tls import LinkCredentials

    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")
    w = World(tmp_path, 4)
    addrs = {p: f"127.0.0.1:{port}" for p, port in zip((0, 1, 2), free_ports(3), strict=True)}
    daemons = {p: _start_daemon(w, p, a) for p, a in addrs.items()}
    try:
        for p in range(3):
            w.add(p, **({"chaos-direct-addr": addrs[p]} if p in addrs else {}))
        joiner: dict[str, FakeNode] = {}
        w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))
        strategy = w.strategy()
        strategy.start(w.grid, _initial(), num_rounds=4, timeout=10)
        ((rlog, join),) = _joins(strategy, w.pid(3))
        # it came during round 2's training and needs a sponsor (sponsors_required 1): the
        # daemons countersigned its join over their links while their nodes trained, so it
        # took round 1's state then and trained in round 2, the round it came during
        assert rlog.server_round == 2 and join.ok and join.server_round == 1
        assert join.digest == _round_log(strategy, 1).digest
        assert joiner["n"].node_id in rlog.trained
        # asked, countersigned and fetched in one ClientApp: one message before its train one
        assert _before_train(joiner["n"].received) == [CHAOS_MESSAGE_TYPE]
        view = strategy.courier.view
        assert view is not None and view.policy.sponsors_required == 1
        joined = view.records.member(w.pid(3))
        assert joined is not None and joined.status == "active"
        donors = {w.pid(0), w.pid(1), w.pid(2)}
        # every byte over the links (a donor's first batch may be beaten by an end-game copy,
        # so not every donor need deliver one: each was asked, see the daemons' counts below)
        assert set(join.direct_bytes) <= donors and join.direct_failed == []
        assert sum(join.direct_bytes.values()) == join.total_bytes > 0
        assert join.steps == 1  # manifest and shards over the links in one step
        view = strategy.courier.view
        assert view is not None
        for p, addr in addrs.items():  # the endpoint pins the daemon's own certificate
            ep = view.records.endpoint(w.pid(p))
            creds = read_link_file(w.state_root / f"party-{p}")
            assert ep is not None and ep.address == addr and creds is not None
            assert ep.cert == creds.serve_cert_der

        async def dial(creds: LinkCredentials, req: bytes) -> Exception | bytes:
            dialer = LinkDialer(creds)
            try:
                ep = view.records.endpoint(w.pid(0))
                assert ep is not None
                return await dialer.request(ep.address, ep.cert, req, timeout=10.0)
            except Exception as exc:  # the typed refusal is the result
                return exc
            finally:
                await dialer.close()

        import asyncio

        from chaos_flwr import codec

        req = codec.encode(
            {"round": join.server_round, "digest": b"\0" * 32, "start": [0], "end": [10]}
        )
        outsider = Identity.from_seed("not-in-charter", "x")
        got = asyncio.run(dial(LinkCredentials.create(outsider, w.charter.federation), req))
        assert isinstance(got, NotMemberError)
        member = Identity.load(key_path(w.keys, 3))
        got = asyncio.run(dial(LinkCredentials.create(member, w.charter.federation), req))
        assert isinstance(got, StoreError)  # a member, but that digest is not held there
        # a restarted ServerApp's key, once the party granted it (its hello): read, no more
        from chaos_flwr.flower.grant import write_grant
        from chaos_flwr.flower.server.pull import relay_link

        relay = relay_link(view.policy, view.records.view)
        assert isinstance(asyncio.run(dial(relay.creds, req)), NotMemberError)  # no grant yet
        write_grant(w.state_root / "party-0", w.charter.federation, relay.creds.spki)
        assert isinstance(asyncio.run(dial(relay.creds, req)), StoreError)  # served: not held
    finally:
        outs = {}
        for p, proc in daemons.items():
            proc.send_signal(signal.SIGTERM)
            outs[p] = proc.communicate(timeout=20)[0]
            assert proc.returncode == 0
    for p, out in outs.items():
        served = int(out.split("requests, ")[1].split(" bytes")[0])
        assert served >= join.direct_bytes.get(w.pid(p), 0)  # its shards (and any copy)
    assert "NotMemberError 2" in outs[0] and "StoreError 2" in outs[0]
    # each donor it asked countersigned (no message reached their training nodes for it)
    signed = [int(o.split("taken, ")[1].split(" join(s) countersigned")[0]) for o in outs.values()]
    assert signed == [1, 1, 1]
    # one daemon answered the manifest request (counted as a request; it served no bytes)
    requests = sorted(int(o.split("stopped: ")[1].split(" requests")[0]) for o in outs.values())
    assert requests[-1] >= 2 and requests[0] >= 1  # shards each, plus the manifest


def _train_contents(w: World) -> list[set[str]]:
    """Record the content keys of every train message the grid pushes."""
    seen: list[set[str]] = []
    push = w.grid.push_messages

    def recording(messages: Any) -> Any:
        msgs = list(messages)
        seen.extend(
            set(m.content.keys()) for m in msgs if m.metadata.message_type.startswith("train")
        )
        return push(msgs)

    w.grid.push_messages = recording  # type: ignore[method-assign]
    return seen


def test_train_messages_leave_out_the_model_each_party_holds(tmp_path: Path) -> None:
    from chaos_flwr.flower.held import HELD_KEY
    from chaos_flwr.flower.server.state import certified_digest

    finals, contents = {}, {}
    for elide in (True, False):
        w = World(tmp_path / str(elide), 3)
        for p in range(3):
            w.add(p)
        contents[elide] = _train_contents(w)
        strategy = w.strategy(elide_held=elide)
        result = strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
        finals[elide] = certified_digest(result.arrays, 3)
        assert [len(r.trained) for r in strategy.rounds if r.server_round >= 1] == [3, 3, 3]
    # the same rounds, the same trainers, the same model: each party trained on its own copy
    assert finals[True] == finals[False]
    # round 1's train messages carry the initial state's certify (and its arrays); from round
    # 2 on the model is left out and named instead
    assert all("arrays" in c and HELD_KEY not in c for c in contents[False])
    later = contents[True][3:]
    assert len(later) == 6 and all("arrays" not in c and HELD_KEY in c for c in later)
