"""Run a Flower app on the simulation engine from Python, bounded in time, cleaned up by pid.

``flwr run`` on a local simulation federation starts a detached background SuperLink (on port
39091 by default) and leaves it running. This runner starts the SuperLink itself instead, on free
loopback ports chosen per run and with a private ``FLWR_HOME``, so that ``flwr run`` finds it and
starts none of its own; when the run ends (or times out) the runner stops the SuperLink and every
process below it (SuperExec, the simulation process, Ray's workers) by process id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.launch import (
    SimulationRun,
    app_folder,
    bin_path,
    config_arg,
    flower_env,
    free_port,
    read_results,
    results_path,
    run_home,
    wait_health,
)
from chaos_flwr.lab.processes import descendants, kill_tree_now, serverapp_pids, stop_process_tree
from chaos_flwr.lab.settings import (
    FLOWER_DEMO_POLL_S,
    FLOWER_RUN_TIMEOUT_S,
    FLOWER_SUPERLINK_STARTUP_TIMEOUT_S,
)

__all__ = ["SimulationRun", "federation_options", "run_simulation_app", "usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (a cpuset narrows it; a CPU quota such
    as ``docker --cpus`` does not, and is not read here)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def federation_options(
    app_dir: Path, num_supernodes: int | None, workers: int | None = None
) -> dict[str, Any]:
    """The ``[simulation]`` table of ``app_dir/federation.toml``, with overrides.

    Parameters
    ----------
    app_dir
        The Flower app's folder.
    num_supernodes
        Virtual SuperNodes (``None``: the file's).
    workers
        ClientApp workers sharing the usable CPUs (:func:`usable_cpus`; Ray runs as many at
        once as ``client-resources-num-cpus`` fits in ``init-args-num-cpus``); ``None``: the
        file's.

    Raises
    ------
    ConfigError
        The file is not TOML, names no ``num-supernodes`` when none is given, or ``workers``
        is not 1 to the usable CPUs.
    """
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
    if workers is not None:
        cpus = usable_cpus()
        if not 1 <= workers <= cpus:
            raise ConfigError(f"workers: {workers}; give 1 to {cpus} (one CPU each at least)")
        options["client-resources-num-cpus"] = cpus // workers
        options["init-args-num-cpus"] = cpus // workers * workers
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
        bin_path("flower-superlink"),
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
        wait_health(port, proc, startup_s, log)
        yield proc.pid
    finally:
        stop_process_tree(proc)


@dataclass(frozen=True)
class _Watch:
    """How :func:`_watch` bounds one ``flwr run`` and when it kills the ServerApp."""

    link_pid: int
    deadline: float
    timeout_s: float
    home: Path
    kill_when: Callable[[], bool] | None
    poll_s: float


def _watch(proc: subprocess.Popen[Any], watch: _Watch) -> tuple[list[int], list[int]]:
    """Wait for ``proc`` within the deadline, killing the ServerApp when ``kill_when`` says so.

    Returns the pids seen and the pids killed; raises TransportError on the deadline (every
    process then stopped).
    """
    pids: list[int] = []
    killed: list[int] = []
    link_pid = watch.link_pid
    while proc.poll() is None:
        if time.monotonic() > watch.deadline:
            pids = [link_pid, *descendants(link_pid), *stop_process_tree(proc)]
            raise TransportError(
                f"timeout_s: flwr run did not finish within {watch.timeout_s:.0f} s; all "
                f"its processes were stopped (logs in {watch.home} if keep_home was set)"
            )
        if watch.kill_when is not None and not killed and watch.kill_when():
            for victim in serverapp_pids(link_pid):
                killed.extend(kill_tree_now(victim))
            if killed:
                # the SuperLink would wait for the dead run; end this run here
                pids = [link_pid, *descendants(link_pid), *killed]
                stop_process_tree(proc)
                break
        time.sleep(watch.poll_s)
    return pids, killed


def _simulation_run_cmd(
    app: Path, options: Mapping[str, object], config: Mapping[str, object]
) -> list[str]:
    return [
        bin_path("flwr"),
        "run",
        str(app),
        "--stream",
        "--federation-config",
        config_arg(options),
        "--run-config",
        config_arg(config),
    ]


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
    workers: int | None = None,
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
    workers:
        ClientApp workers run at once, sharing the CPUs (sets ``client-resources-num-cpus``
        and ``init-args-num-cpus``); ``None``: as ``federation.toml`` says.

    Returns
    -------
    SimulationRun
    """
    app = app_folder(app_dir)
    options = federation_options(app, num_supernodes, workers)
    home = run_home(keep_home)
    env = flower_env(home)
    config = dict(run_config or {})
    results = results_path(config, home)
    cmd = _simulation_run_cmd(app, options, config)
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
            watch = _Watch(link_pid, t0 + timeout_s, timeout_s, home, kill_when, poll_s)
            try:
                pids, killed = _watch(proc, watch)
            finally:
                if proc.poll() is None:
                    stop_process_tree(proc)
            wall = time.monotonic() - t0
            pids = [*pids, link_pid, *descendants(link_pid)]
        log_text = out_path.read_text("utf-8", "replace") if out_path.is_file() else ""
        code = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return SimulationRun(code, read_results(results), wall, log_text, sorted(set(pids)), killed)
    finally:
        if keep_home is None:
            shutil.rmtree(home, ignore_errors=True)
