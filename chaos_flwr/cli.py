"""The ``chaos-flwr`` command line.

Each command is a thin shell over a library function: the work (and its tests) lives in the
package, the CLI only parses options, shows progress and prints results.
"""

from __future__ import annotations

import json
from typing import Any

import typer

app = typer.Typer(
    name="chaos-flwr",
    help="Self-healing and autoscaling for Flower federated learning over WANs.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print JSON figures.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_json(result: Any) -> None:
    typer.echo(json.dumps(result, indent=2, sort_keys=True))


# --- bench planner ---------------------------------------------------------------------------
# (section owned by the planner)

# --- identity / charter ----------------------------------------------------------------------
# (section owned by identity and charter)

# --- simulate / bench events -----------------------------------------------------------------
# (section owned by the simulator and the peer protocol)


@bench_app.command("events")
def bench_events(
    peers: int = typer.Option(64, "--peers", help="Cluster size (>= 8)."),
    repeats: int | None = typer.Option(None, "--repeats", help="Events of each type."),
    carrier: str = typer.Option("auto", "--carrier", help="grpc, memory, or auto."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the event choices."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time leave, link-up, link-down and fail from trigger until every member applied it."""
    from .bench.events import run_events
    from .defaults import EVENTS_BENCH_REPEATS, EVENTS_BENCH_SEED

    result = run_events(
        peers,
        repeats=EVENTS_BENCH_REPEATS if repeats is None else repeats,
        seed=EVENTS_BENCH_SEED if seed is None else seed,
        carrier=carrier,
    )
    if as_json:
        _print_json(result)
        return
    typer.echo(f"{result['peers']} peers over the {result['carrier']} carrier")
    for name, row in result["events"].items():
        typer.echo(
            f"  {name:<10} n={row['count']:<4} p50={row['p50_ms']:.3f} ms  "
            f"p99={row['p99_ms']:.3f} ms"
        )


# --- bench scale-out -------------------------------------------------------------------------
# (section owned by state transfer)

# --- demo / status ---------------------------------------------------------------------------
# (section owned by the Flower integration)


@app.command()
def demo(
    rounds: int = typer.Option(10, help="Federated rounds of each run."),
    out: str = typer.Option("report.json", help="Where to write the JSON report."),
    timeout_s: float = typer.Option(300.0, help="Wall-time bound of each run."),
) -> None:
    """Run the multi-institution example as plain FedAvg and under ChaosStrategy (simulation).

    Churn scenarios are not wired into the demo yet: this compares churn-free runs.
    """
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from chaos_flwr.flower.overhead import measure_overhead

    console = Console()
    with console.status(f"running {rounds} rounds of FedAvg, then of ChaosStrategy(FedAvg)..."):
        result = measure_overhead(rounds, timeout_s=timeout_s)
    table = Table(title="Accuracy on the global test set")
    table.add_column("round", justify="right")
    table.add_column("FedAvg", justify="right")
    table.add_column("Chaos(FedAvg)", justify="right")
    for rnd, acc in result["fedavg"]["accuracy"].items():
        chaos_acc = result["chaos"]["accuracy"].get(rnd, float("nan"))
        table.add_row(rnd, f"{acc:.4f}", f"{chaos_acc:.4f}")
    console.print(table)
    console.print(
        f"median round: FedAvg {result['fedavg']['median_round_s']:.3f} s, "
        f"Chaos {result['chaos']['median_round_s']:.3f} s "
        f"(ratio {result['ratio_median_round']:.3f})"
    )
    Path(out).write_text(json.dumps(result, indent=2, sort_keys=True), encoding="utf-8")
    console.print(f"report written to {out}")


@bench_app.command("flower-overhead")
def bench_flower_overhead(
    rounds: int = typer.Option(10, help="Federated rounds of each run."),
    timeout_s: float = typer.Option(300.0, help="Wall-time bound of each run."),
) -> None:
    """Per-round wall time of ChaosStrategy over plain FedAvg in simulation (JSON)."""
    from chaos_flwr.flower.overhead import measure_overhead

    _print_json(measure_overhead(rounds, timeout_s=timeout_s))


def main() -> None:
    """Run the ``chaos-flwr`` command line."""
    app()


if __name__ == "__main__":
    main()
