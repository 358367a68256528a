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

# --- bench scale-out -------------------------------------------------------------------------
# (section owned by state transfer)

# --- demo / status ---------------------------------------------------------------------------
# (section owned by the Flower integration)


def main() -> None:
    """Run the ``chaos-flwr`` command line."""
    app()


if __name__ == "__main__":
    main()
