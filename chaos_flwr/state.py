"""Training state <-> canonical bytes, and the shard manifest that certifies them.

A :class:`TrainingState` is the part of a federation that a joining or recovering party needs:
named arrays (model parameters, optimizer buffers), the round number, an opaque strategy state
and a small metadata map. It serialises to one byte string, deterministically, and rebuilds
bit-identically (names, dtypes including byte order, shapes, values, NaN payloads).

Serialised layout (all integers big-endian)::

    magic   8 bytes   b"CHAOSST" + format version byte
    hlen    8 bytes   length of the header
    header  hlen      codec.encode({"arrays": [[name, dtype.str, shape], ...],
                                    "meta": {...}, "round": r, "strategy_bytes": n})
    pad               zeros up to the next multiple of STATE_ALIGN_BYTES
    strategy n bytes  the opaque strategy state
    then, per array in header order: zero padding to the alignment, then the array's
    elements in C order in the array's own dtype (so big-endian stays big-endian).

Array names are sorted by their UTF-8 bytes, so insertion order never changes the bytes; data
offsets are implied by the header (nothing to disagree with), padding must be zero and the
length must match exactly, so :meth:`TrainingState.from_bytes` accepts only bytes that
:meth:`TrainingState.to_bytes` could have produced.

Manifests and the certified digest
----------------------------------
Receipts and certificates name the **state digest**, ``sha256(to_bytes())``. A :class:`Manifest`
cuts those bytes into shards of ``shard_bytes`` (shard ``i`` covers
``[i*s, min((i+1)*s, W))``, as the planner numbers them) and lists each shard's SHA-256; its
:attr:`Manifest.root` is ``sha256(codec.encode({"shard_bytes": s, "shards": [...],
"total_bytes": W}))``. The manifest also carries the state digest it claims to describe.

How a verifier ties a manifest to a certified state: the certificate carries only the state
digest (and the byte count). A joiner takes a manifest for the planned shard size from any
donor, requires ``manifest.state_digest == certified digest`` and ``total_bytes`` to match,
checks every arriving shard against the manifest (so a bad donor is caught on its first bad
shard), and after reassembly checks ``sha256(state) == certified digest``
(:meth:`Manifest.verify_state`). A lying manifest therefore can never make a wrong state
accepted; at worst it makes honest shards look bad, which reassembly exposes. We do not sign a
manifest per chain shard size: the planner picks ``K`` from a 13-point chain at join time, so
that would cost 13 hashing passes over the state every round on every party, while
verification by reassembly costs the joiner one pass it has to make anyway.

Pure: no I/O, no clock. Torch is never imported here (see :mod:`chaos_flwr.torch_adapter`);
Flower is imported only inside the ``ArrayRecord`` converters.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import codec
from .defaults import STATE_ALIGN_BYTES, STATE_MAX_HEADER_BYTES
from .errors import DecodeError, ShardIntegrityError

if TYPE_CHECKING:  # pragma: no cover
    from flwr.app import ArrayRecord

__all__ = [
    "STATE_MAGIC",
    "Manifest",
    "TrainingState",
    "from_array_record",
    "npy_view",
    "shard_range",
    "state_digest",
    "to_array_record",
]

#: The first bytes of every serialised state: ``b"CHAOSST"`` and the format version.
STATE_MAGIC: bytes = b"CHAOSST\x01"
_U64 = struct.Struct(">Q")
_PREFIX = len(STATE_MAGIC) + _U64.size
#: Kinds of numpy dtype a state may hold: bool, ints, floats, complex, bytes, str, time.
_KINDS = frozenset("biufcSUmM")


def _align(n: int) -> int:
    return -(-n // STATE_ALIGN_BYTES) * STATE_ALIGN_BYTES


def _check_dtype(dtype: np.dtype[Any], name: str) -> None:
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(
            f"arrays[{name!r}]: dtype {dtype!r} cannot be serialised (object, structured and "
            "void dtypes are refused); convert the array to a numeric, bool, bytes or str dtype"
        )
    if dtype.itemsize == 0:
        raise TypeError(f"arrays[{name!r}]: dtype {dtype!r} has zero item size; give S1/U1 or more")


def _raw_view(arr: np.ndarray[Any, Any]) -> memoryview:
    """The array's element bytes in C order, without a copy when it is already C-contiguous."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class TrainingState:
    """A party's training state: named arrays, round number, strategy state, metadata.

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray]
        Named arrays (any shape, non-contiguous and big-endian welcome). Object, structured and
        void dtypes are refused with ``TypeError``. The mapping is copied (arrays are not).
    round : int
        The federated round the state belongs to (>= 0).
    strategy_state : bytes, optional
        Opaque bytes of the (inner) strategy's own state.
    meta : Mapping[str, Any], optional
        Small metadata map of values :mod:`chaos_flwr.codec` can encode (no NaN floats).

    Notes
    -----
    Equality is bitwise (:meth:`same_as`); ``==`` is identity, as for numpy arrays.
    """

    arrays: Mapping[str, np.ndarray[Any, Any]]
    round: int
    strategy_state: bytes = b""
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise ValueError(f"round: got {self.round!r}; give the round number as an int >= 0")
        if not isinstance(self.strategy_state, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"strategy_state: got {type(self.strategy_state).__name__}; give bytes "
                "(serialise the strategy state yourself)"
            )
        if not isinstance(self.arrays, Mapping):
            raise TypeError("arrays: expected a mapping of name -> numpy.ndarray")
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for name, arr in self.arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"arrays: name {name!r} is not a str; array names must be str")
            if not isinstance(arr, np.ndarray):
                raise TypeError(
                    f"arrays[{name!r}]: got {type(arr).__name__}; give a numpy.ndarray "
                    "(torch tensors go through chaos_flwr.torch_adapter)"
                )
            _check_dtype(arr.dtype, name)
            arrays[name] = arr
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "strategy_state", bytes(self.strategy_state))
        if not isinstance(self.meta, Mapping):
            raise TypeError("meta: expected a mapping of str -> codec-encodable values")
        meta = dict(self.meta)
        try:
            codec.encode(meta)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"meta: cannot be encoded canonically ({exc}); keep to None/bool/int/float/"
                "str/bytes/list/dict values"
            ) from exc
        object.__setattr__(self, "meta", meta)

    # --- serialisation ---------------------------------------------------------------------

    def _names(self) -> list[str]:
        return sorted(self.arrays, key=lambda n: n.encode("utf-8"))

    def _header(self, names: Sequence[str]) -> bytes:
        specs = []
        for name in names:
            arr = self.arrays[name]
            specs.append([name, arr.dtype.str, list(arr.shape)])
        return codec.encode(
            {
                "arrays": specs,
                "meta": self.meta,
                "round": self.round,
                "strategy_bytes": len(self.strategy_state),
            }
        )

    def iter_chunks(self) -> Iterator[bytes | memoryview]:
        """Yield the serialised state piece by piece (header, padding, raw array bytes).

        The pieces concatenate to :meth:`to_bytes`. C-contiguous arrays are yielded as
        memoryviews of their own memory (no copy), so a writer can stream a large state to a
        file or socket without assembling it.
        """
        names = self._names()
        header = self._header(names)
        yield STATE_MAGIC + _U64.pack(len(header)) + header
        pos = _PREFIX + len(header)
        pad = _align(pos) - pos
        if pad:
            yield bytes(pad)
        pos += pad
        if self.strategy_state:
            yield self.strategy_state
            pos += len(self.strategy_state)
        for name in names:
            arr = self.arrays[name]
            pad = _align(pos) - pos
            if pad:
                yield bytes(pad)
            pos += pad
            if arr.size:
                view = _raw_view(arr)
                yield view
                pos += view.nbytes

    def serialized_size(self) -> int:
        """Return ``len(self.to_bytes())`` without serialising."""
        names = self._names()
        pos = _PREFIX + len(self._header(names))
        pos = _align(pos) + len(self.strategy_state)
        for name in names:
            arr = self.arrays[name]
            pos = _align(pos) + arr.size * arr.dtype.itemsize
        return pos

    def to_bytes(self) -> bytes:
        """Serialise the state deterministically (one copy of the array data).

        Returns
        -------
        bytes
            The canonical bytes; equal states give equal bytes.
        """
        return b"".join(self.iter_chunks())

    def digest(self) -> bytes:
        """Return the state digest ``sha256(to_bytes())`` without assembling the bytes."""
        h = hashlib.sha256()
        for chunk in self.iter_chunks():
            h.update(chunk)
        return h.digest()

    @classmethod
    def from_bytes(
        cls, data: bytes | bytearray | memoryview, *, copy: bool = False
    ) -> TrainingState:
        """Rebuild a state from :meth:`to_bytes` output.

        Parameters
        ----------
        data : bytes-like
            The serialised state; it must be exactly what :meth:`to_bytes` produces.
        copy : bool, optional
            ``False`` (default) returns arrays that are read-only views into ``data`` (no copy
            of a large state; keep ``data`` alive and unchanged). ``True`` returns writable
            copies.

        Returns
        -------
        TrainingState
            Bit-identical to the state that was serialised.

        Raises
        ------
        DecodeError
            If the magic, version, header, padding or length is wrong.
        """
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if len(view) < _PREFIX or bytes(view[: len(STATE_MAGIC) - 1]) != STATE_MAGIC[:-1]:
            raise DecodeError(
                "state: bytes do not start with the chaos-flwr state magic; this is not a "
                "serialised TrainingState"
            )
        if view[len(STATE_MAGIC) - 1] != STATE_MAGIC[-1]:
            raise DecodeError(
                f"state: format version {view[len(STATE_MAGIC) - 1]} is not supported "
                f"(this build reads version {STATE_MAGIC[-1]}); upgrade chaos-flwr"
            )
        (hlen,) = _U64.unpack_from(view, len(STATE_MAGIC))
        if hlen > STATE_MAX_HEADER_BYTES or _PREFIX + hlen > len(view):
            raise DecodeError(f"state: header length {hlen} is past the end or over the limit")
        header = codec.decode(view[_PREFIX : _PREFIX + hlen])
        round_, meta, specs, n_strategy = _parse_header(header)
        pos = _PREFIX + hlen
        arrays: dict[str, np.ndarray[Any, Any]] = {}

        def skip_padding(pos: int) -> int:
            end = _align(pos)
            if end > len(view):
                raise DecodeError("state: truncated inside padding")
            if any(view[pos:end]):
                raise DecodeError(f"state: non-zero padding at offset {pos}")
            return end

        pos = skip_padding(pos)
        if pos + n_strategy > len(view):
            raise DecodeError("state: truncated inside the strategy state")
        strategy = bytes(view[pos : pos + n_strategy])
        pos += n_strategy
        previous: bytes | None = None
        for name, dtype, shape in specs:
            key = name.encode("utf-8")
            if previous is not None and key <= previous:
                raise DecodeError(f"state: array names not strictly sorted at {name!r}")
            previous = key
            pos = skip_padding(pos)
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            if pos + nbytes > len(view):
                raise DecodeError(f"state: truncated inside array {name!r}")
            if count:
                arr = np.frombuffer(view, dtype=dtype, count=count, offset=pos).reshape(shape)
            else:
                arr = np.empty(shape, dtype=dtype)
            arrays[name] = arr.copy() if copy else arr
            pos += nbytes
        if pos != len(view):
            raise DecodeError(f"state: {len(view) - pos} trailing bytes after the last array")
        return cls(arrays=arrays, round=round_, strategy_state=strategy, meta=meta)

    def same_as(self, other: TrainingState) -> bool:
        """Return True when both states serialise to the same bytes (bitwise equality)."""
        return self.digest() == other.digest()


def _parse_header(
    header: Any,
) -> tuple[int, dict[str, Any], list[tuple[str, np.dtype[Any], tuple[int, ...]]], int]:
    if not isinstance(header, dict) or set(header) != {
        "arrays",
        "meta",
        "round",
        "strategy_bytes",
    }:
        raise DecodeError("state: header has missing or unknown fields")
    round_ = header["round"]
    meta = header["meta"]
    n_strategy = header["strategy_bytes"]
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        raise DecodeError(f"state: header round {round_!r} is not an int >= 0")
    if not isinstance(meta, dict):
        raise DecodeError("state: header meta is not a map")
    if isinstance(n_strategy, bool) or not isinstance(n_strategy, int) or n_strategy < 0:
        raise DecodeError("state: header strategy_bytes is not an int >= 0")
    raw_specs = header["arrays"]
    if not isinstance(raw_specs, list):
        raise DecodeError("state: header arrays is not a list")
    specs: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
    for spec in raw_specs:
        if (
            not isinstance(spec, list)
            or len(spec) != 3
            or not isinstance(spec[0], str)
            or not isinstance(spec[1], str)
            or not isinstance(spec[2], list)
            or not all(type(d) is int and d >= 0 for d in spec[2])
        ):
            raise DecodeError(f"state: malformed array entry {spec!r:.80}")
        try:
            dtype = np.dtype(spec[1])
        except TypeError as exc:
            raise DecodeError(f"state: array {spec[0]!r} has unknown dtype {spec[1]!r}") from exc
        try:
            _check_dtype(dtype, spec[0])
        except TypeError as exc:
            raise DecodeError(str(exc)) from exc
        if dtype.str != spec[1]:
            raise DecodeError(f"state: dtype {spec[1]!r} is not in canonical form {dtype.str!r}")
        specs.append((spec[0], dtype, tuple(spec[2])))
    return round_, meta, specs, n_strategy


def state_digest(data: bytes | bytearray | memoryview) -> bytes:
    """Return the state digest (SHA-256) of serialised state bytes."""
    return hashlib.sha256(data).digest()


def shard_range(total_bytes: int, shard_bytes: int, index: int) -> tuple[int, int]:
    """Return ``[start, end)`` of shard ``index`` (the planner's numbering)."""
    start = min(index * shard_bytes, total_bytes)
    return start, min(start + shard_bytes, total_bytes)


# --- manifest --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """Per-shard SHA-256 digests of a serialised state for one shard size.

    Attributes
    ----------
    total_bytes : int
        ``W``, the length of the serialised state.
    shard_bytes : int
        ``s``; shard ``i`` covers ``[i*s, min((i+1)*s, W))``.
    shard_hashes : tuple of bytes
        SHA-256 of each shard (``ceil(W / s)`` of them, or as many as the plan has shards:
        trailing empty shards hash to ``sha256(b"")``).
    state_digest : bytes
        ``sha256`` of the whole state, the digest receipts and certificates name.
    """

    total_bytes: int
    shard_bytes: int
    shard_hashes: tuple[bytes, ...]
    state_digest: bytes

    def __post_init__(self) -> None:
        if self.total_bytes < 0:
            raise ValueError(f"total_bytes: got {self.total_bytes}; must be >= 0")
        if self.shard_bytes < 1 and self.total_bytes > 0:
            raise ValueError(f"shard_bytes: got {self.shard_bytes}; must be >= 1")
        if len(self.state_digest) != 32 or any(len(h) != 32 for h in self.shard_hashes):
            raise ValueError("state_digest/shard_hashes: each digest must be 32 bytes (SHA-256)")
        if self.total_bytes > 0 and len(self.shard_hashes) * self.shard_bytes < self.total_bytes:
            raise ValueError(
                f"shard_hashes: {len(self.shard_hashes)} shards of {self.shard_bytes} bytes do "
                f"not cover {self.total_bytes} bytes"
            )

    @classmethod
    def build(
        cls,
        data: bytes | bytearray | memoryview,
        shard_bytes: int,
        *,
        num_shards: int | None = None,
    ) -> Manifest:
        """Build the manifest of ``data`` for shards of ``shard_bytes``.

        Parameters
        ----------
        data : bytes-like
            The serialised state.
        shard_bytes : int
            Shard size ``s`` (>= 1), e.g. ``plan.shard_bytes``.
        num_shards : int, optional
            Number of shards (the plan's ``K``, which may include trailing empty shards);
            defaults to ``ceil(len(data) / s)``.

        Returns
        -------
        Manifest
        """
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        total = len(view)
        k = _shard_count(total, shard_bytes, num_shards)
        hashes = []
        whole = hashlib.sha256()
        for i in range(k):
            start, end = shard_range(total, shard_bytes, i)
            piece = view[start:end]
            hashes.append(hashlib.sha256(piece).digest())
            whole.update(piece)
        return cls(total, shard_bytes, tuple(hashes), whole.digest())

    @property
    def num_shards(self) -> int:
        """The number of shards."""
        return len(self.shard_hashes)

    @property
    def root(self) -> bytes:
        """``sha256(codec.encode({"shard_bytes", "shards", "total_bytes"}))``."""
        return hashlib.sha256(
            codec.encode(
                {
                    "shard_bytes": self.shard_bytes,
                    "shards": list(self.shard_hashes),
                    "total_bytes": self.total_bytes,
                }
            )
        ).digest()

    def shard_range(self, index: int) -> tuple[int, int]:
        """Return ``[start, end)`` of shard ``index``."""
        self._check_index(index)
        return shard_range(self.total_bytes, self.shard_bytes, index)

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ShardIntegrityError(f"index: {index!r} is not an int shard index")
        if not 0 <= index < self.num_shards:
            raise ShardIntegrityError(
                f"index: shard {index} is outside range({self.num_shards}) of this manifest"
            )

    def verify_shard(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Check one shard against the manifest.

        Raises
        ------
        ShardIntegrityError
            If the index is out of range, the length is wrong, or the SHA-256 differs.
        """
        start, end = self.shard_range(index)
        n = memoryview(data).nbytes
        if n != end - start:
            raise ShardIntegrityError(
                f"shard {index}: got {n} bytes, the manifest says {end - start}; "
                "re-request it from another donor"
            )
        if hashlib.sha256(data).digest() != self.shard_hashes[index]:
            raise ShardIntegrityError(
                f"shard {index}: SHA-256 does not match the manifest; the donor sent corrupt "
                "data, re-request it from another donor"
            )

    def verify_state(self, data: bytes | bytearray | memoryview) -> None:
        """Check the whole state against :attr:`state_digest` (and the length).

        Raises
        ------
        ShardIntegrityError
            If the length or the digest differs.
        """
        n = memoryview(data).nbytes
        if n != self.total_bytes:
            raise ShardIntegrityError(
                f"state: {n} bytes, the manifest says {self.total_bytes}; do not use it"
            )
        if hashlib.sha256(data).digest() != self.state_digest:
            raise ShardIntegrityError(
                "state: SHA-256 of the reassembled state differs from the certified state "
                "digest (the manifest does not describe the certified state); fetch a manifest "
                "from another donor and transfer again"
            )

    def check_certified(self, state_digest: bytes, total_bytes: int | None = None) -> None:
        """Check that this manifest claims the certified state (digest, optionally size).

        Raises
        ------
        ShardIntegrityError
            If the manifest names another state.
        """
        if self.state_digest != state_digest:
            raise ShardIntegrityError(
                "manifest: its state_digest is not the certified digest; fetch the manifest "
                "of the certified round from another donor"
            )
        if total_bytes is not None and total_bytes != self.total_bytes:
            raise ShardIntegrityError(
                f"manifest: total_bytes {self.total_bytes} differs from the certified {total_bytes}"
            )

    def to_bytes(self) -> bytes:
        """Canonical encoding (for the wire)."""
        return codec.encode(
            {
                "shard_bytes": self.shard_bytes,
                "shards": list(self.shard_hashes),
                "state_digest": self.state_digest,
                "total_bytes": self.total_bytes,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """Decode :meth:`to_bytes` output.

        Raises
        ------
        DecodeError
            If the bytes are not a canonical manifest.
        """
        obj = codec.decode(data)
        if not isinstance(obj, dict) or set(obj) != {
            "shard_bytes",
            "shards",
            "state_digest",
            "total_bytes",
        }:
            raise DecodeError("manifest: missing or unknown fields")
        s, w, hashes, digest = (
            obj["shard_bytes"],
            obj["total_bytes"],
            obj["shards"],
            obj["state_digest"],
        )
        if not (
            type(s) is int
            and type(w) is int
            and isinstance(hashes, list)
            and all(isinstance(h, bytes) for h in hashes)
            and isinstance(digest, bytes)
        ):
            raise DecodeError("manifest: a field has the wrong type")
        try:
            return cls(w, s, tuple(hashes), digest)
        except ValueError as exc:
            raise DecodeError(f"manifest: {exc}") from exc


def _shard_count(total: int, shard_bytes: int, num_shards: int | None) -> int:
    if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise ValueError(f"shard_bytes: got {shard_bytes!r}; give an int >= 1")
    minimum = -(-total // shard_bytes)
    if num_shards is None:
        return minimum
    if num_shards < minimum:
        raise ValueError(
            f"num_shards: {num_shards} shards of {shard_bytes} bytes cannot cover {total} bytes"
        )
    return num_shards


# --- Flower ArrayRecord ----------------------------------------------------------------------


def to_array_record(state: TrainingState) -> ArrayRecord:
    """Return the state's arrays as a Flower ``ArrayRecord`` (names kept, canonical order).

    Round, strategy state and meta are not part of an ``ArrayRecord``; carry them separately
    (e.g. a ``ConfigRecord``) and pass them back to :func:`from_array_record`.
    """
    from flwr.app import Array, ArrayRecord

    record = ArrayRecord()
    for name in sorted(state.arrays, key=lambda n: n.encode("utf-8")):
        record[name] = Array(np.asarray(state.arrays[name]))
    return record


#: Bytes of an ``.npy`` payload read to parse its header (a version 1.0 header is at most
#: 65,545 bytes; a longer one goes through ``numpy.load``).
NPY_HEAD_BYTES: int = 65_546


def npy_view(data: bytes | memoryview) -> np.ndarray[Any, Any]:
    """A read-only array viewing the ``.npy`` bytes ``data`` (no copy of the elements).

    Only the header is parsed, with NumPy's own reader (no unpickling); anything but a plain
    C-order array whose elements fill the rest of ``data`` exactly goes through
    ``numpy.load``, which copies (and refuses object arrays with ``ValueError``).
    """
    import io

    from numpy.lib import format as npy

    head = data if isinstance(data, bytes) else bytes(data[:NPY_HEAD_BYTES])
    stream = io.BytesIO(head)
    readers = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}
    try:
        shape, fortran, dtype = readers[npy.read_magic(stream)](stream)
    except (KeyError, ValueError, TypeError, SyntaxError, EOFError):
        return np.load(io.BytesIO(data), allow_pickle=False)  # type: ignore[no-any-return]
    offset = stream.tell()
    count = math.prod(shape)
    if fortran or dtype.hasobject or count * dtype.itemsize != len(data) - offset:
        return np.load(io.BytesIO(data), allow_pickle=False)  # type: ignore[no-any-return]
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def from_array_record(
    record: ArrayRecord,
    *,
    round: int,
    strategy_state: bytes = b"",
    meta: Mapping[str, Any] | None = None,
) -> TrainingState:
    """Build a state from a Flower ``ArrayRecord``: each NumPy ``Array`` is viewed in place
    (read-only, no copy of a model that may be hundreds of MiB), others decoded with
    ``.numpy()``.

    Raises
    ------
    DecodeError
        If an array cannot be read without unpickling (an object array).
    TypeError
        If an array has a refused dtype.
    """
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for name, arr in record.items():
        try:
            arrays[name] = npy_view(arr.data) if arr.stype == "numpy.ndarray" else arr.numpy()
        except ValueError as exc:  # e.g. an object array, which would need unpickling
            raise DecodeError(
                f"arrays[{name!r}]: not a plain numpy array ({exc}); object arrays are refused"
            ) from exc
    return TrainingState(
        arrays=arrays, round=round, strategy_state=strategy_state, meta=dict(meta or {})
    )
