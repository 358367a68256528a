"""Run the example on Flower's deployment engine: a SuperLink and SuperNodes on 127.0.0.1.

    python examples/multi_institution/deploy.py --nodes 3 --rounds 2 --mode fedavg

Every process is stopped by pid when the run ends. Parties here run without identities
(``chaos-unsigned``) in chaos mode; a signed federation gives each SuperNode ``chaos-key``,
``chaos-charter`` and ``chaos-state-dir`` in its node config instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from chaos_flwr.lab.deployment import run_deployment_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", choices=["fedavg", "chaos"], default="fedavg")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    nodes = [{"partition-id": i, "num-partitions": args.nodes} for i in range(args.nodes)]
    run = run_deployment_app(
        Path(__file__).resolve().parent,
        node_configs=nodes,
        run_config={
            "mode": args.mode,
            "num-server-rounds": args.rounds,
            "min-nodes": args.nodes,
            "chaos-unsigned": args.mode == "chaos",
        },
        timeout_s=args.timeout_s,
    )
    if run.returncode != 0:
        print(run.log[-3000:])
        raise SystemExit(run.returncode)
    summary = {k: run.results.get(k) for k in ("mode", "final_accuracy", "round_wall_s")}
    print(json.dumps({**summary, "wall_s": run.wall_s, "pids_stopped": len(run.pids)}, indent=2))


if __name__ == "__main__":
    main()
