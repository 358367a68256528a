"""The cost of ChaosStrategy over plain FedAvg, on Flower's simulation or deployment engine.

Both runs of a pair use the same example app, data, seed, model size, rounds, exchange bound
and poll interval (the engine's own: Chaos pulls as often as Flower's grid does); the only
difference is the run config ``mode`` (``fedavg`` or ``chaos``). Pairs are interleaved (FedAvg,
Chaos, FedAvg, Chaos, ...) so that a drift in the machine's load hits both modes alike.

Per pair: the ratio of the median round times, the time-to-accuracy ratio (wall time from the
ServerApp's start until the run first reaches the final accuracy plain FedAvg reached), the
ClientApp work per round (simulation: messages the ServerApp sends per round, counted by the
same Grid wrapper in both modes; deployment: ClientApp processes the SuperNodes start per round,
one per message), the fewest trainers in any round, the final accuracies and the bytes the
parties' replicas hold on disk after a Chaos run.

With ``audits`` the bench measures Chaos alone, four ways interleaved per repeat
(``unverified``: a charter without a ``rounds`` section, so no commitments either; audits
``off``: the FedAvg rule with 0 auditors, so commitments and certify proofs but no audit;
1 rota auditor; ``all`` auditors: charters from ``make_federation(rounds=fedavg_rounds(...))``,
the same keys), and reports per mode the median round time, time to the off run's final
accuracy, final accuracy, rounds certified, audit bytes per round (from the ServerApp's
progress lines) and ClientApp messages per round, with the round time ratios of 1 and
``all`` auditors over audits off (the same verified run without audits) and of audits off
over unverified (what commitments and proofs cost).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.report import read_progress
from chaos_flwr.lab.settings import (
    FLOWER_ENGINE_POLL_S,
    FLOWER_EXAMPLE_SUPERNODES,
    FLOWER_OVERHEAD_DEFAULT_HIDDEN,
    FLOWER_OVERHEAD_EXCHANGE_TIMEOUT_S,
    FLOWER_OVERHEAD_ROUNDS,
    FLOWER_OVERHEAD_RUN_TIMEOUT_S,
    FLOWER_PROGRESS_RUN_CONFIG_KEY,
)

__all__ = [
    "AUDIT_MODES",
    "OverheadSpec",
    "audit_progress",
    "audit_run_figures",
    "audits_table",
    "clientapp_figures",
    "hidden_for_mib",
    "measure_audits",
    "measure_overhead",
    "model_bytes_for_hidden",
    "node_configs",
    "pair_figures",
]

ENGINES = ("simulation", "deployment")
MODES = ("fedavg", "chaos")
#: The audit bench's modes: no ``rounds`` section in the charter, the FedAvg rule with 0
#: auditors, 1 rota auditor, all of them.
AUDIT_MODES = ("unverified", "off", "1", "all")
MIB = 1 << 20
#: The example's MLP (64 -> h -> h -> 10, float32): parameters = h^2 + (64 + 1 + 1 + 10) h + 10.
_IN, _OUT, _FLOAT_BYTES = 64, 10, 4


def hidden_for_mib(mib: float) -> int:
    """The example's layer width whose float32 model is closest to ``mib`` MiB (at least 1)."""
    if not mib > 0:
        raise ConfigError(f"model_mib must be > 0, got {mib}")
    params = mib * MIB / _FLOAT_BYTES
    b = _IN + 2 + _OUT  # the linear term's coefficient (weights in, biases, weights out)
    return max(1, round((-b + math.sqrt(b * b + 4 * (params - _OUT))) / 2))


def model_bytes_for_hidden(hidden: int) -> int:
    """Bytes of the example's float32 model of layer width ``hidden``."""
    params = _IN * hidden + hidden + hidden * hidden + hidden + hidden * _OUT + _OUT
    return params * _FLOAT_BYTES


@dataclass(frozen=True)
class OverheadSpec:
    """What to measure: engine, rounds, model size, pairs, signing and bounds.

    ``audits``: measure Chaos with audits off, 1 auditor and ``all`` (:func:`measure_audits`)
    instead of the FedAvg/Chaos pair; needs signed parties (audits are signed).
    """

    engine: str = "simulation"
    rounds: int = FLOWER_OVERHEAD_ROUNDS
    model_mib: float | None = None
    repeats: int = 1
    signed: bool = True
    num_supernodes: int = FLOWER_EXAMPLE_SUPERNODES
    poll_interval_s: float | None = None
    timeout_s: float = FLOWER_OVERHEAD_RUN_TIMEOUT_S
    exchange_timeout_s: float = FLOWER_OVERHEAD_EXCHANGE_TIMEOUT_S
    app_dir: Path | None = None
    extra_config: Mapping[str, object] = field(default_factory=dict)
    audits: bool = False
    daemons: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.rounds < 2 or self.repeats < 1:
            raise ConfigError("rounds must be >= 2 and repeats >= 1")
        if self.num_supernodes < 1:
            raise ConfigError(f"num_supernodes must be >= 1, got {self.num_supernodes}")
        if self.audits and not self.signed:
            raise ConfigError("audits need signed parties: drop --no-signed")
        if self.daemons and (self.engine != "deployment" or not self.signed):
            raise ConfigError("--daemons needs the deployment engine and signed parties")

    @property
    def poll_s(self) -> float:
        """The poll interval of both modes: given, or the engine's own."""
        return self.poll_interval_s or FLOWER_ENGINE_POLL_S[self.engine]

    @property
    def hidden(self) -> int:
        """The example model's layer width for ``model_mib`` (its own default if None)."""
        if self.model_mib is None:
            return FLOWER_OVERHEAD_DEFAULT_HIDDEN
        return hidden_for_mib(self.model_mib)


def measure_overhead(spec: OverheadSpec) -> dict[str, Any]:
    """Run ``spec.repeats`` interleaved FedAvg/Chaos pairs; return per-pair and median figures.

    Returns
    -------
    dict
        The issue's keys (``engine``, ``model_bytes``, ``round_time_ratio``,
        ``time_to_accuracy_ratio``, ``clientapp_per_round``, ``min_trainers``,
        ``final_accuracy``; medians over the pairs, ``min_trainers`` the fewest over all runs),
        ``replica_disk_bytes``, ``pairs`` (each pair's figures), ``fedavg``/``chaos`` (the last
        run of each mode in full), ``loadavg`` (1-minute load before and after) and the old
        keys ``ratio_median_round``, ``ratio_mean_round`` and ``accuracy_gap``.
    """
    app = spec.app_dir or example_dir()
    out: dict[str, Any] = {
        "engine": spec.engine,
        "rounds": spec.rounds,
        "supernodes": spec.num_supernodes,
        "poll_interval_s": spec.poll_s,
        "hidden": spec.hidden,
        "signed": spec.signed,
        "daemons": spec.daemons,
        "repeats": spec.repeats,
        "loadavg": {"before": os.getloadavg()[0]},
    }
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="chaos-overhead-") as tmp:
        keys = _keys(Path(tmp), spec)
        for rep in range(spec.repeats):
            runs: dict[str, dict[str, Any]] = {}
            for mode in MODES:
                work = Path(tmp) / f"run-{rep}-{mode}"
                runs[mode] = _one_run(app, spec, mode, keys, work)
                out[mode] = runs[mode]
            pairs.append(pair_figures(runs["fedavg"], runs["chaos"]))
    out["loadavg"]["after"] = os.getloadavg()[0]
    out["model_bytes"] = out["chaos"]["model_bytes"]
    out["pairs"] = pairs
    out.update(_medians(pairs))
    return out


def _keys(tmp: Path, spec: OverheadSpec) -> Path | None:
    """Keys and the shipped default charter, every SuperNode a founder (None: unsigned)."""
    if not spec.signed:
        return None
    from chaos_flwr.flower.keys import make_federation

    n = spec.num_supernodes
    return make_federation(tmp / "keys", n, founders=n, seed="overhead")


def _run_config(spec: OverheadSpec, mode: str, keys: Path | None, work: Path) -> dict[str, object]:
    cfg: dict[str, object] = {
        "mode": mode,
        "num-server-rounds": spec.rounds,
        "poll-interval-s": spec.poll_s,
        "hidden": spec.hidden,
        "round-timeout-s": spec.exchange_timeout_s,
        "phase-timeout-s": spec.exchange_timeout_s,
        "results-path": str(work / "results.json"),
        **spec.extra_config,
    }
    if keys is None:
        cfg["chaos-unsigned"] = True
    else:
        cfg["chaos-unsigned"] = False
        cfg["chaos-keys-dir"] = str(keys)
        cfg["chaos-state-root"] = str(work / "state")  # fresh replicas: every run starts at 0
    return cfg


def _one_run(
    app: Path, spec: OverheadSpec, mode: str, keys: Path | None, work: Path
) -> dict[str, Any]:
    """Run the example once in ``mode``; return its figures (TransportError if it failed)."""
    work.mkdir(parents=True)
    cfg = _run_config(spec, mode, keys, work)
    clientapps: dict[int, float] = {}
    if spec.engine == "simulation":
        from chaos_flwr.lab.simulation import run_simulation_app

        run = run_simulation_app(
            app, run_config=cfg, num_supernodes=spec.num_supernodes, timeout_s=spec.timeout_s
        )
        state_root = work / "state"
    else:
        from chaos_flwr.lab.deployment import run_deployment_app

        nodes = node_configs(spec.num_supernodes, keys, work / "state")
        run = run_deployment_app(
            app, node_configs=nodes, run_config=cfg, timeout_s=spec.timeout_s,
            keep_home=work / "home", clientapps=clientapps,
            daemons=spec.daemons and mode == "chaos",
        )  # fmt: skip
        state_root = work / "state"
    if run.returncode != 0 or not run.results:
        raise TransportError(f"the {mode} run failed (exit {run.returncode}):\n{run.log[-2000:]}")
    fig = run_figures(run.results)
    fig["replica_disk_bytes"] = _disk_bytes(state_root)
    if spec.engine == "deployment":
        fig.update(clientapp_figures(run.results, clientapps, work / "home" / "logs"))
        fig["clientapp_per_round"] = fig["clientapp_processes_per_round_median"]
    return fig


def node_configs(n: int, keys: Path | None, state: Path) -> list[Mapping[str, object]]:
    """One SuperNode per partition; signed ones carry their key, the charter, a state dir."""
    from chaos_flwr.flower.keys import charter_path, key_path

    out: list[Mapping[str, object]] = []
    for i in range(n):
        node: dict[str, object] = {"partition-id": i, "num-partitions": n}
        if keys is not None:
            node["chaos-key"] = str(key_path(keys, i))
            node["chaos-charter"] = str(charter_path(keys))
            node["chaos-state-dir"] = str(state / f"party-{i}")
        out.append(node)
    return out


def _disk_bytes(root: Path) -> int:
    """Bytes of every file below ``root`` (0 if it does not exist)."""
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _sum_counts(counts: Mapping[str, int]) -> int:
    return sum(int(v) for v in counts.values())


def run_figures(results: Mapping[str, Any]) -> dict[str, Any]:
    """One run's figures from the JSON its ServerApp wrote (round 1 left out of the round
    time medians: it includes the engine's start-up)."""
    walls = list(results["round_wall_s"])
    per_round = [_sum_counts(c) for c in results.get("messages_per_round") or []]
    trainers = list(results.get("trainers_per_round") or [])
    fig: dict[str, Any] = {
        "final_accuracy": results["final_accuracy"],
        "accuracy": results["accuracy"],
        "round_wall_s": walls,
        "median_round_s": statistics.median(walls[1:]),
        "mean_round_s": statistics.fmean(walls[1:]),
        "total_wall_s": results["total_wall_s"],
        "round_end_s": results.get("round_end_s") or [],
        "model_bytes": results.get("model_bytes"),
        "setup_messages": results.get("setup_messages") or {},
        "messages_per_round": results.get("messages_per_round") or [],
        "messages_per_round_total": per_round,
        "trainers_per_round": trainers,
        "min_trainers": min(trainers) if trainers else 0,
        "clientapp_per_round": statistics.median(per_round) if per_round else None,
    }
    chaos_rounds = [r for r in results.get("chaos_rounds") or [] if r.get("round", 0) >= 2]
    if chaos_rounds:
        fig["phase_s"] = {
            k: statistics.median(float(r.get(k) or 0.0) for r in chaos_rounds)
            for k in ("ask_s", "train_s", "certify_s", "join_s")
        }
        fig["unsigned_receipts"] = max(r["unsigned_receipts"] for r in chaos_rounds)
        fig["holders"] = min(r["holders"] for r in chaos_rounds)
        fig["missing"] = max(r["missing"] for r in chaos_rounds)
    return fig


#: A party daemon's exit line: messages it answered over its local socket.
_ANSWERED = re.compile(r"local socket: (\d+) message\(s\) answered")


def clientapp_figures(
    results: Mapping[str, Any], clientapps: Mapping[int, float], logs: Path
) -> dict[str, Any]:
    """ClientApp processes the SuperNodes started, per round by when they were first seen
    (before the first train message: setup), and the messages their logs say they received."""
    ends = list(results.get("round_end_at") or [])
    first = results.get("first_train_at") or 0.0
    setup, per_round, after = 0, [0] * len(ends), 0
    for seen in clientapps.values():
        if seen < first:
            setup += 1
            continue
        idx = next((i for i, end in enumerate(ends) if seen <= end), None)
        if idx is None:
            after += 1
        else:
            per_round[idx] += 1
    received = sum(
        log.read_text("utf-8", "replace").count("Receiving: ")
        for log in sorted(logs.glob("supernode-*.log"))
    )
    answered = [
        int(m.group(1))
        for log in sorted(logs.glob("party-*.log"))
        for m in _ANSWERED.finditer(log.read_text("utf-8", "replace"))
    ]
    return {
        "daemon_messages_answered": sum(answered),
        "clientapp_processes": len(clientapps),
        "clientapp_processes_setup": setup,
        "clientapp_processes_per_round": per_round,
        "clientapp_processes_after_run": after,
        "clientapp_processes_per_round_median": statistics.median(per_round) if ends else None,
        "supernode_messages_received": received,
    }


def _time_to(fig: Mapping[str, Any], target: float) -> float | None:
    """Seconds from the ServerApp's start until the run's accuracy first reached ``target``."""
    acc = fig["accuracy"]
    for rnd, end in enumerate(fig["round_end_s"], start=1):
        value = acc.get(str(rnd))
        if value is not None and value >= target:
            return float(end)
    return None


def pair_figures(fedavg: Mapping[str, Any], chaos: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one FedAvg/Chaos pair (the issue's JSON keys)."""
    target = float(fedavg["final_accuracy"])
    t_fedavg, t_chaos = _time_to(fedavg, target), _time_to(chaos, target)
    tta = t_chaos / t_fedavg if t_chaos is not None and t_fedavg else None
    return {
        "round_time_ratio": chaos["median_round_s"] / fedavg["median_round_s"],
        "mean_round_ratio": chaos["mean_round_s"] / fedavg["mean_round_s"],
        "median_round_s": {"fedavg": fedavg["median_round_s"], "chaos": chaos["median_round_s"]},
        "time_to_accuracy_s": {"fedavg": t_fedavg, "chaos": t_chaos},
        "time_to_accuracy_ratio": tta,
        "clientapp_per_round": {m: f["clientapp_per_round"] for m, f in _both(fedavg, chaos)},
        "messages_per_round": {m: f["messages_per_round_total"] for m, f in _both(fedavg, chaos)},
        "min_trainers": {m: f["min_trainers"] for m, f in _both(fedavg, chaos)},
        "trainers_per_round": {m: f["trainers_per_round"] for m, f in _both(fedavg, chaos)},
        "final_accuracy": {m: f["final_accuracy"] for m, f in _both(fedavg, chaos)},
        "setup_messages": {m: f["setup_messages"] for m, f in _both(fedavg, chaos)},
        "replica_disk_bytes": chaos.get("replica_disk_bytes"),
    }


def _both(
    fedavg: Mapping[str, Any], chaos: Mapping[str, Any]
) -> list[tuple[str, Mapping[str, Any]]]:
    return [("fedavg", fedavg), ("chaos", chaos)]


def _median(values: Sequence[float | None]) -> float | None:
    """Median of the values; None if any is None (a run that never got there)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(float(v) for v in values if v is not None)


def _medians(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the pairs (``min_trainers``: the fewest of any run)."""
    per_mode = {
        key: {m: _median([p[key][m] for p in pairs]) for m in MODES}
        for key in ("clientapp_per_round", "final_accuracy")
    }
    ratio = _median([p["round_time_ratio"] for p in pairs])
    final = per_mode["final_accuracy"]
    return {
        "round_time_ratio": ratio,
        "time_to_accuracy_ratio": _median([p["time_to_accuracy_ratio"] for p in pairs]),
        "time_to_accuracy_reached": sum(p["time_to_accuracy_ratio"] is not None for p in pairs),
        **per_mode,
        "min_trainers": {m: min(p["min_trainers"][m] for p in pairs) for m in MODES},
        "replica_disk_bytes": _median([p["replica_disk_bytes"] for p in pairs]),
        "ratio_median_round": ratio,
        "ratio_runs": [p["round_time_ratio"] for p in pairs],
        "ratio_mean_round": _median([p["mean_round_ratio"] for p in pairs]),
        "accuracy_gap": (final["chaos"] or 0.0) - (final["fedavg"] or 0.0),
    }


def summary_table(fig: Mapping[str, Any]) -> str:
    """The figures as a plain-text table (one line per pair, then the medians)."""
    head = (
        f"engine={fig['engine']} model={fig['model_bytes']} B rounds={fig['rounds']} "
        f"poll={fig['poll_interval_s']} s signed={fig['signed']} "
        f"load {fig['loadavg']['before']:.2f} -> {fig['loadavg']['after']:.2f}"
    )
    cols = "pair  round_ratio  tta_ratio  clientapp/rnd(f,c)  min_trainers(f,c)  acc(f,c)"
    lines = [head, cols]

    def row(name: str, p: Mapping[str, Any]) -> str:
        tta = p["time_to_accuracy_ratio"]
        ca, mt, acc = p["clientapp_per_round"], p["min_trainers"], p["final_accuracy"]
        return (
            f"{name:<5} {p['round_time_ratio']:>11.3f}  "
            f"{'never' if tta is None else f'{tta:.3f}':>9}  "
            f"{ca['fedavg']!s:>8},{ca['chaos']!s:<9}  {mt['fedavg']:>8},{mt['chaos']:<8}  "
            f"{acc['fedavg']:.3f},{acc['chaos']:.3f}"
        )

    lines += [row(str(i + 1), p) for i, p in enumerate(fig["pairs"])]
    lines.append(row("med", fig))
    lines.append(f"replica disk (chaos): {fig['replica_disk_bytes']} B")
    return "\n".join(lines)


# -- audits off / 1 auditor / all ----------------------------------------------------------------
#: JSON key of each auditing mode's round time ratio over audits off.
AUDIT_RATIO_KEYS = {"1": "audit1_round_ratio", "all": "audit_all_round_ratio"}
#: JSON key of the round time ratio of audits off over unverified.
VERIFIED_RATIO_KEY = "verified_round_ratio"
#: Per-mode figures the audit bench reports as medians over the repeats.
AUDIT_MEDIAN_KEYS = (
    "median_round_s",
    "time_to_accuracy_s",
    "final_accuracy",
    "rounds_certified",
    "audit_bytes_per_round",
    "auditors_per_round",
    "clientapp_per_round",
)


def measure_audits(spec: OverheadSpec) -> dict[str, Any]:
    """Run Chaos unverified, with audits off, 1 auditor and ``all``, interleaved per repeat.

    Returns
    -------
    dict
        Per mode (``modes``: ``unverified``, ``off``, ``1``, ``all``) the medians over the
        repeats of :data:`AUDIT_MEDIAN_KEYS` (time to accuracy: to the off run's final
        accuracy of the same repeat); ``audit1_round_ratio`` and ``audit_all_round_ratio``
        (medians of the per-repeat ratios of median round times over audits off),
        ``verified_round_ratio`` (audits off over unverified), ``repeats_figures`` (each
        repeat's per-mode figures), ``model_bytes`` and ``loadavg`` (1-minute, before and after).
    """
    if not spec.audits:
        raise ConfigError("measure_audits needs OverheadSpec(audits=True)")
    app = spec.app_dir or example_dir()
    out: dict[str, Any] = {
        "engine": spec.engine,
        "audits": True,
        "rounds": spec.rounds,
        "supernodes": spec.num_supernodes,
        "poll_interval_s": spec.poll_s,
        "hidden": spec.hidden,
        "repeats": spec.repeats,
        "loadavg": {"before": os.getloadavg()[0]},
    }
    reps: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="chaos-audits-") as tmp:
        keys = {mode: _audit_keys(Path(tmp), spec, mode) for mode in AUDIT_MODES}
        for rep in range(spec.repeats):
            runs = {
                mode: _audit_run(app, spec, keys[mode], Path(tmp) / f"run-{rep}-{mode}")
                for mode in AUDIT_MODES
            }
            reps.append(audit_repeat_figures(runs))
    out["loadavg"]["after"] = os.getloadavg()[0]
    out["model_bytes"] = reps[-1]["off"]["model_bytes"]
    out["repeats_figures"] = reps
    out.update(audit_medians(reps))
    return out


def _audit_keys(tmp: Path, spec: OverheadSpec, mode: str) -> Path:
    """The federation of one audit mode: the same seeded keys, a charter with the mode's
    ``rounds`` section (none for ``unverified``, 0 auditors for ``off``)."""
    from chaos_flwr.flower.keys import fedavg_rounds, make_federation

    counts: dict[str, int | Literal["all"]] = {"off": 0, "1": 1, "all": "all"}
    rounds = None if mode == "unverified" else fedavg_rounds(counts[mode])
    n = spec.num_supernodes
    return make_federation(tmp / f"keys-{mode}", n, founders=n, seed="overhead", rounds=rounds)


def _audit_run(app: Path, spec: OverheadSpec, keys: Path, work: Path) -> dict[str, Any]:
    """One Chaos run on ``keys``: :func:`_one_run`'s figures plus its progress lines' audits."""
    progress = work / "progress.jsonl"
    extra = {**spec.extra_config, FLOWER_PROGRESS_RUN_CONFIG_KEY: str(progress)}
    run_spec = dataclasses.replace(spec, extra_config=extra)
    fig = _one_run(app, run_spec, "chaos", keys, work)
    return audit_run_figures(fig, read_progress(progress))


def audit_progress(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The audit figures of one run from its ServerApp's progress lines.

    Each line names its ``round``, the parties sent the previous round's committed updates
    (``audited``) and the bytes those added (``audit_bytes``); the last line carries every
    round log so far (``chaos_rounds``): a round is certified when an attempt at it was not
    skipped and has holders.
    """
    per_round = {int(ln["round"]): ln for ln in lines if int(ln.get("round", 0)) >= 1}
    rounds = sorted(per_round)
    last = lines[-1].get("chaos_rounds") if lines else None
    logs = [r for r in last or [] if int(r.get("server_round", 0)) >= 1]
    certified = {r["server_round"] for r in logs if r.get("holders") and not r.get("skipped")}
    return {
        "audit_bytes": [int(per_round[r].get("audit_bytes") or 0) for r in rounds],
        "audited": [list(per_round[r].get("audited") or []) for r in rounds],
        "rounds_certified": len(certified),
        "attempts": len(logs),
    }


def audit_run_figures(fig: Mapping[str, Any], lines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's figures (:func:`run_figures`) with its audits: per round bytes and auditors, and
    their medians over rounds 2.. (round 1 has no audited base)."""
    audits = audit_progress(lines)
    later_bytes, later_auditors = audits["audit_bytes"][1:], audits["audited"][1:]
    return {
        **fig,
        **audits,
        # an attempt that was not certified is tried again as the same round, within the
        # run's rounds: the run then certified fewer rounds than it was asked for
        "every_round_certified": audits["attempts"] == audits["rounds_certified"] > 0,
        "audit_bytes_per_round": statistics.median(later_bytes) if later_bytes else 0,
        "auditors_per_round": statistics.median(map(len, later_auditors)) if later_auditors else 0,
    }


def audit_repeat_figures(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One repeat's per-mode figures: time to the off run's final accuracy, the round time
    ratio over audits off, and the run figures the bench reports."""
    target = float(runs["off"]["final_accuracy"])
    base = float(runs["off"]["median_round_s"])
    keep = (
        "model_bytes",
        "round_wall_s",
        "audit_bytes",
        "audited",
        "attempts",
        "every_round_certified",
    )
    out: dict[str, dict[str, Any]] = {}
    for mode, fig in runs.items():
        out[mode] = {k: fig.get(k) for k in (*AUDIT_MEDIAN_KEYS, *keep)}
        out[mode]["time_to_accuracy_s"] = _time_to(fig, target)
        out[mode]["round_ratio"] = float(fig["median_round_s"]) / base
    return out


def audit_medians(reps: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Medians over the repeats: per mode, the ratios over audits off, and audits off over
    unverified (``verified_round_ratio``).

    A ratio is ``None`` when a run of either mode left a round uncertified (its round times
    then include retries and are not comparable); ``ratio_runs`` keeps the measured values and
    ``incomplete`` names those modes.
    """
    modes = {
        mode: {key: _median([r[mode][key] for r in reps]) for key in AUDIT_MEDIAN_KEYS}
        for mode in AUDIT_MODES
    }
    incomplete = [m for m in AUDIT_MODES if not all(r[m]["every_round_certified"] for r in reps)]
    ratios = {
        name: None
        if {mode, "off"} & set(incomplete)
        else _median([r[mode]["round_ratio"] for r in reps])
        for mode, name in AUDIT_RATIO_KEYS.items()
    }
    runs = {name: [r[mode]["round_ratio"] for r in reps] for mode, name in AUDIT_RATIO_KEYS.items()}
    runs[VERIFIED_RATIO_KEY] = [1.0 / r["unverified"]["round_ratio"] for r in reps]
    ratios[VERIFIED_RATIO_KEY] = (
        None if {"unverified", "off"} & set(incomplete) else _median(runs[VERIFIED_RATIO_KEY])
    )
    return {"modes": modes, **ratios, "ratio_runs": runs, "incomplete": incomplete}


def audits_table(fig: Mapping[str, Any]) -> str:
    """The audit figures as a plain-text table (one line per mode, medians over the repeats)."""
    head = (
        f"engine={fig['engine']} model={fig['model_bytes']} B rounds={fig['rounds']} "
        f"supernodes={fig['supernodes']} repeats={fig['repeats']} "
        f"poll={fig['poll_interval_s']} s load {fig['loadavg']['before']:.2f} -> "
        f"{fig['loadavg']['after']:.2f}"
    )
    cols = (
        "mode        round_s  ratio  tta_s   acc    certified  audit_B/rnd  auditors  clientapp/rnd"
    )
    lines = [head, cols]
    ratio = {"off": 1.0, **{m: fig[k] for m, k in AUDIT_RATIO_KEYS.items()}}
    verified = fig.get(VERIFIED_RATIO_KEY)
    ratio["unverified"] = None if not verified else 1.0 / verified
    for mode in AUDIT_MODES:
        m = fig["modes"][mode]
        tta = m["time_to_accuracy_s"]
        lines.append(
            f"{mode:<10} {_num(m['median_round_s'], 3):>8} {_num(ratio[mode], 3):>6} "
            f"{'never' if tta is None else f'{tta:.2f}':>6} {_num(m['final_accuracy'], 3):>6} "
            f"{_num(m['rounds_certified'], 0):>10} {_num(m['audit_bytes_per_round'], 0):>12} "
            f"{_num(m['auditors_per_round'], 0):>9} {_num(m['clientapp_per_round'], 0):>14}"
        )
    if fig.get("incomplete"):
        lines.append(f"left rounds uncertified (ratio not comparable): {fig['incomplete']}")
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
