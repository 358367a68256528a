"""Pulling a certified training state from its holders: messages, the puller's state machine,
and its saved form (sans-I/O; carriers live in :mod:`chaos_flwr.flower` and
:mod:`chaos_flwr.transport`)."""

from __future__ import annotations

from chaos_flwr.pull.messages import (
    ManifestReply,
    ManifestRequest,
    Op,
    Reply,
    Request,
    ShardsReply,
    ShardsRequest,
    SizeReply,
    SizeRequest,
    read_reply,
    read_request,
    serve,
)
from chaos_flwr.pull.negotiation import Decision, LinkResult, PullNegotiation, Stage, Status
from chaos_flwr.pull.saved import load_negotiation, save_negotiation

__all__ = [
    "Decision",
    "LinkResult",
    "ManifestReply",
    "ManifestRequest",
    "Op",
    "PullNegotiation",
    "Reply",
    "Request",
    "ShardsReply",
    "ShardsRequest",
    "SizeReply",
    "SizeRequest",
    "Stage",
    "Status",
    "load_negotiation",
    "read_reply",
    "read_request",
    "save_negotiation",
    "serve",
]
