"""Figures of ChaosStrategy on Flower's engines.

:func:`measure_overhead`: per-round wall time of ChaosStrategy over plain FedAvg on the
simulation engine. :func:`measure_deploy_churn`: on the deployment engine, the time for a
joining SuperNode to be training and for a restarted ServerApp to resume.

Both runs use the same example app, data, seed and number of rounds; the only difference is
the run config ``mode`` (``fedavg`` or ``chaos``). Chaos parties run without identities here
(``chaos-unsigned``): simulated SuperNodes have no per-node key settings, and the figure
measured is the carrier's cost (extra records, relay bookkeeping, receipts), not signing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import (
    FLOWER_DEMO_POLL_S,
    FLOWER_DEPLOY_FOUNDERS,
    FLOWER_DEPLOY_JOIN_ROUNDS,
    FLOWER_DEPLOY_PHASE_TIMEOUT_S,
    FLOWER_DEPLOY_RESUME_PHASES,
    FLOWER_DEPLOY_ROUNDS,
    FLOWER_DEPLOY_TIMEOUT_S,
    FLOWER_EXAMPLE_SUPERNODES,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_RUN_TIMEOUT_S,
)
from chaos_flwr.errors import TransportError
from chaos_flwr.flower.runner import run_simulation_app, stop_process_tree

__all__ = ["example_dir", "measure_deploy_churn", "measure_overhead"]


def example_dir() -> Path:
    """The multi-institution example of a source checkout."""
    return Path(__file__).resolve().parents[2] / "examples" / "multi_institution"


def measure_overhead(
    rounds: int = 10,
    *,
    app_dir: Path | None = None,
    num_supernodes: int = FLOWER_EXAMPLE_SUPERNODES,
    poll_interval_s: float = FLOWER_POLL_INTERVAL_S,
    timeout_s: float = FLOWER_RUN_TIMEOUT_S,
    signed: bool = False,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run the example as plain FedAvg and as ChaosStrategy(FedAvg); return the figures.

    Parameters
    ----------
    rounds:
        Federated rounds of each run.
    poll_interval_s:
        ChaosStrategy's pull interval (plain FedAvg uses Flower's own ``send_and_receive``,
        which pulls every 0.1 s on the simulation engine).
    signed:
        Chaos parties with identities (keys and a charter from
        :func:`chaos_flwr.flower.keys.make_federation`, every SuperNode a founder): receipts
        signed and verified, the server keeps its view of the signed records. Otherwise the
        parties run unsigned (the carrier's cost only).
    repeats:
        FedAvg/Chaos run pairs, interleaved (one of each, then the next pair).

    Returns
    -------
    dict
        Per mode the last run's figures plus ``median_round_s_runs`` (the median of rounds
        2..N of every run; round 1 includes Ray's start-up); ``ratio_median_round`` is the
        median over the pairs of Chaos over FedAvg, ``ratio_runs`` each pair's ratio (and the
        same of the rounds' means: ``ratio_mean_round``, ``ratio_mean_round_runs``). Chaos
        runs add ``phase_s`` (median train / certify / join exchange times of rounds 2..N).
        ``loadavg`` is the 1-minute load average before and after.
    """
    import os
    import tempfile

    app = app_dir or example_dir()
    out: dict[str, Any] = {
        "rounds": rounds,
        "supernodes": num_supernodes,
        "chaos_poll_interval_s": poll_interval_s,
        "signed": signed,
        "repeats": repeats,
        "loadavg": {"before": os.getloadavg()[0]},
    }
    ratios: list[float] = []
    mean_ratios: list[float] = []
    runs: dict[str, list[float]] = {"fedavg": [], "chaos": []}
    means: dict[str, list[float]] = {"fedavg": [], "chaos": []}
    with tempfile.TemporaryDirectory(prefix="chaos-overhead-") as tmp:
        extra: dict[str, object] = {"chaos-unsigned": True}
        if signed:
            from chaos_flwr.flower.keys import make_federation

            keys = make_federation(
                Path(tmp) / "keys", num_supernodes, founders=num_supernodes, seed="overhead"
            )
            extra = {"chaos-unsigned": False, "chaos-keys-dir": str(keys)}
        for rep in range(repeats):
            for mode in ("fedavg", "chaos"):
                cfg: dict[str, object] = {
                    "mode": mode,
                    "num-server-rounds": rounds,
                    "poll-interval-s": poll_interval_s,
                    **extra,
                }
                if signed:  # fresh replicas per run: every run starts at round 0
                    cfg["chaos-state-root"] = str(Path(tmp) / f"state-{rep}-{mode}")
                run = run_simulation_app(
                    app, run_config=cfg, num_supernodes=num_supernodes, timeout_s=timeout_s
                )
                if run.returncode != 0 or not run.results:
                    raise TransportError(
                        f"the {mode} run failed (exit {run.returncode}):\n{run.log[-2000:]}"
                    )
                walls = list(run.results["round_wall_s"])
                med = statistics.median(walls[1:]) if len(walls) > 1 else walls[0]
                mean = statistics.fmean(walls[1:]) if len(walls) > 1 else walls[0]
                runs[mode].append(med)
                means[mode].append(mean)
                fig: dict[str, Any] = {
                    "final_accuracy": run.results["final_accuracy"],
                    "accuracy": run.results["accuracy"],
                    "round_wall_s": walls,
                    "median_round_s": med,
                    "mean_round_s": mean,
                    "total_wall_s": run.results["total_wall_s"],
                }
                chaos_rounds = [
                    r for r in run.results.get("chaos_rounds") or [] if r.get("round", 0) >= 2
                ]
                if chaos_rounds:
                    fig["phase_s"] = {
                        k: statistics.median(float(r.get(k, 0.0)) for r in chaos_rounds)
                        for k in ("train_s", "certify_s", "join_s")
                    }
                    fig["unsigned_receipts"] = max(r["unsigned_receipts"] for r in chaos_rounds)
                    fig["holders"] = min(r["holders"] for r in chaos_rounds)
                out[mode] = fig
            ratios.append(runs["chaos"][-1] / runs["fedavg"][-1])
            mean_ratios.append(means["chaos"][-1] / means["fedavg"][-1])
    for mode in ("fedavg", "chaos"):
        out[mode]["median_round_s_runs"] = runs[mode]
        out[mode]["mean_round_s_runs"] = means[mode]
    out["ratio_runs"] = ratios
    out["ratio_median_round"] = statistics.median(ratios)
    # rounds end on 0.1 s polling steps, so a run's median is one of a few values; the mean
    # of rounds 2..N is the finer figure
    out["ratio_mean_round_runs"] = mean_ratios
    out["ratio_mean_round"] = statistics.median(mean_ratios)
    out["accuracy_gap"] = out["chaos"]["final_accuracy"] - out["fedavg"]["final_accuracy"]
    out["loadavg"]["after"] = os.getloadavg()[0]
    return out


def _wait_for(
    cond: Callable[[], bool], deadline: float, what: str, proc: Any | None = None
) -> None:
    while not cond():
        if time.time() > deadline:
            raise TransportError(f"timed out waiting for {what}")
        if proc is not None and proc.poll() is not None and not cond():
            raise TransportError(f"the run ended (exit {proc.returncode}) before {what}")
        time.sleep(FLOWER_DEMO_POLL_S)


def _trained_parties(line: dict[str, Any]) -> set[str]:
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
    from chaos_flwr.flower.report import read_progress
    from chaos_flwr.flower.runner import DeploymentCluster, _alive

    say = log or (lambda _msg: None)
    app = app_dir or example_dir()
    work = Path(work_dir)
    n = founders + 1
    keys = make_federation(work / "keys", n, founders=founders, seed="chaos-flwr-deploy")
    ids = load_federation(keys).party_ids

    def node_config(i: int) -> dict[str, object]:
        return {
            "partition-id": i,
            "num-partitions": n,
            "chaos-key": str(key_path(keys, i)),
            "chaos-charter": str(charter_path(keys)),
            "chaos-state-dir": str(work / "state" / f"party-{i}"),
        }

    cfg: dict[str, object] = {
        "mode": "chaos",
        "num-server-rounds": rounds,
        "min-nodes": max(1, founders - 1),
        "local-epochs": 1,
        "chaos-keys-dir": str(keys),
        "phase-timeout-s": phase_timeout_s,
        "round-timeout-s": timeout_s,
        "poll-interval-s": 0.2,
    }
    progress1, progress2 = work / "progress-1.jsonl", work / "progress-2.jsonl"
    deadline = time.time() + timeout_s
    out: dict[str, Any] = {"founders": founders, "rounds": rounds, "party_ids": ids}
    joiner, victim = founders, founders - 1
    with DeploymentCluster(app, work / "home") as cluster:
        for i in range(founders):
            cluster.start_supernode(f"party-{i}", node_config(i))
        run1 = cluster.start_run({**cfg, "progress-path": str(progress1)}, "run-1.log")
        _wait_for(lambda: any(x["round"] >= 1 for x in read_progress(progress1)), deadline,
                  "round 1 of the first run", run1)  # fmt: skip
        say("round 1 done: starting the joiner's SuperNode")
        t_join = cluster.start_supernode(f"party-{joiner}", node_config(joiner))
        out["join_started_after_round"] = max(x["round"] for x in read_progress(progress1))

        join_round = out["join_started_after_round"] + 1

        def joiner_trained() -> bool:
            return any(ids[joiner] in _trained_parties(x) for x in read_progress(progress1))

        def join_waited() -> bool:
            last = max(x["round"] for x in read_progress(progress1))
            return joiner_trained() or last >= join_round + FLOWER_DEPLOY_JOIN_ROUNDS

        _wait_for(join_waited, deadline, "the joiner's first training round", run1)
        lines = read_progress(progress1)
        first = next((x for x in lines if ids[joiner] in _trained_parties(x)), None)
        out["join_trained_in_round"] = first["round"] if first is not None else None
        out["join_to_training_s"] = float(first["time"]) - t_join if first is not None else None
        out["joiner_admitted"] = any(
            ids[joiner] in (r.get("members") or {}).get("active", [])
            for x in lines
            for r in x.get("chaos_rounds") or []
        )
        out["join_pulls"] = [
            {k: j.get(k) for k in ("server_round", "ok", "error", "donors", "bytes_per_donor")}
            | {"pull_s": j.get("pull_s"), "lower_bound_s": j.get("lower_bound_s")}
            # what the joiner verified and stored is the state the round certified
            | {"digest_ok": bool(j.get("digest")) and j.get("digest") == r.get("digest")}
            for r in (lines[-1].get("chaos_rounds") or [])
            for j in r.get("joins", [])
            if j.get("party") == ids[joiner]
        ]
        say(f"join: trained in round {out['join_trained_in_round']}; crashing party-{victim}")
        cluster.kill_supernode(f"party-{victim}")
        crash_round = max(x["round"] for x in read_progress(progress1)) + 1
        out["crash_in_round"] = crash_round
        # the crash round itself may still sample the victim (its message then goes unanswered)
        _wait_for(lambda: any(x["round"] >= crash_round for x in read_progress(progress1)),
                  deadline, "the crash round", run1)  # fmt: skip
        crash_lines = read_progress(progress1)
        crash_line = next(x for x in crash_lines if x["round"] >= crash_round)
        out["trained_in_crash_round"] = sorted(_trained_parties(crash_line))
        before_crash = [x for x in crash_lines if x["round"] < crash_line["round"]]
        # wall time of the round the party crashed in (its phase deadline runs out on it)
        out["crash_round_s"] = (
            float(crash_line["time"]) - float(before_crash[-1]["time"]) if before_crash else None
        )
        certified = max(x["round"] for x in read_progress(progress1))
        say(f"round {certified} done: killing the ServerApp")
        out["server_killed_pids"] = len(cluster.kill_serverapps())
        out["certified_before_kill"] = certified
        cluster.note_pids()
        stop_process_tree(run1)
        t_restart = time.time()
        # the SuperNodes first work through the killed run's queued messages (a ClientApp
        # process each): the resumed run's hello gets a longer deadline
        resume_cfg = {**cfg, "phase-timeout-s": phase_timeout_s * FLOWER_DEPLOY_RESUME_PHASES}
        run2 = cluster.start_run({**resume_cfg, "progress-path": str(progress2)}, "run-2.log")

        def trained_round(x: dict[str, Any]) -> bool:
            return bool(x["round"] >= 1 and _trained_parties(x))

        _wait_for(lambda: any(trained_round(x) for x in read_progress(progress2)), deadline,
                  "the resumed run's first trained round", run2)  # fmt: skip
        lines2 = read_progress(progress2)
        resumed = next(x for x in lines2 if trained_round(x))
        out["resumed_first_round"] = next(x["round"] for x in lines2 if x["round"] >= 1)
        out["resumed_at_round"] = resumed["round"]
        out["restart_to_first_round_s"] = float(resumed["time"]) - t_restart
        out["resume_pull"] = resumed.get("last_pull")
        # a restarted server knows no suspects: the dead party must still not be sampled
        out["victim_sampled_after_restart"] = ids[victim] in _sampled_parties(resumed)
        say(f"resumed at round {resumed['round']}: stopping the cluster")
        out["resumed_trained"] = sorted(_trained_parties(resumed))
        out["final_accuracy"] = resumed.get("accuracy")
        out["progress"] = {"run1": read_progress(progress1), "run2": read_progress(progress2)}
    pids = cluster.close()
    out["pids_seen"] = len(pids)
    out["pids_alive"] = [p for p in pids if _alive(p)]
    return out
