"""A member countersigning a joiner's join over a direct link (sans-I/O): :func:`countersign`.

On Flower a join request reaches its sponsors through the relay, with their next message: while
their SuperNodes train, none comes, so a joiner that needs sponsors trains one round later than
it could. A party's daemon serves its links while its SuperNode trains; it answers a charter
party that asks it, over an authenticated link, to countersign that party's own join. It checks
what a sponsor checks when the request comes through the relay
(:meth:`~chaos_flwr.peer_joins.JoinNegotiation.on_join_req`): the body is a join of this
federation whose subject is the dialler, the joiner's signature verifies, this party is an
active member, and the join is of an incarnation above every one its view holds of the joiner.
Then it signs. When the signatures it holds make the record complete (``sponsors_required``
met), the record is returned too: the daemon holds it, so the joiner is a member in its view
(and is served) and gossip carries it on.

The function does no I/O and reads no clock.

Wire values (codec maps): request ``{"countersign": join body, "sigs": {signer: signature}}``
(the joiner's own signature at least; a joiner that already holds other sponsors' signatures
sends them too, so the donor can hold the complete record); reply ``{"sig": signature}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ChaosError, DecodeError, PolicyError
from .membership import (
    ACTIVE,
    Policy,
    Record,
    RecordSet,
    SignatureCache,
    signing_bytes,
    validate_record,
)

__all__ = ["COUNTERSIGN_KEY", "Countersigned", "countersign", "countersign_request"]

#: Request key naming a countersign request (its value: the join body).
COUNTERSIGN_KEY = "countersign"


@dataclass(frozen=True)
class Countersigned:
    """What :func:`countersign` gives: the reply, and the join record when it is complete."""

    reply: dict[str, Any]
    record: Record | None


def countersign_request(body: dict[str, Any], sigs: dict[str, bytes]) -> dict[str, Any]:
    """The request value asking a member to countersign the join ``body`` (``sigs``: the
    signatures held, the joiner's own among them)."""
    return {COUNTERSIGN_KEY: body, "sigs": dict(sigs)}


def _parse(value: Any, policy: Policy) -> tuple[dict[str, Any], dict[str, bytes]]:
    if not isinstance(value, dict) or not isinstance(value.get(COUNTERSIGN_KEY), dict):
        raise DecodeError("countersign request must be a map with 'countersign' (a join body)")
    sigs = value.get("sigs")
    if not isinstance(sigs, dict) or not 0 < len(sigs) <= len(policy.keyring):
        raise DecodeError("countersign field 'sigs' must map at most every charter party")
    if not all(isinstance(k, str) and isinstance(v, bytes) for k, v in sigs.items()):
        raise DecodeError("countersign field 'sigs' maps party ids to signature bytes")
    return value[COUNTERSIGN_KEY], sigs


def countersign(
    records: RecordSet,
    party_id: str,
    sign: Callable[[bytes], bytes],
    src: str,
    value: Any,
) -> Countersigned:
    """Countersign the join ``src`` asks for in ``value`` (``src`` authenticated by the link).

    Parameters
    ----------
    records
        This party's record set (its view, and the policy every record is checked against).
    party_id, sign
        This party's id, and its signing function (``Identity.sign``).
    src
        The dialler's party id.
    value
        The decoded request (module docstring).

    Returns
    -------
    Countersigned
        The reply (this party's signature over the body), and the join record when the
        signatures make it complete (validated against the charter; not held here).

    Raises
    ------
    DecodeError
        ``value`` is not a countersign request, or its body is malformed.
    PolicyError
        The body is not a join of ``src`` in this federation, this party is not an active
        member, or the view holds an incarnation of ``src`` at or above the body's.
    SignatureError, UnknownPartyError
        The joiner's signature does not verify, or ``src`` is no charter party.
    """
    policy = records.policy
    body, sigs = _parse(value, policy)
    if body.get("kind") != "join" or body.get("federation") != policy.federation:
        raise PolicyError("countersign asks for a join record of this federation only")
    if body.get("subject") != src or src not in sigs:
        raise PolicyError("a countersign request carries the dialler's own signed join")
    incarnation = body.get("incarnation")
    if not isinstance(incarnation, int) or isinstance(incarnation, bool):
        raise DecodeError("join body field 'incarnation' must be an int")
    own = Record(body=body, signatures={src: sigs[src]})
    with contextlib.suppress(PolicyError):  # its sponsors are what it asks for
        validate_record(own, policy)  # the body's shape, and the joiner's signature
    me = records.member(party_id)
    if me is None or me.status != ACTIVE:
        raise PolicyError(f"party {party_id} is not an active member; cannot sponsor")
    known = records.member(src)
    if known is not None and known.incarnation >= incarnation:
        raise PolicyError(
            f"incarnation {known.incarnation} of {src} is held ({known.status}); a join "
            "countersigned now names a higher one"
        )
    mine = sign(signing_bytes(body))
    return Countersigned({"sig": mine}, _complete(body, sigs, src, party_id, mine, policy))


def _complete(
    body: dict[str, Any], sigs: dict[str, bytes], src: str, me: str, mine: bytes, policy: Policy
) -> Record | None:
    """The join record of every signature sent and this party's, or of the joiner's and this
    party's alone, whichever validates first (``None``: not complete yet)."""
    cache = SignatureCache()
    for signatures in ({**sigs, me: mine}, {src: sigs[src], me: mine}):
        record = Record(body=body, signatures=signatures)
        try:
            validate_record(record, policy, cache)
        except ChaosError:
            continue
        return record
    return None
