"""A signing party's side of the verifiable rounds (:mod:`chaos_flwr.rounds`) in a ClientApp.

- :func:`commit`: with its train reply the party signs a commitment to its update (base = the
  state it holds, which the arrays it trained on must be).
- :func:`take_certify`: before it takes up and signs a certified state it checks the certify's
  proof with its :class:`~chaos_flwr.rounds.RoundGuard` and the state's digest; a refused
  certify is logged in :attr:`Party.errors` with its typed error and changes nothing. A party
  whose in-time update was left out of the set logs it (not refused: stragglers are normal);
  a trainer whose signed view differs from the party's is logged with its signed commitment
  as evidence, and the party exchanges records with it (:meth:`chaos_flwr.peer.Peer.reconcile`).
- :func:`audit`: a party the rota names as an auditor of a round recomputes its aggregate from
  the committed updates the message carries and signs an :class:`~chaos_flwr.rounds.Audit`.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from chaos_flwr.errors import ChaosError, DecodeError, EquivocationError, ProofError, StoreError
from chaos_flwr.flower.updates import unpack_updates, update_digest, weight_of
from chaos_flwr.rounds import Audit, CertifyProof, Commitment, RoundGuard, open_audit
from chaos_flwr.state import TrainingState, from_array_record

if TYPE_CHECKING:
    from chaos_flwr.flower.client.verified import VerifiedRounds as Party

__all__ = [
    "audit",
    "commit",
    "commits_digest",
    "guard_of",
    "max_signed",
    "proof_of",
    "take_certify",
    "take_refutations",
    "unfinal",
]

#: Consecutive certified rounds in which a trainer's signed view differs from this party's
#: before the party logs it as a split view (one or two are churn: records still travelling;
#: the party exchanges records with it from the first).
VIEW_DIVERGENCE_ROUNDS: int = 3
#: Rounds below the held one whose audits a party still notes (a window: audits of rounds far
#: from it are ignored, so they evict nothing).
PARTY_AUDIT_WINDOW: int = 16
#: Audits a party sends with one reply (its own, newest last).
PARTY_MAX_AUDITS_OUT: int = 8


def guard_of(party: Party) -> RoundGuard | None:
    """The party's round guard (built once from its charter), or ``None`` for a party that
    does not sign (an unsigned run takes what it is sent)."""
    if party.signer is None or party.peer is None:
        return None
    keyring = party.keyring
    if keyring is None:  # the charter's keys, as the party's peer verifies records with
        keyring = getattr(getattr(party.peer, "policy", None), "keyring", None)
    if keyring is None:
        return None
    if party.guard is None:
        charter = getattr(party.peer, "charter", None)
        policy = getattr(charter, "round_policy", None)
        pol = policy() if callable(policy) else None
        party.guard = RoundGuard(
            party=party.party_id,
            federation=bytes(getattr(party.peer, "federation_tag", b"")),
            keyring=dict(keyring),
            rule_id=getattr(pol, "rule_id", b""),
            min_updates=getattr(pol, "min_updates", 1),
            auditors=getattr(pol, "auditors", 0),
        )
        party.guard.note_audits(party.audits_kept)
    return party.guard


def _active(party: Party) -> list[str]:
    records = getattr(party.peer, "records", None)
    return list(records.active()) if records is not None else []


def _ended(party: Party) -> set[str]:
    """Parties the party's view lists and that are not active (left or failed)."""
    records = getattr(party.peer, "records", None)
    if records is None:
        return set()
    view = records.view()
    return set(view.members) - set(view.active())


def _view_digest(party: Party) -> bytes:
    records = getattr(party.peer, "records", None)
    return bytes(records.view().digest) if records is not None else b""


def max_signed(party: Party) -> int:
    """The newest round this party signed a receipt for: its held round or any replica it keeps
    (after a restart, or a rollback, the store still names the rounds it signed)."""
    newest = party.held_round
    if party.store is not None:
        try:
            rounds = party.store.rounds()
        except StoreError:
            rounds = []
        newest = max([newest, *rounds])
    return max(newest, party.rolled_from)


def _int(record: ConfigRecord, key: str) -> int:
    value = record.get(key, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProofError(f"certify field {key!r} must be an int (the message carries no proof)")
    return value


def _blobs(record: ConfigRecord, key: str) -> tuple[bytes, ...]:
    value = record.get(key, [])
    if not isinstance(value, list):
        raise ProofError(f"certify field {key!r} must be a list of bytes")
    out = tuple(b for b in value if isinstance(b, bytes))
    if len(out) != len(value):
        raise ProofError(f"certify field {key!r} must be a list of bytes")
    return out


def proof_of(record: ConfigRecord) -> CertifyProof:
    """The proof a certify record carries (:class:`ProofError` if it carries none)."""
    digest, base_digest, rule = (record.get(k, None) for k in ("digest", "base-digest", "rule"))
    if not isinstance(digest, bytes) or not isinstance(base_digest, bytes):
        raise ProofError("certify fields 'digest' and 'base-digest' must be bytes")
    return CertifyProof(
        round=_int(record, "round"),
        digest=digest,
        base_round=_int(record, "base-round"),
        base_digest=base_digest,
        rule_id=rule if isinstance(rule, bytes) else b"",
        commitments=_blobs(record, "commits"),
        audits=_blobs(record, "audits"),
    )


def commit(party: Party, record: ConfigRecord, reply: RecordDict) -> bytes:
    """The signed commitment of a train reply (``b""`` when the party signs nothing or holds
    no state to have trained from)."""
    if guard_of(party) is None or party.held_round < 0 or party.left or party.signer is None:
        return b""
    base = (party.held_round, party.held_digest)
    if (record.get("round"), record.get("digest")) != base:
        party.errors.append(
            f"ProofError: train message names round {record.get('round')!r}, not the state this "
            f"party holds (round {party.held_round}); no commitment"
        )
        return b""
    digest = update_digest(reply)
    assert party.guard is not None
    c = Commitment(
        party=party.party_id,
        federation=party.guard.federation,
        # after a rollback the next round is above the one it left (never signed twice)
        round=max(party.held_round, party.rolled_from) + 1,
        base_round=party.held_round,
        base_digest=party.held_digest,
        update=digest,
        weight=weight_of(reply),
        view=_view_digest(party),
    ).signed(party.signer)
    party.committed = (c.round, digest)
    return c.encode()


def _refuse(party: Party, exc: ChaosError) -> None:
    party.errors.append(f"{type(exc).__name__}: {exc}")


def take_certify(party: Party, record: ConfigRecord, arrays: ArrayRecord) -> None:
    """Check a certify and take up its state (module docstring); refusals are logged."""
    guard = guard_of(party)
    assert guard is not None
    sstate = record.get("strategy-state", b"")
    try:
        proof = proof_of(record)
        if not isinstance(sstate, bytes):
            raise ProofError("certify field 'strategy-state' must be bytes")
        held = (party.held_round, party.held_digest) if party.held_round >= 0 else None
        guard.window = (max(0, party.held_round - PARTY_AUDIT_WINDOW), party.held_round + 1)
        commits = guard.check(
            proof,
            held=held,
            max_signed=max_signed(party),
            active=_active(party),
            rollback=party.rollback_base(),
            ended=_ended(party),
            rota=party.held_rota,
        )
        state = from_array_record(arrays, round=proof.round, strategy_state=sstate)
        if state.digest() != proof.digest:
            raise ProofError(
                f"certify of round {proof.round}: the state it carries does not hash to the "
                "digest it names"
            )
    except EquivocationError as exc:  # the base was audited false: roll back to its base
        _refuse(party, exc)
        for blob in proof_of(record).audits:
            party.note_refutation(blob)  # the negative one among them is kept as evidence
        party.roll_back()
        return
    except (ProofError, DecodeError) as exc:
        _refuse(party, exc)
        return
    _note_commitments(party, proof, commits)
    party.hold(state, arrays, proof.digest)
    party.held_rota = guard.rota_of(proof.round, _active(party))
    party.held_commits = commits_digest(proof.commitments)


def _note_commitments(party: Party, proof: CertifyProof, commits: list[Commitment]) -> None:
    """Log an in-time update of this party that was left out, and views that differ."""
    mine = party.committed
    if (
        mine is not None
        and mine[0] == proof.round
        and party.party_id not in {c.party for c in commits}
    ):
        party.errors.append(
            f"UpdateLeftOut: this party's update of round {proof.round} "
            f"({mine[1].hex()[:16]}) is not among the {len(commits)} the aggregate used"
        )
    own = _view_digest(party)
    reconcile = getattr(party.peer, "reconcile", None)
    for c in commits:
        if c.party == party.party_id or not c.view or not own:
            continue
        if c.view == own:
            party.diverged.pop(c.party, None)
            continue
        # views differ for a moment under churn (records are still on their way): exchange
        # records at once, and log it as a split only when it outlasts that
        seen = party.diverged.get(c.party, 0) + 1
        party.diverged[c.party] = seen
        if reconcile is not None:
            party.pending.extend(reconcile(c.party, party.clock()))
        if seen == VIEW_DIVERGENCE_ROUNDS:
            party.errors.append(
                f"ViewDivergence: {c.party} trained round {c.round} under view "
                f"{c.view.hex()[:16]}, this party's is {own.hex()[:16]}, for {seen} rounds in "
                f"a row (evidence: its signed commitment {c.encode().hex()})"
            )
    for gone in [p for p in party.diverged if p not in {c.party for c in commits}]:
        del party.diverged[gone]


def commits_digest(blobs: tuple[bytes, ...] | list[bytes]) -> bytes:
    """SHA-256 of a certify's commitment list, in order (what an audit job must repeat)."""
    h = hashlib.sha256(b"chaos-flwr/commits/v1\x00")
    for blob in blobs:
        h.update(len(blob).to_bytes(4, "big"))
        h.update(blob)
    return h.digest()


def _base_state(party: Party, round_: int, digest: bytes) -> TrainingState:
    if party.store is None:
        raise ProofError(f"audit of round {round_ + 1}: no replica store to read the base from")
    state: TrainingState = party.store.get(round_)
    if state.digest() != digest:
        raise ProofError(f"audit of round {round_ + 1}: the replica of its base is another state")
    return state


def unfinal(party: Party, round_: int, digest: bytes, blobs: object) -> str:
    """Why a signing party may not pull ``(round_, digest)`` ("" when it may): a joiner takes
    only a final state, by the audits the join's start record carries (checked against the
    charter's keys and the joiner's own view of the rota)."""
    guard = guard_of(party)
    if guard is None or round_ == 0 or guard.auditors == 0:
        return ""
    check = RoundGuard(
        party=guard.party,
        federation=guard.federation,
        keyring=guard.keyring,
        rule_id=guard.rule_id,
        min_updates=guard.min_updates,
        auditors=guard.auditors,
    )
    if isinstance(blobs, list):
        check.note_audits(b for b in blobs if isinstance(b, bytes))
    active = _active(party)
    # the round it pulls was certified before its own admission may have reached the
    # certifiers: their rota then came from the view without it (both are signed views)
    before = guard.rota_of(round_, [p for p in active if p != party.party_id])
    verdict = check.verdict(round_, digest, active, also=before)
    if verdict is True:
        return ""
    what = "was audited false" if verdict is False else "is not final (no audits of its rota)"
    return f"ProofError: round {round_} {what}; not pulled"


def take_refutations(party: Party, record: ConfigRecord | None) -> None:
    """Roll back when the relay forwards a negative audit of the held state signed by one of
    its rota auditors (checked here: signature, federation, rota); others are ignored."""
    guard = guard_of(party)
    blobs = record.get("refuted") if record is not None else None
    if guard is None or not isinstance(blobs, list) or party.held_round <= 0:
        return
    rota = set(guard.rota_of(party.held_round, _active(party))) | set(party.held_rota)
    for blob in blobs[:PARTY_MAX_AUDITS_OUT]:
        if not isinstance(blob, bytes):
            continue
        try:
            a = open_audit(blob, guard.federation, guard.keyring)
        except ChaosError:
            continue
        if a.ok or (a.round, a.digest) != (party.held_round, party.held_digest):
            continue
        if a.party not in rota:
            continue
        party.errors.append(
            f"EquivocationError: round {a.round} was audited false by {a.party} (its signed "
            f"audit: recomputed {a.recomputed.hex()[:16]}); rolling back"
        )
        party.note_refutation(blob)
        party.roll_back()
        return


def audit(party: Party, record: ConfigRecord, content: RecordDict) -> None:
    """Audit the round named by a message's ``audit-*`` fields if this party is one of its
    rota auditors (the signed audit goes out with the reply; a false aggregate is logged)."""
    guard = guard_of(party)
    if guard is None or not any(k.startswith("chaos-upd.") for k in content):
        return
    try:
        proof = CertifyProof(
            round=_int(record, "audit-round"),
            digest=_bytes(record, "audit-digest"),
            base_round=_int(record, "audit-base-round"),
            base_digest=_bytes(record, "audit-base-digest"),
            rule_id=guard.rule_id,
            commitments=_blobs(record, "audit-commits"),
        )
        rota = set(guard.rota_of(proof.round, _active(party))) | set(party.held_rota)
        if party.party_id not in rota:
            raise ProofError(f"audit of round {proof.round}: this party is not on its rota")
        if (party.held_round, party.held_digest) != (proof.round, proof.digest):
            raise ProofError(f"audit of round {proof.round}: this party does not hold that state")
        if commits_digest(proof.commitments) != party.held_commits:
            raise ProofError(
                f"audit of round {proof.round}: its commitments are not those of the certify "
                "this party took up"
            )
        # membership was checked by every party when the round was certified; a trainer that
        # left since is no reason to refuse its update now
        commits = guard.commitments(proof)
        verdict, recomputed = _recompute(party, guard, proof, commits, unpack_updates(content))
    except ChaosError as exc:
        _refuse(party, exc)
        return
    signed = Audit(
        party=party.party_id,
        federation=guard.federation,
        round=proof.round,
        digest=proof.digest,
        ok=verdict,
        recomputed=recomputed,
    ).signed(party.signer)
    blob = signed.encode()
    guard.note_audits([blob])
    party.audits_out.append(blob)
    del party.audits_out[:-PARTY_MAX_AUDITS_OUT]
    if not verdict:
        party.errors.append(
            f"EquivocationError: round {proof.round} is a false aggregate (certified "
            f"{proof.digest.hex()[:16]}, recomputed {recomputed.hex()[:16]}); refuted"
        )
        party.note_refutation(blob)
        party.roll_back()


def _bytes(record: ConfigRecord, key: str) -> bytes:
    value = record.get(key, None)
    if not isinstance(value, bytes):
        raise ProofError(f"field {key!r} must be bytes")
    return value


def _recompute(
    party: Party,
    guard: RoundGuard,
    proof: CertifyProof,
    commits: list[Commitment],
    updates: dict[str, RecordDict],
) -> tuple[bool, bytes]:
    """Recompute the round's aggregate with the charter's rule; ``(right?, digest)``.

    Every update is checked against its commitment; the checks (hashing, in a worker thread)
    and the recomputation (numpy, this thread) run side by side, and no verdict is given
    before every check passed: an update that is not the one committed is refused as such,
    whatever the recomputation made of it.
    """
    from chaos_flwr.flower.rule import recompute, states_match

    charter: Any = getattr(party.peer, "charter", None)
    policy = charter.round_policy() if charter is not None else None
    if policy is None or policy.rule is None:
        raise ProofError(f"audit of round {proof.round}: the charter names no aggregation rule")
    ordered: list[RecordDict] = []
    for c in commits:  # sorted by party id: the order the ServerApp aggregates in
        content = updates.get(c.party)
        if content is None:
            raise ProofError(f"audit of round {proof.round}: the update of {c.party} is missing")
        ordered.append(content)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="chaos-audit") as pool:
        checks = pool.submit(_check_updates, proof.round, commits, ordered)
        try:
            base = _base_state(party, proof.base_round, proof.base_digest)
            result = recompute(policy.rule, base, proof.round, ordered)
        except Exception:
            checks.result()  # a forged update is refused as one, not by what it made fail
            raise
        checks.result()
    mine = party.held_state
    if result.digest() == proof.digest:
        return True, proof.digest
    return (mine is not None and states_match(result, mine)), result.digest()


def _check_updates(round_: int, commits: list[Commitment], ordered: list[RecordDict]) -> None:
    """Each update is the one its commitment names (:class:`ProofError` for the first that
    is not)."""
    for c, content in zip(commits, ordered, strict=True):
        if update_digest(content) != c.update:
            raise ProofError(
                f"audit of round {round_}: the update of {c.party} is not the one it committed"
            )
