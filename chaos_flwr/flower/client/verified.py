"""A party's verifiable-rounds state (:mod:`chaos_flwr.rounds`): :class:`VerifiedRounds`.

What a signing party must remember between messages about the rounds it takes part in: its
round guard, its last commitment, the audits it signed or keeps, the rota and commitments of
the state it holds, the round it rolled back from and the refutations it acted on; how it
saves and takes that up (the ``rounds`` part of
:class:`~chaos_flwr.flower.durable.SavedParty`), and how it rolls back. The checks that use it
are in :mod:`.proofs`; :class:`~chaos_flwr.flower.client.party.Party` carries it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord

from chaos_flwr.errors import ChaosError, StoreError
from chaos_flwr.state import TrainingState, to_array_record

if TYPE_CHECKING:
    from chaos_flwr.rounds import RoundGuard
    from chaos_flwr.store import ReplicaStore

__all__ = ["PARTY_MAX_AUDITS_SAVED", "VerifiedRounds"]

#: Audits a party saves between messages (of the state it holds, and those not yet sent).
PARTY_MAX_AUDITS_SAVED: int = 16


class VerifiedRounds:
    """The verifiable-rounds part of a party (module docstring): a base of ``Party``, whose
    dataclass declares the fields below."""

    if TYPE_CHECKING:  # declared by Party's dataclass (what this class and .proofs read)
        party_id: str
        peer: Any
        keyring: Mapping[str, bytes] | None
        pending: list[Any]
        clock: Callable[[], float]
        left: bool
        held_round: int
        held_digest: bytes
        held_state: TrainingState | None
        held_arrays: ArrayRecord | None
        store: ReplicaStore | None
        errors: list[str]
        signer: Callable[[bytes], bytes] | None
        guard: RoundGuard | None
        committed: tuple[int, bytes] | None
        audits_out: list[bytes]
        audits_kept: list[bytes]
        rolled_from: int
        diverged: dict[str, int]
        held_rota: list[str]
        held_commits: bytes
        refutations: list[bytes]
        _saved_held: tuple[int, list[str], bytes] | None

        def hold(
            self, state: TrainingState, arrays: ArrayRecord | None = None, digest: bytes = b""
        ) -> None: ...

    def _rounds_saved(self) -> dict[str, object]:
        """The verifiable rounds' part of the saved state (bounded)."""
        kept = self.audits_of_held() + [b for b in self.audits_out if b not in self.audits_kept]
        return {
            "committed": [] if self.committed is None else list(self.committed),
            "audits": kept[-PARTY_MAX_AUDITS_SAVED:],
            "audits_out": list(self.audits_out),
            "rolled_from": self.rolled_from,
            "diverged": dict(self.diverged),  # charter parties only: bounded by the keyring
            "held": [self.held_round, list(self.held_rota), self.held_commits],
            "refutations": list(self.refutations),
        }

    def audits_of_held(self) -> list[bytes]:
        """Encoded audits this party knows of the state it holds (a restarted ServerApp
        collects them on its first message: the next certify's proof needs them)."""
        guard = self.guard
        if guard is None or self.held_round < 0:
            return list(self.audits_kept)
        found = guard.audits.get((self.held_round, self.held_digest), {})
        return [a.encode() for _, a in sorted(found.items())]

    def _take_up_rounds(self, value: Mapping[str, object]) -> None:
        committed = value.get("committed")
        if isinstance(committed, list) and len(committed) == 2:
            rnd, dig = committed
            if isinstance(rnd, int) and isinstance(dig, bytes):
                self.committed = (rnd, dig)
        audits = value.get("audits")
        if isinstance(audits, list):
            self.audits_kept = [b for b in audits if isinstance(b, bytes)][-PARTY_MAX_AUDITS_SAVED:]
        out = value.get("audits_out")
        if isinstance(out, list):
            self.audits_out = [b for b in out if isinstance(b, bytes)][-PARTY_MAX_AUDITS_SAVED:]
        diverged = value.get("diverged")
        if isinstance(diverged, dict):
            self.diverged = {
                k: v for k, v in diverged.items() if isinstance(k, str) and isinstance(v, int)
            }
        held = value.get("held")
        if isinstance(held, list) and len(held) == 3 and isinstance(held[0], int):
            rota, commits = held[1], held[2]
            if isinstance(rota, list) and isinstance(commits, bytes):
                self._saved_held = (held[0], [p for p in rota if isinstance(p, str)], commits)
                self._apply_saved_held()
        refs = value.get("refutations")
        if isinstance(refs, list):
            self.refutations = [b for b in refs if isinstance(b, bytes)][-PARTY_MAX_AUDITS_SAVED:]
        rolled = value.get("rolled_from")
        if isinstance(rolled, int) and not isinstance(rolled, bool):
            self.rolled_from = rolled

    def _apply_saved_held(self) -> None:
        """Take up the saved rota and commitments digest if they are of the held round."""
        saved = self._saved_held
        if saved is not None and saved[0] == self.held_round >= 0:
            self.held_rota, self.held_commits = list(saved[1]), saved[2]

    def max_signed_round(self) -> int:
        """The newest round this party signed a receipt for (-1 for a party that signs
        nothing: it never refuses a pull for that reason): its held round, any replica it
        keeps (after a restart the store still names the rounds it signed), or the round it
        rolled back from."""
        if self.signer is None:
            return -1
        newest = self.held_round
        if self.store is not None:
            with contextlib.suppress(StoreError):
                newest = max([newest, *self.store.rounds()])
        return max(newest, self.rolled_from)

    def signed_digest(self, rnd: int) -> bytes | None:
        """The digest this party holds (and signed) for round ``rnd``, if it keeps one (never
        for the round it rolled back from: it no longer vouches for that state)."""
        if rnd == self.rolled_from:
            return None
        if rnd == self.held_round and self.held_digest:
            return self.held_digest
        if self.store is not None:
            try:
                if rnd in self.store.rounds():
                    with self.store.open(rnd, verify=False) as replica:
                        return bytes(replica.state_digest)
            except StoreError:
                return None
        return None

    def note_refutation(self, blob: bytes) -> None:
        """Keep a negative audit (the newest ``PARTY_MAX_AUDITS_SAVED``; only ``ok = false``
        ones are kept, checked by the caller)."""
        from chaos_flwr.rounds import Audit

        try:
            if Audit.decode(blob).ok:
                return
        except ChaosError:
            return
        if blob not in self.refutations:
            self.refutations.append(blob)
            del self.refutations[:-PARTY_MAX_AUDITS_SAVED]

    def rollback_base(self) -> bool:
        """Whether the held state is where the party rolled back to from a refuted one."""
        return self.rolled_from > self.held_round >= 0

    def roll_back(self) -> None:
        """The held state was audited false: go back to the newest older replica (its base),
        keeping in mind the round it left (it never signs that round number again)."""
        if self.held_round < 0:
            return
        self.rolled_from = max(self.rolled_from, self.held_round)
        older: list[int] = []
        if self.store is not None:
            try:  # the refuted replica goes (it would push out the base a later audit reads)
                self.store.discard(self.held_round)
                older = [r for r in self.store.rounds() if r < self.held_round]
            except StoreError as exc:
                self.errors.append(f"StoreError: {exc}")
        state: TrainingState | None = None
        if older and self.store is not None:
            try:
                state = self.store.get(max(older))
            except StoreError as exc:
                self.errors.append(f"StoreError: {exc}")
        self.held_rota, self.held_commits = [], b""  # of the refuted state
        if state is None:  # nothing to go back to: it holds nothing and pulls as a joiner
            self.held_round, self.held_digest = -1, b""
            self.held_state, self.held_arrays = None, None
            return
        self.held_round = state.round
        self.held_digest = state.digest()
        self.held_state = state
        self.held_arrays = to_array_record(state)
