"""The donor side of a pull: a party answers a joiner's request from the replica it holds.

The request names the certified round and digest; the party serves it only while it holds that
state (its bytes are cached per round in ``Party._bytes``). The request is one of
:mod:`chaos_flwr.pull.messages` as a ConfigRecord (:func:`serve_request`): the party is told the
shard shape and never plans.
"""

from __future__ import annotations

from typing import Protocol

from flwr.app import ConfigRecord

from chaos_flwr.errors import ChaosError
from chaos_flwr.pull.messages import read_request
from chaos_flwr.pull.messages import serve as serve_message
from chaos_flwr.state import TrainingState

__all__ = ["DonorParty", "serve", "serve_request"]


class DonorParty(Protocol):
    """What :func:`serve` uses of a :class:`~chaos_flwr.flower.client.party.Party`."""

    held_state: TrainingState | None
    held_round: int
    held_digest: bytes
    left: bool
    direct_addr: str
    errors: list[str]
    _bytes: bytes
    _bytes_round: int


def serve(party: DonorParty, record: ConfigRecord, request: ConfigRecord) -> ConfigRecord | None:
    """Answer a pull request from the held replica, if it is the state the request names."""
    if party.held_state is None or party.left:
        return None
    if record.get("round") != party.held_round or record.get("digest") != party.held_digest:
        return None
    if party._bytes_round != party.held_round:
        party._bytes = party.held_state.to_bytes()
        party._bytes_round = party.held_round
    try:
        return serve_request(party._bytes, request, direct_addr=party.direct_addr)
    except ChaosError as exc:
        party.errors.append(f"{type(exc).__name__}: {exc}")
        return None


def serve_request(
    state_bytes: bytes, request: ConfigRecord, *, direct_addr: str = ""
) -> ConfigRecord:
    """A holder's answer to a pull request over its replica bytes (:func:`chaos_flwr.pull.serve`).

    Parameters
    ----------
    direct_addr:
        The holder's direct replica server (``host:port``, see :mod:`chaos_flwr.flower.direct`);
        when set, the size and manifest replies name it under ``direct`` so a joiner can
        fetch its shards without the relay.

    Raises
    ------
    chaos_flwr.errors.DecodeError
        A malformed request (:func:`chaos_flwr.pull.read_request`) or one the holder refuses.
    """
    reply = serve_message(state_bytes, read_request(request), direct_addr=direct_addr)
    return ConfigRecord(reply.to_value())  # type: ignore[arg-type]
