"""What Flower 1.42 does with several messages to one node at once, which the party lock
(chaos_flwr.flower.client.lock) is built on: the simulation engine runs them side by side on
its workers, the deployment engine's SuperNode one after the other."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from chaos_flwr.lab.deployment import run_deployment_app
from chaos_flwr.lab.simulation import run_simulation_app

HOLD_S = 3.0  # each handler's run time
MESSAGES = 4

_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "concurrency-probe"
version = "0.1.0"
description = "Messages to one node: side by side or one after the other?"
license = "Apache-2.0"
dependencies = ["flwr>=1.42,<1.43"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "chaos-flwr"

[tool.flwr.app.components]
serverapp = "probe.server_app:app"
clientapp = "probe.client_app:app"

[tool.flwr.app.config]
results-path = ""
messages = 4
hold-s = 3.0
"""

_CLIENT = """import os, time
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def probe(msg: Message, context: Context) -> Message:
    t0 = time.time()
    time.sleep(float(context.run_config["hold-s"]))
    out = ConfigRecord({"t0": t0, "t1": time.time(), "pid": os.getpid()})
    return Message(RecordDict({"r": out}), reply_to=msg)
"""

_SERVER = """import json, time
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    until = time.monotonic() + 60
    while not list(grid.get_node_ids()) and time.monotonic() < until:
        time.sleep(0.5)
    node = sorted(grid.get_node_ids())[0]
    n = int(context.run_config["messages"])
    msgs = [Message(RecordDict({"c": ConfigRecord({"i": i})}), dst_node_id=node,
                    message_type="query") for i in range(n)]
    replies = grid.send_and_receive(msgs, timeout=120)
    out = [dict(r.content["r"]) for r in replies if r.has_content()]
    with open(context.run_config["results-path"], "w") as f:
        json.dump({"handled": out}, f)
"""


def _app(root: Path, workers: int) -> Path:
    app = root / "probe-app"
    (app / "probe").mkdir(parents=True)
    (app / "pyproject.toml").write_text(_PYPROJECT)
    (app / "probe" / "__init__.py").write_text("")
    (app / "probe" / "client_app.py").write_text(_CLIENT)
    (app / "probe" / "server_app.py").write_text(_SERVER)
    (app / "federation.toml").write_text(
        f"[simulation]\nnum-supernodes = 1\nclient-resources-num-cpus = {2 // workers}\n"
        "init-args-num-cpus = 2\n"
    )
    return app


def _overlaps(handled: list[dict[str, float]]) -> int:
    """Pairs of handler runs that were under way at the same time."""
    spans = sorted((h["t0"], h["t1"]) for h in handled)
    return sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_simulation_engine_runs_messages_to_one_node_side_by_side(tmp_path: Path) -> None:
    run = run_simulation_app(_app(tmp_path, workers=2), timeout_s=240)
    assert run.returncode == 0, run.log[-3000:]
    handled = run.results["handled"]
    assert len(handled) == MESSAGES
    assert _overlaps(handled) >= 1, json.dumps(handled)  # two workers, one node, same time
    assert len({h["pid"] for h in handled}) == 2  # in two processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_deployment_engine_runs_messages_to_one_node_one_after_the_other(
    tmp_path: Path,
) -> None:
    run = run_deployment_app(
        _app(tmp_path, workers=1), node_configs=[{"partition-id": 0}], timeout_s=240
    )
    assert run.returncode == 0, run.log[-3000:]
    handled = run.results["handled"]
    assert len(handled) == MESSAGES
    assert _overlaps(handled) == 0, json.dumps(handled)
    assert len({h["pid"] for h in handled}) == MESSAGES  # a ClientApp process per message
