"""ChaosStrategy around Flower strategies, on the in-process fake Grid."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Krum

from chaos_flwr.errors import ProfileError
from chaos_flwr.flower.client import Party, enable
from chaos_flwr.flower.profiles import available_profiles, load_profile
from chaos_flwr.flower.server import (
    ChaosStrategy,
    PhaseSettings,
    ResumeSettings,
    certified_digest,
    keyring_verifier,
)
from chaos_flwr.state import TrainingState
from chaos_flwr.store import ReplicaStore


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


class VClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 1e-3)


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {
            "w": Array(rng.normal(size=(4, 3)).astype(np.float32)),
            "b": Array(np.zeros(3, np.float32)),
        }
    )


def _app(chaos: bool, factory=None) -> ClientApp:  # type: ignore[no-untyped-def]
    """A deterministic 'training' client: moves every array by a node- and round-dependent step."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        arrays = msg.content["arrays"]
        rnd = int(msg.content["config"]["server-round"])
        k = int(ctx.node_config["k"])
        out = {
            name: Array((arr.numpy() * (1.0 - 0.01 * k) + 0.1 * k + 0.01 * rnd).astype(np.float32))
            for name, arr in arrays.items()
        }
        metrics = MetricRecord({"loss": 1.0 / (k + rnd), "num-examples": 10 * k})
        return Message(
            RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}),
            reply_to=msg,
        )

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        k = int(ctx.node_config["k"])
        metrics = MetricRecord({"score": float(w.sum()) * k, "num-examples": k})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    if chaos:
        enable(app, party_factory=factory or (lambda ctx: Party(party_id=f"p{ctx.node_id}")))
    return app


def _grid(chaos: bool, n: int = 5, clock: VClock | None = None, factory=None) -> FakeGrid:  # type: ignore[no-untyped-def]
    grid = FakeGrid(clock=clock)
    app = _app(chaos, factory)
    for k in range(1, n + 1):
        grid.add_node(app, node_config={"k": k})
    return grid


def _arrays(rec: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in rec.items()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAvg(min_available_nodes=5),
        lambda: FedProx(proximal_mu=0.1, min_available_nodes=5),
        lambda: FedAdam(eta=0.05, min_available_nodes=5),
        lambda: Krum(num_malicious_nodes=1, min_available_nodes=5),
    ],
    ids=["fedavg", "fedprox", "fedadam", "krum"],
)
def test_aggregation_is_identical_to_the_inner_strategy(make) -> None:  # type: ignore[no-untyped-def]
    random.seed(7)
    plain = make().start(
        _grid(False), _initial(), num_rounds=3, timeout=5, train_config=ConfigRecord()
    )
    random.seed(7)
    clock = VClock()
    chaos = ChaosStrategy(
        make(), phases=PhaseSettings(phase_timeout_s=5.0), clock=clock, sleep=clock.sleep
    )
    wrapped = chaos.start(
        _grid(True, clock=clock), _initial(), num_rounds=3, timeout=5, train_config=ConfigRecord()
    )
    a, b = _arrays(plain.arrays), _arrays(wrapped.arrays)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert plain.train_metrics_clientapp.keys() == wrapped.train_metrics_clientapp.keys()
    for r in plain.train_metrics_clientapp:
        assert dict(plain.train_metrics_clientapp[r]) == dict(wrapped.train_metrics_clientapp[r])
        assert dict(plain.evaluate_metrics_clientapp[r]) == dict(
            wrapped.evaluate_metrics_clientapp[r]
        )
    # every party certified every round's state (unsigned here: no verifier, and it says so)
    assert [len(r.holders) for r in chaos.rounds] == [5, 5, 5, 5]
    assert all(len(r.unsigned_receipts) == 5 for r in chaos.rounds)


def test_a_dead_party_does_not_hang_a_round_and_is_not_sampled_again() -> None:
    clock = VClock()
    grid = _grid(True, n=5, clock=clock)
    victim = list(grid.get_node_ids())[2]
    inner = FedAvg(min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=3)
    chaos = ChaosStrategy(
        inner, phases=PhaseSettings(phase_timeout_s=10.0), clock=clock, sleep=clock.sleep
    )
    calls: list[int] = []

    def kill_after_round_1(rnd: int, arrays: ArrayRecord) -> None:
        calls.append(rnd)
        if rnd == 1:
            grid.node(victim).mode = "dead"

    res = chaos.start(grid, _initial(), num_rounds=4, timeout=60, evaluate_fn=kill_after_round_1)
    assert calls == [0, 1, 2, 3, 4]
    r1, r2, r3, r4 = chaos.rounds[1:]
    assert victim in r1.trained and victim in r2.trained  # sampled before anyone knew
    assert victim in r2.missing
    assert r2.train_s == pytest.approx(10.0, abs=0.1)  # waited out the deadline once, no more
    assert victim not in r3.trained and victim not in r4.trained
    assert len(r3.trained) == 4 and r3.train_s < 0.5 and r3.certify_s < 0.5
    assert f"p{victim}" not in r3.holders
    assert 4 in res.train_metrics_clientapp


def test_node_unavailable_errors_take_a_party_out_of_sampling_at_once() -> None:
    clock = VClock()
    grid = _grid(True, n=4, clock=clock)
    victim = next(iter(grid.get_node_ids()))
    chaos = ChaosStrategy(
        FedAvg(min_available_nodes=3, min_train_nodes=3, min_evaluate_nodes=3),
        phases=PhaseSettings(phase_timeout_s=10.0),
        clock=clock,
        sleep=clock.sleep,
    )
    grid.node(victim).mode = "error"
    chaos.start(grid, _initial(), num_rounds=2, timeout=60)
    assert victim not in chaos.rounds[1].eligible  # never certified round 0
    assert all(victim not in r.trained for r in chaos.rounds[1:])
    assert all(r.train_s < 0.5 for r in chaos.rounds[1:])


def test_too_few_eligible_parties_skip_training_instead_of_blocking() -> None:
    clock = VClock()
    grid = _grid(True, n=3, clock=clock)
    for node in list(grid.get_node_ids())[:2]:
        grid.node(node).mode = "dead"
    chaos = ChaosStrategy(
        FedAvg(min_available_nodes=2),
        phases=PhaseSettings(phase_timeout_s=1.0),
        clock=clock,
        sleep=clock.sleep,
    )
    res = chaos.start(grid, _initial(), num_rounds=2, timeout=60)
    assert all(r.skipped.startswith("train: 1 eligible") for r in chaos.rounds[1:])
    assert res.train_metrics_clientapp == {}
    assert clock.t < 10.0


def _keypair() -> tuple[Ed25519PrivateKey, bytes]:
    sk = Ed25519PrivateKey.generate()
    return sk, sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def test_only_receipts_signed_by_admitted_keys_make_a_party_eligible() -> None:
    keys = {f"p{1001 + i}": _keypair() for i in range(4)}
    forger_sk, _ = _keypair()
    forger = "p1004"  # signs with a key that is not the one in the keyring

    def factory(ctx: Context) -> Party:
        pid = f"p{ctx.node_id}"
        sk = forger_sk if pid == forger else keys[pid][0]
        return Party(party_id=pid, signer=sk.sign)

    clock = VClock()
    grid = _grid(True, n=4, clock=clock, factory=factory)
    verifier = keyring_verifier({p: pk for p, (_, pk) in keys.items()})
    chaos = ChaosStrategy(
        FedAvg(min_available_nodes=3, min_train_nodes=3),
        receipt_verifier=verifier,
        clock=clock,
        sleep=clock.sleep,
    )
    chaos.start(grid, _initial(), num_rounds=2, timeout=60)
    hello, *rounds = chaos.rounds  # a fresh start: nothing to resume from
    assert hello.server_round == -1 and [r.server_round for r in rounds] == [0, 1, 2]
    assert all(r.holders == ["p1001", "p1002", "p1003"] for r in rounds)
    assert all(r.unsigned_receipts == [] for r in chaos.rounds)
    assert all(1004 not in r.trained for r in rounds)


def test_view_source_limits_sampling_to_active_parties() -> None:
    clock = VClock()
    grid = _grid(True, n=4, clock=clock)
    nodes = list(grid.get_node_ids())
    active = {f"p{n}" for n in nodes[1:]}
    chaos = ChaosStrategy(
        FedAvg(min_available_nodes=3, min_train_nodes=3),
        view_source=lambda: active,
        clock=clock,
        sleep=clock.sleep,
    )
    chaos.start(grid, _initial(), num_rounds=2, timeout=60)
    assert all(sorted(r.trained) == nodes[1:] for r in chaos.rounds[1:])


# -- profiles ---------------------------------------------------------------------------------
def test_shipped_profiles_load_and_build_their_inner_strategy() -> None:
    assert {"fedavg-wan", "fedprox-wan", "fedadam-wan"} <= set(available_profiles())
    expected = {"fedavg-wan": FedAvg, "fedprox-wan": FedProx, "fedadam-wan": FedAdam}
    for name, cls in expected.items():
        s = ChaosStrategy.from_profile(name, poll_interval_s=0.5)
        assert type(s.inner) is cls
        assert s.phases.poll_interval_s == 0.5
        # the shipped profiles bound the adaptive deadlines and leave the first round to the
        # ceiling (no fixed phase timeout)
        assert s.phases.deadline_ceiling_s == load_profile(name).chaos["deadline_ceiling_s"]
        assert s.phases.deadline_floor_s == load_profile(name).chaos["deadline_floor_s"]
        assert s.phases.phase_timeout_s is None
    assert ChaosStrategy.from_profile("fedprox-wan").inner.proximal_mu == 0.01  # type: ignore[attr-defined]
    assert ChaosStrategy.from_profile("fedadam-wan").joins.max_donors == 8  # an integer setting


@pytest.mark.parametrize(
    ("text", "field_name"),
    [
        ("inner: {strategy: FedNope}", "inner.strategy"),
        ("inner: {strategy: FedAvg, args: {fraction_trian: 1.0}}", "inner.args.fraction_trian"),
        ("inner: {strategy: FedAvg, args: {min_train_nodes: 2.5}}", "inner.args.min_train_nodes"),
        ("inner: {strategy: FedAvg, args: {fraction_train: yes}}", "inner.args.fraction_train"),
        ("inner: {strategy: FedAvg}\nchaos: {phase_timeout_s: -1}", "chaos.phase_timeout_s"),
        ("inner: {strategy: FedAvg}\nchaos: {retries: 3}", "chaos.retries"),
        ("inner: {strategy: FedAvg}\nchaos: {join_max_donors: 2.5}", "chaos.join_max_donors"),
        ("inner: {strategy: FedAvg}\ncolour: red", "colour"),
        ("name: x", "inner is missing"),
        ("- a list", "mapping"),
        ("inner: {strategy: FedAvg, args: {fraction_train: 1.0}, extra: 1}", "inner: unknown"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(
    tmp_path: Path, text: str, field_name: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=field_name.replace(".", r"\.")):
        ChaosStrategy.from_profile(path)


def test_unknown_profile_name_lists_the_available_ones() -> None:
    with pytest.raises(ProfileError, match="fedavg-wan"):
        load_profile("no-such-profile")


# -- a restarted ServerApp ---------------------------------------------------------------------
def _signed_grid(clock: VClock, tamper: set[int] | None = None):  # type: ignore[no-untyped-def]
    keys = {f"p{1001 + i}": _keypair() for i in range(4)}
    parties: dict[int, Party] = {}

    def factory(ctx: Context) -> Party:
        party = Party(party_id=f"p{ctx.node_id}", signer=keys[f"p{ctx.node_id}"][0].sign)
        parties[ctx.node_id] = party
        return party

    grid = _grid(True, n=4, clock=clock, factory=factory)
    verifier = keyring_verifier({p: pk for p, (_, pk) in keys.items()})
    return grid, verifier, parties


def _fresh(verifier, clock: VClock) -> ChaosStrategy:  # type: ignore[no-untyped-def]
    return ChaosStrategy(
        FedAvg(min_available_nodes=3, min_train_nodes=3),
        receipt_verifier=verifier,
        clock=clock,
        sleep=clock.sleep,
    )


def test_a_restarted_server_resumes_from_the_parties_replicas() -> None:
    clock = VClock()
    grid, verifier, _ = _signed_grid(clock)
    first = _fresh(verifier, clock).start(grid, _initial(), num_rounds=3, timeout=60)
    again = _fresh(verifier, clock)
    res = again.start(grid, _initial(), num_rounds=3, timeout=60)  # nothing left to train
    assert again.rounds[0].server_round == 3
    assert sorted(res.train_metrics_clientapp) == []
    for key, arr in _arrays(first.arrays).items():
        np.testing.assert_array_equal(_arrays(res.arrays)[key], arr)
    more = _fresh(verifier, clock)
    res5 = more.start(grid, _initial(), num_rounds=5, timeout=60)
    assert sorted(res5.train_metrics_clientapp) == [4, 5]


def test_a_replica_that_does_not_match_the_receipts_is_refused() -> None:
    clock = VClock()
    grid, verifier, parties = _signed_grid(clock)
    _fresh(verifier, clock).start(grid, _initial(), num_rounds=2, timeout=60)
    for party in parties.values():  # every holder's disk copy is corrupted, receipts are not
        assert party.held_state is not None
        bad = {k: v + 1.0 for k, v in party.held_state.arrays.items()}
        party.held_state = TrainingState(arrays=bad, round=party.held_state.round)
    again = _fresh(verifier, clock)
    res = again.start(grid, _initial(), num_rounds=4, timeout=60)
    assert again.rounds[0].server_round == -1  # no resume
    # started over from the initial state, numbered above round 2 (which parties signed)
    assert again.rounds[1].server_round == 3
    assert again.rounds[1].digest == certified_digest(_initial(), 3)
    assert sorted(res.train_metrics_clientapp) == [4]


def test_without_a_verifier_unsigned_receipts_are_never_resumed_from() -> None:
    clock = VClock()
    grid = _grid(True, n=4, clock=clock)
    ChaosStrategy(FedAvg(min_available_nodes=3), clock=clock, sleep=clock.sleep).start(
        grid, _initial(), num_rounds=2, timeout=60
    )
    again = ChaosStrategy(FedAvg(min_available_nodes=3), clock=clock, sleep=clock.sleep)
    res = again.start(grid, _initial(), num_rounds=1, timeout=60)
    assert sorted(res.train_metrics_clientapp) == [1]


def test_parties_restarted_with_their_disks_let_a_new_server_resume(tmp_path: Path) -> None:
    keys = {f"p{1001 + i}": _keypair() for i in range(4)}
    verifier = keyring_verifier({p: pk for p, (_, pk) in keys.items()})
    made: dict[int, Party] = {}

    def factory(ctx: Context) -> Party:  # what default_party_factory does with chaos-state-dir
        pid = f"p{ctx.node_id}"
        party = Party(party_id=pid, signer=keys[pid][0].sign, store=ReplicaStore(tmp_path / pid))
        party.restore()
        made[ctx.node_id] = party
        return party

    clock = VClock()
    first = _fresh(verifier, clock).start(
        _grid(True, n=4, clock=clock, factory=factory), _initial(), num_rounds=2, timeout=60
    )
    assert ReplicaStore(tmp_path / "p1001").rounds() == [1, 2]  # the default keeps two
    # one party's disk is damaged while everything is down
    victim = ReplicaStore(tmp_path / "p1002").path_of(2)
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    made.clear()
    grid = _grid(True, n=4, clock=clock, factory=factory)  # every process starts afresh
    again = _fresh(verifier, clock)
    res = again.start(grid, _initial(), num_rounds=2, timeout=60)
    hello = again.rounds[0]
    assert hello.server_round == 2
    assert hello.holders == ["p1001", "p1003", "p1004"]  # p1002's replica failed its check
    assert made[1002].errors  # its own replica was refused ...
    (join,) = [j for j in hello.joins if j.party == "p1002"]  # ... so it pulled from the others
    assert join.ok and join.server_round == 2 and set(join.donors) <= set(hello.holders)
    assert made[1002].held_digest == hello.digest
    for key, arr in _arrays(first.arrays).items():
        np.testing.assert_array_equal(_arrays(res.arrays)[key], arr)


class _LosesShards(Party):
    """A holder that answers receipts and size/manifest requests but never sends shards."""

    def serve(self, record: ConfigRecord, request: ConfigRecord) -> ConfigRecord | None:
        if request.get("op") == "shards":
            return None
        return super().serve(record, request)


def test_resume_pulls_shares_from_several_holders_and_survives_a_lost_one() -> None:
    keys = {f"p{1001 + i}": _keypair() for i in range(4)}
    verifier = keyring_verifier({p: pk for p, (_, pk) in keys.items()})
    parties: dict[str, Party] = {}
    lossy = {"p1003"}

    def factory(ctx: Context) -> Party:
        pid = f"p{ctx.node_id}"
        cls = _LosesShards if pid in lossy else Party
        party = parties.get(pid) or cls(party_id=pid, signer=keys[pid][0].sign)
        parties[pid] = party
        return party

    clock = VClock()
    grid = _grid(True, n=4, clock=clock, factory=factory)
    first = _fresh(verifier, clock).start(grid, _initial(), num_rounds=2, timeout=60)
    again = ChaosStrategy(
        FedAvg(min_available_nodes=3, min_train_nodes=3),
        receipt_verifier=verifier,
        resume=ResumeSettings(min_shard_bytes=16),
        clock=clock,
        sleep=clock.sleep,
    )
    res = again.start(grid, _initial(), num_rounds=2, timeout=60)
    report = again.last_pull
    assert report is not None and again.rounds[0].server_round == 2
    total = len(parties["p1001"]._bytes)
    assert sum(report.shares.values()) >= total
    assert len([p for p, b in report.shares.items() if b > 0]) >= 2  # several holders at once
    assert "p1003" in report.lost and "p1003" not in report.shares
    for key, arr in _arrays(first.arrays).items():
        np.testing.assert_array_equal(_arrays(res.arrays)[key], arr)


def test_nodes_that_all_missed_a_deadline_are_waited_for_again_once_they_answer() -> None:
    clock = VClock()
    grid = _grid(True, n=3, clock=clock)
    # the first exchange is slower than its deadline, and than the ceiling a stalled exchange
    # waits on to (a stall, not a slow spell)
    for node in grid.get_node_ids():
        grid.node(node).delay_s = 5.0
    strategy = ChaosStrategy(
        FedAvg(min_available_nodes=3),
        phases=PhaseSettings(phase_timeout_s=1.0, deadline_floor_s=1.0, deadline_ceiling_s=2.0),
        clock=clock,
        sleep=clock.sleep,
    )
    original = strategy.courier.exchange
    calls = {"n": 0}

    def exchange_then_speed_up(*args, **kwargs):  # type: ignore[no-untyped-def]
        res = original(*args, **kwargs)
        calls["n"] += 1
        for node in grid.get_node_ids():
            grid.node(node).delay_s = 0.0  # the federation is fast from then on
        return res

    strategy.courier.exchange = exchange_then_speed_up  # type: ignore[method-assign]
    res = strategy.start(grid, _initial(), num_rounds=4, timeout=60)
    first = strategy.rounds[0]
    assert sorted(first.missing) == sorted(grid.get_node_ids())  # all missed round 0
    assert strategy.rounds[-1].trained and sorted(strategy.rounds[-1].trained) == sorted(
        grid.get_node_ids()
    )  # their late replies showed them alive: they are sampled and waited for again
    assert 4 in res.train_metrics_clientapp


def test_when_every_node_is_a_suspect_the_next_exchange_still_waits_for_them() -> None:
    clock = VClock()
    grid = _grid(True, n=3, clock=clock)
    # round 0's certify misses its deadline everywhere, and the ceiling a stalled exchange
    # waits on to (a stall, not a slow spell)
    for node in grid.get_node_ids():
        grid.node(node).delay_s = 5.0
    strategy = ChaosStrategy(
        FedAvg(min_available_nodes=3),
        phases=PhaseSettings(phase_timeout_s=1.0, deadline_floor_s=1.0, deadline_ceiling_s=2.0),
        clock=clock,
        sleep=clock.sleep,
    )
    original = strategy.courier.exchange

    def slow_but_in_time(*args, **kwargs):  # type: ignore[no-untyped-def]
        res = original(*args, **kwargs)
        for node in grid.get_node_ids():
            grid.node(node).delay_s = 0.5  # from then on every reply is in time, not at once
        return res

    strategy.courier.exchange = slow_but_in_time  # type: ignore[method-assign]
    res = strategy.start(grid, _initial(), num_rounds=4, timeout=60)
    assert sorted(strategy.rounds[0].missing) == sorted(grid.get_node_ids())
    # all suspects: the next exchanges waited (bounded) for their replies, so training resumed
    assert sorted(strategy.rounds[-1].trained) == sorted(grid.get_node_ids())
    assert strategy.rounds[-1].missing == [] and 4 in res.train_metrics_clientapp
