"""The paper's claims measured on Flower over the testbed (``chaos-flwr bench flower-wan``).

For each placement of the server (at an institution, whose uplink is then the bottleneck, and
at a well-connected site) and each mode (plain FedAvg, ChaosStrategy(FedAvg) with signed
parties), one run on a fresh testbed (:func:`~chaos_flwr.lab.testbed.wan_testbed`): every
institution but the joiner starts, after :data:`JOIN_AFTER_ROUND` rounds the joiner's SuperNode
starts, and the run goes on to its last round. From each run:

- the joiner's time from its SuperNode's start to the end of the first round it trained in
  (plain: the model arrives in its first train message; Chaos: the state is pulled through the
  relay from the holders first), with two lower bounds from the profile's link rates: the
  model's time over the relay path's bottleneck (plain) and the planner's water-filling bound
  over the donors' uplinks capped by that bottleneck (Chaos through the relay);
- the wall time of every churn-free round after the first (no join under way) and the
  ClientApp processes the SuperNodes started per round.

Then, per placement, the server-loss runs of :mod:`chaos_flwr.lab.wan_loss` (a ServerApp
SIGKILL after round 2, then the loss of the SuperLink host's disk) for Chaos, plain FedAvg with
the checkpoint a user writes and plain FedAvg as it ships: the time from the loss to the next
finished round and the rounds lost. Every run's events (round ends, the join, kills, resumes)
are kept for the timeline plot (:mod:`chaos_flwr.lab.wan_plot`).

Not measured here (``null`` in the JSON, named in ``not_measured``): direct peer links (they
do not exist yet), and whichever part (``join``, ``server_loss``) was not asked for.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import FLOWER_DIRECT_NODE_KEY
from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.deploy_churn import trained_parties
from chaos_flwr.lab.deployment import clientapp_pids
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.launch import read_results
from chaos_flwr.lab.overhead import (
    clientapp_figures,
    hidden_for_mib,
    model_bytes_for_hidden,
    node_configs,
)
from chaos_flwr.lab.processes import alive
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.settings import (
    FLOWER_CLIENTAPP_SAMPLE_S,
    WAN_BENCH_DIRECT_PORT,
    WAN_BENCH_JOIN_AFTER_ROUND,
    WAN_BENCH_JOINER,
    WAN_BENCH_MODEL_MIB,
    WAN_BENCH_PLACEMENTS,
    WAN_BENCH_ROUNDS,
)
from chaos_flwr.lab.testbed import WanTestbed, wan_testbed
from chaos_flwr.lab.testbed_run import WanRunSpec, run_config
from chaos_flwr.lab.wan_loss import LOSS_VARIANTS, LossRunSpec, loss_figures, server_loss_run
from chaos_flwr.transport.netns import lan_prefix, namespaces
from chaos_flwr.transport.shaping import WanProfile

__all__ = [
    "JOIN_AFTER_ROUND",
    "NOT_MEASURED",
    "PARTS",
    "WanBenchSpec",
    "join_bounds",
    "measure_flower_wan",
    "overhead_ratio",
    "wan_table",
]

#: Rounds every institution but the joiner trains before the joiner's SuperNode starts.
JOIN_AFTER_ROUND = WAN_BENCH_JOIN_AFTER_ROUND
#: The issue's keys this bench does not measure (null in the JSON), and why.
NOT_MEASURED: dict[str, str] = {}
#: The parts of the bench: the join runs and the server-loss runs.
PARTS = ("join", "server_loss")
#: The join runs' modes: plain FedAvg, Chaos through the relay, Chaos with party daemons
#: (direct, authenticated links between the institutions' hosts).
JOIN_MODES = ("fedavg", "chaos", "direct")
#: The port every institution's party daemon serves on (at its host's address).
DIRECT_PORT = WAN_BENCH_DIRECT_PORT


@dataclass(frozen=True)
class WanBenchSpec:
    """What to measure: model size, rounds, repeats, the joiner and the server placements.

    ``placements`` maps a placement's name to the host running the SuperLink; a host that is
    also an institution of the profile runs a SuperNode too (the server at an institution).
    ``sponsors_required`` is the Chaos runs' charter's ``admission.sponsors_required``: with 0
    the joiner's own signed join admits it, so it can train in the round it comes during
    (``JoinSettings.during_round``); with 1 (default) a member's countersignature waits for
    the end of the members' training.
    """

    model_mib: float = WAN_BENCH_MODEL_MIB
    rounds: int = WAN_BENCH_ROUNDS
    repeats: int = 1
    joiner: str = WAN_BENCH_JOINER
    placements: Mapping[str, str] | None = None
    timeout_s: float = 1800.0
    app_dir: Path | None = None
    parts: tuple[str, ...] = PARTS
    disk_loss: bool = True
    join_modes: tuple[str, ...] = JOIN_MODES
    loss_variants: tuple[str, ...] = LOSS_VARIANTS
    sponsors_required: int = 1

    def __post_init__(self) -> None:
        if not self.parts or any(p not in PARTS for p in self.parts):
            raise ConfigError(f"parts: give some of {PARTS}, got {self.parts}")
        if not self.join_modes or any(m not in JOIN_MODES for m in self.join_modes):
            raise ConfigError(f"join modes: give some of {JOIN_MODES}, got {self.join_modes}")
        if not self.loss_variants or any(v not in LOSS_VARIANTS for v in self.loss_variants):
            raise ConfigError(
                f"loss variants: give some of {LOSS_VARIANTS}, got {self.loss_variants}"
            )
        if self.rounds < JOIN_AFTER_ROUND + 2:
            raise ConfigError(f"rounds: give at least {JOIN_AFTER_ROUND + 2} (join, then more)")
        if self.sponsors_required < 0:
            raise ConfigError(f"sponsors: give 0 or more, got {self.sponsors_required}")
        if self.repeats < 1 or not self.model_mib > 0:
            raise ConfigError("repeats must be >= 1 and model_mib > 0")

    def where(self) -> dict[str, str]:
        """Placement name -> the host running the SuperLink."""
        return dict(self.placements or WAN_BENCH_PLACEMENTS)


def _institutions(profile: WanProfile) -> list[str]:
    """Every party but the well-connected site's ``superlink`` host."""
    return [p for p in profile.parties if p != "superlink"]


def join_bounds(
    profile: WanProfile, server: str, joiner: str, donors: Sequence[str], model_bytes: int
) -> dict[str, float]:
    """Lower bounds of a join from the profile's rates (latency 0: the links add none).

    ``plain``: the model over the relay path's bottleneck (the server's uplink and the
    joiner's downlink). ``relay``: the planner's water-filling bound, each donor sending at
    its uplink (unbounded when it shares the server's host) to an ingress that is the
    bottleneck of the server's downlink, its uplink and the joiner's downlink.
    """
    from chaos_flwr.planner import Donor, lower_bound

    inf = float("inf")
    s, j = profile.link(server), profile.link(joiner)
    out_path = min(s.up_bps or inf, j.down_bps or inf)
    ingress = min(out_path, s.down_bps or inf)
    plain = model_bytes / out_path if out_path < inf else 0.0
    fast = 1e12  # bytes/s of a donor on the server's own host (no link between them)
    pool = [
        Donor(d, fast if d == server else (profile.link(d).up_bps or fast))
        for d in donors
        if d != joiner
    ]
    relay = lower_bound(model_bytes, pool, ingress if ingress < inf else None)
    peers = [Donor(d, profile.link(d).up_bps or fast) for d in donors if d != joiner]
    direct = lower_bound(model_bytes, peers, j.down_bps or None)
    return {"plain": plain, "relay": relay, "direct": direct}


def _joiner_trained(line: Mapping[str, Any], mode: str, n: int, joiner_id: str | None) -> bool:
    if mode == "chaos":
        return joiner_id is not None and joiner_id in trained_parties(dict(line))
    trainers = list(line.get("trainers_per_round") or [])
    rnd = int(line.get("round", 0))
    return 1 <= rnd <= len(trainers) and int(trainers[rnd - 1]) >= n


def _run_until(
    bed: WanTestbed,
    proc: Any,
    progress: Path,
    done: Callable[[list[dict[str, Any]]], bool],
    deadline: float,
    clientapps: dict[int, float],
) -> list[dict[str, Any]]:
    """Wait until ``done(progress lines)`` or the run ends; note ClientApp processes."""
    while True:
        for pid in clientapp_pids([p.pid for p in bed.cluster.supernodes.values()]):
            clientapps.setdefault(pid, time.time())
        lines = read_progress(progress)
        if done(lines) or proc.poll() is not None:
            return lines
        if time.time() > deadline:
            raise TransportError(f"the testbed run did not finish in time; see {bed.cluster.logs}")
        time.sleep(FLOWER_CLIENTAPP_SAMPLE_S)


def _one_run(
    profile: WanProfile, spec: WanBenchSpec, server: str, mode: str, work: Path
) -> dict[str, Any]:
    """One run with a join; return its join time, round walls and ClientApp counts."""
    insts = _institutions(profile)
    if spec.joiner not in insts or server not in profile.parties:
        raise ConfigError(f"joiner {spec.joiner!r} / server {server!r}: not in the profile")
    order = [h for h in insts if h != spec.joiner] + [spec.joiner]  # the joiner is last
    n = len(order)
    signed = "fedavg" if mode == "fedavg" else "chaos"
    run_spec = WanRunSpec(mode=signed, rounds=spec.rounds, model_mib=spec.model_mib,
                          server=server, institutions=tuple(order))  # fmt: skip
    keys, joiner_id = None, None
    if signed == "chaos":  # signed parties; the joiner's key is allowlisted, not a founder
        from chaos_flwr.flower.keys import load_federation, make_federation

        keys = make_federation(work / "keys", n, founders=n - 1, seed="flower-wan",
                               sponsors_required=spec.sponsors_required)  # fmt: skip
        joiner_id = load_federation(keys).party_ids[n - 1]
    nodes = node_configs(n, keys, work / "state")
    cfg = run_config(run_spec, keys, work, n - 1)
    clientapps: dict[int, float] = {}
    progress = work / "progress.jsonl"
    t0 = time.time()
    deadline = t0 + spec.timeout_s
    with wan_testbed(profile, work / "bed", app_dir=spec.app_dir or example_dir(), server=server,
                     institutions=order) as bed:  # fmt: skip
        if mode == "direct":  # every institution runs its party daemon beside its SuperNode
            nodes = [{**node, FLOWER_DIRECT_NODE_KEY: f"{bed.net.addresses[h]}:{DIRECT_PORT}"}
                     for h, node in zip(order, nodes, strict=True)]  # fmt: skip
            for host, node in zip(order[:-1], nodes[:-1], strict=True):
                bed.start_party_daemon(host, node, DIRECT_PORT)
        proc = bed.cluster.start_run(cfg, "run.log")
        for host, node in zip(order[:-1], nodes[:-1], strict=True):
            bed.start_supernode(host, node)
        _run_until(bed, proc, progress, lambda ls: any(x["round"] >= JOIN_AFTER_ROUND for x in ls),
                   deadline, clientapps)  # fmt: skip
        if mode == "direct":  # the joiner's institution runs its daemon before its SuperNode
            bed.start_party_daemon(order[-1], nodes[-1], DIRECT_PORT)
        t_join = bed.start_supernode(order[-1], nodes[-1])
        lines = _run_until(bed, proc, progress, lambda _ls: False, deadline, clientapps)
        logs = bed.cluster.logs
    pids = bed.cluster.close()
    results = read_results(work / "results.json")
    if proc.returncode != 0 or not results:
        raise TransportError(f"the {mode} run on {server} failed (exit {proc.returncode}); "
                             f"see {logs}")  # fmt: skip
    first = next((x for x in lines if x["round"] > JOIN_AFTER_ROUND
                  and _joiner_trained(x, signed, n, joiner_id)), None)  # fmt: skip
    walls = [float(w) for w in results["round_wall_s"]]
    trained_in = int(first["round"]) if first is not None else None
    join_rounds = range(JOIN_AFTER_ROUND + 1, (trained_in or len(walls)) + 1)
    free = [r for r in range(2, len(walls) + 1) if r not in join_rounds]
    caps = clientapp_figures(results, clientapps, logs)
    events = [{"kind": "round", "t": float(x["time"]) - t0, "round": int(x["round"])}
              for x in lines if int(x["round"]) >= 1]  # fmt: skip
    events.append({"kind": "join", "t": t_join - t0, "round": JOIN_AFTER_ROUND})
    if first is not None:
        events.append({"kind": "joined", "t": float(first["time"]) - t0, "round": trained_in})
    return {
        "model_bytes": int(results.get("model_bytes") or 0),
        "join_s": float(first["time"]) - t_join if first is not None else None,
        "train_sent_s": _train_sent_s(results, t_join),
        "joiner_trained_in_round": trained_in,
        "round_wall_s": walls,
        "rounds_finished": len(walls),  # fewer than asked: rounds were not certified
        "churn_free_rounds": free,
        "churn_free_round_s": statistics.median([walls[r - 1] for r in free]) if free else None,
        "clientapp_per_round": caps["clientapp_processes_per_round"],
        "pids_alive": [p for p in pids if alive(p)],
        "events": events,
        "join": _join_figures(results, joiner_id),
    }


def _train_sent_s(results: Mapping[str, Any], t_join: float) -> float | None:
    """Seconds from the joiner's SuperNode start to the ServerApp's push of its first train
    message (the first train message to a node that had none before), in either mode: every
    founder is sampled in round 1 (fraction 1.0), so that node is the joiner's."""
    times = [float(t) for t in dict(results.get("first_train_to") or {}).values()]
    later = [t for t in times if t > t_join]
    return min(later) - t_join if later else None


def _join_figures(results: Mapping[str, Any], joiner_id: str | None) -> dict[str, Any] | None:
    """How the joiner got the state, from the ServerApp's round logs (``None``: plain FedAvg,
    or no join logged): where from, bytes per donor and over direct links, its time."""
    for rnd in results.get("chaos_rounds") or []:
        for join in rnd.get("joins") or []:
            if join.get("party") == joiner_id:
                keys = ("source", "ok", "error", "pull_s", "lower_bound_s", "total_bytes",
                        "bytes_per_donor", "direct_bytes", "direct_failed", "rate_bps",
                        "phase_s")  # fmt: skip
                return {k: join.get(k) for k in keys} | {"round": rnd.get("round")}
    return None


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def overhead_ratio(
    fedavg: Sequence[Mapping[str, Any]], chaos: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Chaos's round time over plain FedAvg's, pair by pair (run ``i`` of each mode), on the
    rounds churn-free in both runs of the pair (so both count the same nodes); the median of
    the pairs' ratios, each pair's ratio and the rounds it used."""
    pairs: list[dict[str, Any]] = []
    for f, c in zip(fedavg, chaos, strict=False):
        common = sorted(set(f["churn_free_rounds"]) & set(c["churn_free_rounds"]))
        if not common:
            pairs.append({"rounds": [], "ratio": None})
            continue
        f_s = statistics.median(f["round_wall_s"][r - 1] for r in common)
        c_s = statistics.median(c["round_wall_s"][r - 1] for r in common)
        pairs.append({"rounds": common, "plain_s": f_s, "chaos_s": c_s, "ratio": c_s / f_s})
    return {"ratio": _median([p["ratio"] for p in pairs]), "pairs": pairs}


_JOIN_KEYS = ("plain_join_s", "relay_join_s", "direct_join_s", "plain_train_sent_s",
              "relay_train_sent_s", "direct_train_sent_s", "join_lower_bound_s",
              "plain_join_lower_bound_s", "direct_join_lower_bound_s", "direct_pull_s",
              "plain_round_s", "chaos_round_s", "round_overhead_ratio")  # fmt: skip
#: The join keys each join mode gives.
_MODE_KEYS = {
    "fedavg": ("plain_join_s", "plain_train_sent_s", "plain_round_s", "round_overhead_ratio"),
    "chaos": ("relay_join_s", "relay_train_sent_s", "chaos_round_s", "round_overhead_ratio"),
    "direct": (
        "direct_join_s",
        "direct_train_sent_s",
        "direct_pull_s",
        "chaos_round_s",
        "round_overhead_ratio",
    ),
}


def _unmeasured_loss_keys(variants: Sequence[str]) -> dict[str, str]:
    """The server-loss keys of the variants not asked for."""
    return {
        key: f"the {variant} server-loss runs were not asked for (--loss-variants)"
        for variant, key in _VARIANT_KEYS.items()
        if variant not in variants
    }


def _unmeasured_join_keys(modes: Sequence[str]) -> dict[str, str]:
    """The join keys no asked-for mode gives (a round ratio needs FedAvg and a Chaos mode)."""
    given = {k for m in modes for k in _MODE_KEYS[m]}
    pair = "fedavg" in modes and ("chaos" in modes or "direct" in modes)
    return {
        k: f"the {mode} join runs were not asked for (--join-modes)"
        for mode, keys in _MODE_KEYS.items()
        if mode not in modes
        for k in keys
        if k not in given or (k in ("chaos_round_s", "round_overhead_ratio") and not pair)
    }


_LOSS_KEYS = ("chaos_resume_s", "chaos_direct_resume_s", "plain_checkpoint_resume_s",
              "plain_rounds_lost")  # fmt: skip
#: The server-loss key each variant gives.
_VARIANT_KEYS = {
    "chaos": "chaos_resume_s",
    "chaos_direct": "chaos_direct_resume_s",
    "plain_checkpoint": "plain_checkpoint_resume_s",
    "plain": "plain_rounds_lost",
}


def _join_part(
    profile: WanProfile, spec: WanBenchSpec, name: str, server: str, work: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """The join runs of one placement, plain and Chaos interleaved; their figures."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in JOIN_MODES}
    for rep in range(spec.repeats):
        for mode in spec.join_modes:  # interleaved, so load drifts hit every mode alike
            say(f"{name} (SuperLink at {server}), {mode}, repeat {rep + 1}/{spec.repeats}")
            run_dir = work / f"{name}-{mode}-{rep}"
            fig = _one_run(profile, spec, server, mode, run_dir)
            # each run's figures stay on disk too: a long bench stopped midway keeps them
            (run_dir / "figure.json").write_text(json.dumps(fig), encoding="utf-8")
            say(f"  joiner's first train message after {fig['train_sent_s']} s; it trained after "
                f"{fig['join_s']} s (round {fig['joiner_trained_in_round']}), churn-free round "
                f"{fig['churn_free_round_s']} s")  # fmt: skip
            runs[mode].append(fig)
    model = next(r[-1]["model_bytes"] for r in runs.values() if r)
    bounds = join_bounds(profile, server, spec.joiner, _institutions(profile), model)
    # the round ratio against Chaos through the relay; with no relay runs, against Chaos with
    # party daemons (the deployment a user with daemons runs), named in round_overhead_mode
    direct = overhead_ratio(runs["fedavg"], runs["direct"])
    mode = "chaos" if runs["chaos"] else "direct"
    overhead = overhead_ratio(runs["fedavg"], runs[mode]) if mode == "chaos" else direct
    return {
        "plain_join_s": _median([r["join_s"] for r in runs["fedavg"]]),
        "relay_join_s": _median([r["join_s"] for r in runs["chaos"]]),
        "direct_join_s": _median([r["join_s"] for r in runs["direct"]]),
        "plain_train_sent_s": _median([r.get("train_sent_s") for r in runs["fedavg"]]),
        "relay_train_sent_s": _median([r.get("train_sent_s") for r in runs["chaos"]]),
        "direct_train_sent_s": _median([r.get("train_sent_s") for r in runs["direct"]]),
        "join_lower_bound_s": bounds["relay"],
        "direct_join_lower_bound_s": bounds["direct"],
        "direct_pull_s": _median([(r["join"] or {}).get("pull_s") for r in runs["direct"]]),
        "plain_join_lower_bound_s": bounds["plain"],
        "plain_round_s": _median([p.get("plain_s") for p in overhead["pairs"]]),
        "chaos_round_s": _median([p.get("chaos_s") for p in overhead["pairs"]]),
        "round_overhead_ratio": overhead["ratio"],
        "round_overhead_mode": mode,
        "round_overhead_pairs": overhead["pairs"],
        "direct_round_overhead_ratio": direct["ratio"],
        "clientapp_per_round": {
            m: _median([statistics.median(r["clientapp_per_round"]) for r in runs[m]])
            for m in runs
            if runs[m]
        },
        "runs": runs,
    }


def _loss_part(
    profile: WanProfile, spec: WanBenchSpec, name: str, server: str, work: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    """The server-loss runs of one placement, the variants interleaved; their figures."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in LOSS_VARIANTS}
    insts = tuple(_institutions(profile))
    for rep in range(spec.repeats):
        for variant in spec.loss_variants:
            say(f"{name} (SuperLink at {server}), server loss, {variant}, "
                f"repeat {rep + 1}/{spec.repeats}")  # fmt: skip
            run_dir = work / f"{name}-loss-{variant}-{rep}"
            loss = LossRunSpec(variant=variant, model_mib=spec.model_mib, server=server,
                               institutions=insts, disk_loss=spec.disk_loss,
                               # three runs' starts and a SuperLink restart in one
                               timeout_s=2 * spec.timeout_s, app_dir=spec.app_dir)  # fmt: skip
            try:
                fig = server_loss_run(profile, loss, run_dir, say=say)
            except TransportError as exc:  # one failed run leaves the others' figures
                say(f"  failed: {exc}")
                fig = {"variant": variant, "error": str(exc), "kill": None, "disk_loss": None}
            (run_dir / "figure.json").write_text(json.dumps(fig), encoding="utf-8")
            runs[variant].append(fig)
    return {**loss_figures(runs), "loss_runs": runs}


def _placement(
    profile: WanProfile, spec: WanBenchSpec, name: str, server: str, work: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"server_host": server}
    out.update(dict.fromkeys(_JOIN_KEYS + _LOSS_KEYS))
    if "join" in spec.parts:
        out.update(_join_part(profile, spec, name, server, work, say))
    if "server_loss" in spec.parts:
        out.update(_loss_part(profile, spec, name, server, work, say))
    return out


def measure_flower_wan(
    profile: WanProfile,
    spec: WanBenchSpec,
    work_dir: Path,
    *,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every placement of ``spec`` on ``profile``; return the issue's JSON shape.

    Returns
    -------
    dict
        ``model_bytes``, ``placements`` (name -> ``plain_join_s``, ``relay_join_s``,
        ``direct_join_s`` (null), ``join_lower_bound_s``, ``plain_join_lower_bound_s``,
        ``round_overhead_ratio``, the round medians, ClientApp processes per round, every
        join run (``runs``); ``chaos_resume_s``, ``chaos_direct_resume_s`` (party daemons:
        the resume pull over direct links), ``plain_checkpoint_resume_s``,
        ``plain_resume_s``, ``plain_rounds_lost`` and the other rounds lost after a ServerApp
        SIGKILL, the same under ``server_disk_loss`` after the SuperLink host's disk was lost,
        every server-loss run (``loss_runs``); a part not asked for leaves its keys null),
        ``not_measured`` (key -> why), ``loadavg`` (1-minute, before and after),
        ``latency`` (recorded, not applied) and ``namespaces_left``.
    """
    tell = say or (lambda _msg: None)
    before = namespaces()
    out: dict[str, Any] = {
        "profile": profile.name,
        "rounds": spec.rounds,
        "repeats": spec.repeats,
        "joiner": spec.joiner,
        "join_after_round": JOIN_AFTER_ROUND,
        "sponsors_required": spec.sponsors_required,
        "loadavg": {"before": os.getloadavg()[0]},
        "placements": {},
        "not_measured": {
            **NOT_MEASURED,
            **{
                k: f"the {part} part was not asked for (--parts)"
                for part, keys in (("join", _JOIN_KEYS), ("server_loss", _LOSS_KEYS))
                if part not in spec.parts
                for k in keys
            },
            **(_unmeasured_join_keys(spec.join_modes) if "join" in spec.parts else {}),
            **(_unmeasured_loss_keys(spec.loss_variants) if "server_loss" in spec.parts else {}),
        },
        "latency": "latency_ms of the profile recorded only: netem is missing, links add none",
    }
    for name, server in spec.where().items():
        out["placements"][name] = _placement(profile, spec, name, server, work_dir, tell)
    out["loadavg"]["after"] = os.getloadavg()[0]
    out["model_bytes"] = model_bytes_for_hidden(hidden_for_mib(spec.model_mib))
    # its own only: another testbed (a test run beside it) may have namespaces up right now
    out["namespaces_left"] = sorted(n for n in namespaces() - before if n.startswith(lan_prefix()))
    return out


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _loss_cell(figs: Mapping[str, Any], variant: str) -> str:
    """``<variant> <resume s> (<rounds lost>)`` of one server-loss figure."""
    secs, lost = figs.get(f"{variant}_resume_s"), figs.get(f"{variant}_rounds_lost")
    return f"{variant} {_fmt(secs)} s ({_fmt(lost, 0)} lost)"


def wan_table(fig: Mapping[str, Any]) -> str:
    """A summary table of :func:`measure_flower_wan`'s figures."""
    rows = [
        f"model {fig['model_bytes']} bytes, {fig['rounds']} rounds, joiner {fig['joiner']} "
        f"after round {fig['join_after_round']}, medians of {fig['repeats']} run(s); load "
        f"{fig['loadavg']['before']:.2f} -> {fig['loadavg']['after']:.2f}",
        "join: seconds from the joiner's SuperNode start to its first trained round "
        "(lower bound from the link rates)",
        f"{'placement':<24} {'plain':>12} {'relay':>12} {'direct':>12} "
        f"{'plain rnd s':>11} {'chaos rnd s':>11} {'ratio':>6} {'apps/rnd':>9}",
    ]
    for name, p in fig["placements"].items():
        apps = p.get("clientapp_per_round") or {}
        cells = [
            f"{_fmt(p.get(k))} ({_fmt(p.get(b), 1)})"
            for k, b in (("plain_join_s", "plain_join_lower_bound_s"),
                         ("relay_join_s", "join_lower_bound_s"),
                         ("direct_join_s", "direct_join_lower_bound_s"))
        ]  # fmt: skip
        rows.append(
            f"{name:<24} {cells[0]:>12} {cells[1]:>12} {cells[2]:>12} "
            f"{_fmt(p['plain_round_s']):>11} "
            f"{_fmt(p['chaos_round_s']):>11} {_fmt(p['round_overhead_ratio'], 2):>6} "
            f"{_fmt(apps.get('fedavg'), 0)}/{_fmt(apps.get('chaos'), 0):>4}"
        )
    rows.append(
        "server loss: seconds from the loss to the next finished round (rounds lost); "
        "SIGKILL of the ServerApp | loss of the SuperLink host's disk"
    )
    for name, p in fig["placements"].items():
        disk = p.get("server_disk_loss") or {}
        kill = [_loss_cell(p, v) for v in ("chaos", "chaos_direct", "plain_checkpoint", "plain")]
        lost = [_loss_cell(disk, v) for v in ("chaos", "chaos_direct", "plain_checkpoint")]
        rows.append(f"{name:<24} {', '.join(kill)} | {', '.join(lost)}")
    rows.append("not measured: " + ", ".join(fig["not_measured"]))
    rows.append(fig["latency"])
    return "\n".join(rows)
