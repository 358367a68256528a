"""chaos-flwr on Flower: ChaosStrategy (server side), :func:`enable` (client side), the relay.

Importing this package imports Flower.
"""

from __future__ import annotations

from chaos_flwr.flower.client import Party, PartySettings, enable, party_for, party_settings
from chaos_flwr.flower.keys import make_federation
from chaos_flwr.flower.profiles import Profile, available_profiles, load_profile
from chaos_flwr.flower.relay import Relay, exchange
from chaos_flwr.flower.strategy import (
    ChaosStrategy,
    JoinLog,
    MembershipEvent,
    RoundLog,
    keyring_verifier,
)

__all__ = [
    "ChaosStrategy",
    "JoinLog",
    "MembershipEvent",
    "Party",
    "PartySettings",
    "Profile",
    "Relay",
    "RoundLog",
    "available_profiles",
    "enable",
    "exchange",
    "keyring_verifier",
    "load_profile",
    "make_federation",
    "party_for",
    "party_settings",
]
