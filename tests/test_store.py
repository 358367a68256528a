"""Replica store: atomic writes, verified loads, pruning, range serving, crash safety."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from chaos_flwr import store as store_mod
from chaos_flwr.errors import StoreError
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.store import ReplicaStore
from chaos_flwr.transfer import ShardServer


def _state(round_: int, n: int = 5000) -> TrainingState:
    rng = np.random.default_rng(round_)
    return TrainingState(
        {"w": rng.standard_normal(n).astype(np.float32), "b": np.arange(7, dtype=">i8")},
        round=round_,
        strategy_state=b"strategy-%d" % round_,
        meta={"round": round_},
    )


def test_put_get_latest_rounds_and_pruning(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "replicas", keep_rounds=3)
    assert store.latest() is None and store.rounds() == []
    for r in (1, 2, 5, 7, 9):
        store.put(_state(r), certificate=b"cert-%d" % r)
    assert store.rounds() == [5, 7, 9]
    latest = store.latest()
    assert latest is not None and latest.same_as(_state(9))
    assert store.get(7).same_as(_state(7))
    assert store.certificate(5) == b"cert-5"
    with pytest.raises(StoreError, match="round: 1 is not stored"):
        store.get(1)
    # Only replica files and nothing else are left in the directory.
    assert sorted(p.name for p in (tmp_path / "replicas").iterdir()) == [
        "round-000000000005.replica",
        "round-000000000007.replica",
        "round-000000000009.replica",
    ]


def test_a_replica_that_cannot_be_pruned_fails_no_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the new state is written and stored; an old file that cannot be removed stays, and the
    # next put that can prunes it
    store = ReplicaStore(tmp_path, keep_rounds=1)
    store.put(_state(1))
    real_unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self.suffix == ".replica":
            raise PermissionError(13, "Permission denied", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    store.put(_state(2))
    assert store.rounds() == [1, 2] and store.latest() is not None
    assert store.get(2).same_as(_state(2))
    monkeypatch.setattr(Path, "unlink", real_unlink)
    store.put(_state(3))
    assert store.rounds() == [3]


def test_put_accepts_serialised_bytes_and_same_round_rules(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    data = _state(3).to_bytes()
    store.put(data)
    assert store.get(3).to_bytes() == data
    store.put(_state(3), certificate=b"now certified")  # same digest: certificate updated
    assert store.certificate(3) == b"now certified"
    other = TrainingState({"w": np.zeros(3, np.float32)}, round=3)
    with pytest.raises(StoreError, match="different state digest"):
        store.put(other)
    assert store.get(3).to_bytes() == data
    with pytest.raises(StoreError, match="not a serialised TrainingState"):
        store.put(b"junk")
    with pytest.raises(StoreError, match="keep_rounds"):
        ReplicaStore(tmp_path, keep_rounds=0)


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_corrupt_truncated_and_foreign_files_raise_store_error(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, keep_rounds=10)
    for r in range(1, 6):
        store.put(_state(r))
    size = store.path_of(1).stat().st_size
    _flip(store.path_of(1), size - 10)  # inside the state
    with pytest.raises(StoreError, match="state digest mismatch"):
        store.get(1)
    with pytest.raises(StoreError, match="state digest mismatch"):
        store.open(1)
    _flip(store.path_of(2), 20)  # inside the header
    with pytest.raises(StoreError, match="header checksum"):
        store.get(2)
    raw = store.path_of(3).read_bytes()
    store.path_of(3).write_bytes(raw[:-1])
    with pytest.raises(StoreError, match="truncated or padded"):
        store.get(3)
    store.path_of(4).write_bytes(b"PK\x03\x04 this is a zip file, not a replica")
    with pytest.raises(StoreError, match="bad magic"):
        store.get(4)
    # A valid replica renamed to another round is foreign to that name.
    os.replace(store.path_of(5), store.path_of(6))
    with pytest.raises(StoreError, match="the name says 6"):
        store.get(6)
    wrong_version = bytearray(raw)
    wrong_version[7] = 9
    store.path_of(8).write_bytes(bytes(wrong_version))
    with pytest.raises(StoreError, match="version 9"):
        store.get(8)
    # The newest file is corrupt: latest() says so instead of hiding it.
    with pytest.raises(StoreError):
        store.latest()


def test_failed_write_leaves_previous_round_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ReplicaStore(tmp_path)
    store.put(_state(1))
    calls = {"n": 0}
    real = store_mod._write_chunk

    def failing(fd: int, data: bytes | memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(store_mod, "STORE_IO_CHUNK_BYTES", 1024)
    monkeypatch.setattr(store_mod, "_write_chunk", failing)
    with pytest.raises(StoreError, match="write failed"):
        store.put(_state(2))
    assert store.rounds() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["round-000000000001.replica"]
    assert store.get(1).same_as(_state(1))


def test_range_reads_and_manifest_from_replica(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    state = _state(4, n=100_000)
    store.put(state)
    data = state.to_bytes()
    with store.open(4) as replica:
        assert replica.total_bytes == len(data)
        assert replica.state_digest == hashlib.sha256(data).digest()
        assert replica.read(1000, 5000) == data[1000:5000]
        assert replica.read(len(data), len(data)) == b""
        assert replica.read_shard(3, 4096) == data[3 * 4096 : 4 * 4096]
        assert replica.manifest(7000) == Manifest.build(data, 7000)
        assert replica.manifest(7000, num_shards=64) == Manifest.build(data, 7000, num_shards=64)
        with pytest.raises(StoreError, match="range"):
            replica.read(0, len(data) + 1)


def test_stale_temp_files_are_removed_on_open(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    store.put(_state(1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".tmp-round-2-{dead.pid}-deadbeef").write_bytes(b"half a replica")
    (tmp_path / ".tmp-round-3-junk").write_bytes(b"not ours either")
    live = f".tmp-round-4-{os.getpid()}-cafe"  # a writer that is still running
    (tmp_path / live).write_bytes(b"in progress")
    (tmp_path / "notes.txt").write_text("kept")
    ReplicaStore(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        live,
        "notes.txt",
        "round-000000000001.replica",
    ]


def test_server_keeps_serving_a_round_while_training_writes_and_prunes(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path, keep_rounds=1)
    state = _state(1, n=50_000)
    store.put(state)
    data = state.to_bytes()
    replica = store.open(1)
    server = ShardServer(replica, max_concurrent_uploads=2)
    (first,) = server.request("joiner", 0, 0, 4096)
    store.put(_state(2, n=50_000))  # training moved on; round 1 is pruned from the directory
    assert store.rounds() == [2]
    assert server.read(first) == data[:4096]
    server.finish(first)
    (second,) = server.request("joiner", 1, 4096, len(data))
    assert server.read(second) == data[4096:]
    replica.close()


_CHILD = r"""
import sys, time
import numpy as np
from chaos_flwr import store
from chaos_flwr.state import TrainingState

directory, round_ = sys.argv[1], int(sys.argv[2])
real = store._write_chunk

def slow(fd, data):
    time.sleep(0.002)
    real(fd, data)

store._write_chunk = slow
store.STORE_IO_CHUNK_BYTES = 64 * 1024
s = store.ReplicaStore(directory, keep_rounds=3)
state = TrainingState({"w": np.full(1_000_000, round_, dtype=np.float32)}, round=round_)
print("ready", flush=True)
s.put(state, certificate=b"cert")
print("done", flush=True)
time.sleep(30)
"""


@pytest.mark.timeout(120)
def test_sigkill_during_put_never_leaves_a_bad_replica(tmp_path: Path) -> None:
    directory = tmp_path / "replicas"
    ReplicaStore(directory, keep_rounds=3).put(
        TrainingState({"w": np.full(1_000_000, 0, dtype=np.float32)}, round=0)
    )
    rng = random.Random(4)
    interrupted = 0
    for r in range(1, 9):
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(directory), str(r)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.12))  # a full put takes about 0.15 s
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=30)
        store = ReplicaStore(directory, keep_rounds=3)
        present = store.rounds()
        if r not in present:
            interrupted += 1
        for kept in present:
            loaded = store.get(kept)  # verifies digest and round
            assert loaded.round == kept
            assert np.all(loaded.arrays["w"] == np.float32(kept))
        assert present, "a crash must never remove the previous round"
        assert all(not p.name.startswith(".tmp") for p in directory.iterdir())  # dead writer
    assert interrupted >= 3, "the kills should land inside put most of the time"


def test_every_round_the_protocol_admits_is_listed_loaded_and_pruned(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "replicas", keep_rounds=2)
    big = [10**12 - 1, 10**12, 2**63 - 2, 2**63 - 1]  # past the 12 padded digits
    for r in big:
        store.put(_state(r, n=10))
    assert store.rounds() == big[-2:]  # the two newest kept, the older ones pruned
    latest = store.latest()
    assert latest is not None and latest.round == 2**63 - 1
    assert store.get(2**63 - 2).same_as(_state(2**63 - 2, n=10))
    names = sorted(p.name for p in (tmp_path / "replicas").iterdir())
    assert names == [f"round-{r}.replica" for r in big[-2:]]
    # a non-canonical name (extra zero padding) never counts as a second copy of a round
    os.link(store.path_of(2**63 - 1), tmp_path / "replicas" / "round-0000000000001.replica")
    assert store.rounds() == big[-2:]


def test_discard_removes_a_round_and_keeps_the_older_one_it_would_have_pushed_out(
    tmp_path: Path,
) -> None:
    store = ReplicaStore(tmp_path, keep_rounds=2)
    for r in (1, 2):
        store.put(_state(r))
    store.discard(2)  # refuted: gone, and round 1 stays when round 3 comes
    store.discard(2)  # already gone: nothing to do
    assert store.rounds() == [1]
    store.put(_state(3))
    assert store.rounds() == [1, 3] and store.get(1).round == 1
    with pytest.raises(StoreError):
        store.get(2)
