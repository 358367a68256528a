"""Training state: canonical bytes, bit-exact rebuilds, manifests, Flower and torch converters."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from chaos_flwr import codec
from chaos_flwr.errors import DecodeError, ShardIntegrityError
from chaos_flwr.state import Manifest, TrainingState, from_array_record, to_array_record


def _bits(arr: np.ndarray[Any, Any]) -> tuple[str, tuple[int, ...], bytes]:
    return arr.dtype.str, arr.shape, np.ascontiguousarray(arr).tobytes()


def _assert_bit_equal(a: TrainingState, b: TrainingState) -> None:
    assert set(a.arrays) == set(b.arrays)
    for name in a.arrays:
        assert _bits(a.arrays[name]) == _bits(b.arrays[name]), name
    assert a.round == b.round
    assert a.strategy_state == b.strategy_state
    assert dict(a.meta) == dict(b.meta)


def _mixed_state() -> TrainingState:
    rng = np.random.default_rng(7)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    nan_payload = np.array([0x7FC00001, 0xFFC12345, 0x00000001], dtype=np.uint32).view(np.float32)
    return TrainingState(
        arrays={
            "w.noncontig": base.T[::2],  # strided, Fortran-ish view
            "w.big": np.arange(10, dtype=">i8").reshape(2, 5),
            "w.bigf": rng.standard_normal(7).astype(">f8"),
            "scalar": np.array(3.25, dtype=np.float64),
            "empty": np.zeros((0, 4), dtype=np.int16),
            "mask": rng.random(9) > 0.5,
            "cplx": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
            "txt": np.array(["a", "héllo"]),
            "raw": np.array([b"\x00\x01", b"zz"]),
            "half": rng.standard_normal(5).astype(np.float16),
            "nan": nan_payload,
            "ünïcode/名前": np.arange(3, dtype=np.uint8),
        },
        round=42,
        strategy_state=b"\x00strategy\xff",
        meta={"lr": 0.1, "tags": ["a", "b"], "n": 3, "none": None},
    )


def test_round_trip_is_bit_exact_for_mixed_dtypes() -> None:
    state = _mixed_state()
    data = state.to_bytes()
    back = TrainingState.from_bytes(data)
    _assert_bit_equal(state, back)
    assert back.arrays["w.big"].dtype.byteorder == ">"
    assert back.arrays["w.noncontig"].shape == (4, 6)
    assert back.to_bytes() == data
    assert len(data) == state.serialized_size()
    assert state.digest() == hashlib.sha256(data).digest()


def test_bytes_do_not_depend_on_insertion_order_or_contiguity() -> None:
    state = _mixed_state()
    reversed_state = TrainingState(
        arrays={k: np.array(v, copy=True) for k, v in reversed(list(state.arrays.items()))},
        round=state.round,
        strategy_state=state.strategy_state,
        meta=dict(reversed(list(state.meta.items()))),
    )
    assert reversed_state.to_bytes() == state.to_bytes()
    assert state.same_as(reversed_state)


def test_byte_order_is_part_of_the_state() -> None:
    little = TrainingState({"x": np.arange(4, dtype="<i4")}, 1)
    big = TrainingState({"x": np.arange(4, dtype=">i4")}, 1)
    assert little.to_bytes() != big.to_bytes()
    assert TrainingState.from_bytes(big.to_bytes()).arrays["x"].dtype == np.dtype(">i4")
    assert np.array_equal(TrainingState.from_bytes(big.to_bytes()).arrays["x"], np.arange(4))


def test_changing_one_value_changes_the_digest() -> None:
    a = np.zeros(100, dtype=np.float32)
    b = a.copy()
    b[57] = np.float32(1e-45)
    assert TrainingState({"x": a}, 0).digest() != TrainingState({"x": b}, 0).digest()
    assert TrainingState({"x": a}, 0).digest() != TrainingState({"x": a}, 1).digest()


def test_views_by_default_copies_on_request() -> None:
    data = _mixed_state().to_bytes()
    view = TrainingState.from_bytes(data)
    assert not view.arrays["w.bigf"].flags.writeable
    with pytest.raises(ValueError):
        view.arrays["w.bigf"][0] = 0.0
    copied = TrainingState.from_bytes(data, copy=True)
    first = float(copied.arrays["w.bigf"][0])
    copied.arrays["w.bigf"][0] = first + 1.0
    assert float(TrainingState.from_bytes(data).arrays["w.bigf"][0]) == first
    # Every array's data starts on an aligned offset of the buffer.
    buf = np.frombuffer(data, dtype=np.uint8)
    base = buf.ctypes.data
    for name, arr in view.arrays.items():
        if arr.size:
            assert (arr.ctypes.data - base) % 64 == 0, name


@pytest.mark.parametrize(
    "bad",
    [
        np.array([{"a": 1}, None], dtype=object),
        np.zeros(3, dtype=[("a", "i4"), ("b", "f4")]),
        np.zeros(2, dtype="V8"),
    ],
)
def test_refuses_object_structured_and_void_dtypes(bad: np.ndarray[Any, Any]) -> None:
    with pytest.raises(TypeError, match=r"arrays\['bad'\]"):
        TrainingState({"bad": bad}, 0)


def test_refuses_non_arrays_and_bad_fields() -> None:
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        TrainingState({"x": [1, 2, 3]}, 0)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="round"):
        TrainingState({}, -1)
    with pytest.raises(TypeError, match="meta"):
        TrainingState({}, 0, meta={"x": float("nan")})
    with pytest.raises(TypeError, match="strategy_state"):
        TrainingState({}, 0, strategy_state="text")  # type: ignore[arg-type]


def test_from_bytes_rejects_what_to_bytes_would_not_produce() -> None:
    data = bytearray(_mixed_state().to_bytes())
    with pytest.raises(DecodeError, match="magic"):
        TrainingState.from_bytes(b"NOTSTATE" + bytes(data[8:]))
    wrong_version = bytearray(data)
    wrong_version[7] = 99
    with pytest.raises(DecodeError, match="version"):
        TrainingState.from_bytes(bytes(wrong_version))
    with pytest.raises(DecodeError, match="trailing"):
        TrainingState.from_bytes(bytes(data) + b"\x00")
    with pytest.raises(DecodeError, match="truncated"):
        TrainingState.from_bytes(bytes(data[:-1]))
    # Non-zero padding between header and data.
    hlen = int.from_bytes(data[8:16], "big")
    pad_at = 16 + hlen
    assert pad_at % 64 != 0
    padded = bytearray(data)
    padded[pad_at] = 1
    with pytest.raises(DecodeError, match="padding"):
        TrainingState.from_bytes(bytes(padded))


def test_from_bytes_rejects_forged_headers() -> None:
    def build(header: dict[str, Any]) -> bytes:
        raw = codec.encode(header)
        out = b"CHAOSST\x01" + len(raw).to_bytes(8, "big") + raw
        return out + bytes(-len(out) % 64)

    base = {"arrays": [], "meta": {}, "round": 0, "strategy_bytes": 0}
    assert TrainingState.from_bytes(build(base)).round == 0
    with pytest.raises(DecodeError, match="dtype"):
        TrainingState.from_bytes(build({**base, "arrays": [["x", "|O", [1]]]}))
    with pytest.raises(DecodeError, match="canonical"):
        TrainingState.from_bytes(build({**base, "arrays": [["x", "float32", [0]]]}))
    with pytest.raises(DecodeError, match="sorted"):
        TrainingState.from_bytes(build({**base, "arrays": [["b", "<i4", [0]], ["a", "<i4", [0]]]}))
    with pytest.raises(DecodeError, match="fields"):
        TrainingState.from_bytes(build({**base, "extra": 1}))


_dtypes = st.sampled_from(["<f4", ">f4", "<f8", ">i2", "<u8", "|b1", "|i1", "<c16", "<f2"])


@settings(max_examples=60, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text(min_size=1, max_size=8),
        _dtypes.flatmap(
            lambda dt: hnp.arrays(
                np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
            )
        ),
        max_size=5,
    ),
    round_=st.integers(min_value=0, max_value=2**40),
    strategy=st.binary(max_size=70),
)
def test_property_round_trip(
    arrays: dict[str, np.ndarray[Any, Any]], round_: int, strategy: bytes
) -> None:
    state = TrainingState(arrays, round_, strategy)
    data = state.to_bytes()
    back = TrainingState.from_bytes(data)
    _assert_bit_equal(state, back)
    assert back.to_bytes() == data


# --- manifest --------------------------------------------------------------------------------


def test_manifest_for_every_shard_size_names_the_same_state_digest() -> None:
    data = _mixed_state().to_bytes()
    digest = hashlib.sha256(data).digest()
    roots = set()
    for k in (1, 2, 4, 8, 16, 32):
        s = -(-len(data) // k)
        m = Manifest.build(data, s, num_shards=k)
        assert m.state_digest == digest
        assert m.num_shards == k
        m.check_certified(digest, len(data))
        for i in range(k):
            start, end = m.shard_range(i)
            assert m.shard_hashes[i] == hashlib.sha256(data[start:end]).digest()
            m.verify_shard(i, data[start:end])
        m.verify_state(data)
        roots.add(m.root)
    assert len(roots) == 6


def test_manifest_root_is_hash_of_canonical_fields() -> None:
    data = bytes(range(256)) * 10
    m = Manifest.build(data, 300)
    expected = hashlib.sha256(
        codec.encode({"shard_bytes": 300, "shards": list(m.shard_hashes), "total_bytes": len(data)})
    ).digest()
    assert m.root == expected
    assert Manifest.from_bytes(m.to_bytes()) == m
    with pytest.raises(DecodeError):
        Manifest.from_bytes(codec.encode({"shard_bytes": 1}))


def test_trailing_empty_shards_hash_to_empty() -> None:
    data = b"x" * 9  # K = 4, s = 3: shard 3 is empty
    m = Manifest.build(data, 3, num_shards=4)
    assert m.shard_range(3) == (9, 9)
    m.verify_shard(3, b"")
    assert m.shard_hashes[3] == hashlib.sha256(b"").digest()
    with pytest.raises(ValueError, match="num_shards"):
        Manifest.build(data, 3, num_shards=2)


def test_verify_shard_raises_on_bad_data() -> None:
    data = os.urandom(1000)
    m = Manifest.build(data, 128)
    good = data[128:256]
    m.verify_shard(1, good)
    flipped = bytearray(good)
    flipped[5] ^= 1
    with pytest.raises(ShardIntegrityError, match="shard 1: SHA-256"):
        m.verify_shard(1, bytes(flipped))
    with pytest.raises(ShardIntegrityError, match="shard 1: got 127 bytes"):
        m.verify_shard(1, good[:-1])
    with pytest.raises(ShardIntegrityError, match="outside"):
        m.verify_shard(8, b"")
    with pytest.raises(ShardIntegrityError, match="state"):
        m.verify_state(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ShardIntegrityError, match="certified"):
        m.check_certified(hashlib.sha256(b"other").digest())


def test_manifest_that_lies_about_the_state_is_caught_at_reassembly() -> None:
    data = os.urandom(4000)
    other = hashlib.sha256(b"the certified state").digest()
    honest = Manifest.build(data, 1000)
    liar = Manifest(honest.total_bytes, honest.shard_bytes, honest.shard_hashes, other)
    liar.check_certified(other)  # it claims the certified digest ...
    for i in range(liar.num_shards):
        start, end = liar.shard_range(i)
        liar.verify_shard(i, data[start:end])  # ... and its shards verify ...
    with pytest.raises(ShardIntegrityError, match="certified state digest"):
        liar.verify_state(data)  # ... but the reassembled state does not.


# --- Flower ArrayRecord ----------------------------------------------------------------------


@pytest.fixture()
def flwr_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("FLWR_DISABLE_UPDATE_CHECK", "1")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))


@pytest.mark.usefixtures("flwr_env")
def test_array_record_round_trip() -> None:
    from flwr.app import ArrayRecord

    state = TrainingState(
        {
            "b": np.arange(6, dtype=">f4").reshape(2, 3),
            "a": np.ones((3, 2), dtype=np.float64).T,
            "m": np.array([True, False]),
        },
        round=5,
        strategy_state=b"s",
        meta={"k": 1},
    )
    record = to_array_record(state)
    assert isinstance(record, ArrayRecord)
    assert list(record.keys()) == ["a", "b", "m"]
    back = from_array_record(record, round=5, strategy_state=b"s", meta={"k": 1})
    _assert_bit_equal(state, back)
    assert back.to_bytes() == state.to_bytes()
    # Built the ordinary Flower way (list of arrays) it converts too.
    plain = ArrayRecord([np.arange(3, dtype=np.int32)])
    assert np.array_equal(from_array_record(plain, round=0).arrays["0"], np.arange(3))


# --- import without torch --------------------------------------------------------------------


def test_state_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import chaos_flwr.state, chaos_flwr.store, chaos_flwr.transfer\n"
        "import numpy as np\n"
        "s = chaos_flwr.state.TrainingState({'x': np.arange(3)}, 1)\n"
        "assert chaos_flwr.state.TrainingState.from_bytes(s.to_bytes()).round == 1\n"
        "try:\n"
        "    import chaos_flwr.torch_adapter\n"
        "except ImportError:\n"
        "    print('adapter-needs-torch')\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["adapter-needs-torch", "False"]


# --- torch -----------------------------------------------------------------------------------


torch = pytest.importorskip("torch")


def _model() -> Any:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(), torch.nn.Linear(5, 2)
    )


def _train(model: Any, opt: Any, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _tensor_bits(t: Any) -> tuple[str, tuple[int, ...], bytes]:
    t = t.detach().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return str(t.dtype), tuple(t.shape), raw


def _assert_tree_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert _tensor_bits(a) == _tensor_bits(b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_tree_equal(x, y)
    else:
        assert type(a) is type(b) and a == b


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), amsgrad=True),
    ],
    ids=["sgd-momentum", "adam"],
)
def test_torch_round_trip_and_training_continues_identically(make_opt: Any) -> None:
    from chaos_flwr.torch_adapter import from_torch, to_torch

    torch.set_num_threads(1)
    model = _model()
    opt = make_opt(model.parameters())
    _train(model, opt, steps=3, seed=0)
    state = from_torch(model.state_dict(), opt.state_dict(), round=3, strategy_state=b"fedavg")
    data = state.to_bytes()
    assert (
        from_torch(
            model.state_dict(), opt.state_dict(), round=3, strategy_state=b"fedavg"
        ).to_bytes()
        == data
    )

    model_sd, opt_sd = to_torch(TrainingState.from_bytes(data))
    _assert_tree_equal(model.state_dict(), model_sd)
    _assert_tree_equal(opt.state_dict(), opt_sd)

    restored = _model()
    with torch.no_grad():
        for p in restored.parameters():
            p.add_(1.0)  # make sure the restore, not the seed, sets the values
    restored.load_state_dict(model_sd)
    restored_opt = make_opt(restored.parameters())
    restored_opt.load_state_dict(opt_sd)

    _train(model, opt, steps=4, seed=99)
    _train(restored, restored_opt, steps=4, seed=99)
    _assert_tree_equal(model.state_dict(), restored.state_dict())
    _assert_tree_equal(opt.state_dict(), restored_opt.state_dict())


def test_torch_special_values_and_dtypes() -> None:
    from chaos_flwr.torch_adapter import from_torch, to_torch

    model_sd = {
        "bf16": torch.tensor([1.5, -0.0, float("inf")], dtype=torch.bfloat16),
        "i64": torch.tensor(7, dtype=torch.int64),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    opt_sd = {
        "state": {0: {"step": torch.tensor(2.0), "buf": torch.zeros(2)}, 3: {"x": -0.0}},
        "param_groups": [{"lr": float("nan"), "betas": (0.9, 0.999), "params": [0, 3]}],
        "name": "custom",
        "flags": [True, None, 1e300],
    }
    state = from_torch(model_sd, opt_sd, round=1)
    m2, o2 = to_torch(TrainingState.from_bytes(state.to_bytes()))
    assert o2 is not None
    _assert_tree_equal(model_sd, m2)
    assert o2["param_groups"][0]["betas"] == (0.9, 0.999)
    assert isinstance(o2["param_groups"][0]["betas"], tuple)
    assert np.isnan(o2["param_groups"][0]["lr"])
    assert list(o2["state"]) == [0, 3] and str(np.copysign(1.0, o2["state"][3]["x"])) == "-1.0"
    _assert_tree_equal(opt_sd["state"][0], o2["state"][0])
    with pytest.raises(TypeError, match="key"):
        from_torch({}, {"state": {(1, 2): 0}}, round=0)
    with pytest.raises(TypeError, match="cannot be encoded"):
        from_torch({}, {"state": {0: {1, 2}}}, round=0)
    with pytest.raises(DecodeError, match=r"meta\.torch"):
        to_torch(TrainingState({}, 0))
