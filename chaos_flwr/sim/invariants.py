"""The training invariants the simulator checks at the end of a run (3-5 and equivocation).

See the module docstring of :mod:`chaos_flwr.sim.runner` for the list. The checker reads the
trainer's global observations (what parties certified and when, holder gaps, equivocations),
which no single party has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

from .trainmodel import TrainParty

__all__ = ["Observed", "check_training"]


class Observed(Protocol):
    """What the checker reads of a :class:`~chaos_flwr.sim.training.Trainer`."""

    @property
    def parties(self) -> dict[str, TrainParty]: ...
    @property
    def founders(self) -> list[str]: ...
    @property
    def quorum(self) -> int: ...
    @property
    def stats(self) -> dict[str, int]: ...
    @property
    def accepted(self) -> dict[int, dict[bytes, set[str]]]: ...
    @property
    def accepted_at(self) -> dict[tuple[int, bytes], float]: ...
    @property
    def gap_rounds(self) -> list[tuple[float, int]]: ...
    @property
    def holder_gaps(self) -> list[str]: ...
    @property
    def progress_marks(self) -> list[tuple[float, int]]: ...
    @property
    def equivocated(self) -> dict[int, dict[str, Any]]: ...
    @property
    def detected(self) -> dict[int, set[str]]: ...


def _certified_states(t: Observed) -> dict[str, Any]:
    """(3) every party's state for round r has the certified digest for r."""
    bad3: list[str] = []
    for r, by_digest in sorted(t.accepted.items()):
        if len(by_digest) > 1:
            second = sorted(t.accepted_at[(r, d)] for d in by_digest)[1]
            # a round number is reused only after the state (and who signed it) was lost
            if not any(at < second for at, _ in t.gap_rounds):
                bad3.append(f"round {r} certified with {len(by_digest)} digests")
    for pid, tp in sorted(t.parties.items()):
        for r, digest in tp.digests.items():
            if hashlib.sha256(tp.held[r]).digest() != digest:
                bad3.append(f"{pid[:12]} round {r}: held bytes do not hash to their digest")
            if r and t.accepted.get(r, {}).get(digest) is None:
                bad3.append(f"{pid[:12]} holds uncertified state for round {r}")
            if r and tp.known.get(r) != digest:
                bad3.append(f"{pid[:12]} round {r}: held digest is not the one it certified")
    return {
        "ok": not bad3,
        "detail": bad3
        or f"{sum(len(tp.held) for tp in t.parties.values())} replicas match their "
        f"certified digests over {len(t.accepted)} rounds",
    }


def _recovered(t: Observed, live: Sequence[str], wanted: set[str]) -> tuple[dict[str, Any], bool]:
    """(4) the latest certified state is recovered while a holder is alive; and whether the
    latest state was lost with every live holder."""
    final_top = max(t.accepted, default=0)
    bad4: list[str] = []
    latest = {tp.top() for p, tp in t.parties.items() if p in live and p in wanted}
    holders = [p for p in live if final_top in t.parties[p].held]
    lost = not holders and any(r == final_top for _, r in t.gap_rounds)
    if final_top and not lost:
        d = max(t.accepted[final_top], key=lambda x: t.accepted_at[(final_top, x)])
        for p in live:
            if p not in wanted:
                continue
            tp = t.parties[p]
            if tp.digests.get(final_top) != d:
                bad4.append(f"{p[:12]} holds round {tp.top()}, not the latest {final_top}")
    return {
        "ok": not bad4,
        "detail": bad4
        or (
            f"all live parties hold round {final_top} (from {len(holders)} holders)"
            if not lost
            else f"round {final_top} was lost with every live holder (excused): "
            f"{[g for g in t.holder_gaps if f'round {final_top}:' in g][:2]}"
        ),
        "latest": final_top,
        "held_rounds": sorted(latest),
    }, lost


def _progress(
    t: Observed, live: Sequence[str], wanted: set[str], settle_from: float
) -> dict[str, Any]:
    """(5) progress whenever the founders' quorum is connected."""
    final_top = max(t.accepted, default=0)
    live_founders = [p for p in t.founders if p in live and p in wanted]
    progressed = any(at >= settle_from for at, _ in t.progress_marks)
    # Waived when the newest certified state had no live holder at some point (a holder
    # gap): the simulator's recovery after such a loss is best effort (docs/threat-model.md).
    gap_final = any(r == final_top for _, r in t.gap_rounds)
    quorum_up = len(live_founders) >= t.quorum
    ok5 = progressed or not quorum_up or gap_final
    t.stats["progress_waived"] = int(not progressed and quorum_up and gap_final)
    return {
        "ok": ok5,
        "detail": (
            f"{t.stats['rounds_certified']} rounds certified, newest {final_top}"
            if ok5
            else f"no round certified after heal at {settle_from:g} s although "
            f"{len(live_founders)} founders are live"
        ),
    }


def _equivocation(t: Observed) -> dict[str, Any]:
    """Equivocated rounds are never certified, and the parties report them."""
    bad_e: list[str] = []
    for r, info in sorted(t.equivocated.items()):
        hit = [d for d in info["digests"] if d in t.accepted.get(r, {})]
        if hit:
            who = sorted(p[:12] for d in hit for p in t.accepted[r][d])
            bad_e.append(f"an equivocated digest of round {r} was certified by {who}")
        info["detected_by"] = len(t.detected.get(r, set()))
    detected = sum(1 for r in t.equivocated if t.detected.get(r))
    t.stats["equivocated_rounds"] = len(t.equivocated)
    t.stats["equivocations_detected"] = detected
    t.stats["holder_gaps"] = len(t.holder_gaps)
    return {
        "ok": not bad_e,
        "detail": bad_e
        or f"{len(t.equivocated)} equivocated rounds, none certified, {detected} detected",
        "rounds": len(t.equivocated),
        "detected": detected,
    }


def check_training(
    t: Observed, live: Sequence[str], wanted: set[str], settle_from: float
) -> dict[str, Any]:
    """Invariants 3-5 and equivocation; also fills the trainer's checker counters."""
    out: dict[str, Any] = {"certified_states": _certified_states(t)}
    out["recovered"], lost = _recovered(t, live, wanted)
    out["progress"] = _progress(t, live, wanted, settle_from)
    out["equivocation"] = _equivocation(t)
    t.stats["latest_lost"] = int(lost)
    return out
