"""A churn-free Chaos round sends the messages plain FedAvg sends; the overhead bench's figures.

The message counts come from the in-process fake Grid (signed parties, the default charter);
the bench's arithmetic (model size, time to accuracy, ClientApp processes per round) from
hand-made results. No timing is asserted here: speed figures come from the bench's JSON.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from fake_grid import FakeGrid
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr.charter import load_charter
from chaos_flwr.errors import ConfigError
from chaos_flwr.flower.client import default_party_factory, enable
from chaos_flwr.flower.keys import charter_path, make_federation
from chaos_flwr.flower.server import ChaosStrategy, PhaseSettings
from chaos_flwr.lab.overhead import (
    OverheadSpec,
    clientapp_figures,
    hidden_for_mib,
    pair_figures,
    run_figures,
)

N = 5
ROUNDS = 4


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


class CountingFakeGrid(FakeGrid):
    """Counts pushed messages by type in the round ``evaluate_fn`` last opened (0 = setup)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_round: dict[int, Counter[str]] = {}
        self.round = 0
        self.started = False

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        for m in msgs:
            self.started = self.started or m.metadata.message_type == "train"
            slot = self.round if self.started else 0
            self.per_round.setdefault(slot, Counter())[m.metadata.message_type] += 1
        return super().push_messages(msgs)

    def round_done(self, server_round: int, _arrays: ArrayRecord) -> None:
        self.round = server_round + 1


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(3)
    return ArrayRecord({"w": Array(rng.normal(size=(4, 64)).astype(np.float32))})


def _app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        k = int(ctx.node_config["partition-id"]) + 1
        out = {n: Array((a.numpy() * 0.9 + 0.01 * k).astype(np.float32))
               for n, a in msg.content["arrays"].items()}  # fmt: skip
        metrics = MetricRecord({"num-examples": k})
        return Message(RecordDict({"arrays": ArrayRecord(out), "metrics": metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, ctx: Context) -> Message:
        metrics = MetricRecord(
            {"s": float(msg.content["arrays"]["w"].numpy().sum()), "num-examples": 1}
        )
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    enable(app, party_factory=default_party_factory)
    return app


def _run(tmp: Path, chaos: bool, fraction: float) -> CountingFakeGrid:
    keys = make_federation(tmp / "fed", N, founders=N, seed="overhead-test")
    grid = CountingFakeGrid()
    app = _app()
    for p in range(N):
        grid.add_node(
            app,
            node_config={"partition-id": p},
            run_config={"chaos-keys-dir": str(keys), "chaos-state-root": str(tmp / "state")},
        )
    inner = FedAvg(
        fraction_train=fraction, fraction_evaluate=fraction,
        min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2,
    )  # fmt: skip
    strategy = inner if not chaos else ChaosStrategy(
        inner, charter=load_charter(charter_path(keys)), phases=PhaseSettings(phase_timeout_s=5.0)
    )  # fmt: skip
    random.seed(11)  # the same sample for both modes
    strategy.start(grid, _initial(), num_rounds=ROUNDS, timeout=30, evaluate_fn=_done(grid))
    return grid


def _done(grid: CountingFakeGrid):  # type: ignore[no-untyped-def]
    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> None:
        grid.round_done(server_round, arrays)

    return evaluate_fn


def test_a_churn_free_chaos_round_sends_exactly_fedavgs_messages(tmp_path: Path) -> None:
    plain = _run(tmp_path / "plain", chaos=False, fraction=1.0)
    chaos = _run(tmp_path / "chaos", chaos=True, fraction=1.0)
    want = {"train": N, "evaluate": N}
    for rnd in range(1, ROUNDS + 1):
        assert dict(plain.per_round[rnd]) == want
        assert dict(chaos.per_round[rnd]) == want, (rnd, chaos.per_round[rnd])
    assert 0 not in plain.per_round
    # before round 1 only the hello (one per node): the initial state's certify rides on
    # round 1's train messages, which carry that state anyway
    assert dict(chaos.per_round[0]) == {"query.chaos": N}


def test_sampled_rounds_send_fedavgs_messages_plus_one_per_unsampled_node(
    tmp_path: Path,
) -> None:
    # FedAvg samples 3 of 5 nodes for each exchange; the 2 others get the new state (certify
    # query, which also carries their envelopes) and no relay query in the train phase, but
    # in round 1, whose train messages carry the initial state's certify: the 2 others get it
    # in a query of that exchange (the start sends only the hello before it)
    plain = _run(tmp_path / "plain", chaos=False, fraction=0.6)
    chaos = _run(tmp_path / "chaos", chaos=True, fraction=0.6)
    assert dict(chaos.per_round[0]) == {"query.chaos": N}
    for rnd in range(1, ROUNDS + 1):
        p, c = plain.per_round[rnd], chaos.per_round[rnd]
        assert c["train"] == p["train"] == 3 and c["evaluate"] == p["evaluate"] == 3
        assert c["query.chaos"] == (N - 3) * (2 if rnd == 1 else 1), (rnd, c)


# -- the bench's arithmetic ---------------------------------------------------------------------
def _model_bytes(hidden: int) -> int:
    return 4 * (64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10)


@pytest.mark.parametrize("mib", [1, 16, 64])
def test_hidden_for_mib_sizes_the_example_model_to_within_half_a_percent(mib: int) -> None:
    size = _model_bytes(hidden_for_mib(mib))
    assert abs(size - mib * (1 << 20)) / (mib * (1 << 20)) < 0.005


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ConfigError):
        hidden_for_mib(0)
    with pytest.raises(ConfigError):
        OverheadSpec(engine="ray")
    assert OverheadSpec(engine="deployment").poll_s == 3.0
    assert OverheadSpec().poll_s == 0.1


def _results(acc: list[float], ends: list[float], trainers: list[int]) -> dict[str, object]:
    return {
        "final_accuracy": acc[-1],
        "accuracy": {str(r): a for r, a in enumerate([0.1, *acc])},
        "round_wall_s": [b - a for a, b in zip([0.0, *ends], ends, strict=False)],
        "total_wall_s": ends[-1],
        "round_end_s": ends,
        "messages_per_round": [{"train": 5, "evaluate": 5}] * len(acc),
        "trainers_per_round": trainers,
    }


def test_time_to_accuracy_is_when_a_run_first_reaches_fedavgs_final_accuracy() -> None:
    fedavg = run_figures(_results([0.5, 0.8, 0.8], [10.0, 20.0, 30.0], [5, 5, 5]))
    chaos = run_figures(_results([0.6, 0.7, 0.85], [12.0, 24.0, 36.0], [5, 4, 5]))
    pair = pair_figures(fedavg, chaos)
    assert pair["time_to_accuracy_s"] == {"fedavg": 20.0, "chaos": 36.0}
    assert pair["time_to_accuracy_ratio"] == pytest.approx(1.8)
    assert pair["round_time_ratio"] == pytest.approx(1.2)
    assert pair["min_trainers"] == {"fedavg": 5, "chaos": 4}
    assert pair["clientapp_per_round"] == {"fedavg": 10, "chaos": 10}
    never = run_figures(_results([0.5, 0.6, 0.7], [10.0, 20.0, 30.0], [5, 5, 5]))
    assert pair_figures(fedavg, never)["time_to_accuracy_ratio"] is None


def test_clientapp_processes_are_counted_in_the_round_they_started_in(tmp_path: Path) -> None:
    (tmp_path / "supernode-0.log").write_text("Receiving: train message\nReceiving: evaluate\n")
    (tmp_path / "supernode-1.log").write_text("Receiving: train message\n")
    results = {"first_train_at": 100.0, "round_end_at": [110.0, 120.0]}
    seen = {1: 99.0, 2: 101.0, 3: 109.0, 4: 111.0, 5: 125.0}
    fig = clientapp_figures(results, seen, tmp_path)
    assert fig["clientapp_processes_setup"] == 1
    assert fig["clientapp_processes_per_round"] == [2, 1]
    assert fig["clientapp_processes_after_run"] == 1
    assert fig["supernode_messages_received"] == 3


def test_deployment_round_checks_mark_join_and_crash_rounds_as_events() -> None:
    from chaos_flwr.lab.deploy_churn import _event_rounds, round_checks

    fig = {"join_started_after_round": 1, "join_trained_in_round": 4, "crash_in_round": 6}
    events = _event_rounds(fig, 7)
    assert events == {2, 3, 6, 7}
    sent = [{"train": 3, "evaluate": 3}] * 5 + [{"train": 4, "evaluate": 4, "query.chaos": 1}] * 2
    chaos_rounds = [{"server_round": 0}] + [
        {
            "server_round": r,
            "trained": [1, 2, 3],
            "joins": [{"ok": True}] if r == 3 else [],
            "audited": ["p0"] if r > 1 else [],
        }
        for r in range(1, 8)
    ]
    line = {"messages_per_round": sent, "trainers_per_round": [3] * 7, "chaos_rounds": chaos_rounds}
    rounds = round_checks([{"round": 7}, line], events)
    assert [r["round"] for r in rounds if r["churn_free"]] == [1, 4, 5]
    assert rounds[0] == {
        "round": 1,
        "messages": {"train": 3, "evaluate": 3},
        "sampled": 3,
        "trainers": 3,
        "audited": [],
        "churn_free": True,
    }
    assert rounds[1]["audited"] == ["p0"]


def test_the_summary_table_lists_each_pair_and_the_medians() -> None:
    from chaos_flwr.lab.overhead import _medians, summary_table

    fedavg = run_figures(_results([0.5, 0.8, 0.8], [10.0, 20.0, 30.0], [5, 5, 5]))
    chaos = run_figures(_results([0.6, 0.7, 0.85], [12.0, 24.0, 36.0], [5, 4, 5]))
    chaos["replica_disk_bytes"] = 1234
    pairs = [pair_figures(fedavg, chaos), pair_figures(fedavg, fedavg)]
    fig = {"engine": "simulation", "model_bytes": 99, "rounds": 3, "poll_interval_s": 0.1}
    fig |= {"signed": True, "loadavg": {"before": 1.0, "after": 2.0}, "pairs": pairs}
    fig |= _medians(pairs)
    assert fig["min_trainers"] == {"fedavg": 5, "chaos": 4}
    assert fig["time_to_accuracy_ratio"] == pytest.approx((1.8 + 1.0) / 2)
    lines = summary_table(fig).splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["1", "2", "med"]
    assert "1.800" in lines[2] and "0.800,0.850" in lines[2]


def test_the_cli_refuses_an_unknown_engine_before_running_anything() -> None:
    from typer.testing import CliRunner

    from chaos_flwr.cli import app

    res = CliRunner().invoke(app, ["bench", "flower-overhead", "--engine", "ray"])
    assert res.exit_code == 2 and "engine must be one of" in res.output


# -- the audit bench (--audits): validation, progress lines, figures ------------------------------
def test_audit_specs_need_signed_parties_and_at_least_one_supernode() -> None:
    from chaos_flwr.lab.overhead import measure_audits

    with pytest.raises(ConfigError, match="signed"):
        OverheadSpec(audits=True, signed=False)
    with pytest.raises(ConfigError, match="num_supernodes"):
        OverheadSpec(num_supernodes=0)
    with pytest.raises(ConfigError, match="audits=True"):
        measure_audits(OverheadSpec())  # refused before any run starts
    assert OverheadSpec(audits=True, num_supernodes=20).num_supernodes == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--audits", "--no-signed"], "audits need signed parties"),
        (["--audits", "--supernodes", "0"], "num_supernodes must be >= 1"),
        (["--audits", "--rounds", "1"], "rounds must be >= 2"),
    ],
)
def test_the_cli_refuses_bad_audit_options_before_running_anything(
    args: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    from chaos_flwr.cli import app

    res = CliRunner().invoke(app, ["bench", "flower-overhead", *args])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output


def _server_app(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The example's ServerApp module (its progress line is what the bench parses)."""
    import importlib

    root = Path(__file__).resolve().parents[1] / "examples" / "multi_institution"
    monkeypatch.syspath_prepend(str(root))
    return importlib.import_module("multi_institution.server_app")


def test_the_example_progress_line_carries_each_rounds_audits_and_the_bench_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.flower.server.logs import RoundLog
    from chaos_flwr.lab.overhead import audit_progress
    from chaos_flwr.lab.report import read_progress

    server_app = _server_app(monkeypatch)
    progress = server_app._Progress(str(tmp_path / "progress.jsonl"), "chaos")
    rounds = [RoundLog(0, holders=["a", "b"], digest=b"\x00")]
    progress.strategy = type("S", (), {"rounds": rounds})()
    progress.accuracy = {1: 0.5, 2: 0.6, 3: 0.7}
    rounds.append(RoundLog(1, holders=["a", "b"], digest=b"\x01"))
    progress.write(1)
    # round 2's first attempt is not certified (its base's audit is missing): its audit bytes
    # were moved all the same and count with the attempt that certified it
    rounds.append(RoundLog(2, skipped="audits missing", audited=["b"], audit_bytes=700))
    rounds.append(RoundLog(2, holders=["a"], digest=b"\x02", audited=["a", "b"], audit_bytes=1400))
    progress.write(2)
    rounds.append(RoundLog(3, holders=[], digest=b"\x03", audited=["a"], audit_bytes=700))
    progress.write(3)
    lines = read_progress(tmp_path / "progress.jsonl")
    assert [(ln["audit_bytes"], ln["audited"]) for ln in lines] == [
        (0, []), (2100, ["a", "b"]), (700, ["a"])
    ]  # fmt: skip
    assert audit_progress(lines) == {
        "audit_bytes": [0, 2100, 700],
        "audited": [[], ["a", "b"], ["a"]],
        "rounds_certified": 2,  # round 3 has no holders: not certified
        "attempts": 4,
    }
    assert audit_progress([]) == {
        "audit_bytes": [], "audited": [], "rounds_certified": 0, "attempts": 0
    }  # fmt: skip


def _audit_run(wall: float, acc: list[float], audit_bytes: list[int]) -> dict[str, object]:
    from chaos_flwr.lab.overhead import audit_run_figures

    ends = [10.0 + wall * i for i in range(len(acc))]
    lines = [
        {"round": r, "audit_bytes": b, "audited": ["p"] * (b > 0)}
        for r, b in enumerate(audit_bytes, start=1)
    ]
    lines[-1]["chaos_rounds"] = [
        {"server_round": r, "holders": ["p"], "skipped": ""} for r in range(len(acc) + 1)
    ]
    fig = run_figures(_results(acc, ends, [5] * len(acc)))
    fig["model_bytes"] = 64
    return audit_run_figures(fig, lines)


def test_audit_figures_are_medians_over_repeats_with_ratios_over_audits_off() -> None:
    from chaos_flwr.lab.overhead import audit_medians, audit_repeat_figures, audits_table

    reps = []
    for off_wall, slow in ((2.0, 1.05), (4.0, 1.25), (2.0, 1.15)):
        runs = {
            "unverified": _audit_run(off_wall / 1.1, [0.5, 0.7, 0.8], [0, 0, 0]),
            "off": _audit_run(off_wall, [0.5, 0.7, 0.8], [0, 0, 0]),
            "1": _audit_run(off_wall * slow, [0.5, 0.8, 0.8], [0, 300, 500]),
            "all": _audit_run(off_wall * 2, [0.5, 0.7, 0.8], [0, 1500, 2500]),
        }
        reps.append(audit_repeat_figures(runs))
    one = reps[0]["1"]
    assert one["audit_bytes_per_round"] == 400  # rounds 2..: round 1 has no audited base
    assert one["auditors_per_round"] == 1 and one["rounds_certified"] == 3
    assert one["time_to_accuracy_s"] == pytest.approx(10.0 + 2.0 * 1.05)  # off's final 0.8
    assert reps[0]["off"]["time_to_accuracy_s"] == pytest.approx(14.0)
    fig = audit_medians(reps)
    assert fig["audit1_round_ratio"] == pytest.approx(1.15)
    assert fig["audit_all_round_ratio"] == pytest.approx(2.0)
    assert fig["ratio_runs"]["audit1_round_ratio"] == pytest.approx([1.05, 1.25, 1.15])
    assert fig["modes"]["all"]["audit_bytes_per_round"] == 2000
    assert fig["modes"]["off"]["median_round_s"] == 2.0
    assert fig["verified_round_ratio"] == pytest.approx(1.1)  # what commitments cost
    fig |= {"engine": "simulation", "model_bytes": 64, "rounds": 3, "supernodes": 5}
    fig |= {"repeats": 3, "poll_interval_s": 0.1, "loadavg": {"before": 1.0, "after": 2.0}}
    lines = audits_table(fig).splitlines()
    assert [ln.split()[0] for ln in lines[2:]] == ["unverified", "off", "1", "all"]
    assert lines[2].split()[2] == "0.909" and lines[3].split()[2] == "1.000"
    assert lines[4].split()[2] == "1.150" and lines[5].split()[6] == "2000"


def test_a_mode_that_left_a_round_uncertified_gets_no_round_ratio() -> None:
    from chaos_flwr.lab.overhead import audit_medians, audit_repeat_figures, audits_table

    # 20 parties, all auditing: round 2 was tried twice and never certified (its audits missed
    # the deadline), so its "round time" spans retries: no comparable ratio
    stalled = _audit_run(8.0, [0.5, 0.5, 0.5], [0, 900, 900])
    stalled["rounds_certified"], stalled["attempts"] = 1, 3
    stalled["every_round_certified"] = False
    runs = {
        "unverified": _audit_run(2.0, [0.5, 0.7, 0.8], [0, 0, 0]),
        "off": _audit_run(2.0, [0.5, 0.7, 0.8], [0, 0, 0]),
        "1": _audit_run(2.1, [0.5, 0.7, 0.8], [0, 300, 300]),
        "all": stalled,
    }
    fig = audit_medians([audit_repeat_figures(runs)])
    assert fig["incomplete"] == ["all"]
    assert fig["audit_all_round_ratio"] is None
    assert fig["ratio_runs"]["audit_all_round_ratio"] == pytest.approx([4.0])
    assert fig["audit1_round_ratio"] == pytest.approx(1.05)
    assert fig["modes"]["all"]["time_to_accuracy_s"] is None  # never reached off's 0.8
    fig |= {"engine": "simulation", "model_bytes": 64, "rounds": 3, "supernodes": 20}
    fig |= {"repeats": 1, "poll_interval_s": 0.1, "loadavg": {"before": 1.0, "after": 2.0}}
    lines = audits_table(fig).splitlines()
    assert lines[5].split()[2] == "-" and lines[5].split()[3] == "never"
    assert "uncertified" in lines[-1] and "'all'" in lines[-1]


def test_a_run_certifies_every_round_only_when_no_attempt_was_retried() -> None:
    from chaos_flwr.lab.overhead import audit_run_figures

    logs = [{"server_round": 1, "holders": ["a"], "skipped": ""}]
    logs += [{"server_round": 2, "holders": [], "skipped": "the audit of round 1 has not come in"}]
    logs += [{"server_round": 2, "holders": [], "skipped": "0 signed update(s) < 1"}]
    lines = [{"round": 1, "audit_bytes": 0, "audited": [], "chaos_rounds": logs}]
    fig = audit_run_figures({}, lines)
    assert (fig["rounds_certified"], fig["attempts"]) == (1, 3)
    assert fig["every_round_certified"] is False
    assert audit_run_figures({}, [])["every_round_certified"] is False  # nothing certified
    assert _audit_run(2.0, [0.5, 0.7], [0, 10])["every_round_certified"] is True
