"""The example on Flower's deployment engine: a join, a crash and a server restart, end to end.

A SuperLink and signed SuperNodes on 127.0.0.1 (node config ``chaos-key``, ``chaos-charter``,
``chaos-state-dir``); a SuperNode started mid-run joins, another is killed with SIGKILL, then the
ServerApp process is killed mid-round and a new run resumes from the parties' replicas. Every
process is stopped by pid. The deployment engine polls every 3 s and starts a ClientApp process
per message, so this one test takes minutes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chaos_flwr.flower import runner
from chaos_flwr.flower.overhead import measure_deploy_churn

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "multi_institution"


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_join_crash_and_server_restart_on_the_deployment_engine(tmp_path: Path) -> None:
    fig = measure_deploy_churn(tmp_path, app_dir=EXAMPLE, timeout_s=540)
    progress = fig.pop("progress")
    print(json.dumps(fig, indent=1, default=str))  # the measured figures (pytest -s)
    ids = fig["party_ids"]
    joiner, victim = ids[fig["founders"]], ids[fig["founders"] - 1]
    # join: the new SuperNode trained, from a round after it started
    assert fig["join_trained_in_round"] > fig["join_started_after_round"]
    assert 0 < fig["join_to_training_s"] < 540
    joins = [
        j
        for line in progress["run1"]
        for r in line.get("chaos_rounds", [])
        for j in r.get("joins", [])
        if j.get("party") == joiner and j.get("ok")
    ]
    assert joins and len(joins[0]["donors"]) >= 2  # pulled from >= 2 holders, digest checked
    # crash: two rounds later the killed party is not sampled and training goes on without it
    assert fig["victim_sampled_after_crash"] is False
    assert victim not in fig["trained_after_crash"] and fig["trained_after_crash"]
    # server restart: the new run resumed right after the last certified round, from replicas
    assert fig["resumed_at_round"] == fig["certified_before_kill"] + 1
    assert fig["server_killed_pids"] >= 1
    pull = fig["resume_pull"]
    assert pull and sum(pull["shares"].values()) > 0 and len(pull["shares"]) >= 2
    assert fig["resumed_trained"], "the resumed run trained nobody"
    assert 0 < fig["restart_to_first_round_s"] < 540
    # nothing left behind
    assert fig["pids_alive"] == []
    assert [p for p in runner.descendants(os.getpid()) if runner._alive(p)] == []
