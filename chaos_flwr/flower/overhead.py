"""Per-round wall time of ChaosStrategy over plain FedAvg on the simulation engine.

Both runs use the same example app, data, seed and number of rounds; the only difference is
the run config ``mode`` (``fedavg`` or ``chaos``). Chaos parties run without identities here
(``chaos-unsigned``): simulated SuperNodes have no per-node key settings, and the figure
measured is the carrier's cost (extra records, relay bookkeeping, receipts), not signing.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import (
    FLOWER_EXAMPLE_SUPERNODES,
    FLOWER_POLL_INTERVAL_S,
    FLOWER_RUN_TIMEOUT_S,
)
from chaos_flwr.errors import TransportError
from chaos_flwr.flower.runner import run_simulation_app

__all__ = ["example_dir", "measure_overhead"]


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
) -> dict[str, Any]:
    """Run the example as plain FedAvg and as ChaosStrategy(FedAvg); return the figures.

    Round 1 includes Ray's start-up, so the per-round figure is the median of rounds 2..N.
    """
    app = app_dir or example_dir()
    out: dict[str, Any] = {
        "rounds": rounds,
        "supernodes": num_supernodes,
        "chaos_poll_interval_s": poll_interval_s,
    }
    for mode in ("fedavg", "chaos"):
        run = run_simulation_app(
            app,
            run_config={
                "mode": mode,
                "num-server-rounds": rounds,
                "chaos-unsigned": True,
                "poll-interval-s": poll_interval_s,
            },
            num_supernodes=num_supernodes,
            timeout_s=timeout_s,
        )
        if run.returncode != 0 or not run.results:
            raise TransportError(
                f"the {mode} run failed (exit {run.returncode}):\n{run.log[-2000:]}"
            )
        walls = list(run.results["round_wall_s"])
        out[mode] = {
            "final_accuracy": run.results["final_accuracy"],
            "accuracy": run.results["accuracy"],
            "round_wall_s": walls,
            "median_round_s": statistics.median(walls[1:]) if len(walls) > 1 else walls[0],
            "total_wall_s": run.results["total_wall_s"],
        }
    out["ratio_median_round"] = out["chaos"]["median_round_s"] / out["fedavg"]["median_round_s"]
    out["accuracy_gap"] = out["chaos"]["final_accuracy"] - out["fedavg"]["final_accuracy"]
    return out
