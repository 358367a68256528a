"""Run the imaging CNN example with signed Chaos parties, in one command.

    python examples/imaging_cnn/run.py                          # simulation, 3 institutions
    python examples/imaging_cnn/run.py --engine deployment      # SuperLink + SuperNodes, 127.0.0.1

Makes a federation (a key per institution, a charter every founder signed) in a temporary folder,
runs ``ChaosStrategy`` over the ``fedprox-wan`` profile for ``--rounds`` rounds and prints the
accuracy per round, the round times, the model's size and who certified each round's state.
Every process started is stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from chaos_flwr.flower.keys import make_federation
from chaos_flwr.lab.deployment import run_deployment_app
from chaos_flwr.lab.launch import SimulationRun
from chaos_flwr.lab.simulation import run_simulation_app

APP = Path(__file__).resolve().parent


def run(engine: str, institutions: int, rounds: int, work: Path, timeout_s: float) -> SimulationRun:
    """Run the example signed on ``engine``; ``work`` holds the keys and the parties' state."""
    from chaos_flwr.charter import RoundRules
    from chaos_flwr.flower.rule import rule_of_profile

    # the charter fixes the profile's FedProx as the rule: every round audited by one party
    audited = RoundRules(rule=rule_of_profile("fedprox-wan"), auditors=1)
    keys = make_federation(work / "keys", institutions, founders=institutions, rounds=audited)
    config: dict[str, object] = {
        "mode": "chaos",
        "num-server-rounds": rounds,
        "min-nodes": institutions,
        "chaos-keys-dir": str(keys),
        "chaos-state-root": str(work / "state"),
    }
    if engine == "simulation":
        return run_simulation_app(
            APP, run_config=config, num_supernodes=institutions, timeout_s=timeout_s
        )
    nodes: list[dict[str, object]] = [
        {"partition-id": i, "num-partitions": institutions} for i in range(institutions)
    ]
    return run_deployment_app(APP, node_configs=nodes, run_config=config, timeout_s=timeout_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["simulation", "deployment"], default="simulation")
    parser.add_argument("--institutions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="imaging-cnn-") as work:
        result = run(args.engine, args.institutions, args.rounds, Path(work), args.timeout_s)
    if result.returncode != 0 or not result.results:
        print(result.log[-3000:])
        raise SystemExit(result.returncode or 1)
    print(json.dumps({**result.results, "wall_s": round(result.wall_s, 1)}, indent=2))


if __name__ == "__main__":
    main()
