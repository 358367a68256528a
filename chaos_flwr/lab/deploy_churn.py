"""A join, a crash and a server restart of ChaosStrategy on Flower's deployment engine.

:func:`measure_deploy_churn` returns the time for a joining SuperNode to be training and for a
restarted ServerApp to resume (``chaos-flwr bench flower-churn --engine deployment``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.errors import TransportError
from chaos_flwr.lab.deployment import DeploymentCluster
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.processes import alive, stop_process_tree
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.settings import (
    FLOWER_DEMO_POLL_S,
    FLOWER_DEPLOY_FOUNDERS,
    FLOWER_DEPLOY_JOIN_ROUNDS,
    FLOWER_DEPLOY_PHASE_TIMEOUT_S,
    FLOWER_DEPLOY_RESUME_PHASES,
    FLOWER_DEPLOY_ROUNDS,
    FLOWER_DEPLOY_TIMEOUT_S,
)

__all__ = ["measure_deploy_churn", "round_checks", "trained_parties"]

#: Pull interval of the ServerApp in the deployment runs.
_DEPLOY_POLL_INTERVAL_S = 0.2


def _wait_for(
    cond: Callable[[], bool], deadline: float, what: str, proc: Any | None = None
) -> None:
    while not cond():
        if time.time() > deadline:
            raise TransportError(f"timed out waiting for {what}")
        if proc is not None and proc.poll() is not None and not cond():
            raise TransportError(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(FLOWER_DEMO_POLL_S)


def trained_parties(line: dict[str, Any]) -> set[str]:
    """Parties that answered their train message in the round this progress line reports."""
    nodes = {int(k): v for k, v in (line.get("node_parties") or {}).items()}
    for rlog in line.get("chaos_rounds") or []:
        if rlog.get("server_round") == line.get("round") and rlog.get("trained"):
            failed = {int(n) for n in rlog.get("errors", {})} | set(rlog.get("missing", []))
            return {nodes[int(n)] for n in rlog["trained"] if int(n) in nodes and n not in failed}
    return set()


def _sampled_parties(line: dict[str, Any]) -> set[str]:
    nodes = {int(k): v for k, v in (line.get("node_parties") or {}).items()}
    for rlog in line.get("chaos_rounds") or []:
        if rlog.get("server_round") == line.get("round"):
            return {nodes[int(n)] for n in rlog.get("trained", []) if int(n) in nodes}
    return set()


def round_checks(lines: list[dict[str, Any]], events: set[int]) -> list[dict[str, Any]]:
    """Per finished round of a run (from its last progress line): the messages the ServerApp
    sent, the nodes sampled to train, the trainers whose reply came, the auditors sent its
    committed updates, and ``churn_free``: no join pull ran in it and it is not in ``events``
    (rounds of a join or a crash)."""
    if not lines:
        return []
    last = lines[-1]
    sent = list(last.get("messages_per_round") or [])
    replies = list(last.get("trainers_per_round") or [])
    out: list[dict[str, Any]] = []
    for rlog in last.get("chaos_rounds") or []:
        rnd = int(rlog.get("server_round", 0))
        if rnd < 1 or rnd > len(sent):
            continue
        out.append(
            {
                "round": rnd,
                "messages": {str(k): int(v) for k, v in sent[rnd - 1].items()},
                "sampled": len(rlog.get("trained") or []),
                "trainers": replies[rnd - 1] if rnd <= len(replies) else 0,
                "audited": [str(p) for p in rlog.get("audited") or []],
                "churn_free": not rlog.get("joins") and rnd not in events,
            }
        )
    return out


def _event_rounds(fig: dict[str, Any], last_round: int) -> set[int]:
    """Rounds of the first run a membership event touched: from the joiner's start until it
    trained, and from the crash on."""
    start = int(fig["join_started_after_round"]) + 1
    trained = fig.get("join_trained_in_round")
    crash = int(fig["crash_in_round"])
    join_end = int(trained) if trained is not None else crash
    return set(range(start, join_end)) | set(range(crash, last_round + 1))


@dataclass(frozen=True)
class _Plan:
    """One deployment measurement: who joins, who crashes, and the bounds."""

    ids: dict[int, str]
    joiner: int
    victim: int
    cfg: dict[str, object]
    progress1: Path
    progress2: Path
    deadline: float
    phase_timeout_s: float
    say: Callable[[str], None]


def _run_config(
    founders: int, rounds: int, keys: Path, phase_timeout_s: float, timeout_s: float
) -> dict[str, object]:
    return {
        "mode": "chaos",
        "num-server-rounds": rounds,
        "min-nodes": max(1, founders - 1),
        "local-epochs": 1,
        "chaos-keys-dir": str(keys),
        "phase-timeout-s": phase_timeout_s,
        "round-timeout-s": timeout_s,
        "poll-interval-s": _DEPLOY_POLL_INTERVAL_S,
    }


def _join(
    cluster: DeploymentCluster, plan: _Plan, run1: Any, node: dict[str, object]
) -> dict[str, Any]:
    """Start the joiner's SuperNode after round 1; wait until it trained (or gave up)."""
    out: dict[str, Any] = {}
    ids, joiner, progress1 = plan.ids, plan.joiner, plan.progress1
    _wait_for(lambda: any(x["round"] >= 1 for x in read_progress(progress1)), plan.deadline,
              "round 1 of the first run", run1)  # fmt: skip
    plan.say("round 1 done: starting the joiner's SuperNode")
    t_join = cluster.start_supernode(f"party-{joiner}", node)
    out["join_started_after_round"] = max(x["round"] for x in read_progress(progress1))

    join_round = out["join_started_after_round"] + 1

    def joiner_trained() -> bool:
        return any(ids[joiner] in trained_parties(x) for x in read_progress(progress1))

    def join_waited() -> bool:
        last = max(x["round"] for x in read_progress(progress1))
        return joiner_trained() or last >= join_round + FLOWER_DEPLOY_JOIN_ROUNDS

    _wait_for(join_waited, plan.deadline, "the joiner's first training round", run1)
    lines = read_progress(progress1)
    first = next((x for x in lines if ids[joiner] in trained_parties(x)), None)
    out["join_trained_in_round"] = first["round"] if first is not None else None
    out["join_to_training_s"] = float(first["time"]) - t_join if first is not None else None
    out["joiner_admitted"] = any(
        ids[joiner] in (r.get("members") or {}).get("active", [])
        for x in lines
        for r in x.get("chaos_rounds") or []
    )
    rlogs = lines[-1].get("chaos_rounds") or []
    certified = {r.get("server_round"): r.get("digest") for r in rlogs if r.get("digest")}
    mine = [j for r in rlogs for j in r.get("joins", []) if j.get("party") == ids[joiner]]
    out["join_pulls"] = [
        {k: j.get(k) for k in ("server_round", "ok", "error", "donors", "bytes_per_donor")}
        | {"pull_s": j.get("pull_s"), "lower_bound_s": j.get("lower_bound_s")}
        # what the joiner verified and stored is the state its round certified (the round
        # before the one it is logged in, when it came between rounds: newcomers_first)
        | {
            "digest_ok": bool(j.get("digest"))
            and j.get("digest") == certified.get(j.get("server_round"))
        }
        for j in mine
    ]
    return out


def _crash(cluster: DeploymentCluster, plan: _Plan, run1: Any) -> dict[str, Any]:
    """Kill the victim's SuperNode; wait for the round it crashed in."""
    out: dict[str, Any] = {}
    progress1 = plan.progress1
    cluster.kill_supernode(f"party-{plan.victim}")
    crash_round = max(x["round"] for x in read_progress(progress1)) + 1
    out["crash_in_round"] = crash_round
    # the crash round itself may still sample the victim (its message then goes unanswered)
    _wait_for(lambda: any(x["round"] >= crash_round for x in read_progress(progress1)),
              plan.deadline, "the crash round", run1)  # fmt: skip
    crash_lines = read_progress(progress1)
    crash_line = next(x for x in crash_lines if x["round"] >= crash_round)
    out["trained_in_crash_round"] = sorted(trained_parties(crash_line))
    before_crash = [x for x in crash_lines if x["round"] < crash_line["round"]]
    # wall time of the round the party crashed in (its phase deadline runs out on it)
    out["crash_round_s"] = (
        float(crash_line["time"]) - float(before_crash[-1]["time"]) if before_crash else None
    )
    return out


def _restart(cluster: DeploymentCluster, plan: _Plan, run1: Any) -> dict[str, Any]:
    """Kill the ServerApp mid-round, start a new run; wait for its first trained round."""
    out: dict[str, Any] = {}
    certified = max(x["round"] for x in read_progress(plan.progress1))
    plan.say(f"round {certified} done: killing the ServerApp")
    out["server_killed_pids"] = len(cluster.kill_serverapps())
    out["certified_before_kill"] = certified
    cluster.note_pids()
    stop_process_tree(run1)
    t_restart = time.time()
    # the SuperNodes first work through the killed run's queued messages (a ClientApp
    # process each): the resumed run's hello gets a longer deadline
    phase_s = plan.phase_timeout_s * FLOWER_DEPLOY_RESUME_PHASES
    resume_cfg = {**plan.cfg, "phase-timeout-s": phase_s}
    run2 = cluster.start_run({**resume_cfg, "progress-path": str(plan.progress2)}, "run-2.log")

    def trained_round(x: dict[str, Any]) -> bool:
        return bool(x["round"] >= 1 and trained_parties(x))

    _wait_for(lambda: any(trained_round(x) for x in read_progress(plan.progress2)),
              plan.deadline, "the resumed run's first trained round", run2)  # fmt: skip
    lines2 = read_progress(plan.progress2)
    resumed = next(x for x in lines2 if trained_round(x))
    out["resumed_first_round"] = next(x["round"] for x in lines2 if x["round"] >= 1)
    out["resumed_at_round"] = resumed["round"]
    out["restart_to_first_round_s"] = float(resumed["time"]) - t_restart
    out["resume_pull"] = resumed.get("last_pull")
    # a restarted server knows no suspects: the dead party must still not be sampled
    out["victim_sampled_after_restart"] = plan.ids[plan.victim] in _sampled_parties(resumed)
    plan.say(f"resumed at round {resumed['round']}: stopping the cluster")
    out["resumed_trained"] = sorted(trained_parties(resumed))
    out["final_accuracy"] = resumed.get("accuracy")
    return out


#: Keys of the deployment lab derive from this seed (reproducible party ids); its charter
#: fixes FedAvg as the rule, with one rota auditor a round.
_SEED = "chaos-flwr-deploy"


def measure_deploy_churn(
    work_dir: Path,
    *,
    app_dir: Path | None = None,
    founders: int = FLOWER_DEPLOY_FOUNDERS,
    rounds: int = FLOWER_DEPLOY_ROUNDS,
    phase_timeout_s: float = FLOWER_DEPLOY_PHASE_TIMEOUT_S,
    timeout_s: float = FLOWER_DEPLOY_TIMEOUT_S,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """A join, a crash and a server restart on the deployment engine; return the figures.

    ``founders`` SuperNodes (signed: ``chaos-key``, ``chaos-charter``, ``chaos-state-dir`` in
    their node config) start with a SuperLink on 127.0.0.1. After round 1 a new SuperNode with
    an allowlisted key starts (the join); once it has trained (or ``FLOWER_DEPLOY_JOIN_ROUNDS``
    rounds later), one founder's SuperNode is killed with SIGKILL (the crash); after that round
    the ServerApp process is killed with SIGKILL mid-round and a new run resumes from the
    parties' replicas; once it has finished a round, everything is stopped by pid (the run's
    remaining rounds are not waited for).

    Returns
    -------
    dict
        ``join_to_training_s`` (SuperNode start -> end of the first round it trained in;
        ``None`` if it did not train in time), whether the server's view admitted the joiner,
        ``restart_to_first_round_s`` (new run start -> its first finished round), the rounds
        (certified before the kill, resumed at), whether the dead party was sampled after the
        restart, the resume
        pull, and every pid seen with those still alive (there must be none).
    """
    from chaos_flwr.flower.keys import charter_path, key_path, load_federation, make_federation
    from chaos_flwr.flower.keys import fedavg_rounds as audited

    say = log or (lambda _msg: None)
    app = app_dir or example_dir()
    work = Path(work_dir)
    n = founders + 1
    keys = make_federation(work / "keys", n, founders=founders, seed=_SEED, rounds=audited())
    ids = load_federation(keys).party_ids

    def node_config(i: int) -> dict[str, object]:
        return {
            "partition-id": i,
            "num-partitions": n,
            "chaos-key": str(key_path(keys, i)),
            "chaos-charter": str(charter_path(keys)),
            "chaos-state-dir": str(work / "state" / f"party-{i}"),
        }

    plan = _Plan(
        ids=ids,
        joiner=founders,
        victim=founders - 1,
        cfg=_run_config(founders, rounds, keys, phase_timeout_s, timeout_s),
        progress1=work / "progress-1.jsonl",
        progress2=work / "progress-2.jsonl",
        deadline=time.time() + timeout_s,
        phase_timeout_s=phase_timeout_s,
        say=say,
    )
    out: dict[str, Any] = {"founders": founders, "rounds": rounds, "party_ids": ids}
    with DeploymentCluster(app, work / "home") as cluster:
        for i in range(founders):
            cluster.start_supernode(f"party-{i}", node_config(i))
        run1 = cluster.start_run({**plan.cfg, "progress-path": str(plan.progress1)}, "run-1.log")
        out.update(_join(cluster, plan, run1, node_config(plan.joiner)))
        say(f"join: trained in round {out['join_trained_in_round']}; crashing party-{plan.victim}")
        out.update(_crash(cluster, plan, run1))
        out.update(_restart(cluster, plan, run1))
        out["progress"] = {
            "run1": read_progress(plan.progress1),
            "run2": read_progress(plan.progress2),
        }
        run1_lines = out["progress"]["run1"]
        last_round = max((int(x["round"]) for x in run1_lines), default=0)
        out["rounds_run1"] = round_checks(run1_lines, _event_rounds(out, last_round))
    pids = cluster.close()
    out["pids_seen"] = len(pids)
    out["pids_alive"] = [p for p in pids if alive(p)]
    return out
