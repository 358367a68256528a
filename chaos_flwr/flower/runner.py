"""Launch Flower runs from Python, bounded in time, and stop every process they started.

``flwr run`` on a local simulation federation starts a detached background SuperLink (on port
39091 by default) and leaves it running. This runner starts the SuperLink itself instead, on free
loopback ports chosen per run and with a private ``FLWR_HOME``, so that ``flwr run`` finds it and
starts none of its own; when the run ends (or times out) the runner stops the SuperLink and every
process below it (SuperExec, the simulation process, Ray's workers) by process id.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr.defaults import (
    FLOWER_DEMO_POLL_S,
    FLOWER_RUN_TIMEOUT_S,
    FLOWER_STOP_GRACE_S,
    FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
)
from chaos_flwr.errors import ConfigError, TransportError

__all__ = [
    "FLOWER_ENV",
    "DeploymentCluster",
    "SimulationRun",
    "descendants",
    "flower_env",
    "free_port",
    "kill_tree_now",
    "run_deployment_app",
    "run_simulation_app",
    "serverapp_pids",
    "stop_process_tree",
]

#: Environment every Flower process started by chaos-flwr gets.
FLOWER_ENV: dict[str, str] = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}


@dataclass
class SimulationRun:
    """What one simulation run left behind.

    Attributes
    ----------
    returncode:
        Exit code of ``flwr run`` (0 on success).
    results:
        The JSON the example's ServerApp wrote to ``results-path`` (empty if none).
    wall_s:
        Wall time of ``flwr run``, SuperLink start excluded.
    log:
        Combined stdout/stderr of ``flwr run --stream``.
    pids:
        Every process id the runner saw under its SuperLink (all stopped on return).
    killed:
        Process ids the runner killed with SIGKILL because ``kill_when`` said so (the
        simulation process running the ServerApp, and everything below it); empty otherwise.
    """

    returncode: int
    results: dict[str, Any]
    wall_s: float
    log: str
    pids: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a Flower process: quiet, offline, with its own ``FLWR_HOME``."""
    env = dict(os.environ)
    env.update(FLOWER_ENV)
    env["FLWR_HOME"] = str(flwr_home)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    if extra:
        env.update(extra)
    return env


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces; fields after the last ')' are fixed
        fields = stat[stat.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children = _children_map()
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace")


def kill_tree_now(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every process below it at once (a crash, not a shutdown).

    The descendants are collected before the first signal, so none escapes by being
    re-parented. Returns the pids signalled.
    """
    victims = [pid, *descendants(pid)]
    for p in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return victims


def serverapp_pids(root: int) -> list[int]:
    """Processes below ``root`` that run a ServerApp: ``flwr-simulation`` (the simulation
    engine, which also hosts the virtual SuperNodes) or ``flwr-serverapp`` (deployment)."""
    out = []
    for pid in descendants(root):
        cmd = _cmdline(pid)
        if "flwr-simulation" in cmd or "flwr-serverapp" in cmd:
            out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] != "Z"


def stop_process_tree(
    proc: subprocess.Popen[Any], grace_s: float = FLOWER_STOP_GRACE_S
) -> list[int]:
    """Stop ``proc`` and all its descendants by pid: SIGTERM, then SIGKILL after ``grace_s``.

    Returns the pids that were signalled. Descendants are collected before the first signal
    (and again before SIGKILL), so processes re-parented to init on their parent's death are
    still found.
    """
    seen = [proc.pid, *descendants(proc.pid)]
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in seen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    for pid in seen:
        if _alive(pid):
            for child in descendants(pid):
                if child not in seen:
                    seen.append(child)
    for pid in seen:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    return seen


def _wait_health(port: int, proc: subprocess.Popen[Any], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TransportError(
                f"flower-superlink exited with code {proc.returncode} before it was ready; "
                f"see {log}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
                if 200 <= r.status < 300:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TransportError(
        f"flower-superlink did not answer on 127.0.0.1:{port}/health within {timeout_s:.0f} s; "
        f"see {log}"
    )


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise ConfigError(
        f"run_config values must be bool, int, float or str, got {type(value).__name__} {value!r}"
    )


def _federation_options(app_dir: Path, num_supernodes: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    fed_file = app_dir / "federation.toml"
    if fed_file.exists():
        try:
            options.update(tomllib.loads(fed_file.read_text("utf-8")).get("simulation", {}))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{fed_file} is not valid TOML: {exc}") from exc
    if num_supernodes is not None:
        options["num-supernodes"] = num_supernodes
    if "num-supernodes" not in options:
        raise ConfigError(
            f"num_supernodes: not given and {fed_file} has no [simulation] num-supernodes"
        )
    return options


@contextlib.contextmanager
def _local_superlink(flwr_home: Path, env: dict[str, str], startup_s: float) -> Iterator[int]:
    port, control = free_port(), free_port()
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(port)
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control)
    (flwr_home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n',
        encoding="utf-8",
    )
    runtime = flwr_home / "local-superlink"
    runtime.mkdir(parents=True, exist_ok=True)
    log = runtime / "superlink.log"
    cmd = [
        str(Path(sys.executable).parent / "flower-superlink"),
        "--insecure",
        "--simulation",
        "--isolation",
        "subprocess",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--control-api-address",
        f"127.0.0.1:{control}",
        "--log-file",
        str(log),
        "--database",
        str(runtime / "state.db"),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_health(port, proc, startup_s, log)
        yield proc.pid
    finally:
        stop_process_tree(proc)


def run_simulation_app(
    app_dir: Path | str,
    *,
    run_config: Mapping[str, object] | None = None,
    num_supernodes: int | None = None,
    timeout_s: float = FLOWER_RUN_TIMEOUT_S,
    startup_timeout_s: float = FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
    keep_home: Path | None = None,
    kill_when: Callable[[], bool] | None = None,
    poll_s: float = FLOWER_DEMO_POLL_S,
) -> SimulationRun:
    """Run a Flower app with ``flwr run`` on the simulation engine, bounded and cleaned up.

    Parameters
    ----------
    app_dir:
        Directory holding the app's ``pyproject.toml`` (and optionally ``federation.toml``
        with a ``[simulation]`` table of ``--federation-config`` keys).
    run_config:
        Overrides of ``[tool.flwr.app.config]``. ``results-path`` is set by the runner unless
        given, and the JSON the ServerApp writes there is returned.
    num_supernodes:
        Virtual SuperNodes; overrides ``federation.toml``.
    timeout_s:
        Wall-time bound of ``flwr run``; on expiry every process is stopped and
        :class:`~chaos_flwr.errors.TransportError` is raised.
    startup_timeout_s:
        How long to wait for the SuperLink to be ready.
    keep_home:
        Use this directory as ``FLWR_HOME`` and keep it (logs); default: a temporary one,
        removed afterwards.
    kill_when:
        Called every ``poll_s`` while the run goes; when it returns True the process running
        the ServerApp (``flwr-simulation``, with the virtual SuperNodes and Ray below it) is
        killed with SIGKILL at once, as a crash would, and the rest is then stopped.
        :attr:`SimulationRun.killed` lists what was killed.
    poll_s:
        Pause between two ``kill_when`` calls.

    Returns
    -------
    SimulationRun
    """
    app = Path(app_dir).resolve()
    if not (app / "pyproject.toml").is_file():
        raise ConfigError(f"app_dir: {app} has no pyproject.toml; pass the Flower app's folder")
    options = _federation_options(app, num_supernodes)
    home = keep_home if keep_home is not None else Path(tempfile.mkdtemp(prefix="chaos-flwr-"))
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    config = dict(run_config or {})
    results_path = Path(str(config.get("results-path") or home / "results.json"))
    config["results-path"] = str(results_path)
    cmd = [
        str(Path(sys.executable).parent / "flwr"),
        "run",
        str(app),
        "--stream",
        "--federation-config",
        " ".join(f"{k}={_toml_value(v)}" for k, v in options.items()),
        "--run-config",
        " ".join(f"{k}={_toml_value(v)}" for k, v in config.items()),
    ]
    pids: list[int] = []
    killed: list[int] = []
    out_path = home / "flwr-run.log"
    try:
        with _local_superlink(home, env, startup_timeout_s) as link_pid:
            t0 = time.monotonic()
            with out_path.open("wb") as out_file:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            try:
                deadline = t0 + timeout_s
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        pids = [link_pid, *descendants(link_pid), *stop_process_tree(proc)]
                        raise TransportError(
                            f"timeout_s: flwr run did not finish within {timeout_s:.0f} s; all "
                            f"its processes were stopped (logs in {home} if keep_home was set)"
                        )
                    if kill_when is not None and not killed and kill_when():
                        for victim in serverapp_pids(link_pid):
                            killed.extend(kill_tree_now(victim))
                        if killed:
                            # the SuperLink would wait for the dead run; end this run here
                            pids = [link_pid, *descendants(link_pid), *killed]
                            stop_process_tree(proc)
                            break
                    time.sleep(poll_s)
            finally:
                if proc.poll() is None:
                    stop_process_tree(proc)
            wall = time.monotonic() - t0
            pids = [*pids, link_pid, *descendants(link_pid)]
        results: dict[str, Any] = {}
        if results_path.is_file():
            results = json.loads(results_path.read_text("utf-8"))
        log_text = out_path.read_text("utf-8", "replace") if out_path.is_file() else ""
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return SimulationRun(code, results, wall, log_text, sorted(set(pids)), killed)
    finally:
        if keep_home is None:
            shutil.rmtree(home, ignore_errors=True)


def _node_config(values: Mapping[str, object]) -> str:
    return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


def run_deployment_app(
    app_dir: Path | str,
    *,
    node_configs: list[Mapping[str, object]],
    run_config: Mapping[str, object] | None = None,
    timeout_s: float = FLOWER_RUN_TIMEOUT_S,
    startup_timeout_s: float = FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
    keep_home: Path | None = None,
) -> SimulationRun:
    """Run a Flower app on the deployment engine: a SuperLink and one SuperNode per entry of
    ``node_configs``, all on 127.0.0.1 (insecure, loopback only), stopped by pid afterwards.

    Each SuperNode gets its entry as ``--node-config`` (e.g. ``partition-id``,
    ``num-partitions`` and the party settings ``chaos-key``/``chaos-charter``/
    ``chaos-state-dir``). Returns what :func:`run_simulation_app` returns.
    """
    app = Path(app_dir).resolve()
    if not (app / "pyproject.toml").is_file():
        raise ConfigError(f"app_dir: {app} has no pyproject.toml; pass the Flower app's folder")
    if not node_configs:
        raise ConfigError("node_configs: give at least one SuperNode's node config")
    home = keep_home if keep_home is not None else Path(tempfile.mkdtemp(prefix="chaos-flwr-"))
    home.mkdir(parents=True, exist_ok=True)
    env = flower_env(home)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n',
        encoding="utf-8",
    )
    config = dict(run_config or {})
    results_path = Path(str(config.get("results-path") or home / "results.json"))
    config["results-path"] = str(results_path)
    bin_dir = Path(sys.executable).parent
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
        link = spawn(
            [
                str(bin_dir / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--database",
                str(home / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
            "superlink.log",
        )
        _wait_health(port, link, startup_timeout_s, logs / "superlink.log")
        for i, node_config in enumerate(node_configs):
            spawn(
                [
                    str(bin_dir / "flower-supernode"),
                    "--insecure",
                    "--superlink",
                    f"127.0.0.1:{port}",
                    "--port",
                    str(free_port()),
                    "--node-config",
                    _node_config(node_config),
                ],
                f"supernode-{i}.log",
            )
        cmd = [
            str(bin_dir / "flwr"),
            "run",
            str(app),
            "deployment",
            "--stream",
            "--run-config",
            " ".join(f"{k}={_toml_value(v)}" for k, v in config.items()),
        ]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        started.append(proc)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TransportError(
                f"timeout_s: flwr run did not finish within {timeout_s:.0f} s on the deployment "
                "engine; all its processes were stopped"
            ) from None
        wall = time.monotonic() - t0
        results: dict[str, Any] = {}
        if results_path.is_file():
            results = json.loads(results_path.read_text("utf-8"))
        return SimulationRun(proc.returncode, results, wall, out, pids)
    finally:
        for p in reversed(started):
            pids.extend(stop_process_tree(p))
        if keep_home is None:
            shutil.rmtree(home, ignore_errors=True)


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
        self.app = Path(app_dir).resolve()
        if not (self.app / "pyproject.toml").is_file():
            raise ConfigError(
                f"app_dir: {self.app} has no pyproject.toml; pass the Flower app's folder"
            )
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs = self.home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.env = flower_env(self.home)
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n',
            encoding="utf-8",
        )
        self.bin = Path(sys.executable).parent
        self.started: list[subprocess.Popen[Any]] = []
        self.supernodes: dict[str, subprocess.Popen[Any]] = {}
        self.runs: list[subprocess.Popen[Any]] = []
        self.seen: set[int] = set()
        self.killed: list[int] = []
        self.link = self._spawn(
            [
                str(self.bin / "flower-superlink"),
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--database",
                str(self.home / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
            "superlink.log",
        )
        try:
            _wait_health(self.port, self.link, startup_timeout_s, self.logs / "superlink.log")
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
            [
                str(self.bin / "flower-supernode"),
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(free_port()),
                "--node-config",
                _node_config(node_config),
            ],
            f"supernode-{name}.log",
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
        proc = self._spawn(
            [
                str(self.bin / "flwr"),
                "run",
                str(self.app),
                "deployment",
                "--stream",
                "--run-config",
                " ".join(f"{k}={_toml_value(v)}" for k, v in run_config.items()),
            ],
            log_name,
        )
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
