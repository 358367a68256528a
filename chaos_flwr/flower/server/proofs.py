"""The ServerApp's side of the verifiable rounds (:mod:`chaos_flwr.rounds`): it gathers what
the parties sign and hands it on, and decides nothing.

- It keeps the signed update commitments of the train replies and aggregates only the updates
  whose commitment verifies and matches what was sent (:meth:`RoundProofs.select`), in party-id
  order (the order every auditor recomputes in).
- A certify carries its proof (:meth:`RoundProofs.certify_fields`): base, commitments, the
  federation's rule, and the audits of its base round.
- The audit of round r rides on round r's certify messages to its rota auditors
  (:meth:`RoundProofs.audit_job`): the round's committed updates and its commitments. Their
  signed audits come back with the certify replies, so an honest run pays no extra exchange.
  When they do not come in, the next train messages ask again, the spare rota positions too;
  a round whose base has no audits is not certified (tried again).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.supercore import log

from chaos_flwr.defaults import AUDIT_ROTA_SPARE, ROUNDS_MAX_AUDITS_KEPT
from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.updates import copy_update, update_digest
from chaos_flwr.peer import federation_tag
from chaos_flwr.rounds import Audit, Commitment, auditors_of, keep_audit, open_audit

__all__ = ["SERVER_MAX_REFUTATIONS", "AuditJob", "Chosen", "RoundProofs"]

#: Negative audits the ServerApp keeps and forwards with its train messages (the newest).
SERVER_MAX_REFUTATIONS: int = 8


@dataclass(frozen=True)
class Chosen:
    """An update the aggregate uses: its party, its signed commitment, the reply (what the
    inner strategy aggregates) and the update's records as they came (what the auditors are
    sent: a copy of the record containers, so an inner strategy that pops arrays out of the
    replies, as FedMedian and FedTrimmedAvg do, leaves the audit material whole)."""

    party: str
    commitment: bytes
    reply: Message
    update: RecordDict


@dataclass(frozen=True)
class AuditJob:
    """What the rota auditors of one round are sent (with their train messages)."""

    parties: frozenset[str]
    fields: tuple[tuple[str, Any], ...]
    updates: tuple[tuple[str, RecordDict], ...]


@dataclass
class _Certified:
    round: int
    digest: bytes
    base_round: int
    base_digest: bytes
    chosen: tuple[Chosen, ...]
    rota: tuple[str, ...] = ()
    asks: int = 0


@dataclass
class RoundProofs:
    """Commitments and audits as the relay sees them (module docstring).

    Parameters
    ----------
    keyring, federation:
        The charter's keys and federation tag (what signatures are checked against).
    rule_id, min_updates, auditors:
        The charter's round policy (:meth:`chaos_flwr.charter.Charter.round_policy`).
    """

    keyring: Mapping[str, bytes]
    federation: bytes
    rule_id: bytes = b""
    min_updates: int = 1
    auditors: int | None = 0
    commits: dict[int, bytes] = field(default_factory=dict)
    audits: dict[tuple[int, bytes], dict[str, bytes]] = field(default_factory=dict)
    last: _Certified | None = None
    refuted: dict[tuple[int, bytes], bytes] = field(default_factory=dict)

    @classmethod
    def from_charter(cls, charter: Any) -> RoundProofs:
        """The proofs of a federation from its verified charter."""
        policy = getattr(charter, "round_policy", None)
        pol = policy() if callable(policy) else None
        return cls(
            keyring=dict(charter.keyring()),
            federation=federation_tag(charter),
            rule_id=getattr(pol, "rule_id", b""),
            min_updates=getattr(pol, "min_updates", 1),
            auditors=getattr(pol, "auditors", 0),
        )

    # -- what the replies carry -----------------------------------------------------------------
    def absorb(self, node: int, record: ConfigRecord) -> None:
        """Keep a reply's commitment (unchecked until :meth:`select`) and its audits (checked)."""
        blob = record.get("commit")
        if isinstance(blob, bytes) and blob:
            self.commits[node] = blob
        for key in ("audits", "audits-held"):
            blobs = record.get(key)
            if isinstance(blobs, list):
                self.note_audits(b for b in blobs if isinstance(b, bytes))

    def note_audits(self, blobs: Iterable[bytes]) -> None:
        """Keep the audits that verify (the newest rounds only)."""
        for blob in blobs:
            try:
                audit = open_audit(blob, self.federation, self.keyring)
            except ChaosError:
                continue
            if self.last is not None and not (
                self.last.base_round - ROUNDS_MAX_AUDITS_KEPT <= audit.round <= self.last.round
            ):
                continue  # far from the rounds in play: a flood of them evicts nothing
            keep_audit(self.audits, (audit.round, audit.digest), audit.party, blob)
            if not audit.ok:  # forwarded to every party until the run ends (bounded)
                self.refuted[(audit.round, audit.digest)] = blob
                while len(self.refuted) > SERVER_MAX_REFUTATIONS:
                    del self.refuted[min(self.refuted)]

    def refutations(self) -> list[bytes]:
        """The negative audits it knows (each party checks them against its own rota and rolls
        back a state they refute)."""
        return [self.refuted[k] for k in sorted(self.refuted)]

    def top_refuted(self) -> int:
        """The newest round a negative audit refutes (-1: none): no party signs it again, so
        the round after a rollback is numbered above it."""
        return max((r for r, _ in self.refuted), default=-1)

    def audits_of(self, round_: int, digest: bytes) -> list[bytes]:
        """Encoded audits of a state, by auditor."""
        found = self.audits.get((round_, digest), {})
        return [found[p] for p in sorted(found)]

    def verdict(self, round_: int, digest: bytes, active: Sequence[str]) -> bool | None:
        """Final (``True``), refuted (``False``) or undecided (``None``), as a party would
        judge it with the same view (:meth:`chaos_flwr.rounds.RoundGuard.verdict`)."""
        if round_ == 0 or self.auditors == 0:
            return True
        spare = 0 if self.auditors is None else AUDIT_ROTA_SPARE
        rota = set(
            auditors_of(round_, active, None if self.auditors is None else self.auditors + spare)
        )
        last = self.last
        if last is not None and (last.round, last.digest) == (round_, digest):
            rota |= set(last.rota)
        need = len(auditors_of(round_, active, self.auditors))
        good = 0
        for blob in self.audits_of(round_, digest):
            audit = Audit.decode(blob)
            if audit.party in rota:
                if not audit.ok:
                    return False
                good += 1
        return True if need and good >= need else None

    # -- the train phase ------------------------------------------------------------------------
    def select(
        self,
        round_: int,
        base: tuple[int, bytes],
        party_of: Mapping[int, str],
        replies: Sequence[Message],
        gone: Collection[str] = (),
    ) -> list[Chosen]:
        """The train replies the aggregate may use, sorted by party id: each with a commitment
        that verifies, names this round, base and federation, is its sender's, and matches
        the update the reply carries, of a party the server's view does not list as ``gone``
        (left or failed: the parties would refuse the certify). Others are logged and left
        out."""
        chosen: dict[str, Chosen] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            blob = self.commits.pop(node, b"")
            who = party_of.get(node)
            why = self._bad(blob, round_, base, who, reply)
            if not why and who in gone:
                why = f"{who} left or failed in the signed view"
            if why:
                log(WARNING, "Chaos: update of node %d left out of round %d: %s", node, round_, why)
                continue
            c = Commitment.decode(blob)
            chosen.setdefault(c.party, Chosen(c.party, blob, reply, copy_update(reply.content)))
        self.commits.clear()
        return [chosen[p] for p in sorted(chosen)]

    def _bad(
        self, blob: bytes, round_: int, base: tuple[int, bytes], party: str | None, reply: Message
    ) -> str:
        if not blob:
            return "no signed commitment"
        try:
            c = Commitment.decode(blob)
            c.verify(self.keyring)
        except ChaosError as exc:
            return f"{type(exc).__name__}: {exc}"
        if c.federation != self.federation or (c.round, c.base_round, c.base_digest) != (
            round_,
            *base,
        ):
            return f"its commitment is for round {c.round} on base {c.base_round}"
        if party is not None and c.party != party:
            return f"its commitment is signed by {c.party}, not by the node's party {party}"
        if not reply.has_content() or update_digest(reply.content) != c.update:
            return "the update is not the one its commitment names"
        return ""

    def audit_job(self, active: Sequence[str]) -> AuditJob | None:
        """The audit of the last certified round, for its rota auditors (and, once it was
        asked without an answer, the spare positions too), or ``None`` when nothing is due."""
        last = self.last
        if last is None or self.auditors == 0 or not last.chosen:
            return None
        if self.verdict(last.round, last.digest, active) is not None:
            return None
        extra = 0 if self.auditors is None or last.asks == 0 else AUDIT_ROTA_SPARE
        count = None if self.auditors is None else self.auditors + extra
        first = last.rota[: self.auditors] if self.auditors is not None else last.rota
        asked = set(first if last.asks == 0 else last.rota) | set(
            auditors_of(last.round, active, count)
        )
        last.asks += 1
        fields = (
            ("audit-round", last.round),
            ("audit-digest", last.digest),
            ("audit-base-round", last.base_round),
            ("audit-base-digest", last.base_digest),
            ("audit-commits", [c.commitment for c in last.chosen]),
        )
        updates = tuple((c.party, c.update) for c in last.chosen)
        return AuditJob(frozenset(asked), fields, updates)

    # -- the certify phase ----------------------------------------------------------------------
    def certify_fields(
        self, base: tuple[int, bytes], chosen: Sequence[Chosen]
    ) -> tuple[tuple[str, Any], ...]:
        """The proof a certify on ``base`` from ``chosen`` carries."""
        return (
            ("base-round", base[0]),
            ("base-digest", base[1]),
            ("rule", self.rule_id),
            ("commits", [c.commitment for c in chosen]),
            ("audits", self.audits_of(*base) if base[0] >= 0 else []),
        )

    def certified(
        self,
        round_: int,
        digest: bytes,
        base: tuple[int, bytes],
        chosen: Sequence[Chosen],
        active: Sequence[str],
    ) -> None:
        """A round was certified from ``chosen``: its audit is due with the next train, to the
        rota of the view as it is now (the parties note theirs when they take the state up)."""
        spare = 0 if self.auditors is None else AUDIT_ROTA_SPARE
        k = None if self.auditors is None else self.auditors + spare
        rota = tuple(auditors_of(round_, active, k))
        self.last = _Certified(round_, digest, base[0], base[1], tuple(chosen), rota)
