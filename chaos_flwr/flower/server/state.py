"""What a round certifies: the digest of the training state, and the inner strategy's own state.

:func:`certified_digest` is the digest every party's receipt names;
:func:`strategy_state_of` / :func:`restore_strategy_state` carry the inner strategy's state
(e.g. FedAdam's moments) inside the certified state, so a resumed ServerApp gets it back.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy

from chaos_flwr.state import TrainingState, from_array_record

__all__ = [
    "certified_digest",
    "certified_state",
    "restore_strategy_state",
    "strategy_state_of",
]


def certified_digest(arrays: ArrayRecord, server_round: int, strategy_state: bytes = b"") -> bytes:
    """Digest of the training state ``(arrays, server_round, strategy_state)``, as receipts
    certify it.

    It is :meth:`chaos_flwr.state.TrainingState.digest` of the state built from the
    ArrayRecord, so receipts, replica files and shard manifests name the same digest.
    ``strategy_state`` is the inner strategy's opaque state (e.g. FedAdam's moments).
    """
    return certified_state(arrays, server_round, strategy_state).digest()


def certified_state(
    arrays: ArrayRecord, server_round: int, strategy_state: bytes = b""
) -> TrainingState:
    """The training state a round certifies (its digest is :func:`certified_digest`'s, its
    :meth:`~chaos_flwr.state.TrainingState.serialized_size` the size a joiner pulls)."""
    return from_array_record(arrays, round=server_round, strategy_state=strategy_state)


_M, _V = "m_t/", "v_t/"


def strategy_state_of(inner: Strategy) -> bytes:
    """The inner strategy's own state as opaque bytes (part of the certified state).

    A strategy with a ``chaos_state() -> bytes`` method gives its own; FedOpt strategies
    (FedAdam, FedYogi, FedAdagrad) give their moments ``m_t`` / ``v_t``; others none.
    """
    own = getattr(inner, "chaos_state", None)
    if callable(own):
        return bytes(own())
    m, v = getattr(inner, "m_t", None), getattr(inner, "v_t", None)
    if not isinstance(m, dict) and not isinstance(v, dict):
        return b""
    arrays = {f"{_M}{k}": np.asarray(a) for k, a in (m or {}).items()}
    arrays.update({f"{_V}{k}": np.asarray(a) for k, a in (v or {}).items()})
    if not arrays:
        return b""
    return TrainingState(arrays=arrays, round=0).to_bytes()


def restore_strategy_state(inner: Strategy, blob: bytes) -> None:
    """Give the inner strategy back the state :func:`strategy_state_of` took (a resume)."""
    own = getattr(inner, "chaos_restore", None)
    if callable(own):
        own(blob)
        return
    if not blob or not hasattr(inner, "m_t"):
        return
    state = TrainingState.from_bytes(blob)
    m = {k[len(_M) :]: np.array(a) for k, a in state.arrays.items() if k.startswith(_M)}
    v = {k[len(_V) :]: np.array(a) for k, a in state.arrays.items() if k.startswith(_V)}
    inner.m_t = m or None
    inner.v_t = v or None  # type: ignore[attr-defined]
