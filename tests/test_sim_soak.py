"""Jepsen-style soak: hundreds of random 200-event schedules with training, and the checker.

``CHAOS_SOAK_SEEDS`` (default ``SIM_SOAK_CI_SEEDS`` = 300) seeds of 5..200 parties run in
``CHAOS_SOAK_WORKERS`` (default 2) processes; every schedule mixes joins (some concurrent),
leaves, crashes with restarts with and without disk, partitions, link flaps, message faults,
forged envelopes, relay restarts, relay equivocation and donors killed mid transfer, and ends
healed; all invariants (views converge, signatures, forged refused, certified states,
recovery, progress, equivocation) must hold for every seed. A failure names the seed and the
command that replays it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from chaos_flwr.cli import app
from chaos_flwr.sim.runner import Simulation, random_scenario, run_scenario, soak
from chaos_flwr.sim.scenario import parse_scenario
from chaos_flwr.sim.settings import SIM_SOAK_EVENTS

#: Seeds the CI soak test runs (env ``CHAOS_SOAK_SEEDS`` overrides).
SIM_SOAK_CI_SEEDS = 300
SEEDS = int(os.environ.get("CHAOS_SOAK_SEEDS", str(SIM_SOAK_CI_SEEDS)))
WORKERS = int(os.environ.get("CHAOS_SOAK_WORKERS", "2"))


@pytest.mark.timeout(900)
def test_soak_hundreds_of_random_schedules_keep_every_invariant() -> None:
    r = soak(SEEDS, 0, max_parties=200, events=SIM_SOAK_EVENTS, workers=WORKERS)
    assert r["failures"] == [], json.dumps(r["failures"], indent=1)
    assert r["ok"] and r["runs"] == SEEDS
    assert r["schedule_events"] >= SIM_SOAK_EVENTS * SEEDS
    assert r["parties"]["min"] == 5
    if SEEDS >= 300:  # seeds 0..299 include two federations of more than 100 parties
        assert r["parties"]["over_100"] >= 2 and r["parties"]["max"] <= 200
    t = r["training"]
    assert t["rounds_certified"] > 0 and t["pulls_done"] > 0
    assert t["donor_kills_mid_transfer"] > 0 and t["pulls_survived_donor_loss"] > 0
    assert t["relay_restarts"] > 0
    assert t["equivocated_rounds"] > 0 and t["equivocations_detected"] > 0
    for action in ("crash", "restart", "partition", "flap", "faults", "join", "leave", "forge"):
        assert r["faults"][action] > 0, action
    print(
        f"\nsoak: {r['runs']} seeds, {r['schedule_events']} schedule events, "
        f"{r['events']} engine events, {r['events_per_s']:.0f} events/s per process, "
        f"wall {r['wall_s']:.1f} s with {WORKERS} workers"
    )


def test_soak_report_is_a_pure_function_of_the_seeds_across_hash_seeds() -> None:
    code = (
        "import json; from chaos_flwr.sim.runner import soak; "
        "r = soak(1, 11, 8, 120); print(json.dumps([r['digest'], r['events']]))"
    )
    outs = set()
    for hashseed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        outs.add(done.stdout.strip())
    assert len(outs) == 1
    here = soak(1, 11, 8, 120)
    assert json.dumps([here["digest"], here["events"]]) in outs


def test_random_schedules_cover_the_fault_menu() -> None:
    sc = random_scenario(5, 200)
    assert sc.training and len(sc.events) >= SIM_SOAK_EVENTS
    assert sc == random_scenario(5, 200)
    actions = {ev.action for ev in sc.events}
    assert {"crash", "restart", "partition", "heal", "flap", "faults"} <= actions
    big = random_scenario(139, 200)
    assert 100 <= big.parties <= 200
    concurrent = [ev.at for ev in random_scenario(7, 12).events if ev.action == "join"]
    assert len(concurrent) > len(set(concurrent)) or len(concurrent) <= 1


def _scenario(events: list[dict[str, Any]], **kw: Any) -> Any:
    return parse_scenario(
        {"name": "t", "parties": kw.pop("parties", 6), "training": True, "settle_s": 16,
         "events": events, **kw}
    )  # fmt: skip


def test_relay_restart_loses_in_flight_messages_and_nothing_else() -> None:
    sc = _scenario(
        [{"at": 5.0, "action": "relay_restart", "down_s": 1.0}, {"at": 7, "action": "heal"}]
    )
    sim = Simulation(sc, 2)
    sim.setup()
    sim.engine.run(4.99)
    tr = sim.trainer
    assert tr is not None
    before = {p: dict(tp.digests) for p, tp in tr.parties.items()}
    top_before = max(tr.accepted)
    sim.engine.run(5.01)
    assert not tr.relay_up and "relay" in sim.net.crashed
    # the parties kept every certified replica across the relay restart
    assert {p: dict(tp.digests) for p, tp in tr.parties.items()} == before
    r = sim.run_rest()
    assert r["ok"], r["invariants"]
    assert r["training"]["relay_restarts"] == 1
    assert r["invariants"]["recovered"]["latest"] > top_before  # training went on from there


def test_a_donor_killed_mid_transfer_is_survived_by_replanning() -> None:
    sc = _scenario(
        [
            {"at": 4.0, "action": "crash", "party": 5},
            {"at": 5.0, "action": "restart", "party": 5, "disk": False},
            {"at": 5.0, "action": "crash_donor", "down_s": 3.0, "disk": True},
            {"at": 8.0, "action": "heal"},
        ]
    )
    r = run_scenario(sc, 1)
    assert r["ok"], r["invariants"]
    t = r["training"]
    assert t["donor_kills_mid_transfer"] == 1
    assert t["pulls_survived_donor_loss"] >= 1


def test_the_training_checker_catches_broken_states() -> None:
    """The invariants can fail: corrupt a replica, lose the latest, stop progress."""
    sc = _scenario([{"at": 6, "action": "heal"}])
    sim = Simulation(sc, 0)
    r = sim.run()
    assert r["ok"], r["invariants"]
    tr = sim.trainer
    assert tr is not None
    live, wants, settle = sim.live(), sim.wants, sc.last_event_at
    victim = tr.parties[sim.pids[4]]
    top = victim.top()
    good = victim.held[top]
    victim.held[top] = good[:-1] + bytes([good[-1] ^ 1])
    assert not tr.check(live, wants, settle)["certified_states"]["ok"]
    victim.held[top] = good
    del victim.held[top], victim.digests[top]
    assert not tr.check(live, wants, settle)["recovered"]["ok"]
    victim.held[top], victim.digests[top] = good, tr.accepted_digest(top)
    marks = list(tr.progress_marks)
    tr.progress_marks[:] = [(t, rr) for t, rr in marks if t < settle]
    assert not tr.check(live, wants, settle)["progress"]["ok"]
    tr.progress_marks[:] = marks
    assert all(v["ok"] for v in tr.check(live, wants, settle).values())


def test_cli_soak_json_reports_seeds_events_rate_and_failures() -> None:
    res = CliRunner().invoke(
        app, ["simulate", "--soak", "2", "--seed", "3", "--max-parties", "7", "--events", "60",
              "--json"]
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["seeds"] == [3, 4] and data["runs"] == 2
    assert data["events"] > 0 and data["events_per_s"] > 0
    assert data["schedule_events"] >= 120 and data["failures"] == []
    text = CliRunner().invoke(app, ["simulate", "--soak", "1", "--seed", "3", "--events", "40"])
    assert text.exit_code == 0 and "0 failures" in text.output
