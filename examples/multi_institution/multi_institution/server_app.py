"""ServerApp of the multi-institution example.

With ``mode = "fedavg"`` (the default) this is a plain Flower FedAvg app; with ``mode = "chaos"``
the same FedAvg runs inside :class:`chaos_flwr.flower.ChaosStrategy`. Accuracy on the global test
set is measured after every round, and when ``results-path`` is set, the per-round accuracy and
wall time are written there as JSON.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from multi_institution.task import evaluate, load_global_test, make_model

torch.set_num_threads(1)

app = ServerApp()


def _build_strategy(context: Context) -> Strategy:
    cfg = context.run_config
    fedavg = FedAvg(
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=float(cfg["fraction-evaluate"]),
        min_train_nodes=int(cfg["min-nodes"]),
        min_evaluate_nodes=int(cfg["min-nodes"]),
        min_available_nodes=int(cfg["min-nodes"]),
    )
    mode = str(cfg["mode"])
    if mode == "fedavg":
        return fedavg
    if mode == "chaos":
        from chaos_flwr.flower import ChaosStrategy

        return ChaosStrategy(
            fedavg,
            phase_timeout_s=float(cfg["phase-timeout-s"]),
            poll_interval_s=float(cfg["poll-interval-s"]),
        )
    # (a signed federation also passes receipt_verifier=keyring_verifier(charter.keyring()))
    raise ValueError(f"run config 'mode' must be 'fedavg' or 'chaos', got {mode!r}")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation for ``num-server-rounds`` rounds."""
    cfg = context.run_config
    seed = int(cfg["seed"])
    model = make_model(seed, int(cfg["hidden"]))
    test_data = load_global_test(seed)
    marks: list[float] = []
    accuracy: dict[int, float] = {}

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, test_data)
        marks.append(time.monotonic())
        accuracy[server_round] = acc
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = _build_strategy(context)
    t0 = time.monotonic()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]),
        timeout=float(cfg["round-timeout-s"]),
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central_eval,
    )
    total = time.monotonic() - t0
    results_path = str(cfg.get("results-path", ""))
    if results_path:
        client_acc = {
            r: float(m["eval_acc"])
            for r, m in result.evaluate_metrics_clientapp.items()
            if "eval_acc" in m
        }
        report = {
            "mode": str(cfg["mode"]),
            "rounds": int(cfg["num-server-rounds"]),
            "accuracy": {str(r): a for r, a in sorted(accuracy.items())},
            "client_accuracy": {str(r): a for r, a in sorted(client_acc.items())},
            "final_accuracy": accuracy[max(accuracy)],
            "round_wall_s": [b - a for a, b in itertools.pairwise(marks)],
            "total_wall_s": total,
        }
        chaos_rounds = getattr(strategy, "rounds", None)
        if chaos_rounds is not None:
            report["chaos_rounds"] = [
                {
                    "round": r.server_round,
                    "trained": len(r.trained),
                    "holders": len(r.holders),
                    "unsigned_receipts": len(r.unsigned_receipts),
                    "missing": len(r.missing),
                }
                for r in chaos_rounds
            ]
        Path(results_path).write_text(json.dumps(report, indent=2), encoding="utf-8")
