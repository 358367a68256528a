"""Server loss on the multi-site testbed: a ServerApp SIGKILL, then the loss of its host's disk.

For each variant, one run on a fresh testbed (:func:`~chaos_flwr.lab.testbed.wan_testbed`)
with every institution's SuperNode started:

1. after :data:`KILL_AFTER_ROUND` rounds, the ServerApp process is killed with SIGKILL (mid-run:
   the next round is under way) and ``flwr run`` is started again at once; the figure is the
   time from the kill to the next finished round, and the rounds lost (finished before the kill
   and trained again after it);
2. once that resumed run has finished a round, the SuperLink host's disk is lost: the SuperLink
   is killed with its ServerApp, its state and ``FLWR_HOME`` (and anything a ServerApp saved
   there) are deleted, it is started again on the same address, the institutions' SuperNode
   keys are registered again, and ``flwr run`` is started again; the same two figures. A
   SuperNode that reaches the new SuperLink before its key is registered again is refused
   (HTTP 401) and exits, as Flower's SuperNode does; each institution's SuperNode is then
   started again with its node config and its party's state directory (what a service
   manager restarting it would do), and the figure includes that. When the SuperLink's host
   is an institution's (the server at an institution), that disk was also its party's: the
   party's SuperNode, ClientApps and daemon are killed with the SuperLink, its state
   directory is deleted, and it starts again empty (a party that rejoins; the new run resumes
   from the other parties' replicas).

Variants: ``chaos`` (ChaosStrategy(FedAvg), signed parties: a new run resumes from the parties'
replicas, through the relay), ``chaos_direct`` (the same with a party daemon beside every
SuperNode: the new run's ServerApp pulls the state over direct links, on the grant its hello
asks for), ``plain_checkpoint`` (the example's plain FedAvg with ``checkpoint-path`` on the
server's disk: a new run resumes from that file) and ``plain`` (plain FedAvg as it ships: a new
run starts again at round 1 from a fresh model; its disk loss is the same as its kill, so it is
not run).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import FLOWER_DIRECT_NODE_KEY
from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.deploy_churn import trained_parties
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.overhead import node_configs
from chaos_flwr.lab.processes import alive, descendants, kill_tree_now, stop_process_tree
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.settings import (
    FLOWER_CLIENTAPP_SAMPLE_S,
    FLOWER_DEPLOY_RESUME_PHASES,
    WAN_BENCH_DIRECT_PORT,
    WAN_LOSS_DEADLINE_FLOOR_S,
    WAN_LOSS_KILL_AFTER_ROUND,
    WAN_LOSS_ROUNDS,
)
from chaos_flwr.lab.testbed import WanTestbed, wan_testbed
from chaos_flwr.lab.testbed_run import WanRunSpec, run_config
from chaos_flwr.transport.shaping import WanProfile

__all__ = [
    "KILL_AFTER_ROUND",
    "LOSS_VARIANTS",
    "LossRunSpec",
    "loss_figures",
    "next_round",
    "server_loss_run",
]

#: Rounds finished before the ServerApp is killed.
KILL_AFTER_ROUND = WAN_LOSS_KILL_AFTER_ROUND
#: The runs of the server-loss figures (see the module's docstring).
LOSS_VARIANTS = ("chaos", "chaos_direct", "plain_checkpoint", "plain")
#: The file, in the SuperLink host's ``FLWR_HOME``, where plain FedAvg keeps its checkpoint.
CHECKPOINT_NAME = "global-model.pt"


@dataclass(frozen=True)
class LossRunSpec:
    """One server-loss run: the variant, model size, rounds, where the server is, bounds."""

    variant: str
    model_mib: float
    server: str
    institutions: tuple[str, ...]
    rounds: int = WAN_LOSS_ROUNDS
    disk_loss: bool = True
    timeout_s: float = 1800.0
    app_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.variant not in LOSS_VARIANTS:
            raise ConfigError(f"variant: give one of {LOSS_VARIANTS}, got {self.variant!r}")
        if self.rounds < KILL_AFTER_ROUND + 2:
            raise ConfigError(f"rounds: give at least {KILL_AFTER_ROUND + 2} (kill, then more)")


def next_round(lines: list[dict[str, Any]], variant: str) -> dict[str, Any] | None:
    """The first round a restarted run finished, from its progress lines (None: not yet).

    Chaos: the first round >= 1 some party trained in (a resumed run's first round carries
    the parties' state). Plain: the first round after the checkpoint it started from
    (``resumed_from``, 0 without one).
    """
    for line in lines:
        rnd = int(line.get("round", 0))
        if variant.startswith("chaos"):
            if rnd >= 1 and trained_parties(line):
                return line
        elif rnd >= 1 and rnd > int(line.get("resumed_from") or 0):
            return line
    return None


@dataclass
class _Loss:
    """A server-loss run under way: its testbed, run config, deadline and events so far."""

    bed: WanTestbed
    cfg: dict[str, object]
    work: Path
    deadline: float
    t0: float
    events: list[dict[str, Any]]
    say: Callable[[str], None]

    def note(self, kind: str, t: float, rnd: int | None = None) -> None:
        self.events.append({"kind": kind, "t": t - self.t0, "round": rnd})

    def wait(
        self, proc: Any, progress: Path, done: Callable[[list[dict[str, Any]]], bool]
    ) -> list[dict[str, Any]]:
        while True:
            lines = read_progress(progress)
            if done(lines):
                return lines
            if proc.poll() is not None:
                raise TransportError(f"the run ended (exit {proc.returncode}) before its round; "
                                     f"see {self.bed.cluster.logs}")  # fmt: skip
            if time.time() > self.deadline:
                raise TransportError(f"the server-loss run did not finish in time; see "
                                     f"{self.bed.cluster.logs}")  # fmt: skip
            time.sleep(FLOWER_CLIENTAPP_SAMPLE_S)

    def start(self, phase: int, resumed: bool) -> tuple[Any, Path]:
        progress = self.work / f"progress-{phase}.jsonl"
        cfg = {**self.cfg, "progress-path": str(progress),
               "results-path": str(self.work / f"results-{phase}.json")}  # fmt: skip
        if resumed:  # SuperNodes first work through the killed run's queued messages
            cfg["phase-timeout-s"] = (
                float(str(cfg["phase-timeout-s"])) * FLOWER_DEPLOY_RESUME_PHASES
            )
        return self.bed.cluster.start_run(cfg, f"run-{phase}.log"), progress


def _restart_supernodes(
    bed: WanTestbed, nodes: Mapping[str, Mapping[str, object]], children: Mapping[str, list[int]]
) -> list[str]:
    """Start every institution's SuperNode again: one still running is stopped, and the
    processes it had (``children``, its ClientApps, orphaned if it exited on its own) are
    killed, as a service manager stopping the unit would. Return the institutions whose
    SuperNode had exited on its own."""
    exited = []
    for host, node in nodes.items():
        proc = bed.cluster.supernodes[host]
        if proc.poll() is not None:
            exited.append(host)
        else:
            bed.cluster.note_pids()
            stop_process_tree(proc)
        for pid in children.get(host, []):
            if alive(pid):
                kill_tree_now(pid)
        bed.start_supernode(host, node)
    return exited


def _crash_colocated_party(bed: WanTestbed, node: Mapping[str, object], direct: bool) -> None:
    """The SuperLink's host is also an institution's (``bed.server``): its disk is that party's
    disk too. Its SuperNode with its ClientApps and its party daemon are killed with SIGKILL
    and its state directory is deleted; the daemon is started again with an empty one here,
    and the SuperNode with the others (:func:`_restart_supernodes`): a party that lost its
    disk, which comes back as a restarted founder with a fresh incarnation and no replica."""
    host = bed.server
    bed.cluster.kill_supernode(host)
    bed.kill_party_daemon(host)
    if "chaos-state-dir" in node:
        shutil.rmtree(Path(str(node["chaos-state-dir"])), ignore_errors=True)
    if direct:
        bed.start_party_daemon(host, node, WAN_BENCH_DIRECT_PORT)


def _recover(
    run: _Loss, variant: str, phase: int, before: int, t_loss: float
) -> tuple[Any, dict[str, Any]]:
    """Start run ``phase`` after a loss at ``t_loss``; wait for its first finished round."""
    proc, progress = run.start(phase, resumed=True)
    lines = run.wait(proc, progress, lambda ls: next_round(ls, variant) is not None)
    line = next_round(lines, variant)
    if line is None:  # wait() returned: it is there
        raise TransportError(f"run {phase}: no finished round after the loss")
    rnd = int(line["round"])
    run.note("resume", float(line["time"]), rnd)
    run.say(f"  resumed at round {rnd}, {float(line['time']) - t_loss:.1f} s after the loss")
    return proc, {
        "finished_before": before,
        "resumed_round": rnd,
        "resume_s": float(line["time"]) - t_loss,
        "rounds_lost": max(0, before - (rnd - 1)),
        "pull": _resume_pull(lines),
    }


def _resume_pull(lines: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The resumed ServerApp's pull of the state, as its progress lines report it (Chaos):
    seconds, relay exchanges, bytes and the part that came over direct links."""
    pull = next((x["last_pull"] for x in reversed(lines) if x.get("last_pull")), None)
    if not isinstance(pull, dict):
        return None
    return {
        "seconds": pull.get("seconds"),
        "exchanges": pull.get("exchanges"),
        "bytes": sum((pull.get("shares") or {}).values()),
        "direct_bytes": sum((pull.get("direct") or {}).values()),
        "direct_failed": pull.get("direct_failed") or [],
    }


def server_loss_run(
    profile: WanProfile, spec: LossRunSpec, work: Path, *, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """One server-loss run of ``spec.variant`` (see the module's docstring); return its figures.

    Returns
    -------
    dict
        ``variant``, ``kill`` (``finished_before``, ``resumed_round``, ``resume_s``: SIGKILL
        of the ServerApp to the next finished round, ``rounds_lost``), ``disk_loss`` (the
        same after the SuperLink host's disk was lost; None for ``plain`` or when not asked),
        ``checkpoint_left`` (whether plain FedAvg's checkpoint survived the disk loss),
        ``party_disk_lost`` (the institution whose party lost its disk with the server's, or
        None), ``supernodes_exited`` (the other SuperNodes that exited on their own),
        ``events`` (kind, seconds from the first run's start, round) and ``pids_alive``.
    """
    tell = say or (lambda _msg: None)
    insts = list(spec.institutions)
    n = len(insts)
    mode = "chaos" if spec.variant.startswith("chaos") else "fedavg"
    keys = None
    if mode == "chaos":
        from chaos_flwr.flower.keys import make_federation

        keys = make_federation(work / "keys", n, founders=n, seed="flower-wan-loss")
    run_spec = WanRunSpec(mode=mode, rounds=spec.rounds, model_mib=spec.model_mib,
                          server=spec.server, institutions=tuple(insts))  # fmt: skip
    cfg = run_config(run_spec, keys, work, n)
    cfg["chaos-deadline-floor-s"] = WAN_LOSS_DEADLINE_FLOOR_S
    out: dict[str, Any] = {"variant": spec.variant, "disk_loss": None}
    with wan_testbed(profile, work / "bed", app_dir=spec.app_dir or example_dir(),
                     server=spec.server, institutions=insts) as bed:  # fmt: skip
        checkpoint = bed.cluster.home / CHECKPOINT_NAME
        if spec.variant == "plain_checkpoint":
            cfg["checkpoint-path"] = str(checkpoint)
        run = _Loss(bed, cfg, work, time.time() + spec.timeout_s, time.time(), [], tell)
        proc, progress = run.start(1, resumed=False)
        nodes = dict(zip(insts, node_configs(n, keys, work / "state"), strict=True))
        if spec.variant == "chaos_direct":  # a party daemon beside every SuperNode
            for host, node in nodes.items():
                addr = f"{bed.net.addresses[host]}:{WAN_BENCH_DIRECT_PORT}"
                nodes[host] = {**node, FLOWER_DIRECT_NODE_KEY: addr}
                bed.start_party_daemon(host, nodes[host], WAN_BENCH_DIRECT_PORT)
        for host, node in nodes.items():
            bed.start_supernode(host, node)
        lines = run.wait(proc, progress, lambda ls: any(x["round"] >= KILL_AFTER_ROUND for x in ls))
        for x in lines:
            if x["round"] >= 1:
                run.note("round", float(x["time"]), int(x["round"]))
        before = max(int(x["round"]) for x in lines)
        tell(f"  round {before} done: SIGKILL to the ServerApp")
        t_kill = time.time()
        bed.cluster.kill_serverapps()
        stop_process_tree(proc)
        run.note("kill", t_kill, before)
        proc, out["kill"] = _recover(run, spec.variant, 2, before, t_kill)
        if spec.disk_loss and spec.variant != "plain":
            stop_process_tree(proc)
            before = max(int(x["round"]) for x in read_progress(work / "progress-2.jsonl"))
            tell(f"  round {before} done: the SuperLink host's disk is lost")
            children = {h: descendants(p.pid) for h, p in bed.cluster.supernodes.items()}
            t_loss = time.time()
            bed.cluster.kill_serverapps()  # at once: no round finishes during what follows
            colocated = spec.server in nodes  # its party's state goes with the server's disk
            if colocated:
                _crash_colocated_party(bed, nodes[spec.server], spec.variant == "chaos_direct")
            bed.restart_superlink(lose_disk=True)
            run.note("disk_loss", t_loss, before)
            exited = _restart_supernodes(bed, nodes, children)
            out["supernodes_exited"] = [h for h in exited if not (colocated and h == spec.server)]
            out["party_disk_lost"] = spec.server if colocated else None
            out["checkpoint_left"] = checkpoint.exists()
            proc, out["disk_loss"] = _recover(run, spec.variant, 3, before, t_loss)
        out["events"] = run.events
    pids = bed.cluster.close()
    out["pids_alive"] = [p for p in pids if alive(p)]
    return out


def loss_figures(runs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Placement figures from its server-loss runs (variant -> runs): medians, the issue's keys."""

    def med(variant: str, part: str, key: str) -> float | None:
        vals = [r[part][key] for r in runs.get(variant, []) if r.get(part) is not None]
        return statistics.median(vals) if vals else None

    return {
        "chaos_resume_s": med("chaos", "kill", "resume_s"),
        "chaos_rounds_lost": med("chaos", "kill", "rounds_lost"),
        "chaos_direct_resume_s": med("chaos_direct", "kill", "resume_s"),
        "chaos_direct_rounds_lost": med("chaos_direct", "kill", "rounds_lost"),
        "plain_checkpoint_resume_s": med("plain_checkpoint", "kill", "resume_s"),
        "plain_checkpoint_rounds_lost": med("plain_checkpoint", "kill", "rounds_lost"),
        "plain_rounds_lost": med("plain", "kill", "rounds_lost"),
        "plain_resume_s": med("plain", "kill", "resume_s"),
        "server_disk_loss": {
            "chaos_resume_s": med("chaos", "disk_loss", "resume_s"),
            "chaos_rounds_lost": med("chaos", "disk_loss", "rounds_lost"),
            "chaos_direct_resume_s": med("chaos_direct", "disk_loss", "resume_s"),
            "chaos_direct_rounds_lost": med("chaos_direct", "disk_loss", "rounds_lost"),
            "plain_checkpoint_resume_s": med("plain_checkpoint", "disk_loss", "resume_s"),
            "plain_checkpoint_rounds_lost": med("plain_checkpoint", "disk_loss", "rounds_lost"),
        },
    }
