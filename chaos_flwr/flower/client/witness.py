"""A party witnesses the round receipts the relay forwards: the equivocation check.

Each forwarded receipt is verified against the keyring; two valid receipts for one round with
different digests are equivocation evidence (:class:`chaos_flwr.receipts.Equivocation`): the
party keeps it (newest :data:`PARTY_MAX_EVIDENCE`), logs it as an ``EquivocationError`` and
reports it with its next reply, and refuses to train while it holds any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from flwr.app import ConfigRecord

from chaos_flwr.errors import ChaosError

if TYPE_CHECKING:
    from chaos_flwr.flower.client.party import Party
    from chaos_flwr.receipts import Equivocation

__all__ = ["PARTY_LEDGER_ROUNDS", "PARTY_MAX_EVIDENCE", "check_receipts", "keep_evidence"]

#: Rounds of receipts a party's ledger keeps in memory, up to its held round (the window of
#: :meth:`ReceiptLedger.window`): above the replicas a party keeps (STORE_KEEP_ROUNDS) and the
#: rounds it saves (FLOWER_DURABLE_LEDGER_ROUNDS), so every round it could still serve or
#: resume from is covered.
PARTY_LEDGER_ROUNDS: int = 16
#: Equivocation evidence a party keeps (:attr:`Party.evidence`, newest last). Any evidence at
#: all stops the party training, so dropping the oldest never lets a conflicted round through.
PARTY_MAX_EVIDENCE: int = 16


def check_receipts(party: Party, record: ConfigRecord | None) -> bool:
    """Compare the receipts the relay forwards (the previous round's) with ``party``'s own.

    Returns whether the party holds any evidence (it then refuses to train).
    """
    blobs = record.get("receipts") if record is not None else None
    if isinstance(blobs, list) and blobs and party.keyring is not None:
        from chaos_flwr.receipts import Receipt, ReceiptLedger

        if party._ledger is None:
            party._ledger = ReceiptLedger(dict(party.keyring))
        ledger = party._ledger
        if party.held_round >= 0:  # the previous rounds' receipts only, a bounded window
            ledger.window(party.held_round - PARTY_LEDGER_ROUNDS + 1, party.held_round + 1)
        found: list[Equivocation] = []
        own = party._receipt()
        if own:
            found += ledger.add_all(
                [Receipt.from_flower(party.party_id, party.held_round, party.held_digest, own)]
            )
        theirs: list[Receipt] = []
        for blob in blobs:
            if isinstance(blob, bytes):
                try:
                    theirs.append(Receipt.decode(blob))
                except ChaosError as exc:
                    party.errors.append(f"{type(exc).__name__}: {exc}")
        found += ledger.add_all(theirs)
        for ev in found:
            party.errors.append(f"EquivocationError: {ev.error()}")
        keep_evidence(party, found)
    return bool(party.evidence)


def keep_evidence(party: Party, found: Sequence[Equivocation]) -> None:
    """Append ``found`` to ``party.evidence``, keeping the newest ``PARTY_MAX_EVIDENCE``
    (those dropped unsent are not reported: the newer ones stop training just as well)."""
    party.evidence.extend(found)
    extra = len(party.evidence) - PARTY_MAX_EVIDENCE
    if extra > 0:
        del party.evidence[:extra]
        party._evidence_sent = max(0, party._evidence_sent - extra)
