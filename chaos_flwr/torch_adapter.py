"""Torch adapter: model ``state_dict`` + optimizer ``state_dict`` <-> :class:`TrainingState`.

Imported only when torch is used (``chaos_flwr.state`` never imports it).

Encoding
--------
Every tensor becomes one named array: model tensors as ``"model/<key>"``, optimizer tensors as
``"optim/<n>"`` where ``n`` numbers the tensors in the order a depth-first walk of the
optimizer state dict meets them. Everything that is not a tensor (the tree of dicts with int or
str keys, lists, tuples, ints, floats, bools, None, str) is kept as a *skeleton*: a tagged tree
encoded with :mod:`chaos_flwr.codec` and stored as bytes in ``meta["torch"]``. Tags keep
``tuple`` apart from ``list`` and int keys apart from str keys; floats are stored as their
IEEE-754 bits, so NaN payloads and ``-0.0`` survive. Dict items are kept in their original
order (optimizer code relies on the order of ``param_groups`` and ``params``), which is
deterministic because ``state_dict()`` builds them in a fixed order.

Tensors are copied to CPU and made contiguous; dtypes numpy lacks (``bfloat16``) are stored as
raw ``int16`` bits with the torch dtype in the skeleton, and rebuilt bit-exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from . import codec
from .errors import DecodeError
from .state import TrainingState

__all__ = ["MODEL_PREFIX", "OPTIM_PREFIX", "from_torch", "to_torch"]

#: Array-name prefix of model ``state_dict`` tensors.
MODEL_PREFIX = "model/"
#: Array-name prefix of optimizer ``state_dict`` tensors.
OPTIM_PREFIX = "optim/"
_META_KEY = "torch"
_F64 = struct.Struct(">d")
#: Torch dtypes without a numpy twin, stored as raw bits of a same-width integer.
_BITCAST: dict[torch.dtype, tuple[torch.dtype, str]] = {
    torch.bfloat16: (torch.int16, "bfloat16"),
}
_BY_NAME: dict[str, torch.dtype] = {name: dt for dt, (_, name) in _BITCAST.items()}


def _tensor_to_numpy(t: torch.Tensor) -> tuple[np.ndarray[Any, Any], str]:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _BITCAST:
        as_int, name = _BITCAST[t.dtype]
        return t.view(as_int).numpy().copy(), name
    return t.numpy().copy(), ""


def _numpy_to_tensor(arr: np.ndarray[Any, Any], tdtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.array(arr, copy=True))
    if tdtype:
        if tdtype not in _BY_NAME:
            raise DecodeError(f"meta.torch: unknown torch dtype {tdtype!r}")
        t = t.view(_BY_NAME[tdtype])
    return t


class _Walker:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}

    def walk(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"{OPTIM_PREFIX}{len(self.arrays)}"
            arr, tdtype = _tensor_to_numpy(value)
            self.arrays[name] = arr
            return {"t": "tensor", "name": name, "dtype": tdtype}
        if value is None or isinstance(value, (bool, str, bytes)):
            return {"t": "v", "v": value}
        if isinstance(value, int):
            return {"t": "v", "v": value}
        if isinstance(value, float):
            return {"t": "f", "v": _F64.pack(value)}
        if isinstance(value, Mapping):
            keys = []
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (int, str)):
                    raise TypeError(
                        f"optimizer_state{path}: key {k!r} is not int or str; only int and str "
                        "keys can be encoded"
                    )
                keys.append(k if isinstance(k, str) else {"i": k})
                items.append(self.walk(v, f"{path}[{k!r}]"))
            return {"t": "dict", "k": keys, "v": items}
        if isinstance(value, tuple):
            return {"t": "tuple", "v": [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"t": "list", "v": [self.walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        raise TypeError(
            f"optimizer_state{path}: a {type(value).__name__} cannot be encoded; optimizer "
            "state may hold tensors, dicts, lists, tuples, numbers, bools, str and None"
        )


def _unwalk(node: Any, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Any:
    if not isinstance(node, dict) or "t" not in node:
        raise DecodeError("meta.torch: malformed skeleton node")
    tag = node["t"]
    if tag == "v":
        return node["v"]
    if tag == "f":
        raw = node["v"]
        if not isinstance(raw, bytes) or len(raw) != _F64.size:
            raise DecodeError("meta.torch: malformed float")
        return _F64.unpack(raw)[0]
    if tag == "tensor":
        name = node["name"]
        if name not in arrays:
            raise DecodeError(f"meta.torch: the state has no array {name!r}")
        return _numpy_to_tensor(arrays[name], node["dtype"])
    if tag == "dict":
        keys = [k["i"] if isinstance(k, dict) else k for k in node["k"]]
        return {k: _unwalk(v, arrays) for k, v in zip(keys, node["v"], strict=True)}
    if tag == "tuple":
        return tuple(_unwalk(v, arrays) for v in node["v"])
    if tag == "list":
        return [_unwalk(v, arrays) for v in node["v"]]
    raise DecodeError(f"meta.torch: unknown skeleton tag {tag!r}")


def from_torch(
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any] | None = None,
    *,
    round: int,
    strategy_state: bytes = b"",
    meta: Mapping[str, Any] | None = None,
) -> TrainingState:
    """Build a :class:`TrainingState` from torch state dicts.

    Parameters
    ----------
    model_state : Mapping[str, torch.Tensor]
        ``model.state_dict()``.
    optimizer_state : Mapping[str, Any] or None, optional
        ``optimizer.state_dict()`` (nested dicts/lists of tensors and plain values).
    round : int
        The round number.
    strategy_state : bytes, optional
        Opaque strategy state.
    meta : Mapping[str, Any] or None, optional
        Extra metadata; the key ``"torch"`` is reserved.

    Returns
    -------
    TrainingState

    Raises
    ------
    TypeError
        If a value cannot be encoded (the message names its path) or ``meta`` uses ``"torch"``.
    """
    user_meta = dict(meta or {})
    if _META_KEY in user_meta:
        raise TypeError(f"meta: the key {_META_KEY!r} is reserved for the torch adapter")
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    model_keys: list[list[str]] = []
    for key, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"model_state[{key!r}]: got {type(tensor).__name__}, not a tensor")
        arr, tdtype = _tensor_to_numpy(tensor)
        arrays[MODEL_PREFIX + key] = arr
        model_keys.append([key, tdtype])
    skeleton: dict[str, Any] = {"model": model_keys, "optimizer": None}
    if optimizer_state is not None:
        walker = _Walker()
        skeleton["optimizer"] = walker.walk(optimizer_state, "")
        arrays.update(walker.arrays)
    user_meta[_META_KEY] = codec.encode(skeleton)
    return TrainingState(arrays=arrays, round=round, strategy_state=strategy_state, meta=user_meta)


def to_torch(
    state: TrainingState,
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Rebuild ``(model_state_dict, optimizer_state_dict)`` from a state made by :func:`from_torch`.

    Returns
    -------
    tuple
        The model state dict (original key order) and the optimizer state dict (or ``None``
        if none was stored), ready for ``load_state_dict``. Tensors are fresh CPU copies.

    Raises
    ------
    DecodeError
        If the state was not made by :func:`from_torch` or its skeleton is malformed.
    """
    raw = state.meta.get(_META_KEY)
    if not isinstance(raw, bytes):
        raise DecodeError(
            "meta.torch: missing; this state was not built by chaos_flwr.torch_adapter.from_torch"
        )
    skeleton = codec.decode(raw)
    if not isinstance(skeleton, dict) or set(skeleton) != {"model", "optimizer"}:
        raise DecodeError("meta.torch: malformed skeleton")
    model: dict[str, torch.Tensor] = {}
    for entry in skeleton["model"]:
        key, tdtype = entry
        name = MODEL_PREFIX + key
        if name not in state.arrays:
            raise DecodeError(f"meta.torch: the state has no array {name!r}")
        model[key] = _numpy_to_tensor(state.arrays[name], tdtype)
    opt = skeleton["optimizer"]
    optimizer = None if opt is None else _unwalk(opt, state.arrays)
    if optimizer is not None and not isinstance(optimizer, dict):
        raise DecodeError("meta.torch: the optimizer skeleton is not a dict")
    return model, optimizer
