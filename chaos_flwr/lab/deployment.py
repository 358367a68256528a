"""Run a Flower app on the deployment engine on 127.0.0.1, and stop every process by pid.

:func:`run_deployment_app` runs it all at once; :class:`DeploymentCluster` lets a test start
SuperNodes while a run goes (a join), kill them (a crash) and kill the ServerApp (a restart).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.launch import (
    SimulationRun,
    app_folder,
    deployment_home,
    deployment_run_cmd,
    flower_env,
    free_port,
    read_results,
    results_path,
    run_home,
    superlink_cmd,
    supernode_cmd,
    wait_health,
)
from chaos_flwr.lab.processes import _cmdline as cmdline
from chaos_flwr.lab.processes import (
    descendants,
    kill_tree_now,
    serverapp_pids,
    stop_process_tree,
)
from chaos_flwr.lab.settings import (
    FLOWER_CLIENTAPP_SAMPLE_S,
    FLOWER_RUN_TIMEOUT_S,
    FLOWER_STOP_GRACE_S,
    FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
)

__all__ = ["DeploymentCluster", "clientapp_pids", "run_deployment_app"]

#: What a ClientApp process's command line holds (the SuperNode starts one per message).
CLIENTAPP_MARK = "flwr-clientapp"


def clientapp_pids(roots: list[int]) -> list[int]:
    """ClientApp processes below the processes ``roots`` (e.g. the SuperNodes), now."""
    return [p for r in roots for p in descendants(r) if CLIENTAPP_MARK in cmdline(p)]


def run_deployment_app(
    app_dir: Path | str,
    *,
    node_configs: list[Mapping[str, object]],
    run_config: Mapping[str, object] | None = None,
    timeout_s: float = FLOWER_RUN_TIMEOUT_S,
    startup_timeout_s: float = FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
    keep_home: Path | None = None,
    clientapps: dict[int, float] | None = None,
) -> SimulationRun:
    """Run a Flower app on the deployment engine: a SuperLink and one SuperNode per entry of
    ``node_configs``, all on 127.0.0.1 (insecure, loopback only), stopped by pid afterwards.

    When ``clientapps`` is given, the ClientApp processes below the SuperNodes are sampled
    every :data:`~chaos_flwr.lab.settings.FLOWER_CLIENTAPP_SAMPLE_S` while the run goes, and
    each one's pid is stored with the wall-clock time (``time.time``) it was first seen.

    Each SuperNode gets its entry as ``--node-config`` (e.g. ``partition-id``,
    ``num-partitions`` and the party settings ``chaos-key``/``chaos-charter``/
    ``chaos-state-dir``). Returns what
    :func:`~chaos_flwr.lab.simulation.run_simulation_app` returns.
    """
    app = app_folder(app_dir)
    if not node_configs:
        raise ConfigError("node_configs: give at least one SuperNode's node config")
    home = run_home(keep_home)
    env = flower_env(home)
    port = free_port()
    deployment_home(home, port)
    config = dict(run_config or {})
    results = results_path(config, home)
    started: list[subprocess.Popen[Any]] = []
    pids: list[int] = []
    logs = home / "logs"
    logs.mkdir(exist_ok=True)

    def spawn(cmd: list[str], log_name: str) -> subprocess.Popen[Any]:
        with (logs / log_name).open("wb") as log_file:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(proc)
        return proc

    try:
        link = spawn(superlink_cmd(port, home / "state.db"), "superlink.log")
        wait_health(port, link, startup_timeout_s, logs / "superlink.log")
        nodes = [
            spawn(supernode_cmd(port, node_config), f"supernode-{i}.log").pid
            for i, node_config in enumerate(node_configs)
        ]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            deployment_run_cmd(app, config),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        out = _wait_sampling(proc, timeout_s, nodes, clientapps)
        wall = time.monotonic() - t0
        return SimulationRun(proc.returncode, read_results(results), wall, out, pids)
    finally:
        for p in reversed(started):
            pids.extend(stop_process_tree(p))
        if keep_home is None:
            shutil.rmtree(home, ignore_errors=True)


def _wait_sampling(
    proc: subprocess.Popen[str],
    timeout_s: float,
    nodes: list[int],
    clientapps: dict[int, float] | None,
) -> str:
    """Wait for ``flwr run`` (its output), noting new ClientApp processes below ``nodes``."""
    deadline = time.monotonic() + timeout_s
    step = FLOWER_CLIENTAPP_SAMPLE_S if clientapps is not None else timeout_s
    while True:
        if clientapps is not None:
            for pid in clientapp_pids(nodes):
                clientapps.setdefault(pid, time.time())
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransportError(
                f"timeout_s: flwr run did not finish within {timeout_s:.0f} s on the deployment "
                "engine; all its processes were stopped"
            )
        try:
            out, _ = proc.communicate(timeout=min(step, left))
        except subprocess.TimeoutExpired:
            continue  # communicate() may be called again without losing output
        return out or ""


class DeploymentCluster:
    """A SuperLink and SuperNodes on 127.0.0.1 that a test drives step by step.

    Unlike :func:`run_deployment_app` (everything at once), SuperNodes can be started while a
    run goes (a join), killed with SIGKILL (a crash), and the process running a ServerApp
    (``flwr-serverapp``, started by the SuperLink per run) can be killed mid-round, after which
    a new run is started. Every process started is stopped by pid in :meth:`close` (also on
    ``with`` exit), whatever happened.

    Parameters
    ----------
    app_dir:
        The Flower app (its ``pyproject.toml``).
    home:
        ``FLWR_HOME`` and the logs folder of the cluster (kept).
    startup_timeout_s:
        How long to wait for the SuperLink to answer.
    """

    def __init__(
        self,
        app_dir: Path | str,
        home: Path,
        *,
        startup_timeout_s: float = FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
    ) -> None:
        self.app = app_folder(app_dir)
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs = self.home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = flower_env(self.home)
        self.port = free_port()
        deployment_home(self.home, self.port)
        self.started: list[subprocess.Popen[Any]] = []
        self.supernodes: dict[str, subprocess.Popen[Any]] = {}
        self.runs: list[subprocess.Popen[Any]] = []
        self.seen: set[int] = set()
        self.killed: list[int] = []
        self.link = self._spawn(superlink_cmd(self.port, self.home / "state.db"), "superlink.log")
        try:
            wait_health(self.port, self.link, startup_timeout_s, self.logs / "superlink.log")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DeploymentCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, cmd: list[str], log_name: str) -> subprocess.Popen[Any]:
        with (self.logs / log_name).open("ab") as log_file:
            proc = subprocess.Popen(
                cmd,
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(proc)
        self.seen.add(proc.pid)
        return proc

    def note_pids(self) -> None:
        """Remember every process now below the processes started (for the final check)."""
        for p in self.started:
            self.seen.update(descendants(p.pid))

    def start_supernode(self, name: str, node_config: Mapping[str, object]) -> float:
        """Start a SuperNode named ``name`` with ``node_config``; return its start time."""
        if name in self.supernodes and self.supernodes[name].poll() is None:
            raise ConfigError(f"supernode {name!r} is already running")
        t = time.time()
        self.supernodes[name] = self._spawn(
            supernode_cmd(self.port, node_config), f"supernode-{name}.log"
        )
        return t

    def kill_supernode(self, name: str) -> list[int]:
        """SIGKILL a SuperNode and its ClientApp processes at once (a crash)."""
        proc = self.supernodes[name]
        self.note_pids()
        victims = kill_tree_now(proc.pid)
        self.killed.extend(victims)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=FLOWER_STOP_GRACE_S)
        return victims

    def start_run(self, run_config: Mapping[str, object], log_name: str) -> subprocess.Popen[Any]:
        """Start ``flwr run <app> deployment`` with ``run_config`` (streams to ``log_name``)."""
        proc = self._spawn(deployment_run_cmd(self.app, run_config), log_name)
        self.runs.append(proc)
        return proc

    def kill_serverapps(self) -> list[int]:
        """SIGKILL every ``flwr-serverapp`` process below the SuperLink (the running server)."""
        self.note_pids()
        victims: list[int] = []
        for pid in serverapp_pids(self.link.pid):
            victims.extend(kill_tree_now(pid))
        self.killed.extend(victims)
        return victims

    def close(self) -> list[int]:
        """Stop every process started (runs first, SuperLink last), by pid; return them all."""
        self.note_pids()
        for p in reversed(self.started):
            self.seen.update(stop_process_tree(p))
        return sorted(self.seen)
