"""Find and stop processes by pid: the process tree below a pid, read from ``/proc``.

Every Flower process the lab starts is stopped by pid (never by name), including those
re-parented to init when their parent died.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from chaos_flwr.lab.settings import FLOWER_STOP_GRACE_S

__all__ = [
    "alive",
    "descendants",
    "kill_process_now",
    "kill_tree_now",
    "serverapp_pids",
    "stop_process_tree",
]


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


def kill_process_now(proc: subprocess.Popen[Any]) -> list[int]:
    """:func:`kill_tree_now` for a process this program started, unless it has already
    exited: once reaped, its pid may belong to another process. Returns the pids signalled."""
    if proc.poll() is not None:
        return []
    return kill_tree_now(proc.pid)


def serverapp_pids(root: int) -> list[int]:
    """Processes below ``root`` that run a ServerApp: ``flwr-simulation`` (the simulation
    engine, which also hosts the virtual SuperNodes) or ``flwr-serverapp`` (deployment)."""
    out = []
    for pid in descendants(root):
        cmd = _cmdline(pid)
        if "flwr-simulation" in cmd or "flwr-serverapp" in cmd:
            out.append(pid)
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
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
    still found. A process that has already exited is not signalled at all: once reaped, its
    pid may belong to another process by now, and its children were re-parented away.
    """
    if proc.poll() is not None:
        return []
    seen = [proc.pid, *descendants(proc.pid)]
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in seen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    for pid in seen:
        if alive(pid):
            for child in descendants(pid):
                if child not in seen:
                    seen.append(child)
    for pid in seen:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    return seen
