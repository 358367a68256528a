"""Carriers: opaque bytes between party ids (in-memory, grpc.aio, shaped, netns)."""

from __future__ import annotations

from .base import Carrier, Handler
from .grpc_carrier import GrpcCarrier
from .memory import Endpoint, MemoryNetwork
from .shaping import Shaper, TokenBucket, WanProfile, load_profile, parse_profile

__all__ = [
    "Carrier",
    "Endpoint",
    "GrpcCarrier",
    "Handler",
    "MemoryNetwork",
    "Shaper",
    "TokenBucket",
    "WanProfile",
    "load_profile",
    "parse_profile",
]
