"""The README's deployment commands, run as written: TLS, SuperNode authentication, two rounds.

The fenced block after the ``deploy-test`` marker in README.md is split into shell steps (a line
ending in ``\\`` continues, a here-document runs to its terminator). A step ending in ``&`` is a
server: it is started in its own session and stopped by pid at the end; every other step must
exit 0. Only the ports change (free ports on 127.0.0.1 for the README's 8000, 9094 and 9095).
After the run, the SuperLink is checked to speak only TLS with the README's CA, and a SuperNode
with a key nobody registered is checked to be refused.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from chaos_flwr.lab.launch import flower_env, free_port
from chaos_flwr.lab.processes import alive, descendants, stop_process_tree

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- deploy-test:"
#: The README's ports, each replaced by a free one.
README_PORTS = ("8000", "9094", "9095")
#: How long a server started by a step has to listen on its port.
LISTEN_TIMEOUT_S = 60.0
#: Bound of one foreground step (the last one is the whole run).
STEP_TIMEOUT_S = 330.0
ROUNDS = 2
#: Bound of the SuperNode with an unregistered key (it gives up after one retry).
UNREGISTERED_TIMEOUT_S = 90.0


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def readme_deploy_block(text: str) -> str:
    """The fenced block right after the ``deploy-test`` marker."""
    start = text.index(MARKER)
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert match, "no ```bash block after the deploy-test marker"
    return match.group(1)


def shell_steps(block: str) -> list[str]:
    """Split a shell block into steps: continuations joined, here-documents kept whole."""
    steps: list[str] = []
    lines = iter(block.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        step = line
        while step.endswith("\\"):
            step = step[:-1] + " " + next(lines).strip()
        heredoc = re.search(r"<<\s*'?(\w+)'?", step)
        if heredoc:
            body = []
            for inner in lines:
                body.append(inner)
                if inner == heredoc.group(1):
                    break
            step = "\n".join([step, *body])
        steps.append(step)
    return steps


def _wait_listening(port: int, proc: subprocess.Popen[Any], log: Path) -> None:
    deadline = time.monotonic() + LISTEN_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}:\n{log.read_text()[-3000:]}")


def _run_steps(steps: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[Any], str]:
    """Run the steps in ``cwd``; return the servers started and the last step's output."""
    servers: list[subprocess.Popen[Any]] = []
    out = ""
    try:
        for i, step in enumerate(steps):
            if step.endswith("&"):
                log = cwd / f"server-{i}.log"
                with log.open("wb") as f:
                    proc = subprocess.Popen(
                        ["bash", "-c", "exec " + step[:-1]],
                        cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                servers.append(proc)
                _wait_listening(int(re.findall(r"--port (\d+)", step)[-1]), proc, log)
                continue
            done = subprocess.run(
                ["bash", "-c", "set -e\n" + step],
                cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
            )  # fmt: skip
            out = done.stdout + done.stderr
            assert done.returncode == 0, f"step {step!r} failed:\n{out[-4000:]}"
    except BaseException:
        _stop(servers)
        raise
    return servers, out


def _stop(servers: list[subprocess.Popen[Any]]) -> list[int]:
    pids: list[int] = []
    for proc in reversed(servers):
        pids.extend(stop_process_tree(proc))
    return pids


def _tls_checks(port: int, ca: Path) -> None:
    """The SuperLink speaks TLS with a certificate the README's CA signed, and no plain HTTP."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        assert tls.version() is not None
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()


def _unregistered_node_is_refused(cwd: Path, port: int, env: dict[str, str]) -> None:
    """A SuperNode whose key nobody registered cannot join (SuperNode authentication is on)."""
    make = [sys.executable, "examples/multi_institution/make_certs.py", "--out", "eve"]
    subprocess.run([*make, "--supernode", "eve"], cwd=cwd, env=env, check=True, timeout=60)
    log = cwd / "eve.log"
    with log.open("wb") as f:  # a file, not a pipe: a child it leaves must not hold us up
        node = subprocess.Popen(
            [
                "flower-supernode", "--superlink", f"127.0.0.1:{port}",
                "--root-certificates", "certs/ca.crt", "--auth-supernode-private-key",
                "eve/eve-auth", "--port", str(free_port()), "--max-retries", "1",
                "--max-wait-time", "10",
            ],
            cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        returncode = node.wait(timeout=UNREGISTERED_TIMEOUT_S)
    finally:
        stop_process_tree(node)
    text = log.read_text("utf-8", "replace")
    assert returncode != 0, text[-2000:]
    assert "Failed to activate SuperNode" in text, text[-2000:]


def test_readme_steps_parse() -> None:
    steps = shell_steps(readme_deploy_block((ROOT / "README.md").read_text("utf-8")))
    servers = [s for s in steps if s.endswith("&")]
    assert len(servers) == 3 and "flower-superlink" in servers[0]
    assert all("--insecure" not in s for s in steps)
    assert "--ssl-certfile" in servers[0] and "--enable-supernode-auth" in servers[0]
    assert all("--root-certificates" in s and "--auth-supernode-private-key" in s
               for s in servers[1:])  # fmt: skip
    assert any("<<EOF" in s and s.endswith("\nEOF") for s in steps)
    assert steps[-1].startswith("flwr run examples/multi_institution")


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_readme_deployment_runs_with_tls_and_supernode_auth(
    tmp_path: Path, flower_env: Path
) -> None:
    block = readme_deploy_block((ROOT / "README.md").read_text("utf-8"))
    ports = {p: str(free_port()) for p in README_PORTS}
    block = re.sub(r"\b(8000|9094|9095)\b", lambda m: ports[m.group(1)], block)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    before = set(descendants(os.getpid()))
    t0 = time.monotonic()
    env = flower_env_of(flower_env)
    servers, out = _run_steps(shell_steps(block), tmp_path, env)
    try:
        wall = time.monotonic() - t0
        print(f"README deployment: {wall:.0f} s for {ROUNDS} rounds")  # pytest -s
        _tls_checks(int(ports["8000"]), tmp_path / "certs" / "ca.crt")
        _unregistered_node_is_refused(tmp_path, int(ports["8000"]), env)
        assert f"[ROUND {ROUNDS}/{ROUNDS}]" in out, out[-4000:]
        assert out.count("aggregate_train: Received 2 results and 0 failures") == ROUNDS, out
        assert "skipping training" not in out
        for party in ("alice", "bob"):  # each party holds the last certified round
            replicas = sorted((tmp_path / "state" / party / "replicas").iterdir())
            assert replicas and replicas[-1].name == f"round-{ROUNDS:012d}.replica", replicas
    finally:
        pids = _stop(servers)
    assert [p for p in pids if alive(p)] == []
    assert [p for p in descendants(os.getpid()) if p not in before and alive(p)] == []


def flower_env_of(home: Path) -> dict[str, str]:
    """The environment of every step: Flower offline, FLWR_HOME private, the venv's bin first."""
    home.mkdir(parents=True, exist_ok=True)
    return flower_env(home)
