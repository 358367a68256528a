"""chaos-flwr: self-healing and autoscaling for Flower federated learning over WANs.

Implements Chaos (arXiv 2505.12815) on Flower: multi-neighbour state replication with optimal
shard planning, and membership agreed by signed peer-to-peer negotiation, so the Flower server is
an untrusted relay that can be killed and rebuilt from the parties' replicas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .charter import Charter, load_charter
from .errors import (
    ChaosError,
    CharterError,
    ConfigError,
    DecodeError,
    EncodeError,
    EquivocationError,
    KeyFileError,
    OversizeError,
    PlanError,
    PolicyError,
    ProfileError,
    ReplayError,
    ShardIntegrityError,
    SignatureError,
    StaleIncarnationError,
    StoreError,
    TransferError,
    TransportError,
    UnknownPartyError,
)
from .identity import Identity, party_id_of
from .membership import View
from .monitor import Monitor
from .peer import Outgoing, Peer
from .planner import Donor, TransferPlan, lower_bound, plan_transfer
from .state import Manifest, TrainingState
from .store import ReplicaStore
from .transfer import PullSession, ShardServer
from .wire import Envelope, ReplayGuard, open_sealed, seal

if TYPE_CHECKING:
    from .flower import ChaosStrategy, enable

#: Names served lazily because they import Flower (heavy) on first use.
_FLOWER_NAMES = {"ChaosStrategy", "enable"}


def __getattr__(name: str) -> Any:
    if name in _FLOWER_NAMES:
        from . import flower

        return getattr(flower, name)
    raise AttributeError(f"module 'chaos_flwr' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "ChaosError",
    "ChaosStrategy",
    "Charter",
    "CharterError",
    "ConfigError",
    "DecodeError",
    "Donor",
    "EncodeError",
    "Envelope",
    "EquivocationError",
    "Identity",
    "KeyFileError",
    "Manifest",
    "Monitor",
    "Outgoing",
    "OversizeError",
    "Peer",
    "PlanError",
    "PolicyError",
    "ProfileError",
    "PullSession",
    "ReplayError",
    "ReplayGuard",
    "ReplicaStore",
    "ShardIntegrityError",
    "ShardServer",
    "SignatureError",
    "StaleIncarnationError",
    "StoreError",
    "TrainingState",
    "TransferError",
    "TransferPlan",
    "TransportError",
    "UnknownPartyError",
    "View",
    "__version__",
    "enable",
    "load_charter",
    "lower_bound",
    "open_sealed",
    "party_id_of",
    "plan_transfer",
    "seal",
]
