"""What the simulator's training model shares: its messages, certificates and party state.

:mod:`chaos_flwr.sim.training` (the relay and the parties), :mod:`chaos_flwr.sim.pulls` (state
transfers) and :mod:`chaos_flwr.sim.invariants` (the checker) all read these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import codec
from ..receipts import ReceiptLedger
from ..state import TrainingState
from ..transfer import PullSession
from .settings import SIM_TRAIN_STATE_BYTES

__all__ = [
    "GENESIS_PREV",
    "RELAY",
    "TRAIN_TAG",
    "Cert",
    "Pull",
    "Round",
    "TrainParty",
    "aggregate_state",
    "genesis_state",
    "train_msg",
]

#: Prefix of every training message (peer envelopes never start with it).
TRAIN_TAG = b"chaos-sim/train\x00"
#: Network id of the relay.
RELAY = "relay"
GENESIS_PREV = bytes(32)


def aggregate_state(prev: bytes, round: int, contributors: Sequence[str]) -> TrainingState:
    """The deterministic aggregate of round ``round`` over ``prev`` and ``contributors``."""
    members = sorted(contributors)
    mdigest = hashlib.sha256(codec.encode(members)).digest()
    seed = hashlib.sha256(
        b"chaos-sim/aggregate\x00" + codec.encode({"prev": prev, "round": round, "m": mdigest})
    ).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "big"))
    w = rng.integers(0, 256, SIM_TRAIN_STATE_BYTES, dtype=np.uint8)
    return TrainingState({"w": w}, round=round, meta={"prev": prev, "members": mdigest})


def genesis_state(founders: Sequence[str]) -> TrainingState:
    """Round 0: derived from the charter's founders, known to every party without a transfer."""
    return aggregate_state(GENESIS_PREV, 0, founders)


def train_msg(kind: str, **fields: Any) -> bytes:
    """A training message of ``kind`` (tagged, so peer envelopes never match)."""
    return TRAIN_TAG + codec.encode({"k": kind, **fields})


@dataclass
class Cert:
    """A round's certificate: its digest, contributors and their receipts."""

    round: int
    digest: bytes
    members: tuple[str, ...]
    receipts: tuple[bytes, ...]

    def value(self) -> dict[str, Any]:
        """The certificate as a codec value."""
        return {
            "r": self.round,
            "d": self.digest,
            "c": list(self.members),
            "x": list(self.receipts),
        }

    @classmethod
    def of(cls, v: Any) -> Cert | None:
        """A certificate from a codec value (``None`` for none)."""
        if not isinstance(v, dict):
            return None
        return cls(int(v["r"]), bytes(v["d"]), tuple(v["c"]), tuple(v["x"]))


@dataclass
class Pull:
    """A party's state transfer in progress."""

    round: int
    digest: bytes
    donors: list[str]
    started: float
    session: PullSession | None = None
    manifest_from: str | None = None
    token: int = 0
    lost: int = 0


@dataclass
class TrainParty:
    """One party's training side (its replicas, ledger, receipts and current pull)."""

    pid: str
    ledger: ReceiptLedger
    held: dict[int, bytes] = field(default_factory=dict)
    digests: dict[int, bytes] = field(default_factory=dict)
    certs: dict[int, Cert] = field(default_factory=dict)
    known: dict[int, bytes] = field(default_factory=dict)
    signed: dict[int, bytes] = field(default_factory=dict)
    tentative: dict[int, tuple[bytes, bytes, tuple[str, ...]]] = field(default_factory=dict)
    pull: Pull | None = None
    fresh: bool = False
    receipts: dict[int, bytes] = field(default_factory=dict)
    manifests: dict[tuple[int, int, int], bytes] = field(default_factory=dict)

    def top(self) -> int:
        """Newest certified round held."""
        return max(self.held)


@dataclass
class Round:
    """The relay's bookkeeping of the round it runs."""

    round: int
    invited: list[str]
    ready: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    certs: dict[int, Cert] = field(default_factory=dict)
    members: tuple[str, ...] = ()
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)
    agg_round: int = -1
    done: bool = False
