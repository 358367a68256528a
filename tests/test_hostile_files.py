"""A party's own files, made hostile: FIFOs, devices, symlinks, loose keys, deep nesting, objects.

Each must be refused with the typed error of its reader, at once (a FIFO must never block) and
without reading an unbounded amount.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from chaos_flwr.charter import Charter, load_charter
from chaos_flwr.errors import CharterError, DecodeError, KeyFileError, ProfileError, StoreError
from chaos_flwr.flower import durable
from chaos_flwr.flower.profiles import load_profile
from chaos_flwr.identity import Identity, load_public_key
from chaos_flwr.localfile import read_local_file, write_local_file
from chaos_flwr.state import from_array_record


def _within(seconds: float, call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a thread; fail if it has not returned (or raised) within ``seconds``."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            out.append(None)
        except BaseException as exc:  # the typed error is what the test checks
            out.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, "the reader blocked (a FIFO must be refused, not opened for reading)"
    return out[0]


def test_a_fifo_is_refused_by_every_reader_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases: list[tuple[Callable[[], object], type[Exception]]] = [
        (lambda: Identity.load(fifo), KeyFileError),
        (lambda: load_public_key(fifo), KeyFileError),
        (lambda: load_charter(fifo), CharterError),
        (lambda: load_profile(fifo), ProfileError),
    ]
    from chaos_flwr.errors import ConfigError
    from chaos_flwr.lab.scenario import load_scenario

    cases.append((lambda: load_scenario(fifo), ConfigError))
    for call, kind in cases:
        exc = _within(5.0, call)
        assert isinstance(exc, kind) and "not a regular file" in str(exc), exc
        assert "FIFO" in str(exc)
    state_dir = tmp_path / "party"
    state_dir.mkdir()
    os.mkfifo(state_dir / durable.STATE_FILE)
    exc = _within(5.0, lambda: durable.load(state_dir, "p"))
    assert isinstance(exc, StoreError) and "not a regular file" in str(exc)


def test_a_party_state_linked_to_dev_zero_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / durable.STATE_FILE).symlink_to("/dev/zero")
    with pytest.raises(StoreError, match="not a regular file"):
        durable.load(tmp_path, "p")
    with pytest.raises(StoreError, match="not a regular file"):
        read_local_file(Path("/dev/zero"), what="x", error=StoreError, max_bytes=10)


def test_private_keys_must_not_be_symlinks_and_loose_modes_are_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ident = Identity.generate("k")
    path = ident.save(tmp_path)
    assert Identity.load(path).party_id == ident.party_id  # 0600 as saved: quiet
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="symbolic link"):
        Identity.load(link)
    assert load_public_key(path.with_suffix(".pub")) == ident.public_key  # public: no rule
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="chaos_flwr.localfile"):
        assert Identity.load(path).party_id == ident.party_id
    assert "open to other users" in caplog.text and "chmod 600" in caplog.text


def test_deeply_nested_charter_and_profile_raise_typed_errors(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    charter = tmp_path / "charter.yaml"
    charter.write_text(deep)
    with pytest.raises(CharterError):
        load_charter(charter)
    with pytest.raises(CharterError):
        Charter.from_yaml(deep)
    profile = tmp_path / "deep.yaml"
    profile.write_text(deep)
    with pytest.raises(ProfileError):
        load_profile(profile)


def test_oversized_files_are_refused_before_they_are_read(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as handle:
        handle.truncate(64 * 1024 * 1024)  # sparse: no disk used, but 64 MiB long
    with pytest.raises(CharterError, match="larger than"):
        load_charter(big)
    with pytest.raises(ProfileError, match="larger than"):
        load_profile(big)


def test_an_array_that_would_need_unpickling_is_a_decode_error() -> None:
    from flwr.app import Array, ArrayRecord

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    record = ArrayRecord()
    record["w"] = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=buf.getvalue())
    with pytest.raises(DecodeError, match="object arrays are refused"):
        from_array_record(record, round=1)


def test_a_fifo_or_directory_under_a_replicas_name_is_refused_at_once(tmp_path: Path) -> None:
    from chaos_flwr.store import ReplicaStore

    store = ReplicaStore(tmp_path / "replicas")
    os.mkfifo(store.path_of(3))
    exc = _within(5.0, store.latest)
    assert isinstance(exc, StoreError) and "not a regular file" in str(exc)
    store.path_of(3).unlink()
    store.path_of(4).mkdir()
    with pytest.raises(StoreError, match="not a regular file"):
        store.get(4)


def test_a_pull_too_large_to_save_is_dropped_and_the_rest_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "FLOWER_DURABLE_MAX_BYTES", 4096)
    big_pull = {"v": 1, "data": [b"\x00" * 8192]}  # stands for a pull holding many shards
    state = durable.SavedParty("p", "1:2", 5, 17, joining=big_pull, receipts=[b"r"])
    durable.save(tmp_path, state)
    loaded = durable.load(tmp_path, "p")
    assert loaded is not None and loaded.joining is None and loaded.receipts == [b"r"]
    assert (loaded.incarnation, loaded.seq) == (5, 17)


def test_a_local_file_is_replaced_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "small.file"
    path.write_bytes(b"old")
    assert write_local_file(path, b"new" * 1000, what="test file", error=StoreError) == path
    assert path.read_bytes() == b"new" * 1000 and path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.file"]  # no temporary left
    with pytest.raises(StoreError, match="cannot write the test file"):
        write_local_file(tmp_path / "no-such-dir" / "f", b"x", what="test file", error=StoreError)
