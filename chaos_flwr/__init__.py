"""chaos-flwr: self-healing and autoscaling for Flower federated learning over WANs.

Implements Chaos (arXiv 2505.12815) on Flower: multi-neighbour state replication with optimal
shard planning, and membership agreed by signed peer-to-peer negotiation, so the Flower server is
an untrusted relay that can be killed and rebuilt from the parties' replicas.
"""

from __future__ import annotations

from .errors import (
    ChaosError,
    CharterError,
    ConfigError,
    DecodeError,
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

__version__ = "0.1.0"

__all__ = [
    "ChaosError",
    "CharterError",
    "ConfigError",
    "DecodeError",
    "EquivocationError",
    "KeyFileError",
    "OversizeError",
    "PlanError",
    "PolicyError",
    "ProfileError",
    "ReplayError",
    "ShardIntegrityError",
    "SignatureError",
    "StaleIncarnationError",
    "StoreError",
    "TransferError",
    "TransportError",
    "UnknownPartyError",
    "__version__",
]
