"""ServerApp of the imaging CNN example.

``mode = "fedprox"``: plain Flower FedProx. ``mode = "chaos"``: the strategy profile named by
``strategy-profile`` (``fedprox-wan`` by default) inside :class:`chaos_flwr.ChaosStrategy`, with
receipts verified against the charter in ``chaos-keys-dir``. The global model is evaluated on the
shared test set after every round; ``results-path`` gets the accuracies, the round times, the
model's size and, in chaos mode, which parties certified each round's state.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedProx, Strategy

from imaging_cnn.task import accuracy, load_test, make_model, model_megabytes

torch.set_num_threads(1)

app = ServerApp()


def _strategy(cfg: Any) -> Strategy:
    n = int(cfg["min-nodes"])
    if str(cfg["mode"]) == "fedprox":
        return FedProx(
            min_train_nodes=n,
            min_evaluate_nodes=n,
            min_available_nodes=n,
            proximal_mu=float(cfg["proximal-mu"]),
        )
    if str(cfg["mode"]) != "chaos":
        raise ValueError(f"run config 'mode' must be 'fedprox' or 'chaos', got {cfg['mode']!r}")
    from chaos_flwr import ChaosStrategy, load_charter

    keys_dir = str(cfg["chaos-keys-dir"])
    strategy = ChaosStrategy.from_profile(
        str(cfg["strategy-profile"]),
        charter=load_charter(Path(keys_dir) / "charter.yaml") if keys_dir else None,
        phase_timeout_s=float(cfg["phase-timeout-s"]),
        poll_interval_s=float(cfg["poll-interval-s"]),
    )
    inner = strategy.inner
    inner.min_train_nodes = inner.min_evaluate_nodes = inner.min_available_nodes = n
    return strategy


def _certified(strategy: Strategy) -> dict[str, list[str]]:
    """Round -> the parties whose verified receipt names that round's state (chaos mode)."""
    return {
        str(r.server_round): sorted(r.holders)
        for r in getattr(strategy, "rounds", [])
        if r.server_round >= 0
    }


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds and write the results (if ``results-path`` is set)."""
    cfg = context.run_config
    model = make_model(int(cfg["seed"]), int(cfg["hidden"]))
    test = load_test(int(cfg["seed"]))
    acc: dict[int, float] = {}
    marks: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc[server_round] = accuracy(model, test)
        marks.append(time.monotonic())
        return MetricRecord({"accuracy": acc[server_round], "loss": loss})

    strategy = _strategy(cfg)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout-s"]),
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central,
    )
    if str(cfg["results-path"]):
        results = {
            "mode": str(cfg["mode"]),
            "model_mb": model_megabytes(model),
            "accuracy": {str(r): a for r, a in sorted(acc.items())},
            "round_wall_s": [b - a for a, b in itertools.pairwise(marks)],
            "certified_by": _certified(strategy),
        }
        Path(str(cfg["results-path"])).write_text(json.dumps(results, indent=2), "utf-8")
