"""The lab's process control: a tree is stopped by pid, and a process already gone is left
alone (its pid may name another process by then)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from chaos_flwr.lab import processes
from chaos_flwr.lab.processes import alive, descendants, kill_process_now, stop_process_tree

_PARENT = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "time.sleep(60)\n"
)


def _tree() -> tuple[subprocess.Popen[Any], int]:
    """A parent process with one child; both sleep for a minute."""
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], start_new_session=True)
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        kids = descendants(proc.pid)
        if kids:
            return proc, kids[0]
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError("the child process did not start")


def test_a_running_tree_is_stopped_parent_and_child() -> None:
    proc, child = _tree()
    signalled = stop_process_tree(proc, grace_s=5.0)
    assert set(signalled) == {proc.pid, child}
    assert proc.returncode is not None
    deadline = time.monotonic() + 10.0
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@pytest.mark.parametrize("reaped", [True, False])
def test_a_process_that_already_exited_is_not_signalled(
    monkeypatch: pytest.MonkeyPatch, reaped: bool
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    if reaped:
        proc.wait()
    else:  # exited, a zombie until stop_process_tree polls it
        deadline = time.monotonic() + 20.0
        while alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert Path(f"/proc/{proc.pid}/stat").exists() and proc.returncode is None
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(processes.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    assert stop_process_tree(proc, grace_s=0.1) == []
    assert kill_process_now(proc) == []
    assert sent == []
    assert proc.returncode == 0


def test_a_running_tree_is_killed_at_once() -> None:
    proc, child = _tree()
    assert set(kill_process_now(proc)) == {proc.pid, child}
    assert proc.wait(timeout=10.0) == -9
    deadline = time.monotonic() + 10.0
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)
