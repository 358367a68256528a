"""Churn scenarios (chaos_flwr.lab.scenario, .churn), the demo report, the scenario run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_grid import FakeGrid
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from chaos_flwr.errors import ConfigError, StoreError
from chaos_flwr.flower.schema import server_record
from chaos_flwr.lab import churn
from chaos_flwr.lab.churn import NodeCrashedError, NodeNotJoinedError, message_round
from chaos_flwr.lab.render import plot_report, render_table
from chaos_flwr.lab.report import build_report, read_progress
from chaos_flwr.lab.scenario import load_scenario, parse_scenario

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _base(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "t",
        "rounds": 8,
        "institutions": 3,
        "joiners": 1,
        "events": [
            {"round": 2, "kind": "join", "party": 3},
            {"round": 3, "kind": "link-down", "party": 0, "peer": 1},
            {"round": 3, "kind": "leave", "party": 2},
            {"round": 4, "kind": "crash", "party": 1},
            {"round": 5, "kind": "server-kill"},
            {"round": 6, "kind": "return", "party": 1},
        ],
    }
    data.update(over)
    return data


# -- the scenario model -----------------------------------------------------------------------
def test_the_example_scenario_has_every_event_kind_the_issue_asks_for() -> None:
    scen = load_scenario(EXAMPLE / "churn.yaml")
    kinds = [e.kind for e in scen.events]
    assert {"join", "leave", "link-down", "crash", "server-kill", "return"} <= set(kinds)
    assert scen.num_parties == 6 and scen.institutions == 5
    assert scen.join_round(5) == 3 and scen.join_round(0) == 0
    assert scen.server_kill_round() == 6
    crash = next(e for e in scen.events if e.kind == "crash")
    back = next(e for e in scen.events if e.kind == "return")
    assert crash.party == back.party
    assert scen.is_down(crash.party, crash.round)  # type: ignore[arg-type]
    assert scen.is_down(crash.party, back.round - 1)  # type: ignore[arg-type]
    assert not scen.is_down(crash.party, back.round)  # type: ignore[arg-type]
    assert scen.is_down(5, 2) and not scen.is_down(5, 3)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"events": [{"round": 1, "kind": "join", "party": 0}]}, r"events\[0\]\.party"),
        ({"events": [{"round": 1, "kind": "explode", "party": 0}]}, r"events\[0\]\.kind"),
        ({"events": [{"round": 1, "kind": "link-down", "party": 0}]}, "peer"),
        ({"events": [{"round": 1, "kind": "return", "party": 0}]}, r"events\[0\]\.party"),
        ({"events": [{"round": 9, "kind": "leave", "party": 0}]}, r"events\[0\]\.round"),
        ({"events": [{"round": 2, "kind": "leave", "party": 7}]}, r"events\[0\]\.party"),
        ({"events": [{"round": 1, "kind": "server-kill"}]}, r"events\[0\]\.round"),
        (
            {
                "events": [
                    {"round": 3, "kind": "leave", "party": 0},
                    {"round": 2, "kind": "leave", "party": 1},
                ]
            },
            r"events\[1\]\.round",
        ),
        ({"rounds": 0}, "rounds"),
        ({"colour": "red"}, "colour"),
        ({"events": [{"round": 1, "kind": "leave", "party": 1, "peer": 2}]}, "peer"),
    ],
)
def test_a_bad_scenario_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_scenario(_base(**change))


def test_a_scenario_file_that_is_not_yaml_or_missing_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("events: [\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_scenario(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


# -- which round a message belongs to ---------------------------------------------------------
def _msg(content: RecordDict, mtype: str = "query.chaos") -> Message:
    FakeGrid()  # gives Flower's Message constructor a task identity
    return Message(content, dst_node_id=1, message_type=mtype)


def test_message_round_reads_the_round_from_the_message_itself() -> None:
    train = _msg(RecordDict({"config": ConfigRecord({"server-round": 4})}), "train")
    assert message_round(train) == 4
    relay = _msg(RecordDict({"chaos": server_record([], phase="relay", server_round=4)}))
    assert message_round(relay) == 5  # sent while round 5 trains on the state of round 4
    cert = _msg(RecordDict({"chaos": server_record([], phase="certify", server_round=4)}))
    assert message_round(cert) == 4
    hello = _msg(RecordDict({"chaos": server_record([], phase="hello", server_round=-1)}))
    assert message_round(hello) == 0 and message_round(hello, start_round=6) == 6


# -- the ClientApp wrapper --------------------------------------------------------------------
class FakeParty:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def leave(self) -> None:
        self.calls.append(("leave", ""))

    def disconnect(self, other: str) -> None:
        self.calls.append(("disconnect", other))

    def connect(self, other: str) -> None:
        self.calls.append(("connect", other))


def _plain_app() -> tuple[ClientApp, list[int]]:
    app = ClientApp()
    seen: list[int] = []

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        seen.append(int(msg.content["config"]["server-round"]))
        return Message(RecordDict(), reply_to=msg)

    return app, seen


def _ctx(partition: int, run_config: dict[str, Any] | None = None) -> Context:
    return Context(
        1,
        100 + partition,
        {"partition-id": partition, "num-partitions": 4},
        RecordDict(),
        run_config or {},  # type: ignore[arg-type]
    )


def _train(app: ClientApp, ctx: Context, rnd: int) -> None:
    msg = _msg(RecordDict({"config": ConfigRecord({"server-round": rnd})}), "train")
    app._registered_funcs["train.default"](msg, ctx)


def test_wrapper_keeps_a_joiner_out_before_its_round_and_a_crashed_party_until_it_returns() -> None:
    app, seen = _plain_app()
    churn.apply(app, parse_scenario(_base()))
    joiner, crasher, member = _ctx(3), _ctx(1), _ctx(0)
    with pytest.raises(NodeNotJoinedError, match="joins at round 2"):
        _train(app, joiner, 1)
    _train(app, joiner, 2)
    _train(app, crasher, 3)
    for rnd in (4, 5):
        with pytest.raises(NodeCrashedError):
            _train(app, crasher, rnd)
    _train(app, crasher, 6)
    _train(app, member, 1)
    assert seen == [2, 3, 6, 1]
    with pytest.raises(ConfigError, match="already applied"):
        churn.apply(app, parse_scenario(_base()))


def test_a_message_belongs_to_the_newest_round_its_node_took_a_message_of() -> None:
    # a node that came between rounds 1 and 2 is asked before round 2 trains (a relay query
    # naming round 1's state: round 2), then takes round 1's state in a join message: it goes
    # out during round 2, after the query, so it is round 2's too
    app = ClientApp()
    took: list[str] = []

    @app.query()
    def query(msg: Message, ctx: Context) -> Message:
        took.append(str(msg.content["chaos"]["phase"]))
        return Message(RecordDict(), reply_to=msg)

    churn.apply(app, parse_scenario(_base()))  # partition 3 joins at round 2
    handle = app._registered_funcs["query.default"]

    def send(ctx: Context, phase: str, rnd: int) -> None:
        handle(_msg(RecordDict({"chaos": server_record([], phase=phase, server_round=rnd)})), ctx)

    early, joiner = _ctx(3), _ctx(3)
    with pytest.raises(NodeNotJoinedError, match="this is round 1"):
        send(early, "join", 1)  # nothing of round 2 taken yet: still round 1
    send(joiner, "relay", 1)
    send(joiner, "join", 1)
    assert took == ["relay", "join"]
    assert joiner.state.config_records["chaos-churn"]["seen"] == 2


def test_wrapper_leaves_and_drops_links_once_through_party_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from chaos_flwr.flower import client
    from chaos_flwr.flower.keys import load_federation, make_federation

    keys = make_federation(tmp_path / "keys", 4, founders=3, seed="t")
    ids = load_federation(keys).party_ids
    parties = {0: FakeParty(), 2: FakeParty()}
    monkeypatch.setattr(
        client, "party_for", lambda ctx, app=None: parties[int(ctx.node_config["partition-id"])]
    )
    app, seen = _plain_app()
    churn.apply(app, parse_scenario(_base()))
    run_config = {"chaos-keys-dir": str(keys)}
    linker, leaver = _ctx(0, run_config), _ctx(2, run_config)
    for rnd in (1, 2, 3, 4):
        _train(app, linker, rnd)
        if rnd < 4:
            _train(app, leaver, rnd)
    with pytest.raises(churn.NodeLeftError):
        _train(app, leaver, 4)
    assert parties[0].calls == [("disconnect", ids[1])]  # once, at round 3
    assert parties[2].calls == [("leave", "")]
    # the handlers ran in the leave round (the party decides); then the node is shut down
    assert seen == [1, 1, 2, 2, 3, 3, 4]


def test_an_action_and_its_message_are_one_turn_of_the_party(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With two simulation workers another process of the party could save between the action
    and the message it rides on, and drop the action: the two are one turn of the party."""
    from contextlib import contextmanager

    from chaos_flwr.flower import client
    from chaos_flwr.flower.client.registry import Parties
    from chaos_flwr.flower.keys import make_federation

    keys = make_federation(tmp_path / "keys", 4, founders=3, seed="t")
    events: list[str] = []

    class Recording(FakeParty):
        def leave(self) -> None:
            events.append("leave")

    monkeypatch.setattr(client, "party_for", lambda ctx, app=None: Recording())

    @contextmanager
    def turn(self: Parties, context: Context) -> Iterator[None]:
        events.append("turn")
        yield
        events.append("end")

    monkeypatch.setattr(Parties, "turn", turn)
    app, seen = _plain_app()
    client.enable(app)
    churn.apply(app, parse_scenario(_base()))
    leaver = _ctx(2, {"chaos-keys-dir": str(keys)})
    for rnd in (1, 2, 3):
        _train(app, leaver, rnd)
    # round 3 (the leave): the churn layer's turn holds the action and the enabled handler
    # (whose own turn nests in it); rounds 1 and 2 are one turn each, nested likewise
    assert events == ["turn", "turn", "end", "end"] * 2 + ["turn", "leave", "turn", "end", "end"]
    assert seen == [1, 2, 3]


def test_a_message_with_a_stale_context_copy_does_not_act_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On two simulation workers a message carries the node's Context as it was when sent: one
    that waited while another acted holds no mark of that action. The marks in the party's
    state directory say it was done; in another run they do not count."""
    import copy

    from chaos_flwr.flower import client
    from chaos_flwr.flower.keys import load_federation, make_federation
    from chaos_flwr.lab.churn_marks import MARKS_FILE

    keys = make_federation(tmp_path / "keys", 4, founders=3, seed="t")
    ids = load_federation(keys).party_ids
    party = FakeParty()
    monkeypatch.setattr(client, "party_for", lambda ctx, app=None: party)
    app, seen = _plain_app()
    churn.apply(app, parse_scenario(_base()))
    run_config = {"chaos-keys-dir": str(keys), "chaos-state-root": str(tmp_path / "state")}
    first = _ctx(0, run_config)
    _train(app, first, 2)
    stale = copy.deepcopy(first)  # the copy the second message of round 3 took
    _train(app, first, 3)
    _train(app, stale, 3)
    assert party.calls == [("disconnect", ids[1])]  # once
    assert seen == [2, 3, 3]
    marks = next((tmp_path / "state").rglob(MARKS_FILE))
    later = Context(
        run_id=2, node_id=first.node_id, node_config=first.node_config, state=RecordDict(),
        run_config=first.run_config,
    )  # fmt: skip
    _train(app, later, 3)  # another run: its own marks
    assert party.calls == [("disconnect", ids[1])] * 2
    for bad in ("[1, 2]", '{"run": 1, "seen": true, "done": []}', "[" * 40_000):
        marks.write_text(bad)  # not marks; a bool for an int; nested past the parser's depth
        with pytest.raises(StoreError, match="not churn marks"):
            _train(app, first, 4)


def test_an_action_the_party_refuses_is_reported_once_and_the_node_keeps_answering(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from chaos_flwr.errors import PolicyError
    from chaos_flwr.flower import client
    from chaos_flwr.flower.keys import make_federation

    class Refusing(FakeParty):
        def disconnect(self, other: str) -> None:
            self.calls.append(("disconnect", other))
            raise PolicyError("there is no up link")

    party = Refusing()
    monkeypatch.setattr(client, "party_for", lambda ctx, app=None: party)
    keys = make_federation(tmp_path / "keys", 4, founders=3, seed="t")
    app, seen = _plain_app()
    churn.apply(app, parse_scenario(_base()))
    linker = _ctx(0, {"chaos-keys-dir": str(keys)})
    for rnd in (3, 4, 5):
        _train(app, linker, rnd)
    assert len(party.calls) == 1 and party.calls[0][0] == "disconnect"
    assert seen == [3, 4, 5]
    assert "link-down p0-p1 @r3 refused: PolicyError" in capsys.readouterr().err


def test_wrapper_reads_the_scenario_path_from_the_run_config(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(_base()))
    app, seen = _plain_app()
    churn.apply(app)
    _train(app, _ctx(3), 1)  # no churn-scenario in the run config: pass-through
    with pytest.raises(NodeNotJoinedError):
        _train(app, _ctx(3, {"churn-scenario": str(path)}), 1)
    with pytest.raises(ConfigError, match="churn-scenario"):
        _train(app, _ctx(3, {"churn-scenario": str(tmp_path / "nope.yaml")}), 1)
    assert seen == [1]


# -- the report -------------------------------------------------------------------------------
def _rlog(rnd: int, trained: list[int], **extra: Any) -> dict[str, Any]:
    return {"server_round": rnd, "trained": trained, "eligible": trained, "holders": [], **extra}


def test_report_merges_the_killed_and_the_resumed_run_and_judges_every_event(
    tmp_path: Path,
) -> None:
    scen = parse_scenario(_base())
    ids = {0: "pa", 1: "pb", 2: "pc", 3: "pd"}
    nodes = {"10": "pa", "11": "pb", "12": "pc", "13": "pd"}
    base = [{"round": r, "accuracy": 0.1 + 0.1 * r, "time": 100.0 + r} for r in range(9)]
    join = {
        "party": "pd", "node": 13, "server_round": 2, "ok": True, "donors": ["pa", "pb"],
        "planned_bytes": {"pa": 600, "pb": 400}, "bytes_per_donor": {"pa": 600, "pb": 400},
        "planned_shards": {"pa": 3, "pb": 2}, "pull_s": 0.2, "lower_bound_s": 0.1,
    }  # fmt: skip
    # a first try of the same state that failed (a donor lost): the report shows the one that
    # took it
    failed = {**join, "ok": False, "error": "TransferError: lost", "donors": ["pb"],
              "bytes_per_donor": {}}  # fmt: skip
    logs1 = [
        _rlog(-1, []),
        _rlog(0, []),
        _rlog(1, [10, 11, 12]),
        _rlog(2, [10, 11, 12], joins=[failed, join],
              events=[{"kind": "join", "subject": "pd", "server_round": 2, "first_seen": 1.0,
                       "settle_s": 0.05, "record_id": "j"}]),
        _rlog(3, [10, 11, 13],
              events=[{"kind": "leave", "subject": "pc", "server_round": 3, "first_seen": 2.0,
                       "settle_s": 0.01, "record_id": "l"},
                      {"kind": "link_down", "subject": "pa|pb", "server_round": 3,
                       "first_seen": 2.0, "settle_s": 0.02, "record_id": "d"}]),
        _rlog(4, [10, 11, 13], errors={"11": 2}),  # p1 crashed: sampled, failed
    ]  # fmt: skip
    run1 = [
        {"round": r, "accuracy": 0.1 + 0.1 * r, "time": 200.0 + r, "node_parties": nodes,
         "chaos_rounds": logs1[: r + 2]}
        for r in range(5)
    ]  # fmt: skip
    nodes2 = {"20": "pa", "21": "pb", "23": "pd"}
    logs2 = [
        _rlog(4, [], holders=["pa", "pb"]),  # the hello, renamed after the resumed round
        _rlog(5, [20, 23]),
        _rlog(6, [20, 21, 23]),
        _rlog(7, [20, 21, 23]),
        _rlog(8, [20, 21, 23]),
    ]
    run2 = [{"round": 0, "accuracy": 0.05, "time": 300.0, "node_parties": nodes2}] + [
        {"round": r, "accuracy": 0.1 + 0.1 * r - 0.01, "time": 300.0 + r,
         "node_parties": nodes2, "chaos_rounds": logs2[: r - 3]}
        for r in range(5, 9)
    ]  # fmt: skip
    rep = build_report(
        scen, baseline=base, chaos_runs=[run1, run2], party_ids=ids, resumed_run_start=299.0
    )
    chaos_acc = rep["accuracy"]["chaos"]
    assert chaos_acc["0"] == pytest.approx(0.1)  # the resumed run's round 0 is not the curve
    assert chaos_acc["8"] == pytest.approx(0.89)
    assert rep["final_accuracy"]["gap"] == pytest.approx(-0.01)
    assert rep["final_accuracy"]["within_gap"] is True
    by_round = {r["round"]: r for r in rep["rounds"]}
    assert by_round[4]["run"] == 1  # the hello did not replace round 4's own log
    assert by_round[5]["trained_partitions"] == [0, 3]
    ev = {e["label"]: e for e in rep["events"]}
    assert ev["join p3 @r2"]["settled"] and ev["join p3 @r2"]["trains_in_round"] == 3
    assert ev["leave p2 @r3"]["settle_s"] == pytest.approx(0.01)
    assert ev["link-down p0-p1 @r3"]["record"]["record_id"] == "d"
    assert by_round[4]["sampled_partitions"] == [0, 1, 3]
    assert by_round[4]["trained_partitions"] == [0, 3]
    assert ev["crash p1 @r4"]["excluded_in_round"] == 5
    assert ev["return p1 @r6"]["trains_again_in_round"] == 6
    assert ev["server-kill @r5"]["settled"]
    assert all(e["settled"] for e in rep["events"])
    (j,) = rep["joins"]
    assert j["ok"] and j["donors"] == [0, 1] and j["bytes_per_donor"] == {"0": 600, "1": 400}
    assert j["delay_ratio"] == pytest.approx(2.0)
    assert j["join_to_training_s"] == pytest.approx(203.0 - 201.0)
    restart = rep["server_restart"]
    assert restart["resumed_at_round"] == 5 and restart["resumed_from_round"] == 4
    assert restart["restart_to_first_round_s"] == pytest.approx(6.0)
    assert restart["resume_holders"] == [0, 1]
    png = plot_report(rep, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(render_table(rep)) == 3


def test_read_progress_skips_a_line_torn_by_a_kill(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('{"round": 0, "accuracy": 0.1, "time": 1}\n{"round": 1, "acc')
    assert read_progress(p) == [{"round": 0, "accuracy": 0.1, "time": 1}]
    assert read_progress(tmp_path / "none.jsonl") == []


# -- the full scenario on the simulation engine -----------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_churn_scenario_runs_end_to_end_in_simulation(tmp_path: Path) -> None:
    from chaos_flwr.lab.demo import run_demo
    from chaos_flwr.lab.processes import alive, descendants

    before = set(descendants(os.getpid()))  # e.g. workers of earlier tests
    result = run_demo(tmp_path / "out", timeout_s=180, plot=False)
    rep = result.report
    assert json.loads(result.report_path.read_text()) == json.loads(
        json.dumps(rep, sort_keys=True, default=str)
    )
    unsettled = [e["label"] for e in rep["events"] if not e.get("settled")]
    assert unsettled == [], json.dumps(rep["events"], indent=1)
    # the joiner took the certified state, checked against the holders' receipts (ok): the
    # relay is the only path here, so from the ServerApp in one message (no donor asked)
    joins = [j for j in rep["joins"] if j["ok"]]
    assert joins, json.dumps(rep["joins"], indent=1)
    assert joins[0]["donors"] == [] and joins[0]["bytes_per_donor"] == {}
    assert joins[0]["total_bytes"] > 0
    # training went on after every event: every round after round 0 trained someone
    scen = load_scenario(EXAMPLE / "churn.yaml")
    trained = {r["round"]: r["trained"] for r in rep["rounds"]}
    assert sorted(trained) == list(range(scen.rounds + 1))
    assert all(trained[r] > 0 for r in range(1, scen.rounds + 1)), trained
    # the left party is not sampled after its leave; the server restart resumed
    leave = next(e for e in scen.events if e.kind == "leave")
    later = [r for r in rep["rounds"] if r["round"] > leave.round]
    assert all(leave.party not in r["trained_partitions"] for r in later)
    restart = rep["server_restart"]
    assert restart["resumed_at_round"] == scen.server_kill_round()
    # the restart's time splits into the engine's start-up (the new ServerApp's round-0 line),
    # Chaos's resume and the round itself, each measured
    parts = ("engine_startup_s", "chaos_resume_s", "first_round_s")
    assert all(isinstance(restart[k], float) and restart[k] >= 0 for k in parts), restart
    assert restart["engine_startup_s"] > 0 and restart["first_round_s"] > 0, restart
    assert sum(restart[k] for k in parts) == pytest.approx(restart["restart_to_first_round_s"])
    # accuracy within 2 points of the churn-free FedAvg run
    final = rep["final_accuracy"]
    assert final["within_gap"], final
    # nothing left running: every pid the runs saw is gone, and no child of this process
    for run in result.runs:
        assert not [p for p in run.pids if alive(p)]
    new = [p for p in descendants(os.getpid()) if p not in before]
    assert [p for p in new if alive(p)] == []


# -- the report as a reader sees it (issue 19, point 7) ---------------------------------------
def _six_party_runs() -> tuple[Any, dict[int, str], list[Any], list[list[Any]]]:
    """A recorded churn run like the demo's (5 institutions and a joiner), killed in round 6
    and resumed: the crash of p3 in round 5 produced a signed fail record, p3 returns in 7."""
    scen = parse_scenario(
        _base(rounds=9, institutions=5, joiners=1, events=[
            {"round": 3, "kind": "join", "party": 5},
            {"round": 4, "kind": "link-down", "party": 0, "peer": 1},
            {"round": 4, "kind": "leave", "party": 4},
            {"round": 5, "kind": "crash", "party": 3},
            {"round": 6, "kind": "server-kill"},
            {"round": 7, "kind": "return", "party": 3},
        ])
    )  # fmt: skip
    ids = {i: f"p{i}id" for i in range(6)}
    nodes = {str(100 + i): f"p{i}id" for i in range(6)}
    everyone = [f"p{i}id" for i in range(6)]
    base = [{"round": r, "accuracy": 0.1 * r, "time": 10.0 + r} for r in range(10)]
    donors = {f"p{i}id": 11_264 + 8 * i for i in range(5)}
    join = {
        "party": "p5id", "node": 105, "server_round": 3, "ok": True, "donors": list(donors),
        "planned_bytes": donors, "bytes_per_donor": {**donors, "p0id": 11_000},
        "planned_shards": {d: 11 for d in donors}, "pull_s": 0.41, "lower_bound_s": 0.0123,
    }  # fmt: skip
    fail = {"kind": "fail", "subject": "p3id", "server_round": 5, "first_seen": 5.0,
            "settle_s": 0.2, "record_id": "f"}  # fmt: skip
    members = {"active": [*everyone[:4], "p5id"], "left": ["p4id"]}
    logs1 = [
        _rlog(0, []),
        *(_rlog(r, [100, 101, 102, 103, 104]) for r in (1, 2)),
        _rlog(3, [100, 101, 102, 103, 104], joins=[join]),
        _rlog(4, [100, 101, 102, 103, 105], members=members),
        _rlog(5, [100, 101, 102, 103, 105], errors={"103": 2}, events=[fail], members=members),
    ]
    run1 = [
        {"round": r, "accuracy": 0.1 * r, "time": 100.0 + r, "node_parties": nodes,
         "chaos_rounds": logs1[: r + 1]}
        for r in range(6)
    ]  # fmt: skip
    back = {"kind": "join", "subject": "p3id", "server_round": 7, "first_seen": 9.0,
            "settle_s": 0.3, "record_id": "b"}  # fmt: skip
    logs2 = [
        _rlog(5, [], holders=everyone[:3]),  # the hello, named after the resumed round
        _rlog(6, [100, 101, 102, 105], members=members, train_s=4.0, certify_s=1.5),
        _rlog(7, [100, 101, 102, 103, 105], members=members, events=[back]),
        *(_rlog(r, [100, 101, 102, 103, 105], members=members) for r in (8, 9)),
    ]
    pull = {"seconds": 0.75, "shares": {"p0id": 3, "p1id": 3, "p2id": 2}}
    run2 = [{"round": 0, "accuracy": 0.0, "time": 250.0, "node_parties": nodes}] + [
        {"round": r, "accuracy": 0.1 * r, "time": 260.0 + r, "node_parties": nodes,
         "chaos_rounds": logs2[: r - 4], "last_pull": pull}
        for r in range(6, 10)
    ]  # fmt: skip
    return scen, ids, base, [run1, run2]


def _report() -> dict[str, Any]:
    scen, ids, base, runs = _six_party_runs()
    return build_report(scen, baseline=base, chaos_runs=runs, party_ids=ids,
                        resumed_run_start=200.0)  # fmt: skip


def test_the_resume_time_is_split_into_engine_start_up_and_chaos_resume() -> None:
    restart = _report()["server_restart"]
    assert restart["resumed_at_round"] == 6
    assert restart["restart_to_first_round_s"] == pytest.approx(66.0)  # launch 200 -> 266
    assert restart["engine_startup_s"] == pytest.approx(50.0)  # launch -> the round-0 line
    assert restart["first_round_s"] == pytest.approx(5.5)  # round 6's train + certify
    assert restart["chaos_resume_s"] == pytest.approx(10.5)  # hello, pull, verification
    assert restart["resume_pull_s"] == pytest.approx(0.75)
    parts = ("engine_startup_s", "chaos_resume_s", "first_round_s")
    assert sum(restart[k] for k in parts) == pytest.approx(restart["restart_to_first_round_s"])
    from rich.console import Console

    console = Console(width=100, record=True)
    console.print(render_table(_report())[1])
    text = " ".join(console.export_text().split())
    assert "engine start-up 50.0 s + Chaos resume 10.5 s" in text
    assert "the pull 0.75 s" in text


def test_a_crash_is_failed_in_the_members_column_once_its_signed_record_exists() -> None:
    rounds = {r["round"]: r for r in _report()["rounds"]}
    assert 3 in rounds[4]["members"]["active"]  # before the crash: active
    for rnd in (5, 6):  # the fail record was seen in round 5: failed until it is back
        assert 3 not in rounds[rnd]["members"]["active"], rounds[rnd]["members"]
        assert rounds[rnd]["members"]["failed"] == [3]
    assert 3 in rounds[7]["members"]["active"]  # its join record in round 7: active again
    assert rounds[7]["members"].get("failed", []) == []


def test_the_live_feed_and_the_table_count_the_same_trainers() -> None:
    from chaos_flwr.lab.demo import progress_text

    _, _, _, runs = _six_party_runs()
    rounds = {r["round"]: r for r in _report()["rounds"]}
    crash_line = runs[0][5]  # round 5: p3 was sampled and failed
    assert rounds[5]["trained"] == 4 and rounds[5]["sampled"] == 5
    assert "trained 4 of 5 sampled" in progress_text(crash_line)
    for line in runs[0][1:]:
        shown = int(progress_text(line).split("trained ")[1].split()[0])
        assert shown == rounds[line["round"]]["trained"]


def test_the_live_feed_shows_a_resumed_runs_round_0_as_the_server_up_not_an_accuracy() -> None:
    from chaos_flwr.lab.demo import progress_text

    line = {"round": 0, "accuracy": 0.0919, "chaos_rounds": []}
    assert progress_text(line) == "  round   0  accuracy 0.0919"
    resumed = progress_text(line, resumed=True)
    assert "ServerApp up" in resumed and "accuracy" not in resumed
    later = {"round": 6, "accuracy": 0.649, "chaos_rounds": []}
    assert progress_text(later, resumed=True) == "  round   6  accuracy 0.6490"


def test_the_tables_fit_100_columns_and_round_0_reads_as_no_party() -> None:
    from rich.console import Console

    console = Console(width=200, record=True)
    for table in render_table(_report()):
        assert console.measure(table).maximum <= 100, table.title  # no wrapping at 100
    console.print(render_table(_report())[0])
    row0 = next(ln for ln in console.export_text().splitlines() if ln.strip("│ ").startswith("0 "))
    cells = [c.strip() for c in row0.split("│") if c.strip()]
    assert cells[3] == "initial", cells  # not "0", which reads like party p0
    assert all(c.startswith("p") for c in cells[4].split() if c not in ("/", "-"))


def test_plot_labels_do_not_overlap(tmp_path: Path) -> None:
    from chaos_flwr.lab.render import event_labels, report_figure

    rep = _report()
    labels = event_labels(rep)
    assert labels[4][1] == "link-down p0-p1, leave p4"  # one label per round
    fig = report_figure(rep)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    boxes.append(ax.get_legend().get_window_extent(renderer))
    assert len(boxes) == len(labels) + 1
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), (a, b)
    import matplotlib.pyplot as plt

    plt.close(fig)
