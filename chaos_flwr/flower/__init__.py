"""chaos-flwr on Flower: the server wing (:class:`ChaosStrategy`), the client wing
(:func:`enable`) and the relay between them.

Importing this package imports Flower.
"""

from __future__ import annotations

from chaos_flwr.flower.client import (
    Party,
    PartySettings,
    enable,
    forget_party,
    party_for,
    party_settings,
)
from chaos_flwr.flower.keys import make_federation
from chaos_flwr.flower.profiles import Profile, available_profiles, load_profile
from chaos_flwr.flower.relay import Relay, exchange
from chaos_flwr.flower.server import (
    ChaosStrategy,
    JoinLog,
    JoinSettings,
    MembershipEvent,
    PhaseSettings,
    ResumeSettings,
    RoundLog,
    keyring_verifier,
)

__all__ = [
    "ChaosStrategy",
    "JoinLog",
    "JoinSettings",
    "MembershipEvent",
    "Party",
    "PartySettings",
    "PhaseSettings",
    "Profile",
    "Relay",
    "ResumeSettings",
    "RoundLog",
    "available_profiles",
    "enable",
    "exchange",
    "forget_party",
    "keyring_verifier",
    "load_profile",
    "make_federation",
    "party_for",
    "party_settings",
]
