"""Flood resistance: a per-signer budget on the new records a peer takes from the network.

Every record needs only its own signatures to be valid, and some need just one (a link_down, a
party's leave, a founder's join), so one admitted party could sign records without end. The
record frontier keeps what a peer *holds* bounded (:mod:`chaos_flwr.membership`), but each new
record still costs its receivers a signature check and a fold. :class:`RecordBudget` bounds that
cost: each charter party has a token bucket (``rate`` tokens a minute, at most ``burst``, refilled
by the ``now`` the peer is given; no clock of its own). A new record is charged one token to
each of its signers, and refused, before any signature of it is checked, when none of its
signers has a token left. So one party alone can push at most its own budget, a record several
parties signed is refused only when every one of them is out of budget (a flooding co-signer
cannot block an honest party's records), and an honest party, which signs a handful of records
per membership event, is never refused. A refused record is not held; anti-entropy offers it
again later, so views still converge once the flood stops.

Tokens are charged only after the record's signatures verified (:meth:`RecordBudget.charge`),
so records forged in a party's name do not spend its budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .defaults import (
    FLOOD_RECORD_BURST_BASE,
    FLOOD_RECORD_BURST_PER_PARTY,
    FLOOD_RECORDS_PER_MINUTE,
)
from .errors import PolicyError

__all__ = ["RecordBudget", "limits_of"]

_SECONDS_PER_MINUTE = 60.0


def limits_of(charter: Any, parties: int) -> tuple[float, float]:
    """The ``(records per minute, burst)`` a charter sets, or the defaults.

    ``charter.limits`` (optional; a charter-like object may lack it) gives either value; a
    missing one is the default: ``FLOOD_RECORDS_PER_MINUTE``, and a burst of
    ``FLOOD_RECORD_BURST_BASE + FLOOD_RECORD_BURST_PER_PARTY * parties``.
    """
    limits = getattr(charter, "limits", None)
    rate = getattr(limits, "records_per_minute", None)
    burst = getattr(limits, "record_burst", None)
    return (
        float(FLOOD_RECORDS_PER_MINUTE if rate is None else rate),
        float(FLOOD_RECORD_BURST_BASE + FLOOD_RECORD_BURST_PER_PARTY * parties)
        if burst is None
        else float(burst),
    )


class RecordBudget:
    """Token buckets of the charter parties, metering the records a peer newly takes.

    Parameters
    ----------
    parties : Iterable[str]
        The charter's party ids; only they have buckets (a signer outside the charter is left
        to :func:`chaos_flwr.membership.validate_record`, which refuses it).
    rate_per_minute : float
        Tokens each bucket gains per minute of ``now``.
    burst : float
        Tokens a bucket holds at most (and at the start).

    Attributes
    ----------
    refused_by : dict[str, int]
        Party id -> records refused while every signer (that party among them) was out of
        budget. Keyed by charter parties only, so its size is bounded by the charter.
    """

    def __init__(self, parties: Iterable[str], rate_per_minute: float, burst: float) -> None:
        if not rate_per_minute > 0 or not burst >= 1:
            raise PolicyError(
                f"record limits must be records_per_minute > 0 and record_burst >= 1, got "
                f"{rate_per_minute!r} / {burst!r}"
            )
        self._rate = float(rate_per_minute) / _SECONDS_PER_MINUTE
        self._burst = float(burst)
        self._tokens: dict[str, float] = {pid: self._burst for pid in parties}
        self._at: dict[str, float] = {}
        self.refused_by: dict[str, int] = {}

    def _level(self, party: str, now: float) -> float:
        """The party's tokens at ``now`` (refilled since it was last charged)."""
        tokens = self._tokens[party]
        last = self._at.get(party)
        if last is not None and now > last:
            tokens = min(self._burst, tokens + (now - last) * self._rate)
            self._tokens[party] = tokens
            self._at[party] = now
        return tokens

    def allows(self, signers: Iterable[str], now: float) -> bool:
        """Whether a record of ``signers`` may be taken: some signer has a token left.

        A refused record is counted in :attr:`refused_by` against each of its charter signers.
        A signer set with no charter party is allowed (validation refuses it).
        """
        known = [s for s in signers if s in self._tokens]
        if not known or any(self._level(s, now) >= 1.0 for s in known):
            return True
        for s in known:
            self.refused_by[s] = self.refused_by.get(s, 0) + 1
        return False

    def spent(self, party: str, now: float) -> bool:
        """Whether charter party ``party`` is out of budget at ``now`` (no token left)."""
        return party in self._tokens and self._level(party, now) < 1.0

    def charge(self, signers: Iterable[str], now: float) -> None:
        """Spend one token of each charter signer of a record just taken (not below zero)."""
        for s in signers:
            if s in self._tokens:
                self._tokens[s] = max(0.0, self._level(s, now) - 1.0)
                self._at[s] = max(now, self._at.get(s, now))

    def tokens(self) -> Mapping[str, float]:
        """Party id -> tokens left as last computed (for observation and tests)."""
        return dict(self._tokens)
