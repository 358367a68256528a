"""What every Flower launch of the lab shares: environment, ports, flags, the run's result.

The SuperLink, SuperNode and ``flwr run`` command lines and the ``FLWR_HOME`` configuration
of a local run are built here; :mod:`chaos_flwr.lab.simulation` and
:mod:`chaos_flwr.lab.deployment` start and stop the processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.tls import TlsFiles

__all__ = [
    "FLOWER_ENV",
    "SimulationRun",
    "app_folder",
    "bin_path",
    "config_arg",
    "deployment_home",
    "deployment_run_cmd",
    "flower_env",
    "free_port",
    "in_netns",
    "read_results",
    "results_path",
    "run_home",
    "superlink_cmd",
    "supernode_cmd",
    "wait_health",
    "wait_listening",
]

#: Environment every Flower process started by chaos-flwr gets.
FLOWER_ENV: dict[str, str] = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}
#: Pause between two health probes of a starting SuperLink.
_HEALTH_POLL_S = 0.2
#: Timeout of one health probe.
_HEALTH_PROBE_TIMEOUT_S = 0.5


@dataclass
class SimulationRun:
    """What one run left behind.

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


def bin_path(name: str) -> str:
    """A console script installed beside this Python (``flwr``, ``flower-superlink``, ...)."""
    return str(Path(sys.executable).parent / name)


def app_folder(app_dir: Path | str) -> Path:
    """The Flower app's folder, resolved; :class:`ConfigError` if it has no pyproject.toml."""
    app = Path(app_dir).resolve()
    if not (app / "pyproject.toml").is_file():
        raise ConfigError(f"app_dir: {app} has no pyproject.toml; pass the Flower app's folder")
    return app


def run_home(keep_home: Path | None) -> Path:
    """``keep_home`` (created), or a new temporary ``FLWR_HOME``."""
    home = keep_home if keep_home is not None else Path(tempfile.mkdtemp(prefix="chaos-flwr-"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def results_path(config: dict[str, object], home: Path) -> Path:
    """Where the ServerApp writes its JSON: ``results-path`` of ``config``, set if missing."""
    path = Path(str(config.get("results-path") or home / "results.json"))
    config["results-path"] = str(path)
    return path


def read_results(path: Path) -> dict[str, Any]:
    """The JSON the ServerApp wrote at ``path`` (empty if it wrote none)."""
    if not path.is_file():
        return {}
    results: dict[str, Any] = json.loads(path.read_text("utf-8"))
    return results


def wait_health(port: int, proc: subprocess.Popen[Any], timeout_s: float, log: Path) -> None:
    """Wait until the SuperLink ``proc`` answers on its health port, or raise TransportError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TransportError(
                f"flower-superlink exited with code {proc.returncode} before it was ready; "
                f"see {log}"
            )
        try:
            url = f"http://127.0.0.1:{port}/health"
            with urllib.request.urlopen(url, timeout=_HEALTH_PROBE_TIMEOUT_S) as r:
                if 200 <= r.status < 300:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(_HEALTH_POLL_S)
    raise TransportError(
        f"flower-superlink did not answer on 127.0.0.1:{port}/health within {timeout_s:.0f} s; "
        f"see {log}"
    )


_PROBE = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
"""


def wait_listening(
    host: str,
    port: int,
    proc: subprocess.Popen[Any],
    timeout_s: float,
    log: Path,
    *,
    netns: str | None = None,
) -> None:
    """Wait until something accepts TCP connections on ``host``:``port`` as seen from network
    namespace ``netns`` (a probe process there, stopped by pid), while ``proc`` (the server)
    runs; :class:`TransportError` if it exits or the time runs out."""
    argv = [sys.executable, "-c", _PROBE, host, str(port), str(timeout_s)]
    probe = subprocess.Popen(in_netns(netns, argv), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while probe.poll() is None:
            if proc.poll() is not None:
                raise TransportError(
                    f"{Path(proc.args[0] if isinstance(proc.args, list) else 'server').name} "
                    f"exited with code {proc.returncode} before it listened; see {log}"
                )
            time.sleep(_HEALTH_POLL_S)
        if probe.returncode != 0:
            raise TransportError(
                f"nothing listened on {host}:{port} within {timeout_s:.0f} s; see {log}"
            )
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()


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


def config_arg(values: Mapping[str, object]) -> str:
    """``key=value`` pairs in TOML syntax, as ``--run-config``/``--node-config`` take them."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


def deployment_home(
    home: Path, port: int, *, host: str = "127.0.0.1", root_certificates: Path | None = None
) -> None:
    """Point the ``flwr`` CLI of ``home`` at the SuperLink on ``host``:``port``: over TLS
    checked against ``root_certificates`` if given, else insecure (loopback only)."""
    security = (
        "insecure = true\n"
        if root_certificates is None
        else f"root-certificates = {json.dumps(str(root_certificates))}\n"
    )
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deployment"\n\n[superlink.deployment]\n'
        f'address = "{host}:{port}"\n{security}',
        encoding="utf-8",
    )


def in_netns(netns: str | None, argv: list[str]) -> list[str]:
    """``argv`` run inside network namespace ``netns`` (``ip netns exec``; None = here).

    ``ip netns exec`` replaces itself with the command, so the pid of the process started is
    the command's own.
    """
    return argv if netns is None else ["ip", "netns", "exec", netns, *argv]


def superlink_cmd(
    port: int,
    database: Path,
    *,
    host: str = "127.0.0.1",
    tls: TlsFiles | None = None,
    supernode_auth: bool = False,
) -> list[str]:
    """A deployment-engine SuperLink on ``host``:``port``: insecure (loopback only) without
    ``tls``; with it, HTTPS only, and SuperNodes must authenticate if ``supernode_auth``."""
    security = (
        ["--insecure"]
        if tls is None
        else [
            "--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.certificate),
            "--ssl-keyfile", str(tls.key),
        ]
    )  # fmt: skip
    return [
        bin_path("flower-superlink"),
        *security,
        *(["--enable-supernode-auth"] if supernode_auth else []),
        "--host",
        host,
        "--port",
        str(port),
        "--database",
        str(database),
        "--disable-runtime-dependency-installation",
    ]


def supernode_cmd(
    superlink_port: int,
    node_config: Mapping[str, object],
    *,
    superlink_host: str = "127.0.0.1",
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
) -> list[str]:
    """A SuperNode of the SuperLink on ``superlink_host``:``superlink_port`` with
    ``node_config``: insecure without ``root_certificates``, else over TLS checked against
    them; authenticated with the private key ``auth_key`` if given."""
    security = (
        ["--insecure"] if root_certificates is None else ["--root-certificates",
                                                           str(root_certificates)]
    )  # fmt: skip
    auth = [] if auth_key is None else ["--auth-supernode-private-key", str(auth_key)]
    return [
        bin_path("flower-supernode"),
        *security,
        *auth,
        "--superlink",
        f"{superlink_host}:{superlink_port}",
        "--port",
        str(free_port()),
        "--node-config",
        config_arg(node_config),
    ]


def deployment_run_cmd(app: Path, run_config: Mapping[str, object]) -> list[str]:
    """``flwr run <app> deployment --stream`` with ``run_config``."""
    return [
        bin_path("flwr"),
        "run",
        str(app),
        "deployment",
        "--stream",
        "--run-config",
        config_arg(run_config),
    ]
