"""Training rounds in the simulator: a relay, certified digests, replicas and real pulls.

Model (deterministic, every random choice from the engine's RNG):

* The **state** of round ``r`` is a :class:`~chaos_flwr.state.TrainingState` whose array is a
  deterministic "aggregate": bytes expanded from ``sha256(prev digest, r, contributors)``. Any
  party that holds the previous state can recompute it, so an honest relay cannot make up a
  state, and a state's digest pins its whole history.
* The **relay** (``RELAY``, the Flower SuperLink + ServerApp) drives rounds. All round traffic
  hops through it: ``train`` invitations (to the founders and a sample of members, carrying the
  newest certificate it knows), ``ready`` replies (the round each party holds, with its
  certificate), ``agg`` (the contributor set ``C``), ``rcpt`` receipts, ``cert`` certificates.
  It keeps nothing durable: a restart loses its in-flight messages and its round bookkeeping,
  which it learns again from the parties' ``ready`` replies.
* A party signs one :class:`~chaos_flwr.receipts.Receipt` per round, only for a state it
  recomputed from a certified predecessor, and sends it to the relay and, directly, to the
  founders (the witnesses). A round is **certified** for a party when its
  :class:`~chaos_flwr.receipts.ReceiptLedger` holds receipts for one digest from every party of
  ``C``, ``C`` holds a majority of the founders (so two certificates of one round always share
  a founder) and the ledger has no equivocation evidence for the round. Contributors then keep
  the state as a replica (the newest ``keep_rounds``).
* A party that is invited while it holds an older round than the relay's certificate **pulls**
  the certified state from the certificate's holders with the real sans-I/O
  :class:`~chaos_flwr.transfer.PullSession` over the simulated network (manifest checked against
  the certified digest, every shard verified, donors lost or timed out re-planned).
* An **equivocating** relay sends two contributor sets to two halves of ``C``; both halves sign
  valid receipts for different digests, the founders see both and broadcast the
  :class:`~chaos_flwr.receipts.Equivocation` evidence; no party certifies the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import codec
from ..errors import ChaosError, SignatureError
from ..receipts import Equivocation, Receipt, ReceiptLedger
from .invariants import check_training
from .pulls import Puller
from .settings import (
    SIM_TRAIN_COLLECT_S,
    SIM_TRAIN_MAX_CONTRIBUTORS,
    SIM_TRAIN_MAX_INVITED,
    SIM_TRAIN_ROUND_GAP_S,
    SIM_TRAIN_ROUND_TIMEOUT_S,
)
from .trainmodel import (
    GENESIS_PREV,
    RELAY,
    TRAIN_TAG,
    Cert,
    Round,
    TrainParty,
    aggregate_state,
    genesis_state,
    train_msg,
)
from .world import World

__all__ = ["RELAY", "TRAIN_TAG", "Trainer", "aggregate_state", "genesis_state"]


def _new_stats() -> dict[str, int]:
    """The trainer's counters, all zero."""
    return {
        "rounds_started": 0,
        "rounds_certified": 0,
        "rounds_failed": 0,
        "pulls_started": 0,
        "pulls_done": 0,
        "pulls_failed": 0,
        "donors_lost": 0,
        "donor_kills_mid_transfer": 0,
        "pulls_survived_donor_loss": 0,
        "relay_restarts": 0,
        "rollbacks": 0,
        "bad_inputs": 0,
    }


def _unheld_round(
    parties: dict[str, TrainParty],
    accepted: dict[int, dict[bytes, set[str]]],
    live: set[str],
    wants: set[str],
) -> int | None:
    """The newest certified round if no live wanted party holds it (tentatively or not)."""
    top = max(accepted, default=0)
    if top == 0:
        return None
    for digest in accepted[top]:
        for pid, tp in parties.items():
            if pid not in live or pid not in wants:
                continue
            tent = tp.tentative.get(top)
            if tp.digests.get(top) == digest or (tent is not None and tent[0] == digest):
                return None
    return top


def _equivocating_split(
    members: tuple[str, ...],
) -> tuple[list[str], list[str], tuple[str, ...], tuple[str, ...]]:
    """Two halves of ``members`` and the contributor set an equivocating relay tells each."""
    g1, g2 = list(members[0::2]), list(members[1::2])
    c1 = tuple(p for p in members if p != g2[0])
    c2 = tuple(p for p in members if p != g1[0])
    return g1, g2, c1, c2


def _seen(tp: TrainParty) -> int:
    """Newest round ``tp`` knows of or signed."""
    return max([*tp.known, *tp.signed, 0])


class Trainer:
    """The training model of one :class:`~chaos_flwr.sim.runner.Simulation`."""

    def __init__(self, sim: World) -> None:
        self.sim = sim
        self.keyring = sim.charter.keyring()
        self.founders = list(sim.founders)
        self.quorum = len(self.founders) // 2 + 1
        self.keep = int(sim.charter.replication.keep_rounds)
        g = genesis_state(self.founders)
        self.genesis = g.to_bytes()
        self.genesis_digest = g.digest()
        self.parties: dict[str, TrainParty] = {}
        self.verified: set[tuple[str, int, bytes, bytes]] = set()
        # relay
        self.relay_gen = 0
        self.relay_up = True
        self.next_round = 1
        self.cur: Round | None = None
        self.latest: Cert | None = None
        self.newest: Cert | None = None
        self.equivocate_next = False
        self.census = False
        self.stop_at = float("inf")
        self._relay_receipts: dict[bytes, dict[str, Receipt]] = {}
        self.history: list[tuple[float, int, str, tuple[str, ...]]] = []
        self.holder_receipts: dict[tuple[int, bytes], dict[str, bytes]] = {}
        # global observations (the checker's, not any party's)
        self.accepted: dict[int, dict[bytes, set[str]]] = {}
        self.chain: dict[bytes, bytes] = {self.genesis_digest: GENESIS_PREV}
        self.equivocated: dict[int, dict[str, Any]] = {}
        self.detected: dict[int, set[str]] = {}
        self.holder_gaps: list[str] = []
        self.gap_rounds: list[tuple[float, int]] = []
        self.accepted_at: dict[tuple[int, bytes], float] = {}
        self.progress_marks: list[tuple[float, int]] = []
        self.stats = _new_stats()
        self.pulls = Puller(
            sim,
            self.parties,
            self.stats,
            send=self._send,
            hold=self._hold,
            publish=self._publish,
            state_bytes=len(self.genesis),
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def add_party(self, pid: str, *, keep: TrainParty | None = None, fresh: bool = False) -> None:
        """A new peer runs for ``pid`` (a new party, or one restarted with its disk).

        A ``fresh`` party (joined late, or restarted without disk) knows no round it may have
        signed before, so it contributes only after it pulled a certified state.
        """
        if keep is not None:
            keep.pull = None
            self.parties[pid] = keep
            return
        tp = TrainParty(pid, ReceiptLedger(self.keyring, self.verified), fresh=fresh)
        tp.held[0] = self.genesis
        tp.digests[0] = self.genesis_digest
        tp.known[0] = self.genesis_digest
        self.parties[pid] = tp

    def start(self) -> None:
        """Schedule the first round."""
        self.sim.engine.after(1.0, self._round_timer(self.relay_gen))

    def on_crash(self, pid: str) -> None:
        """``pid`` crashed: its pull is gone (replicas, written with receipts, stay on disk)."""
        tp = self.parties.get(pid)
        if tp is not None:
            tp.pull = None
        self.note_holder_gap(f"crash {pid[:12]}")

    def on_restart(self, pid: str, *, disk: bool) -> None:
        """``pid`` runs again: with its replicas, certificates and ledger, or from nothing."""
        old = self.parties.get(pid)
        if disk and old is not None:
            self.add_party(pid, keep=old)
        else:
            self.add_party(pid, fresh=True)
            self.note_holder_gap(f"restart without disk {pid[:12]}")

    def arm_donor_kill(self, down_s: float, disk: bool) -> None:
        """Crash the next donor asked for a shard, mid transfer (restarted ``down_s`` later)."""
        self.pulls.kill_armed = (down_s, disk)

    def restart_relay(self, down_s: float) -> None:
        """The relay process dies (in-flight messages lost) and comes back after ``down_s``."""
        sim = self.sim
        self.stats["relay_restarts"] += 1
        sim.net.crashed.add(RELAY)
        self.relay_gen += 1
        self.relay_up = False
        self.cur = None
        self.latest = None
        self.newest = None
        self.holder_receipts = {}
        self.next_round = 1
        gen = self.relay_gen

        def back() -> None:
            if self.relay_gen != gen:
                return
            sim.net.crashed.discard(RELAY)
            self.relay_up = True
            self._round_timer(gen)()

        sim.engine.after(down_s, back)

    def note_holder_gap(self, why: str) -> None:
        """Record it if no live member holds the newest certified state any more."""
        top = _unheld_round(self.parties, self.accepted, set(self.sim.live()), self.sim.wants)
        if top is not None:
            self.holder_gaps.append(f"{self.sim.engine.now:g} round {top}: no live holder ({why})")
            self.gap_rounds.append((self.sim.engine.now, top))

    # --- traffic -----------------------------------------------------------------------------

    def _send(self, src: str, dst: str, data: bytes) -> None:
        self.sim.net.send(src, dst, data)

    def deliver(self, src: str, dst: str, data: bytes) -> None:
        """A training message arrived at ``dst``."""
        try:
            msg = codec.decode(memoryview(data)[len(TRAIN_TAG) :])
            if not isinstance(msg, dict):
                raise ChaosError("not a map")
            if dst == RELAY:
                self._relay_handle(src, msg)
            else:
                tp = self.parties.get(dst)
                if tp is not None and dst not in self.sim.net.crashed:
                    self._party_handle(tp, src, msg)
        except (ChaosError, KeyError, TypeError, ValueError):
            self.stats["bad_inputs"] += 1

    # --- relay -------------------------------------------------------------------------------

    def _round_timer(self, gen: int) -> Any:
        def fire() -> None:
            if gen != self.relay_gen or not self.relay_up:
                return
            self._start_round()

        return fire

    def _start_round(self) -> None:
        sim = self.sim
        eng = sim.engine
        if eng.now >= self.stop_at:
            return
        r = self.next_round
        self.next_round += 1
        self.stats["rounds_started"] += 1
        wanted = sorted(p for p in sim.wants if p in self.parties)
        founders = [p for p in self.founders if p in wanted]
        others = [p for p in wanted if p not in founders]
        room = max(0, SIM_TRAIN_MAX_INVITED - len(founders))
        if self.census:  # nobody sampled held the newest round: ask everyone once
            self.census = False
        elif len(others) > room:
            others = sorted(eng.rng.sample(others, room))
        invited = founders + others
        self.cur = Round(r, invited)
        cert = self.latest.value() if self.latest is not None else None
        newest = self.newest.value() if self.newest is not None else None
        hx: list[bytes] = []
        for c in (self.latest, self.newest):
            if c is not None:
                by = self.holder_receipts.get((c.round, c.digest), {})
                hx.extend(by[p] for p in sorted(by)[:SIM_TRAIN_MAX_CONTRIBUTORS])
        for p in invited:
            self._send(RELAY, p, train_msg("train", r=r, cert=cert, newest=newest, hx=hx))
        gen = self.relay_gen
        eng.after(SIM_TRAIN_COLLECT_S, lambda: self._collected(gen, r))
        eng.after(SIM_TRAIN_ROUND_TIMEOUT_S, lambda: self._timeout(gen, r))

    def quiesce(self, at: float, sync_at: Sequence[float]) -> None:
        """Stop starting rounds at ``at``; at each ``sync_at`` tell every member the latest."""
        self.stop_at = at
        for t in sync_at:
            self.sim.engine.at(t, self._sync)

    def _sync(self) -> None:
        if not self.relay_up or self.latest is None:
            return
        cert = self.latest.value()
        for p in sorted(self.sim.wants):
            if p in self.parties:
                self._send(RELAY, p, train_msg("sync", cert=cert))

    def _relay_handle(self, src: str, msg: dict[str, Any]) -> None:
        if not self.relay_up:
            return
        kind = msg["k"]
        cur = self.cur
        if kind == "ready":
            r = int(msg["r"])
            self.next_round = max(self.next_round, int(msg["seen"]) + 1)
            if cur is None or cur.round != r or cur.members:
                return
            cur.ready[src] = (int(msg["held"]), bytes(msg["hd"]))
            if msg["rx"]:
                self._note_holder(Receipt.decode(bytes(msg["rx"])))
            if msg["fresh"]:
                cur.fresh.add(src)
            c = Cert.of(msg.get("cert"))
            if c is not None:
                cur.certs.setdefault(c.round, c)
            n = Cert.of(msg.get("newest"))
            if n is not None and (self.newest is None or n.round > self.newest.round):
                self.newest = n
        elif kind == "rcpt":
            receipt = Receipt.decode(bytes(msg["x"]))
            receipt.verify(self.keyring)
            self._note_holder(receipt, verified=True)
            if cur is None or not cur.members or cur.done or receipt.round != cur.agg_round:
                return
            self._relay_receipts.setdefault(receipt.digest, {})[receipt.party] = receipt
            self._maybe_certify()
        elif kind == "evid":
            ev = Equivocation.decode(bytes(msg["x"]))
            ev.verify(self.keyring)
            self.detected.setdefault(ev.round, set()).add(RELAY)

    def _note_holder(self, receipt: Receipt, *, verified: bool = False) -> None:
        if not verified:
            receipt.verify(self.keyring)
        self.holder_receipts.setdefault((receipt.round, receipt.digest), {})[receipt.party] = (
            receipt.encode()
        )
        if len(self.holder_receipts) > 4 * self.keep + 4:
            for key in sorted(self.holder_receipts)[: len(self.holder_receipts) - 4 * self.keep]:
                del self.holder_receipts[key]

    def _collected(self, gen: int, r: int) -> None:
        cur = self.cur
        if gen != self.relay_gen or cur is None or cur.round != r:
            return
        if not cur.ready:
            self.stats["rounds_failed"] += 1
            return
        top = max(h for h, _ in cur.ready.values())
        base = cur.certs.get(top)
        if top == 0:
            base = Cert(0, self.genesis_digest, (), ())
        if base is None:
            self.stats["rounds_failed"] += 1
            return
        if top > 0 and (self.latest is None or self.latest.round <= top):
            self.latest = base
        # Nothing certified is known by anyone: every wanted party answered, none holds or
        # knows a certified round (all lost their disks). Only then may fresh parties start over.
        # After a total loss (every wanted party answered and none holds the newest round
        # anyone knows of) training goes on from the best state still held, under new round
        # numbers (never reusing one): what a restarted federation can do without the lost state.
        everyone = all(p in cur.ready for p in self.sim.wants if p in self.parties)
        newest = self.newest.round if self.newest is not None else 0
        amnesia = everyone and (top < newest or newest == top == 0)
        if amnesia and top < newest:
            self.stats["rollbacks"] += 1
        elif top < newest and not everyone:
            self.census = True
        holders = sorted(
            p
            for p, (h, d) in cur.ready.items()
            if h == top and d == base.digest and (amnesia or p not in cur.fresh)
        )
        fholders = [p for p in holders if p in self.founders]
        if len(fholders) < self.quorum:
            self.stats["rounds_failed"] += 1  # founders behind: they pull from ``latest``
            return
        rest = [p for p in holders if p not in fholders]
        room = max(0, SIM_TRAIN_MAX_CONTRIBUTORS - len(fholders))
        members = tuple(sorted(fholders + rest[:room]))
        r = max(r, top + 1, self.newest.round + 1 if self.newest is not None else 0)
        self.next_round = max(self.next_round, r + 1)
        cur.members = members
        cur.agg_round = r
        self._relay_receipts = {}
        if self.equivocate_next and len(members) >= 4:
            self.equivocate_next = False
            g1, g2, c1, c2 = _equivocating_split(members)
            for p in g1:
                cur.groups[p] = c1
            for p in g2:
                cur.groups[p] = c2
            self.equivocated[r] = {
                "groups": [g1, g2],
                "at": self.sim.engine.now,
                "digests": [aggregate_state(base.digest, r, c).digest() for c in (c1, c2)],
            }
        else:
            for p in members:
                cur.groups[p] = members
        for p in members:
            self._send(
                RELAY, p, train_msg("agg", r=r, pr=top, pd=base.digest, c=list(cur.groups[p]))
            )

    def _maybe_certify(self) -> None:
        cur = self.cur
        assert cur is not None
        for digest, by_party in sorted(self._relay_receipts.items()):
            for members in sorted(set(cur.groups.values())):
                if all(p in by_party for p in members):
                    cert = Cert(
                        cur.agg_round, digest, members, tuple(by_party[p].encode() for p in members)
                    )
                    cur.done = True
                    self.history.append(
                        (self.sim.engine.now, cur.agg_round, digest.hex()[:8], members)
                    )
                    self.latest = cert
                    self.newest = cert
                    for p in sorted(set(cur.invited) | set(members)):
                        self._send(RELAY, p, train_msg("cert", cert=cert.value()))
                    gen = self.relay_gen
                    self.sim.engine.after(SIM_TRAIN_ROUND_GAP_S, self._round_timer(gen))
                    return

    def _timeout(self, gen: int, r: int) -> None:
        cur = self.cur
        if gen != self.relay_gen or cur is None or cur.round != r:
            return
        if not cur.done:
            self.stats["rounds_failed"] += 1
            self._start_round()

    # --- parties -----------------------------------------------------------------------------

    def _party_handle(self, tp: TrainParty, src: str, msg: dict[str, Any]) -> None:
        kind = msg["k"]
        if kind == "train":
            self._on_train(tp, msg)
        elif kind == "agg":
            self._on_agg(tp, msg)
        elif kind == "sync":
            c = Cert.of(msg["cert"])
            if c is not None:
                self._accept_cert(tp, c)
            if c is not None and c.round > tp.top() and c.round in tp.certs and tp.pull is None:
                self.pulls.start(tp, tp.certs[c.round])
        elif kind == "rcpt":
            self._add_receipts(tp, [bytes(msg["x"])])
        elif kind == "cert":
            c = Cert.of(msg["cert"])
            if c is not None:
                self._accept_cert(tp, c)
        elif kind == "evid":
            ev = Equivocation.decode(bytes(msg["x"]))
            try:
                tp.ledger.add_evidence(ev)
            except SignatureError:
                self.stats["bad_inputs"] += 1
                return
            tp.tentative.pop(ev.round, None)
            self.detected.setdefault(ev.round, set()).add(tp.pid)
        elif kind in ("man?", "shard?"):
            self.pulls.serve(tp, src, kind, msg)
        elif kind in ("man", "shard", "nack"):
            self.pulls.on_reply(tp, src, kind, msg)

    def _on_train(self, tp: TrainParty, msg: dict[str, Any]) -> None:
        c = Cert.of(msg.get("cert"))
        if c is not None:
            self._accept_cert(tp, c)
        n = Cert.of(msg.get("newest"))
        if n is not None:
            self._accept_cert(tp, n)
        self._add_receipts(tp, [bytes(x) for x in msg["hx"]])
        top = tp.top()
        mine = tp.certs.get(top)
        newest = max(tp.certs, default=0)
        self._send(
            tp.pid,
            RELAY,
            train_msg(
                "ready",
                r=int(msg["r"]),
                held=top,
                hd=tp.digests[top],
                seen=_seen(tp),
                fresh=tp.fresh,
                cert=mine.value() if mine is not None else None,
                newest=tp.certs[newest].value() if newest else None,
                rx=tp.receipts.get(top, b""),
            ),
        )
        if tp.pull is None:
            if c is not None and c.round > top and c.round in tp.certs:
                self.pulls.start(tp, tp.certs[c.round])
            elif newest > top:
                self.pulls.start(tp, tp.certs[newest])

    def _valid_members(self, members: Sequence[str]) -> bool:
        return (
            len(set(members)) == len(members)
            and all(p in self.keyring for p in members)
            and sum(1 for p in members if p in self.founders) >= self.quorum
        )

    def _on_agg(self, tp: TrainParty, msg: dict[str, Any]) -> None:
        r, pr, pd = int(msg["r"]), int(msg["pr"]), bytes(msg["pd"])
        members = tuple(msg["c"])
        if (
            tp.pid not in members
            or r <= pr
            or r in tp.signed
            or tp.digests.get(pr) != pd
            or tp.known.get(pr) != pd
            or not self._valid_members(members)
            or tp.ledger.conflicted(r)
        ):
            self.stats["bad_inputs"] += 1
            return
        state = aggregate_state(pd, r, members)
        data = state.to_bytes()
        digest = state.digest()
        self.chain.setdefault(digest, pd)
        tp.signed[r] = digest
        tp.tentative[r] = (digest, data, members)
        receipt = Receipt.sign(self.sim.identities[tp.pid], r, digest)
        tp.ledger.add(receipt)
        self._publish(tp, receipt)

    def _publish(self, tp: TrainParty, receipt: Receipt) -> None:
        raw = receipt.encode()
        tp.receipts[receipt.round] = raw
        self._send(tp.pid, RELAY, train_msg("rcpt", x=raw))
        for f in self.founders:
            if f != tp.pid:
                self._send(tp.pid, f, train_msg("rcpt", x=raw))

    def _add_receipts(self, tp: TrainParty, raws: Sequence[bytes]) -> None:
        for raw in raws:
            try:
                ev = tp.ledger.add(Receipt.decode(raw))
            except ChaosError:
                self.stats["bad_inputs"] += 1
                continue
            if ev is not None:
                self._report(tp, ev)

    def _report(self, tp: TrainParty, ev: Equivocation) -> None:
        self.detected.setdefault(ev.round, set()).add(tp.pid)
        tp.tentative.pop(ev.round, None)
        raw = ev.encode()
        for p in sorted(self.sim.wants):
            if p != tp.pid:
                self._send(tp.pid, p, train_msg("evid", x=raw))
        self._send(tp.pid, RELAY, train_msg("evid", x=raw))

    def _accept_cert(self, tp: TrainParty, c: Cert) -> None:
        if c.round in tp.certs or c.round <= 0:
            return
        self._add_receipts(tp, c.receipts)
        led = tp.ledger
        if (
            led.conflicted(c.round)
            or not self._valid_members(c.members)
            or not set(c.members) <= set(led.holders(c.round, c.digest))
        ):
            return
        tp.certs[c.round] = c
        tp.known[c.round] = c.digest
        self.accepted.setdefault(c.round, {}).setdefault(c.digest, set()).add(tp.pid)
        self.accepted_at.setdefault((c.round, c.digest), self.sim.engine.now)
        tent = tp.tentative.pop(c.round, None)
        if tent is not None and tent[0] == c.digest:
            self._hold(tp, c.round, c.digest, tent[1])
        for r in [r for r in tp.tentative if r < c.round]:
            del tp.tentative[r]

    def _hold(self, tp: TrainParty, r: int, digest: bytes, data: bytes) -> None:
        tp.held[r] = data
        tp.digests[r] = digest
        tp.fresh = False  # it holds a certified state: it may contribute again
        if r > max((m for _, m in self.progress_marks), default=0):
            self.progress_marks.append((self.sim.engine.now, r))
            self.stats["rounds_certified"] += 1
        for old in sorted(tp.held)[: max(0, len(tp.held) - self.keep)]:
            if old != 0:
                del tp.held[old]
                del tp.digests[old]

    # --- invariants --------------------------------------------------------------------------

    def accepted_digest(self, round: int) -> bytes:
        """The digest parties certified for ``round`` (the first, if a lost round was reused)."""
        by_digest = self.accepted[round]
        return min(by_digest, key=lambda d: self.accepted_at[(round, d)])

    def check(self, live: Sequence[str], wanted: set[str], settle_from: float) -> dict[str, Any]:
        """Invariants 3-5 and equivocation (see the module docstring of the runner)."""
        return check_training(self, live, wanted, settle_from)
