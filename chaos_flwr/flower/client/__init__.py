"""The client wing: what runs inside a Flower ClientApp.

- :mod:`.enable`: :func:`enable`, the one hook (registers ``query.chaos``, wraps train/evaluate);
- :mod:`.settings`: :class:`PartySettings` and :func:`party_settings` (``node_config`` and the
  run config fallbacks);
- :mod:`.party`: :class:`Party`, one party's Chaos runtime (receipts, held state, membership
  actions);
- :mod:`.joiner` / :mod:`.donor`: the two ends of a pull of the certified state;
- :mod:`.factory`: :func:`default_party_factory` (identity, charter, peer, saved state);
- :mod:`.registry`: the process's parties (:func:`party_for`, :func:`forget_party`).

Helpers that drive a party from outside (churn scenarios) get it with :func:`party_for` and
call :meth:`Party.leave`, :meth:`Party.connect` or :meth:`Party.disconnect`.
"""

from __future__ import annotations

from chaos_flwr.flower.client.enable import enable
from chaos_flwr.flower.client.factory import default_party_factory
from chaos_flwr.flower.client.party import Party
from chaos_flwr.flower.client.registry import PartyFactory, forget_party, party_for
from chaos_flwr.flower.client.settings import RUN_KEYS_DIR, PartySettings, party_settings

__all__ = [
    "RUN_KEYS_DIR",
    "Party",
    "PartyFactory",
    "PartySettings",
    "default_party_factory",
    "enable",
    "forget_party",
    "party_for",
    "party_settings",
]
