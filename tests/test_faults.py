"""Faults on real processes: a donor killed with SIGKILL mid transfer, a shaped link cut mid
transfer, over the grpc carrier on loopback.

The donors are real OS processes (``python -m chaos_flwr.bench.scale_out``: a GrpcCarrier
serving a replica file through a ShardServer). The joiner runs the sans-I/O PullSession over
its own GrpcCarrier. After the fault the joiner must have re-planned onto the other donors
and hold exactly the certified bytes (same SHA-256): nothing lost, nothing corrupt accepted.

Also on real processes, elsewhere:

* kill -9 of a party in the middle of writing its replica:
  ``tests/test_store.py::test_sigkill_during_put_never_leaves_a_bad_replica``;
* kill -9 of the ServerApp mid round under the Flower deployment engine:
  ``tests/test_flower_deploy.py`` (see docs/threat-model.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from chaos_flwr.errors import ChaosError
from chaos_flwr.planner import Donor, plan_transfer
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.transfer import DonorStatus, PullSession, ShardRequest
from chaos_flwr.transport.grpc_carrier import GrpcCarrier
from chaos_flwr.transport.netns import star
from chaos_flwr.transport.shaping import Shaper, load_profile

pytestmark = pytest.mark.timeout(180)

#: Donor uplinks (MB/s) and latencies: the state takes about a second to move.
PROFILE = {
    "name": "faults3",
    "parties": {
        "joiner": {"up_mb_s": 50, "down_mb_s": 100, "latency_ms": 1},
        "d1": {"up_mb_s": 3, "latency_ms": 2},
        "d2": {"up_mb_s": 2, "latency_ms": 4},
        "d3": {"up_mb_s": 2, "latency_ms": 6},
    },
}
DONORS = ["d1", "d2", "d3"]
PULL_BOUND_S = 60.0

_CAN_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    """A profile file and a ~3 MiB certified replica file shared by every donor process."""
    d = tmp_path_factory.mktemp("faults")
    profile = d / "faults3.yaml"
    profile.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
    rng = np.random.default_rng(6)
    state = TrainingState({"w": rng.standard_normal(3 * 2**18).astype(np.float32)}, round=9)
    data = state.to_bytes()
    path = d / "state.bin"
    path.write_bytes(data)
    return profile, path, data


class _Donors:
    """Donor processes, started and stopped by pid (SIGKILL if they do not leave)."""

    def __init__(self, argvs: dict[str, list[str]]) -> None:
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}
        try:
            for name, argv in argvs.items():
                self.procs[name] = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
            for name, proc in self.procs.items():
                assert proc.stdout is not None
                line = proc.stdout.readline().strip()
                assert ":" in line, f"donor {name} did not start: {line!r}"
                self.addresses[name] = line
        except BaseException:
            self.close()
            raise

    def sigkill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _argv(name: str, profile: Path, state: Path, host: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "chaos_flwr.bench.scale_out", name, str(profile), str(state)]
    return argv if host is None else [*argv, host]


async def _pull(
    carrier: GrpcCarrier,
    profile_path: Path,
    total: int,
    expected: bytes,
    *,
    fault_at: float,
    fault: Callable[[], None],
) -> tuple[bytes, dict[str, Any]]:
    """Drive a PullSession over the carrier; call ``fault`` once at ``fault_at`` of the bytes."""
    profile = load_profile(profile_path)
    donors = [
        Donor(n, float(profile.link(n).up_bps or 1e6), profile.link(n).latency_s) for n in DONORS
    ]
    plan = plan_transfer(total, donors, max_shards=64, min_shard_bytes=32 * 1024)
    raw = await carrier.request(
        DONORS[-1], f"manifest {plan.shard_bytes} {plan.num_shards}".encode(), timeout=30
    )
    manifest = Manifest.from_bytes(raw)
    loop = asyncio.get_running_loop()
    clock = loop.time
    session = PullSession(
        manifest, plan, donors, now=clock(), expected_digest=expected, min_timeout_s=0.5
    )
    tasks: dict[asyncio.Task[bytes], tuple[str, int]] = {}
    by_donor = dict.fromkeys(DONORS, 0)

    def launch(actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, ShardRequest):
                req = f"shard {a.index} {a.start} {a.end}".encode()
                task = loop.create_task(carrier.request(a.donor, req, timeout=10))
                tasks[task] = (a.donor, a.index)

    launch(session.poll(clock()))
    faulted_at: float | None = None
    deadline = clock() + PULL_BOUND_S
    while not session.done:
        assert clock() < deadline, "the pull did not finish in time"
        if tasks:
            done, _ = await asyncio.wait(
                list(tasks), timeout=0.05, return_when=asyncio.FIRST_COMPLETED
            )
        else:
            done = set()
            await asyncio.sleep(0.05)
        for task in done:
            donor, index = tasks.pop(task)
            try:
                data = task.result()
            except (TimeoutError, ChaosError, OSError):
                launch(session.on_donor_lost(donor, clock()))
                continue
            by_donor[donor] += len(data)
            launch(session.on_shard(donor, index, data, clock()))
        launch(session.tick(clock()))
        if faulted_at is None and session.progress(clock()).fraction >= fault_at:
            faulted_at = session.progress(clock()).fraction
            fault()
    for task in tasks:
        task.cancel()
    info = {
        "faulted_at": faulted_at,
        "status": {d: session.status(d) for d in DONORS},
        "by_donor": by_donor,
    }
    return bytes(session.assemble()), info


def _check(data: bytes, expected_bytes: bytes, info: dict[str, Any], victim: str) -> None:
    assert hashlib.sha256(data).digest() == hashlib.sha256(expected_bytes).digest()
    assert data == expected_bytes
    assert info["faulted_at"] is not None and 0.2 <= info["faulted_at"] < 1.0
    assert info["status"][victim] in (DonorStatus.LOST, DonorStatus.TIMED_OUT)
    others = [d for d in DONORS if d != victim]
    assert all(info["status"][d] == DonorStatus.LIVE for d in others)
    # the victim sent part of it at most; the others made up the rest (and re-sent nothing
    # that was verified twice beyond the shards in flight when the fault hit)
    assert info["by_donor"][victim] < len(expected_bytes)
    assert (
        sum(info["by_donor"][d] for d in others) >= len(expected_bytes) - info["by_donor"][victim]
    )


def test_sigkill_a_donor_mid_transfer(replica: tuple[Path, Path, bytes]) -> None:
    profile_path, state_path, expected = replica
    donors = _Donors({n: _argv(n, profile_path, state_path) for n in DONORS})
    victim = "d1"  # the fastest: it holds the largest share of the plan

    async def run() -> tuple[bytes, dict[str, Any]]:
        carrier = GrpcCarrier("joiner", shaper=Shaper(load_profile(profile_path), "joiner"))

        async def refuse(src: str, data: bytes) -> bytes:
            raise ValueError("the joiner serves nothing")

        await carrier.start(refuse)
        for n in DONORS:
            carrier.add_peer(n, donors.addresses[n])
        try:
            return await _pull(
                carrier,
                profile_path,
                len(expected),
                hashlib.sha256(expected).digest(),
                fault_at=0.3,
                fault=lambda: donors.sigkill(victim),
            )
        finally:
            await carrier.close()

    try:
        data, info = asyncio.run(asyncio.wait_for(run(), PULL_BOUND_S + 30))
        assert donors.procs[victim].wait(timeout=10) == -signal.SIGKILL
    finally:
        donors.close()
    _check(data, expected, info, victim)
    for n in DONORS:
        assert donors.procs[n].poll() is not None  # every donor process is gone


@pytest.mark.skipif(not _CAN_NETNS, reason="link cuts need root and iproute2 (ip, tc)")
def test_cut_a_shaped_kernel_link_mid_transfer(replica: tuple[Path, Path, bytes]) -> None:
    """Donors in their own namespaces behind tbf-shaped veths; one veth goes down mid pull."""
    profile_path, state_path, expected = replica
    rates = {"d1": 24_000_000, "d2": 16_000_000, "d3": 16_000_000}  # bit/s
    victim = "d1"
    with star(rates) as topo:
        argvs = {
            n: topo.exec_argv(n, _argv(n, profile_path, state_path, topo.addresses[n]))
            for n in DONORS
        }
        donors = _Donors(argvs)

        def cut() -> None:
            subprocess.run(
                ["ip", "-n", topo.namespaces[victim], "link", "set", "dev",
                 topo.devices[victim], "down"],
                check=True,
                timeout=10,
            )  # fmt: skip

        async def run() -> tuple[bytes, dict[str, Any]]:
            carrier = GrpcCarrier("joiner")

            async def refuse(src: str, data: bytes) -> bytes:
                raise ValueError("the joiner serves nothing")

            await carrier.start(refuse)
            for n in DONORS:
                carrier.add_peer(n, donors.addresses[n])
            try:
                return await _pull(
                    carrier,
                    profile_path,
                    len(expected),
                    hashlib.sha256(expected).digest(),
                    fault_at=0.3,
                    fault=cut,
                )
            finally:
                await carrier.close()

        try:
            t0 = time.monotonic()
            data, info = asyncio.run(asyncio.wait_for(run(), PULL_BOUND_S + 30))
            elapsed = time.monotonic() - t0
            # a cut link is not a crash: the donor process is still running
            assert donors.procs[victim].poll() is None
        finally:
            donors.close()
    _check(data, expected, info, victim)
    assert elapsed < PULL_BOUND_S
