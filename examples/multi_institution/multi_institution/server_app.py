"""ServerApp of the multi-institution example.

With ``mode = "fedavg"`` (the default) this is a plain Flower FedAvg app; with ``mode = "chaos"``
the same FedAvg runs inside :class:`chaos_flwr.flower.ChaosStrategy`. Accuracy on the global test
set is measured after every round, and when ``results-path`` is set, the per-round accuracy and
wall time are written there as JSON (with every :class:`~chaos_flwr.flower.RoundLog` in chaos
mode); ``progress-path`` gets one JSON line per finished round as the run goes (in chaos mode
with the round's ``audited`` parties and ``audit_bytes``).

With ``chaos-keys-dir`` set (a folder from :func:`chaos_flwr.flower.keys.make_federation`),
receipts are verified against the charter's keyring, so a restarted ServerApp resumes from the
parties' replicas.

With ``checkpoint-path`` set in plain FedAvg mode, the ServerApp does what a Flower user would
write to survive a restart: it saves the global model (and its round) to that file after every
round, and a new run that finds the file starts from it and runs only the rounds left.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from multi_institution.counting import CountingGrid
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
        from chaos_flwr import ChaosStrategy, load_charter
        from chaos_flwr.defaults import FLOWER_DEADLINE_FLOOR_S as DEADLINE_FLOOR_S
        from chaos_flwr.flower import PhaseSettings, ResumeSettings

        # a signed federation (run config chaos-keys-dir): receipts are verified against the
        # charter's keyring and the server keeps a view of the signed records it relays;
        # without it, parties run unsigned (only to measure the carrier's overhead)
        keys_dir = str(cfg.get("chaos-keys-dir", ""))
        charter = load_charter(Path(keys_dir) / "charter.yaml") if keys_dir else None
        return ChaosStrategy(
            fedavg,
            charter=charter,
            phases=PhaseSettings(
                phase_timeout_s=float(cfg["phase-timeout-s"]),
                poll_interval_s=float(cfg["poll-interval-s"]),
                # run config chaos-deadline-floor-s: the least any adaptive deadline waits
                deadline_floor_s=float(cfg.get("chaos-deadline-floor-s", DEADLINE_FLOOR_S)),
            ),
            # run config chaos-resume = auto (default) | fresh | require (README: Resume)
            resume=ResumeSettings(mode=str(cfg.get("chaos-resume", "auto"))),
        )
    raise ValueError(f"run config 'mode' must be 'fedavg' or 'chaos', got {mode!r}")


def _load_checkpoint(path: str, model: torch.nn.Module) -> int:
    """Load the global model a previous run saved at ``path`` into ``model``; return its
    round (0, model untouched, if there is none)."""
    if not path or not Path(path).exists():
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    return int(saved["round"])


def _save_checkpoint(path: str, server_round: int, arrays: ArrayRecord) -> None:
    """Save the global model of ``server_round`` at ``path`` (write, then rename); no path,
    no checkpoint."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    torch.save({"round": server_round, "model": arrays.to_torch_state_dict()}, tmp)
    tmp.replace(path)


def _client_accuracy(metrics: dict[int, MetricRecord]) -> dict[int, float]:
    """Round -> the ClientApps' weighted evaluation accuracy (rounds that report one)."""
    return {r: float(m["eval_acc"]) for r, m in metrics.items() if "eval_acc" in m}


def _plain(value: Any) -> Any:
    """JSON-ready copy of a RoundLog-like value (bytes as hex, sets sorted, keys as str)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


def _audit_fields(rounds: list[Any], server_round: int) -> dict[str, Any]:
    """This round's audit traffic over every attempt at it: the parties sent committed updates
    to audit (``audited``: this round's with its certify, or a missing audit asked again) and
    the array bytes those added (``audit_bytes``)."""
    logs = [r for r in rounds if getattr(r, "server_round", None) == server_round]
    audited = sorted({p for r in logs for p in getattr(r, "audited", [])})
    return {"audited": audited, "audit_bytes": sum(int(getattr(r, "audit_bytes", 0)) for r in logs)}


class _Progress:
    """Appends one JSON line per finished round to ``progress-path`` (if set).

    In chaos mode a line is written when ChaosStrategy files the round's RoundLog (round 0's
    when the initial model is evaluated), and it carries every RoundLog so far: a ServerApp
    killed mid-run leaves its history behind.
    """

    def __init__(self, path: str, mode: str, resumed_from: int = 0) -> None:
        self.path = Path(path) if path else None
        self.mode = mode
        self.resumed_from = resumed_from  # the checkpoint's round (plain FedAvg), else 0
        self.accuracy: dict[int, float] = {}
        self.strategy: Any = None
        self.grid: CountingGrid | None = None

    def write(self, server_round: int) -> None:
        if self.path is None:
            return
        line: dict[str, Any] = {
            "round": server_round,
            "accuracy": self.accuracy.get(server_round),
            "time": time.time(),
            "mode": self.mode,
            "resumed_from": self.resumed_from,
        }
        if self.grid is not None:  # messages and trainers per round so far
            line.update(self.grid.summary())
        if self.strategy is not None:
            line.update(_audit_fields(self.strategy.rounds, server_round))
            line["chaos_rounds"] = _plain(list(self.strategy.rounds))
            line["last_pull"] = _plain(getattr(self.strategy, "last_pull", None))
            relay = getattr(self.strategy, "relay", None)
            line["node_parties"] = _plain(getattr(relay, "party_of", {}))
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


class _FiledRounds(list):  # type: ignore[type-arg]
    """ChaosStrategy.rounds that reports each RoundLog as it is filed."""

    def __init__(self, progress: _Progress) -> None:
        super().__init__()
        self.progress = progress

    def append(self, item: Any) -> None:
        super().append(item)
        rnd = int(getattr(item, "server_round", -1))
        if rnd >= 1 and rnd in self.progress.accuracy:  # round 0's line: at its evaluation
            self.progress.write(rnd)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the federation for ``num-server-rounds`` rounds."""
    t_main = time.monotonic()
    grid = CountingGrid(grid)  # messages and trainers per round, for the results JSON
    cfg = context.run_config
    seed = int(cfg["seed"])
    model = make_model(seed, int(cfg["hidden"]))
    checkpoint = str(cfg.get("checkpoint-path", "")) if str(cfg["mode"]) == "fedavg" else ""
    done = _load_checkpoint(checkpoint, model)  # rounds a previous run finished
    test_data = load_global_test(seed)
    marks: list[float] = []
    ends: list[float] = []  # wall clock (time.time) at the end of rounds 1..N
    accuracy: dict[int, float] = {}
    progress = _Progress(str(cfg.get("progress-path", "")), str(cfg["mode"]), done)
    progress.grid = grid

    def central_eval(flower_round: int, arrays: ArrayRecord) -> MetricRecord:
        server_round = done + flower_round  # this run's round 1 is the checkpoint's next
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, test_data)
        marks.append(time.monotonic())
        if flower_round >= 1:
            ends.append(time.time())
            grid.round_done(flower_round)
            _save_checkpoint(checkpoint, server_round, arrays)  # if checkpoint-path is set
        accuracy[server_round] = acc
        progress.accuracy[server_round] = acc
        filed = progress.strategy is not None and any(
            r.server_round == server_round for r in progress.strategy.rounds
        )
        # a round is done once evaluated and filed; the initial model's line (round 0) marks
        # the ServerApp up (a resumed Chaos run files no round-0 log)
        if progress.strategy is None or filed or flower_round == 0:
            progress.write(server_round)
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy = _build_strategy(context)
    if hasattr(strategy, "rounds"):
        progress.strategy = strategy
        strategy.rounds = _FiledRounds(progress)
    t0 = time.monotonic()
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(cfg["num-server-rounds"]) - done,
        timeout=float(cfg["round-timeout-s"]),
        train_config=ConfigRecord({"lr": float(cfg["lr"])}),
        evaluate_fn=central_eval,
    )
    total = time.monotonic() - t0
    results_path = str(cfg.get("results-path", ""))
    if results_path:
        client_acc = _client_accuracy(result.evaluate_metrics_clientapp)
        report = {
            "mode": str(cfg["mode"]),
            "rounds": int(cfg["num-server-rounds"]),
            "accuracy": {str(r): a for r, a in sorted(accuracy.items())},
            "client_accuracy": {str(r): a for r, a in sorted(client_acc.items())},
            "final_accuracy": accuracy[max(accuracy)],
            "round_wall_s": [b - a for a, b in itertools.pairwise(marks)],
            "total_wall_s": total,
            # seconds from the ServerApp's start to the end of rounds 1..N (time to accuracy)
            "round_end_s": [m - t_main for m in marks[1:]],
            "round_end_at": ends,
            "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            **grid.summary(),
        }
        chaos_rounds = getattr(strategy, "rounds", None)
        if chaos_rounds is not None:
            report["chaos_rounds"] = [
                {
                    **_plain(r),
                    "round": r.server_round,
                    "trained": len(r.trained),
                    "holders": len(r.holders),
                    "unsigned_receipts": len(r.unsigned_receipts),
                    "missing": len(r.missing),
                }
                for r in chaos_rounds
            ]
            report["last_pull"] = _plain(getattr(strategy, "last_pull", None))
        Path(results_path).write_text(json.dumps(report, indent=2), encoding="utf-8")
