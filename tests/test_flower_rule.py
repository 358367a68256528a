"""Tests of the federation's aggregation rule (chaos_flwr.flower.rule, Charter.rounds).

The server path is run as ChaosStrategy runs its inner strategy (``configure_train`` on a grid,
``aggregate_train`` on the train replies, ``certified_state``), and a party's
:func:`recompute` must give the same digest from the base state and the updates alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flwr_strategies
from typer.testing import CliRunner

from chaos_flwr import codec
from chaos_flwr.charter import (
    RULE_DOMAIN,
    SUPPORTED_STRATEGIES,
    AggregationRule,
    Charter,
    RoundPolicy,
    RoundRules,
    load_charter,
)
from chaos_flwr.cli import app
from chaos_flwr.defaults import RULE_RTOL
from chaos_flwr.errors import AuditError, CharterError, ConfigError, ProfileError
from chaos_flwr.flower.profiles import available_profiles, load_profile
from chaos_flwr.flower.rule import (
    SAMPLING_ARGS,
    build_strategy,
    check_inner,
    recompute,
    rule_of_profile,
    states_match,
)
from chaos_flwr.flower.server.state import certified_state, strategy_state_of
from chaos_flwr.identity import Identity
from chaos_flwr.state import TrainingState

ALICE = Identity.from_seed(b"charter-alice", name="alice")
BOB = Identity.from_seed(b"charter-bob", name="bob")
CAROL = Identity.from_seed(b"charter-carol", name="carol")
#: Digests of ``Charter.create("hospitals-eu", [ALICE, BOB], [CAROL])`` (and with
#: ``failure_quorum=1, replicas=4``) computed by the build before charters had ``rounds``.
GOLDEN_DIGEST = "8b762daff18a7a19ee891cd0c677882ddd188df6d16cb6a7a456951e5e3a7a30"
GOLDEN_DIGEST_POLICY = "73389542b9288b21e79006e49dd0b11cf90be6269fc1f11a16f55cad63e6752f"

SHAPES = {"w": (4, 3), "b": (3,)}
#: The inner strategies and arguments the server path is checked against.
RULES: dict[str, dict[str, int | float | bool | str]] = {
    "FedAvg": {"fraction_train": 1.0, "min_available_nodes": 2},
    "FedProx": {"proximal_mu": 0.01},
    "FedAdam": {"eta": 0.01, "eta_l": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 0.001},
    "FedYogi": {"eta": 0.02, "tau": 0.001},
    "FedAdagrad": {"eta": 0.05},
    "Krum": {"num_malicious_nodes": 1},
    "MultiKrum": {"num_malicious_nodes": 1, "num_nodes_to_select": 3},
    "FedMedian": {},
    "FedTrimmedAvg": {"beta": 0.2},
}

#: Rules that may leave the aggregate unchanged when one trainer's update changes.
ROBUST = {"Krum", "MultiKrum", "FedMedian", "FedTrimmedAvg"}


def _arrays(rng: np.random.Generator) -> dict[str, np.ndarray[Any, Any]]:
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _update(arrays: dict[str, np.ndarray[Any, Any]], examples: int) -> RecordDict:
    return RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": examples, "loss": 0.5}),
        }
    )


def _grid(nodes: int) -> FakeGrid:
    grid = FakeGrid()
    for _ in range(nodes):
        grid.add_node(lambda msg, ctx: msg)
    return grid


class _Server:
    """The ServerApp side: the inner strategy run as ChaosStrategy runs it."""

    def __init__(self, name: str, args: dict[str, Any], nodes: int) -> None:
        self.inner = getattr(flwr_strategies, name)(**args)
        self.grid = _grid(nodes)

    def round(
        self, rnd: int, base: ArrayRecord, raw: list[tuple[dict[str, Any], int]]
    ) -> TrainingState:
        msgs = list(self.inner.configure_train(rnd, base, ConfigRecord(), self.grid))
        assert len(msgs) == len(raw)
        replies = [Message(_update(a, n), reply_to=m) for m, (a, n) in zip(msgs, raw, strict=True)]
        agg, _ = self.inner.aggregate_train(rnd, replies)
        assert agg is not None
        return certified_state(agg, rnd, strategy_state_of(self.inner))


def _raw(rng: np.random.Generator, n: int) -> list[tuple[dict[str, Any], int]]:
    return [(_arrays(rng), int(rng.integers(10, 100))) for _ in range(n)]


@pytest.mark.parametrize("name", sorted(RULES))
def test_recompute_gives_the_servers_digest(name: str) -> None:
    rng = np.random.default_rng(sorted(RULES).index(name))
    rule = AggregationRule(strategy=name, args=RULES[name])
    nodes = 5
    server = _Server(name, RULES[name], nodes)
    base = certified_state(ArrayRecord({k: Array(v) for k, v in _arrays(rng).items()}), 0)
    rounds = 2 if name in {"FedAdam", "FedYogi"} else 1  # the moments carry over
    for rnd in range(1, rounds + 1):
        raw = _raw(rng, nodes)
        served = server.round(rnd, _to_record(base), raw)
        again = recompute(rule, base, rnd, [_update(a, n) for a, n in raw])
        assert again.digest() == served.digest()
        assert again.round == rnd
        assert states_match(again, served)
        if name in {"FedAdam", "FedYogi"}:
            assert again.strategy_state  # the moments are part of the certified state
        # a changed update changes the digest (one value of one trainer; of each trainer for the
        # robust rules, which may ignore a single outlier by design)
        for arrays, _ in raw if name in ROBUST else raw[:1]:
            arrays["w"] = arrays["w"].copy()
            arrays["w"][0, 0] += 1.0
        changed = recompute(rule, base, rnd, [_update(a, n) for a, n in raw])
        assert changed.digest() != served.digest()
        base = served


def _to_record(state: TrainingState) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in state.arrays.items()})


def test_fedadam_round_two_needs_the_carried_moments() -> None:
    rng = np.random.default_rng(7)
    args = RULES["FedAdam"]
    rule = AggregationRule(strategy="FedAdam", args=args)
    server = _Server("FedAdam", args, 3)
    base0 = certified_state(_to_record(TrainingState(_arrays(rng), 0)), 0)
    base1 = server.round(1, _to_record(base0), _raw(rng, 3))
    raw = _raw(rng, 3)
    served = server.round(2, _to_record(base1), raw)
    without = TrainingState(base1.arrays, 1)  # the same arrays, the moments lost
    assert recompute(rule, base1, 2, [_update(a, n) for a, n in raw]).digest() == served.digest()
    assert recompute(rule, without, 2, [_update(a, n) for a, n in raw]).digest() != (
        served.digest()
    )


def test_recompute_follows_the_given_order_and_leaves_updates_intact() -> None:
    rng = np.random.default_rng(3)
    base = TrainingState(_arrays(rng), 4)
    raw = _raw(rng, 4)
    updates = [_update(a, n) for a, n in raw]
    rule = AggregationRule(strategy="FedMedian")
    first = recompute(rule, base, 5, updates)  # FedMedian pops arrays from the replies
    assert [sorted(u["arrays"].keys()) for u in updates] == [sorted(SHAPES)] * 4
    assert recompute(rule, base, 5, updates).digest() == first.digest()
    # the median does not depend on the order, the weighted sum may only in its last bits
    assert recompute(rule, base, 5, updates[::-1]).digest() == first.digest()
    fedavg = AggregationRule(strategy="FedAvg")
    fwd, rev = recompute(fedavg, base, 5, updates), recompute(fedavg, base, 5, updates[::-1])
    assert states_match(fwd, rev)


def test_recompute_refusals_are_audit_errors() -> None:
    rng = np.random.default_rng(5)
    base = TrainingState(_arrays(rng), 0)
    rule = AggregationRule(strategy="FedAvg")
    with pytest.raises(AuditError, match="no updates"):
        recompute(rule, base, 1, [])
    no_weight = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in _arrays(rng).items()}),
            "metrics": MetricRecord({"loss": 0.1}),
        }
    )
    with pytest.raises(AuditError, match="num-examples"):
        recompute(rule, base, 1, [no_weight])
    other_keys = _update({"z": np.zeros(2, np.float32)}, 3)
    with pytest.raises(AuditError, match="same keys"):
        recompute(rule, base, 1, [_update(_arrays(rng), 3), other_keys])
    # FedAdam: an update of other arrays than the base cannot make delta_t
    adam = AggregationRule(strategy="FedAdam")
    with pytest.raises(AuditError, match="Keys"):
        recompute(adam, base, 1, [other_keys])


def test_states_match_uses_the_named_tolerance() -> None:
    rng = np.random.default_rng(11)
    a = TrainingState(_arrays(rng), 3)
    assert states_match(a, TrainingState(dict(a.arrays), 3))
    near = {k: v * np.float32(1 + RULE_RTOL / 10) for k, v in a.arrays.items()}
    near_state = TrainingState(near, 3)
    assert near_state.digest() != a.digest()
    assert states_match(a, near_state)
    far = {k: v + np.float32(1e-3) for k, v in a.arrays.items()}
    assert not states_match(a, TrainingState(far, 3))
    assert not states_match(a, TrainingState(dict(a.arrays), 4))  # another round
    wider = {k: v.astype(np.float64) for k, v in a.arrays.items()}
    assert not states_match(a, TrainingState(wider, 3))  # another dtype
    fewer = {"w": a.arrays["w"]}
    assert not states_match(a, TrainingState(fewer, 3))
    moments = TrainingState({"m_t/w": np.ones(2, np.float32)}, 0).to_bytes()
    moments_near = TrainingState({"m_t/w": np.ones(2, np.float32) * (1 + 1e-7)}, 0).to_bytes()
    moments_far = TrainingState({"m_t/w": np.full(2, 2.0, np.float32)}, 0).to_bytes()
    with_m = TrainingState(dict(a.arrays), 3, strategy_state=moments)
    assert states_match(with_m, TrainingState(dict(a.arrays), 3, strategy_state=moments_near))
    assert not states_match(with_m, TrainingState(dict(a.arrays), 3, strategy_state=moments_far))
    assert not states_match(with_m, TrainingState(dict(a.arrays), 3))


# --- building and checking the inner strategy ------------------------------------------------


@pytest.mark.parametrize("name", SUPPORTED_STRATEGIES)
def test_every_supported_strategy_builds_and_checks(name: str) -> None:
    rule = AggregationRule(strategy=name, args=RULES[name])
    built = build_strategy(rule)
    assert type(built) is getattr(flwr_strategies, name)
    check_inner(rule, built)
    check_inner(rule, getattr(flwr_strategies, name)(**RULES[name]))


def test_check_inner_names_the_mismatch() -> None:
    rule = AggregationRule(strategy="FedAdam", args={"eta": 0.01, "beta_1": 0.9})
    with pytest.raises(ConfigError, match=r"FedAvg.*FedAdam"):
        check_inner(rule, flwr_strategies.FedAvg())
    with pytest.raises(ConfigError, match=r"eta is 0\.5.*0\.01"):
        check_inner(rule, flwr_strategies.FedAdam(eta=0.5, beta_1=0.9))
    # an argument the rule leaves out must keep the strategy's default
    with pytest.raises(ConfigError, match="tau"):
        check_inner(rule, flwr_strategies.FedAdam(eta=0.01, beta_1=0.9, tau=0.5))
    # a subclass is not the rule's class (it may aggregate differently)
    with pytest.raises(ConfigError, match=r"Krum.*MultiKrum"):
        check_inner(AggregationRule(strategy="MultiKrum"), flwr_strategies.Krum())
    fedavg = AggregationRule(strategy="FedAvg", args={"fraction_train": 0.5})
    with pytest.raises(ConfigError, match="fraction_train"):
        check_inner(fedavg, flwr_strategies.FedAvg())
    # the rule's value equal to the default: the default instance is the rule
    check_inner(AggregationRule(strategy="FedAvg", args={"min_train_nodes": 2}), fedavg_plain())
    # sampling the rule leaves out is the server's to choose; what it aggregates with is not
    check_inner(AggregationRule(strategy="FedAvg"), flwr_strategies.FedAvg(min_train_nodes=5))
    with pytest.raises(ConfigError, match="weighted_by_key"):
        check_inner(AggregationRule(strategy="FedAvg"), flwr_strategies.FedAvg(weighted_by_key="n"))


def fedavg_plain() -> Any:
    return flwr_strategies.FedAvg()


def test_build_strategy_refuses_bad_args() -> None:
    with pytest.raises(ConfigError, match=r"args\.nope is not an argument of FedAvg"):
        build_strategy(AggregationRule(strategy="FedAvg", args={"nope": 1}))
    with pytest.raises(ConfigError, match=r"args\.tau of FedAdam must be a number"):
        build_strategy(AggregationRule(strategy="FedAdam", args={"tau": "1e-3"}))
    with pytest.raises(ConfigError, match=r"args\.min_train_nodes of FedAvg must be an integer"):
        build_strategy(AggregationRule(strategy="FedAvg", args={"min_train_nodes": 2.0}))
    with pytest.raises(ConfigError, match="must be a number"):
        build_strategy(AggregationRule(strategy="FedAvg", args={"fraction_train": True}))
    assert (
        build_strategy(AggregationRule(strategy="FedAvg", args={"fraction_train": 1})) is not None
    )
    with pytest.raises(ConfigError, match="train_metrics_aggr_fn"):
        build_strategy(AggregationRule(strategy="FedAvg", args={"train_metrics_aggr_fn": "x"}))


@pytest.mark.parametrize("name", available_profiles())
def test_each_shipped_profile_gives_a_rule_its_inner_strategy_passes(name: str) -> None:
    profile = load_profile(name)
    rule = rule_of_profile(name)
    assert rule == rule_of_profile(profile)
    # the profile's arguments but the sampling ones (those stay the server's to choose)
    aggregation = {k: v for k, v in profile.args.items() if k not in SAMPLING_ARGS}
    assert rule.strategy == profile.strategy and rule.args == aggregation
    assert set(profile.args) - set(rule.args) <= SAMPLING_ARGS
    check_inner(rule, profile.build_inner())
    check_inner(rule, build_strategy(rule))


def test_rule_of_profile_refuses_a_strategy_parties_cannot_recompute(tmp_path: Path) -> None:
    path = tmp_path / "momentum.yaml"
    path.write_text(
        "name: momentum\ninner:\n  strategy: FedAvgM\n  args: {server_learning_rate: 1.0}\n"
    )
    with pytest.raises(ProfileError, match="FedAvgM"):
        rule_of_profile(path)


# --- the charter's rounds section ------------------------------------------------------------


def _charter(**kwargs: Any) -> Charter:
    return Charter.create("hospitals-eu", [ALICE, BOB], [CAROL], **kwargs)


def test_charter_without_rounds_keeps_its_digest() -> None:
    assert _charter().digest.hex() == GOLDEN_DIGEST
    assert _charter(failure_quorum=1, replicas=4).digest.hex() == GOLDEN_DIGEST_POLICY
    ch = _charter()
    assert "rounds" not in ch.body() and "\nrounds:" not in ch.to_yaml()
    legacy = {k: v for k, v in ch.model_dump().items() if k not in {"signatures", "rounds"}}
    legacy.pop("limits")
    assert ch.digest == hashlib.sha256(codec.encode(legacy)).digest()
    assert Charter.from_yaml(ch.to_yaml()).is_verified


def test_charter_with_rounds_signs_roundtrips_and_changes_the_digest(tmp_path: Path) -> None:
    rule = AggregationRule(strategy="FedAdam", args={"eta": 0.01, "beta_1": 0.9})
    ch = _charter(rounds=RoundRules(rule=rule, min_updates=2, auditors="all"))
    assert ch.is_verified and ch.digest.hex() != GOLDEN_DIGEST
    assert ch.body()["rounds"] == {
        "rule": {"strategy": "FedAdam", "args": {"eta": 0.01, "beta_1": 0.9}},
        "min_updates": 2,
        "auditors": "all",
    }
    loaded = load_charter(ch.save(tmp_path / "charter.yaml"))
    assert loaded.digest == ch.digest and loaded.rounds == ch.rounds
    # null fields inside rounds are left out of the body: writing them changes nothing
    partial = _charter(rounds=RoundRules(rule=rule))
    assert "min_updates" not in partial.body()["rounds"]
    data = partial.model_dump()
    data["rounds"]["min_updates"] = None
    assert Charter.from_dict(data).digest == partial.digest
    assert _charter(rounds=RoundRules()).digest.hex() != GOLDEN_DIGEST  # an empty section


def test_round_policy_defaults_and_rule_id() -> None:
    assert _charter().round_policy() == RoundPolicy(None, b"", 1, 0)
    rule = AggregationRule(strategy="FedAvg", args={"fraction_train": 1.0, "min_train_nodes": 2})
    expected_id = hashlib.sha256(
        RULE_DOMAIN
        + codec.encode(
            {"strategy": "FedAvg", "args": {"fraction_train": 1.0, "min_train_nodes": 2}}
        )
    ).digest()
    policy = _charter(rounds=RoundRules(rule=rule)).round_policy()
    assert policy == RoundPolicy(rule, expected_id, 1, 1)
    assert len(policy.rule_id) == 32
    assert _charter(rounds=RoundRules(rule=rule, auditors="all")).round_policy().auditors is None
    assert _charter(rounds=RoundRules(rule=rule, auditors=0)).round_policy().auditors == 0
    assert _charter(rounds=RoundRules(min_updates=3)).round_policy().min_updates == 3
    # the id changes with any argument, and with an int written for a float
    other = AggregationRule(strategy="FedAvg", args={"fraction_train": 0.5, "min_train_nodes": 2})
    as_int = AggregationRule(strategy="FedAvg", args={"fraction_train": 1, "min_train_nodes": 2})
    assert len({rule.rule_id, other.rule_id, as_int.rule_id}) == 3


@pytest.mark.parametrize(
    ("rounds", "fragment"),
    [
        ({"rule": {"strategy": "FedFoo"}}, "rounds.rule.strategy: unknown or unsupported"),
        ({"rule": {"strategy": "FedAvgM"}}, "FedAvgM"),
        ({"rule": {"strategy": "FedAvg", "args": {"eta": float("inf")}}}, "finite"),
        ({"rule": {"strategy": "FedAvg", "args": {"x": [1]}}}, "rounds.rule.args.x"),
        ({"rule": {"strategy": "FedAvg", "bogus": 1}}, "rounds.rule.bogus: unknown field"),
        ({"min_updates": 0}, "rounds.min_updates"),
        ({"auditors": -1}, "rounds.auditors"),
        ({"auditors": "some"}, "rounds.auditors"),
        ({"auditors": 2}, "needs a rule"),
    ],
)
def test_bad_rounds_are_refused_naming_the_field(rounds: dict[str, Any], fragment: str) -> None:
    data = _charter().model_dump()
    data["rounds"] = rounds
    with pytest.raises(CharterError, match="invalid charter") as info:
        Charter.from_dict(data, verify=False)
    assert fragment in str(info.value), str(info.value)


def test_cli_charter_init_rule_profile(tmp_path: Path) -> None:
    runner = CliRunner()
    for who in ("alice", "bob"):
        keygen = runner.invoke(app, ["keygen", "--out", str(tmp_path), "--name", who])
        assert keygen.exit_code == 0, keygen.output
    out = tmp_path / "charter.yaml"
    args = ["charter", "init", "--federation", "fed", "--out", str(out)]
    args += ["--founder", str(tmp_path / "alice.pub"), "--founder", str(tmp_path / "bob.pub")]
    done = runner.invoke(app, [*args, "--rule-profile", "fedadam-wan"])
    assert done.exit_code == 0, done.output
    charter = load_charter(out, verify=False)
    assert charter.rounds is not None and charter.rounds.rule == rule_of_profile("fedadam-wan")
    assert charter.round_policy().auditors == 1
    bad = runner.invoke(app, [*args, "--force", "--rule-profile", "no-such-profile"])
    assert bad.exit_code == 1 and "no profile named" in bad.output
