"""The server wing: what the Flower ServerApp runs.

- :mod:`.strategy`: :class:`ChaosStrategy`, delegation to the inner strategy and the round loop;
- :mod:`.settings`: its grouped settings (:class:`PhaseSettings`, :class:`JoinSettings`,
  :class:`ResumeSettings`);
- :mod:`.options`: :func:`run_options`, the strategy's settings from the run config;
- :mod:`.courier`: messages with relay envelopes, deadline-bounded exchanges, receipts,
  suspects, eligibility;
- :mod:`.joins`: the join relay (joiners pull the certified state from its holders);
- :mod:`.resume`: a restarted ServerApp rebuilding the certified state from the parties;
- :mod:`.logs`: :class:`RoundLog`, :class:`JoinLog`, :class:`MembershipEvent`;
- :mod:`.view`: the server-side view of the membership, from the records it relays;
- :mod:`.state`: the certified digest and the inner strategy's own state.
"""

from __future__ import annotations

from chaos_flwr.flower.server.courier import ReceiptVerifier, keyring_verifier
from chaos_flwr.flower.server.logs import JoinLog, MembershipEvent, RoundLog
from chaos_flwr.flower.server.options import run_options
from chaos_flwr.flower.server.settings import JoinSettings, PhaseSettings, ResumeSettings
from chaos_flwr.flower.server.state import (
    certified_digest,
    restore_strategy_state,
    strategy_state_of,
)
from chaos_flwr.flower.server.strategy import ChaosStrategy
from chaos_flwr.flower.server.view import ServerView

__all__ = [
    "ChaosStrategy",
    "JoinLog",
    "JoinSettings",
    "MembershipEvent",
    "PhaseSettings",
    "ReceiptVerifier",
    "ResumeSettings",
    "RoundLog",
    "ServerView",
    "certified_digest",
    "keyring_verifier",
    "restore_strategy_state",
    "run_options",
    "strategy_state_of",
]
