"""A ``flwr.simulation.run_simulation()`` script runs the Chaos app (3 virtual SuperNodes).

``run_simulation()`` passes no run config, so the settings come from the environment
(``CHAOS_KEYS_DIR``, ``CHAOS_STATE_ROOT``): the README's smallest example, run as a script.
Without them every party is misconfigured and the script must fail loudly, not exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos_flwr.flower.keys import make_federation

#: Each test starts Ray and a simulation (about 25 s here): end-to-end, so slow.
pytestmark = pytest.mark.slow

#: Wall-time bound of one script run (Ray start-up included).
SCRIPT_TIMEOUT_S = 240

SCRIPT = """
import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from chaos_flwr.flower import enable
from chaos_flwr.flower.server import ChaosStrategy, run_options

client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    arrays = ArrayRecord({"w": Array(msg.content["arrays"]["w"].numpy() + 1)})
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


enable(client)
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    strategy = ChaosStrategy(FedAvg(min_available_nodes=3), **run_options(context))
    result = strategy.start(grid, ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=2)
    print("TRAINED", [r.server_round for r in strategy.rounds if r.trained], flush=True)
    print("W", result.arrays["w"].numpy().tolist(), flush=True)


if __name__ == "__main__":
    run_simulation(server, client, num_supernodes=3)
"""


def _run(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp / "sim.py"
    script.write_text(SCRIPT, encoding="utf-8")
    full = {k: v for k, v in os.environ.items() if not k.startswith("CHAOS_")}
    full.update(env, FLWR_HOME=str(tmp / "flwr-home"))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp,
        env=full,
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        check=False,
    )


def test_a_run_simulation_script_trains_with_the_settings_in_the_environment(
    tmp_path: Path, flower_env: Path
) -> None:
    keys = make_federation(tmp_path / "fed", 3, founders=3)
    env = {"CHAOS_KEYS_DIR": str(keys), "CHAOS_STATE_ROOT": str(tmp_path / "state")}
    proc = _run(tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAINED [1, 2]" in proc.stdout, proc.stdout[-2000:]
    assert "W [2.0, 2.0, 2.0, 2.0]" in proc.stdout
    for p in range(3):  # every party keeps its certified replicas
        assert (tmp_path / "state" / f"party-{p}" / "replicas").is_dir()


def test_a_misconfigured_run_simulation_script_fails_loudly(
    tmp_path: Path, flower_env: Path
) -> None:
    keys = make_federation(tmp_path / "fed", 3, founders=3)
    proc = _run(tmp_path, {"CHAOS_CHARTER": str(keys / "charter.yaml")})  # no party settings
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "PartyConfigError" in out and "3 of 3 nodes cannot take part" in out
    assert "node_config 'chaos-key' is missing" in out
    # the ClientApps answered one line each: the only traceback is the ServerApp's own
    assert out.count("Traceback (most recent call last)") <= 1, out[-5000:]
