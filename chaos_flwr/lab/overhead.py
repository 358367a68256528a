"""Per-round wall time of ChaosStrategy over plain FedAvg on the simulation engine.

Both runs use the same example app, data, seed and number of rounds; the only difference is
the run config ``mode`` (``fedavg`` or ``chaos``). Chaos parties run without identities here
(``chaos-unsigned``): simulated SuperNodes have no per-node key settings, and the figure
measured is the carrier's cost (extra records, relay bookkeeping, receipts), not signing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import FLOWER_POLL_INTERVAL_S
from chaos_flwr.errors import TransportError
from chaos_flwr.lab.example import example_dir
from chaos_flwr.lab.settings import FLOWER_EXAMPLE_SUPERNODES, FLOWER_RUN_TIMEOUT_S
from chaos_flwr.lab.simulation import run_simulation_app

__all__ = ["measure_overhead"]


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
        extra = _identity_config(Path(tmp), num_supernodes, signed)
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
                fig = _one_run(app, cfg, num_supernodes, timeout_s)
                runs[mode].append(fig["median_round_s"])
                means[mode].append(fig["mean_round_s"])
                out[mode] = fig
            ratios.append(runs["chaos"][-1] / runs["fedavg"][-1])
            mean_ratios.append(means["chaos"][-1] / means["fedavg"][-1])
    _summarise(out, runs, means, (ratios, mean_ratios))
    out["loadavg"]["after"] = os.getloadavg()[0]
    return out


def _identity_config(tmp: Path, num_supernodes: int, signed: bool) -> dict[str, object]:
    """Run config of the parties' identities: none, or keys with every SuperNode a founder."""
    if not signed:
        return {"chaos-unsigned": True}
    from chaos_flwr.flower.keys import make_federation

    keys = make_federation(tmp / "keys", num_supernodes, founders=num_supernodes, seed="overhead")
    return {"chaos-unsigned": False, "chaos-keys-dir": str(keys)}


def _one_run(
    app: Path, cfg: dict[str, object], num_supernodes: int, timeout_s: float
) -> dict[str, Any]:
    """Run the example once with ``cfg``; return its figures (TransportError if it failed)."""
    run = run_simulation_app(
        app, run_config=cfg, num_supernodes=num_supernodes, timeout_s=timeout_s
    )
    if run.returncode != 0 or not run.results:
        raise TransportError(
            f"the {cfg['mode']} run failed (exit {run.returncode}):\n{run.log[-2000:]}"
        )
    return _run_figures(run.results)


def _run_figures(results: Mapping[str, Any]) -> dict[str, Any]:
    """One run's figures from the JSON its ServerApp wrote (round 1 left out of the medians)."""
    walls = list(results["round_wall_s"])
    med = statistics.median(walls[1:]) if len(walls) > 1 else walls[0]
    mean = statistics.fmean(walls[1:]) if len(walls) > 1 else walls[0]
    fig: dict[str, Any] = {
        "final_accuracy": results["final_accuracy"],
        "accuracy": results["accuracy"],
        "round_wall_s": walls,
        "median_round_s": med,
        "mean_round_s": mean,
        "total_wall_s": results["total_wall_s"],
    }
    chaos_rounds = [r for r in results.get("chaos_rounds") or [] if r.get("round", 0) >= 2]
    if chaos_rounds:
        fig["phase_s"] = {
            k: statistics.median(float(r.get(k, 0.0)) for r in chaos_rounds)
            for k in ("train_s", "certify_s", "join_s")
        }
        fig["unsigned_receipts"] = max(r["unsigned_receipts"] for r in chaos_rounds)
        fig["holders"] = min(r["holders"] for r in chaos_rounds)
    return fig


def _summarise(
    out: dict[str, Any],
    runs: Mapping[str, list[float]],
    means: Mapping[str, list[float]],
    ratios: tuple[Sequence[float], Sequence[float]],
) -> None:
    """Add the per-mode run lists and the Chaos/FedAvg ratios to ``out``."""
    median_ratios, mean_ratios = ratios
    for mode in ("fedavg", "chaos"):
        out[mode]["median_round_s_runs"] = runs[mode]
        out[mode]["mean_round_s_runs"] = means[mode]
    out["ratio_runs"] = list(median_ratios)
    out["ratio_median_round"] = statistics.median(median_ratios)
    # rounds end on 0.1 s polling steps, so a run's median is one of a few values; the mean
    # of rounds 2..N is the finer figure
    out["ratio_mean_round_runs"] = list(mean_ratios)
    out["ratio_mean_round"] = statistics.median(mean_ratios)
    out["accuracy_gap"] = out["chaos"]["final_accuracy"] - out["fedavg"]["final_accuracy"]
