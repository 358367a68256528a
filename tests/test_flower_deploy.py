"""The example on Flower's deployment engine: a join, a crash and a server restart, end to end.

A SuperLink and signed SuperNodes on 127.0.0.1 (node config ``chaos-key``, ``chaos-charter``,
``chaos-state-dir``); a SuperNode started mid-run joins, another is killed with SIGKILL, then the
ServerApp process is killed mid-round and a new run resumes from the parties' replicas. Every
process is stopped by pid. Churn-free rounds send exactly FedAvg's messages and lose no trainer.
The deployment engine polls every 3 s and starts a ClientApp process per message, so this one
test takes minutes.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from chaos_flwr.lab.deploy_churn import measure_deploy_churn
from chaos_flwr.lab.processes import alive, descendants

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_join_crash_and_server_restart_on_the_deployment_engine(tmp_path: Path) -> None:
    before = set(descendants(os.getpid()))  # e.g. workers of earlier tests
    fig = measure_deploy_churn(tmp_path, app_dir=EXAMPLE, timeout_s=660)
    fig.pop("progress")
    print(json.dumps(fig, indent=1, default=str))  # the measured figures (pytest -s)
    ids = fig["party_ids"]
    joiner, victim = ids[fig["founders"]], ids[fig["founders"] - 1]
    # join: the SuperNode started mid-run was admitted by signed records (the server's view
    # lists it active), took the certified state from the ServerApp in one message (the relay
    # is the only path; digest checked against the holders' receipts), and trained in a
    # later round
    assert fig["joiner_admitted"], fig["join_pulls"]
    pulls = [j for j in fig["join_pulls"] if j["ok"]]
    assert pulls, fig["join_pulls"]
    assert pulls[0]["bytes_per_donor"] == {} and pulls[0]["donors"] == [], pulls
    assert pulls[0]["digest_ok"], pulls
    assert fig["join_to_training_s"] is not None and fig["join_to_training_s"] > 0
    assert fig["join_trained_in_round"] > pulls[0]["server_round"] >= 1
    # crash: training goes on without the killed party, and a restarted server (which knows
    # no suspects) does not sample it either
    assert fig["trained_in_crash_round"] and victim not in fig["trained_in_crash_round"]
    assert fig["victim_sampled_after_restart"] is False
    # server restart: the new run resumed right after the last certified round, from the
    # parties' replicas (shards from >= 2 holders, checked against their signed receipts)
    assert fig["server_killed_pids"] >= 1
    assert fig["resumed_first_round"] == fig["certified_before_kill"] + 1
    assert fig["resumed_at_round"] == fig["certified_before_kill"] + 1
    pull = fig["resume_pull"]
    assert pull and len(pull["shares"]) >= 2 and sum(pull["shares"].values()) > 0
    assert pull["exchanges"] >= 1 and pull["direct"] == {}  # no daemons: through the relay
    assert fig["resumed_trained"] and victim not in fig["resumed_trained"]
    assert joiner in fig["resumed_trained"]  # its durable state survived the server restart too
    assert 0 < fig["restart_to_first_round_s"] < 660
    # a churn-free round sends exactly FedAvg's messages (one ClientApp process each: a train
    # and an evaluate message per node), and no round before the crash lost a trainer
    rounds = fig["rounds_run1"]
    free = [r for r in rounds if r["churn_free"]]
    assert free, rounds
    for r in free:
        assert r["messages"] == {"train": r["sampled"], "evaluate": r["sampled"]}, r
    before_crash = [r for r in rounds if r["round"] < fig["crash_in_round"]]
    assert all(r["trainers"] == r["sampled"] > 0 for r in before_crash), before_crash
    # verified rounds: each round's committed updates went to its rota auditor with its certify
    assert all(len(r["audited"]) >= 1 for r in before_crash), before_crash
    for prev, r in itertools.pairwise(before_crash):
        assert r["sampled"] >= prev["sampled"], (prev, r)
    # nothing left behind
    assert fig["pids_alive"] == []
    new = [p for p in descendants(os.getpid()) if p not in before]
    assert [p for p in new if alive(p)] == []
