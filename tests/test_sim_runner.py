"""The simulator end to end: real Peers, invariants, determinism, restarts, bounds, the CLI."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from chaos_flwr.cli import app
from chaos_flwr.membership import Record, leave_body, link_body
from chaos_flwr.sim.runner import Simulation, random_scenario, run_scenario
from chaos_flwr.sim.scenario import load_scenario, parse_scenario


def _strip(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "wall_s"}


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = run_scenario("churn-5", 11)
    b = run_scenario("churn-5", 11)
    c = run_scenario("churn-5", 12)
    assert a["ok"], a["invariants"]
    assert _strip(a) == _strip(b)
    assert a["trace_digest"] != c["trace_digest"]


def test_churn_scenario_passes_every_invariant() -> None:
    r = run_scenario("churn-5", 3)
    assert r["ok"] and r["bound"] is None
    inv = r["invariants"]
    assert inv["converged"]["ok"] and inv["signatures"]["ok"] and inv["forged_rejected"]["ok"]
    # Each forged kind met a typed refusal: a garbled byte breaks the signature or the
    # encoding, a truncation the encoding, an outsider is unknown, a one-ended link breaks policy.
    errors = set(inv["forged_rejected"]["errors"])
    assert {"DecodeError", "UnknownPartyError", "PolicyError"} <= errors
    assert errors <= {"SignatureError", "DecodeError", "UnknownPartyError", "PolicyError"}
    assert inv["forged_rejected"]["delivered"] == 4
    assert r["messages"]["dropped"] > 0  # the drop fault was in force


def test_partition_heal_views_converge_after_failures() -> None:
    sc = load_scenario("partition-heal")
    sim = Simulation(sc, 5)
    sim.setup()
    sim.engine.run(15.0)  # just before the heal: each side has declared the other failed
    side_a = [sim.pids[i] for i in (0, 1, 2)]
    side_b = [sim.pids[i] for i in (3, 4, 5)]
    view_a = sim.peers[side_a[0]].view()
    view_b = sim.peers[side_b[0]].view()
    # A suspect is declared failed where a quorum of its watchers is on the other side.
    assert "failed" in {view_a.members[p].status for p in side_b}
    assert "failed" in {view_b.members[p].status for p in side_a}
    assert view_a.digest != view_b.digest
    result = sim.run_rest()
    assert result["ok"], result["invariants"]
    digests = {sim.peers[p].view().digest for p in sim.pids}
    assert len(digests) == 1
    final = sim.peers[sim.pids[0]].view()
    assert final.active() == sorted(sim.pids)
    failed_before = [p for p in side_b if view_a.members[p].status == "failed"]
    assert all(final.members[p].incarnation > view_a.members[p].incarnation for p in failed_before)


CRASH = {
    "name": "crash",
    "parties": 5,
    "settle_s": 30,
    "events": [
        {"at": 5, "action": "crash", "party": 3},
        {"at": 12, "action": "restart", "party": 3, "disk": True},
        {"at": 6, "action": "crash", "party": 4},
        {"at": 12, "action": "restart", "party": 4, "disk": False},
    ],
}


def test_crash_restart_with_and_without_disk() -> None:
    sim = Simulation(parse_scenario(CRASH), 2)
    sim.setup()
    sim.engine.run(11.9)
    p3, p4 = sim.pids[3], sim.pids[4]
    before3 = sim.peers[p3]
    held3 = sorted(r.record_id for r in before3.records)
    inc3, inc4 = before3.incarnation, sim.peers[p4].incarnation
    live_view = sim.peers[sim.pids[0]].view()
    assert live_view.members[p3].status == "failed" and live_view.members[p4].status == "failed"
    sim.engine.run(12.0)  # restarts happen; their first messages are still in flight
    after3, after4 = sim.peers[p3], sim.peers[p4]
    assert after3 is not before3
    assert after3.incarnation > inc3 and after4.incarnation > inc4
    assert sorted(r.record_id for r in after3.records) == held3  # the disk kept its records
    assert len(after4.records) == 0  # a fresh joiner with no disk
    result = sim.run_rest()
    assert result["ok"], result["invariants"]
    view = sim.peers[sim.pids[0]].view()
    assert view.members[p3].status == "active" and view.members[p3].incarnation > inc3
    assert view.members[p4].status == "active" and view.members[p4].incarnation > inc4
    assert after3.view().digest == after4.view().digest == view.digest


def test_invariant_checks_catch_tampering() -> None:
    sim = Simulation(parse_scenario({"name": "t", "parties": 5, "settle_s": 10}), 0)
    result = sim.run()
    assert result["ok"]
    a, b, c = sim.pids[0], sim.pids[1], sim.pids[3]
    pa = sim.peers[a]
    # A link_up signed by one end only: the peer would refuse it; force it in as if it had not.
    body = link_body("link_up", pa.policy.federation, (a, pa.incarnation), (b, 0), 99)
    assert pa.records.add(Record.sign(body, [sim.identities[a]]), validated=True)
    sigs = sim._check_signatures()
    assert not sigs["ok"] and "link_up" in sigs["detail"][0]
    # A valid record that only one party holds: views no longer agree.
    pc = sim.peers[c]
    leave = Record.sign(leave_body(pc.policy.federation, c, pc.incarnation), [sim.identities[c]])
    assert sim.peers[b].records.add(leave)
    conv = sim._check_converged()
    assert not conv["ok"] and "distinct view digests" in " ".join(conv["detail"])


def test_event_bound_ends_run_as_failure() -> None:
    r = run_scenario(parse_scenario({"name": "b", "parties": 5, "max_events": 300}), 0)
    assert not r["ok"] and "max_events=300" in r["bound"]
    r = run_scenario(parse_scenario({"name": "v", "parties": 5, "max_virtual_s": 5}), 0)
    assert not r["ok"] and "max_virtual_s" in r["bound"]


def test_random_scenarios_are_pure_functions_of_seed_and_pass() -> None:
    assert random_scenario(4, 8) == random_scenario(4, 8)
    assert random_scenario(4, 8) != random_scenario(5, 8)
    for seed in (1, 2):
        sc = random_scenario(seed, 7)
        assert 5 <= sc.parties <= 7
        r = run_scenario(sc, seed)
        assert r["ok"], (seed, r["invariants"], r["bound"])


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_simulate_json_replays_exactly() -> None:
    runner = CliRunner()
    out1 = runner.invoke(app, ["simulate", "--scenario", "churn-5", "--seed", "4", "--json"])
    out2 = runner.invoke(app, ["simulate", "--scenario", "churn-5", "--seed", "4", "--json"])
    assert out1.exit_code == 0, out1.output
    r1, r2 = json.loads(out1.output), json.loads(out2.output)
    assert r1["ok"] and r1["trace_digest"] == r2["trace_digest"]
    text = runner.invoke(app, ["simulate", "--scenario", "churn-5", "--seed", "4"])
    assert text.exit_code == 0 and "converged" in text.output and "pass" in text.output


def test_cli_simulate_errors(tmp_path: Any) -> None:
    runner = CliRunner()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nparties: 5\nevents:\n  - {at: 1, action: crash, party: 9}\n")
    res = runner.invoke(app, ["simulate", "--scenario", str(bad)])
    assert res.exit_code == 1 and "events.0.party" in res.output
    res = runner.invoke(app, ["simulate", "--scenario", "no-such-scenario"])
    assert res.exit_code == 1 and "shipped scenario" in res.output
    bounded = tmp_path / "bounded.yaml"
    bounded.write_text("name: y\nparties: 5\nmax_events: 200\n")
    res = runner.invoke(app, ["simulate", "--scenario", str(bounded)])
    assert res.exit_code == 1 and "bound" in res.output


def test_cli_soak_and_bench_sim() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["simulate", "--soak", "2", "--seed", "7", "--max-parties", "6"])
    assert res.exit_code == 0, res.output
    assert "seeds 7..8" in res.output and "events/s" in res.output
    res = runner.invoke(
        app, ["simulate", "--soak", "2", "--seed", "7", "--max-parties", "6", "--json"]
    )
    data = json.loads(res.output)
    assert data["runs"] == 2 and data["failures"] == [] and data["events"] > 0
    res = runner.invoke(app, ["bench", "sim", "--parties", "8", "--runs", "2", "--json"])
    assert res.exit_code == 0, res.output
    bench = json.loads(res.output)
    assert bench["parties"] == 8 and bench["runs"] == 2 and bench["events_per_s"] > 0
    assert bench["deterministic"] and bench["ok"]


def test_trace_is_identical_across_processes_with_different_hash_seeds() -> None:
    """A run does not depend on set iteration order (str hashing differs per process)."""
    import os
    import subprocess
    import sys

    code = (
        "from chaos_flwr.sim.runner import run_scenario;"
        "print(run_scenario('partition-heal', 9)['trace_digest'])"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert digests == {run_scenario("partition-heal", 9)["trace_digest"]}
