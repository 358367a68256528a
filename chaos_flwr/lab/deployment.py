"""Run a Flower app on the deployment engine on 127.0.0.1, and stop every process by pid.

:func:`run_deployment_app` runs it all at once; :class:`DeploymentCluster` lets a test start
SuperNodes while a run goes (a join), kill them (a crash) and kill the ServerApp (a restart).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.launch import (
    SimulationRun,
    app_folder,
    bin_path,
    deployment_home,
    deployment_run_cmd,
    flower_env,
    free_port,
    in_netns,
    read_results,
    results_path,
    run_home,
    superlink_cmd,
    supernode_cmd,
    wait_health,
    wait_listening,
)
from chaos_flwr.lab.processes import _cmdline as cmdline
from chaos_flwr.lab.processes import (
    descendants,
    kill_process_now,
    kill_tree_now,
    serverapp_pids,
    stop_process_tree,
)
from chaos_flwr.lab.settings import (
    FLOWER_CLI_TIMEOUT_S,
    FLOWER_CLIENTAPP_SAMPLE_S,
    FLOWER_RUN_TIMEOUT_S,
    FLOWER_STOP_GRACE_S,
    FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
)
from chaos_flwr.lab.tls import TlsFiles

__all__ = ["ClusterSite", "DeploymentCluster", "clientapp_pids", "run_deployment_app"]

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
    daemons: bool = False,
) -> SimulationRun:
    """Run a Flower app on the deployment engine: a SuperLink and one SuperNode per entry of
    ``node_configs``, all on 127.0.0.1 (insecure, loopback only), stopped by pid afterwards.

    With ``daemons``, every signed SuperNode (a ``chaos-key`` in its entry) gets its party
    daemon (``chaos-flwr party``, log ``party-<i>.log``) on a free loopback port, started
    before it and named in its ``chaos-direct-addr``; it stops with the rest (SIGTERM: its
    totals end its log).

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
        if daemons:
            node_configs = [
                _with_daemon(node_config, i, spawn, logs)
                for i, node_config in enumerate(node_configs)
            ]
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


#: Longest wait for a party daemon to listen, in seconds.
DEPLOYMENT_DAEMON_START_S: float = 30.0


def _with_daemon(
    node_config: Mapping[str, object],
    index: int,
    spawn: Callable[[list[str], str], subprocess.Popen[Any]],
    logs: Path,
) -> Mapping[str, object]:
    """Start the party daemon of a signed SuperNode; its node config naming the daemon."""
    if "chaos-key" not in node_config:
        return node_config
    address = f"127.0.0.1:{free_port()}"
    cmd = [
        sys.executable, "-m", "chaos_flwr.cli", "party", "--key", str(node_config["chaos-key"]),
        "--charter", str(node_config["chaos-charter"]),
        "--state-dir", str(node_config["chaos-state-dir"]), "--listen", address,
    ]  # fmt: skip
    proc = spawn(cmd, f"party-{index}.log")
    log = logs / f"party-{index}.log"
    deadline = time.monotonic() + DEPLOYMENT_DAEMON_START_S
    while time.monotonic() < deadline and proc.poll() is None:
        if f"serving {address} " in log.read_text("utf-8", "replace"):
            return {**node_config, "chaos-direct-addr": address}
        time.sleep(0.1)
    raise TransportError(f"party daemon {index} did not start; see {log}")


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


@dataclass(frozen=True)
class ClusterSite:
    """Where a :class:`DeploymentCluster`'s SuperLink runs and how it is reached.

    Attributes
    ----------
    host:
        The address it binds to and is reached at (``127.0.0.1`` by default).
    netns:
        The network namespace it runs in (``None`` = this one); ``flwr`` CLI commands (runs,
        SuperNode registrations) run there too.
    tls:
        Its CA, certificate and key (``None`` = insecure, for loopback only).
    supernode_auth:
        Whether SuperNodes must authenticate with a registered key (needs ``tls``).
    """

    host: str = "127.0.0.1"
    netns: str | None = None
    tls: TlsFiles | None = None
    supernode_auth: bool = False


class DeploymentCluster:
    """A SuperLink and SuperNodes that a test drives step by step.

    Unlike :func:`run_deployment_app` (everything at once), SuperNodes can be started while a
    run goes (a join), killed with SIGKILL (a crash), and the process running a ServerApp
    (``flwr-serverapp``, started by the SuperLink per run) can be killed mid-round, after which
    a new run is started. Every process started is stopped by pid in :meth:`close` (also on
    ``with`` exit), whatever happened. By default everything runs insecure on 127.0.0.1; a
    ``site`` puts the SuperLink at another address, in a network namespace, with TLS and
    SuperNode authentication, and each SuperNode may run in a namespace of its own.

    Parameters
    ----------
    app_dir:
        The Flower app (its ``pyproject.toml``).
    home:
        ``FLWR_HOME`` and the logs folder of the cluster (kept).
    startup_timeout_s:
        How long to wait for the SuperLink to answer.
    site:
        Where the SuperLink runs and how it is reached (default: insecure on 127.0.0.1).
    """

    def __init__(
        self,
        app_dir: Path | str,
        home: Path,
        *,
        startup_timeout_s: float = FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
        site: ClusterSite | None = None,
    ) -> None:
        self.app = app_folder(app_dir)
        self.site = site or ClusterSite()
        if self.site.supernode_auth and self.site.tls is None:
            raise ConfigError("site: SuperNode authentication needs TLS (give site.tls)")
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs = self.home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = flower_env(self.home)
        self.port = free_port()
        ca = self.site.tls.ca if self.site.tls is not None else None
        deployment_home(self.home, self.port, host=self.site.host, root_certificates=ca)
        self.started: list[subprocess.Popen[Any]] = []
        self.supernodes: dict[str, subprocess.Popen[Any]] = {}
        self.runs: list[subprocess.Popen[Any]] = []
        self.seen: set[int] = set()
        self.killed: list[int] = []
        self.startup_timeout_s = startup_timeout_s
        self.link_cmd = superlink_cmd(
            self.port, self.home / "state.db", host=self.site.host, tls=self.site.tls,
            supernode_auth=self.site.supernode_auth,
        )  # fmt: skip
        self.link = self.spawn(self.link_cmd, "superlink.log", self.site.netns)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        log = self.logs / "superlink.log"
        if self.site == ClusterSite():
            wait_health(self.port, self.link, timeout_s, log)
        else:  # /health is HTTPS-only with TLS, and reachable only inside the namespace
            wait_listening(self.site.host, self.port, self.link, timeout_s, log,
                           netns=self.site.netns)  # fmt: skip

    def __enter__(self) -> DeploymentCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(
        self, cmd: list[str], log_name: str, netns: str | None = None
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` (in namespace ``netns``) logging to ``log_name``; it is stopped, by
        pid, with the cluster."""
        with (self.logs / log_name).open("ab") as log_file:
            proc = subprocess.Popen(
                in_netns(netns, cmd),
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started.append(proc)
        self.seen.add(proc.pid)
        return proc

    def register_supernode(self, public_key: Path) -> None:
        """``flwr supernode register <public_key>`` at the SuperLink (SuperNode authentication:
        only registered keys may connect); :class:`TransportError` if it fails."""
        argv = in_netns(self.site.netns, [bin_path("flwr"), "supernode", "register",
                                          str(public_key), "deployment"])  # fmt: skip
        try:
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                                  timeout=FLOWER_CLI_TIMEOUT_S, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise TransportError(f"flwr supernode register {public_key}: timed out") from None
        if done.returncode != 0:
            raise TransportError(
                f"flwr supernode register {public_key} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr)[-1000:]}"
            )

    def note_pids(self) -> None:
        """Remember every process now below the processes started (for the final check)."""
        for p in self.started:
            self.seen.update(descendants(p.pid))

    def start_supernode(
        self,
        name: str,
        node_config: Mapping[str, object],
        *,
        netns: str | None = None,
        auth_key: Path | None = None,
    ) -> float:
        """Start a SuperNode named ``name`` with ``node_config`` (in namespace ``netns``,
        authenticated with the private key ``auth_key``); return its start time."""
        if name in self.supernodes and self.supernodes[name].poll() is None:
            raise ConfigError(f"supernode {name!r} is already running")
        tls = self.site.tls
        cmd = supernode_cmd(
            self.port, node_config, superlink_host=self.site.host,
            root_certificates=tls.ca if tls is not None else None, auth_key=auth_key,
        )  # fmt: skip
        t = time.time()
        self.supernodes[name] = self.spawn(cmd, f"supernode-{name}.log", netns)
        return t

    def kill_supernode(self, name: str) -> list[int]:
        """SIGKILL a SuperNode and its ClientApp processes at once (a crash)."""
        return self.kill(self.supernodes[name])

    def kill(self, proc: subprocess.Popen[Any]) -> list[int]:
        """SIGKILL a process this cluster started, with every process below it (a crash);
        return the pids signalled."""
        self.note_pids()
        victims = kill_process_now(proc)
        self.killed.extend(victims)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=FLOWER_STOP_GRACE_S)
        return victims

    def start_run(self, run_config: Mapping[str, object], log_name: str) -> subprocess.Popen[Any]:
        """Start ``flwr run <app> deployment`` with ``run_config`` (streams to ``log_name``)."""
        proc = self.spawn(deployment_run_cmd(self.app, run_config), log_name, self.site.netns)
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

    def restart_superlink(self, *, lose_disk: bool = False) -> float:
        """SIGKILL the SuperLink with its ServerApps, start it again on the same port; return
        the time it was killed.

        With ``lose_disk`` its host's disk is lost first: every file of ``home`` (its state
        database, ``FLWR_HOME``, anything a ServerApp saved there) but the logs is deleted and
        the ``flwr`` CLI's connection is written anew. SuperNode keys must then be registered
        again (:meth:`register_supernode`).
        """
        self.note_pids()
        t = time.time()
        self.killed.extend(kill_process_now(self.link))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.link.wait(timeout=FLOWER_STOP_GRACE_S)
        if lose_disk:
            for entry in self.home.iterdir():
                if entry == self.logs:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            ca = self.site.tls.ca if self.site.tls is not None else None
            deployment_home(self.home, self.port, host=self.site.host, root_certificates=ca)
        self.link = self.spawn(self.link_cmd, "superlink.log", self.site.netns)
        self._wait_ready(self.startup_timeout_s)
        return t

    def close(self) -> list[int]:
        """Stop every process started (runs first, SuperLink last), by pid; return them all."""
        self.note_pids()
        for p in reversed(self.started):
            self.seen.update(stop_process_tree(p))
        return sorted(self.seen)
