"""State transfers in the simulator: a party pulls a certified state from its holders.

The real sans-I/O :class:`~chaos_flwr.transfer.PullSession` runs over the simulated network:
the manifest is checked against the certified digest, every shard is verified, donors lost or
timed out are re-planned. Donors serve from their replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ChaosError
from ..planner import Donor, plan_transfer
from ..receipts import Receipt
from ..state import Manifest
from ..transfer import CancelRequest, PullSession
from .settings import SIM_TRAIN_MAX_SHARDS, SIM_TRAIN_MIN_SHARD_BYTES, SIM_TRAIN_PULL_TIMEOUT_S
from .trainmodel import Cert, Pull, TrainParty, train_msg
from .world import World

__all__ = ["Puller"]


class Puller:
    """Runs every party's pulls and serves its replicas to other parties' pulls.

    Parameters
    ----------
    sim:
        The simulation (engine, network, identities, generations).
    parties:
        The training parties by id (shared with the trainer).
    stats:
        The trainer's counters (shared).
    send, hold, publish:
        The trainer's ways to send a training message, keep a certified state and publish a
        receipt.
    state_bytes:
        Size of a state (every round's state has the genesis state's size).
    """

    def __init__(
        self,
        sim: World,
        parties: dict[str, TrainParty],
        stats: dict[str, int],
        *,
        send: Callable[[str, str, bytes], None],
        hold: Callable[[TrainParty, int, bytes, bytes], None],
        publish: Callable[[TrainParty, Receipt], None],
        state_bytes: int,
    ) -> None:
        self.sim = sim
        self.parties = parties
        self.stats = stats
        self.send = send
        self.hold = hold
        self.publish = publish
        self.state_bytes = state_bytes
        #: (down_s, disk) of the next donor to crash mid transfer, once armed.
        self.kill_armed: tuple[float, bool] | None = None
        self.pull_failures: dict[str, int] = {}

    def start(self, tp: TrainParty, c: Cert) -> None:
        """Start pulling ``c``'s state from its holders (in random order)."""
        known = set(c.members) | set(tp.ledger.holders(c.round, c.digest))
        donors = sorted(p for p in known if p != tp.pid)
        if len(donors) > 1:
            self.sim.engine.rng.shuffle(donors)
        if not donors:
            return
        self.stats["pulls_started"] += 1
        tp.pull = Pull(c.round, c.digest, donors, self.sim.engine.now)
        self._ask_manifest(tp)

    def _ask_manifest(self, tp: TrainParty) -> None:
        pull = tp.pull
        assert pull is not None
        if not pull.donors:
            self._fail_pull(tp, "no donor answered")
            return
        donor = pull.donors[0]
        pull.manifest_from = donor
        pull.token += 1
        token = pull.token
        total = self.state_bytes
        plan, _ = self._plan(tp, pull.donors, total)
        self.send(
            tp.pid, donor, train_msg("man?", r=pull.round, s=plan.shard_bytes, n=plan.num_shards)
        )
        gen = self.sim.generation.get(tp.pid)
        self.sim.engine.after(
            SIM_TRAIN_PULL_TIMEOUT_S, lambda: self._manifest_timeout(tp, gen, token)
        )

    def _plan(self, tp: TrainParty, donors: Sequence[str], total: int) -> tuple[Any, list[Donor]]:
        net = self.sim.net
        ds = [Donor(d, net.bandwidth(d), net.latency(d, tp.pid)) for d in donors]
        return plan_transfer(
            total, ds, max_shards=SIM_TRAIN_MAX_SHARDS, min_shard_bytes=SIM_TRAIN_MIN_SHARD_BYTES
        ), ds

    def _manifest_timeout(self, tp: TrainParty, gen: int | None, token: int) -> None:
        pull = tp.pull
        if (
            self.parties.get(tp.pid) is not tp
            or self.sim.generation.get(tp.pid) != gen
            or pull is None
            or pull.session is not None
            or pull.token != token
        ):
            return
        pull.donors.pop(0)
        self._ask_manifest(tp)

    def _fail_pull(self, tp: TrainParty, why: str) -> None:
        tp.pull = None
        self.stats["pulls_failed"] += 1
        self.pull_failures[why] = self.pull_failures.get(why, 0) + 1

    def serve(self, tp: TrainParty, src: str, kind: str, msg: dict[str, Any]) -> None:
        """Answer a manifest or shard request from ``tp``'s replicas."""
        r = int(msg["r"])
        data = tp.held.get(r)
        if data is None or r == 0:
            self.send(tp.pid, src, train_msg("nack", r=r))
            return
        if kind == "man?":
            key = (r, int(msg["s"]), int(msg["n"]))
            m = tp.manifests.get(key)
            if m is None:
                m = Manifest.build(data, key[1], num_shards=key[2]).to_bytes()
                tp.manifests = {key: m}
            self.send(tp.pid, src, train_msg("man", r=r, m=m))
        else:
            if self.kill_armed is not None:
                down_s, disk = self.kill_armed
                self.kill_armed = None
                self.stats["donor_kills_mid_transfer"] += 1
                self.sim.kill(tp.pid, down_s, disk=disk)
                return
            i, s, e = int(msg["i"]), int(msg["s"]), int(msg["e"])
            self.send(tp.pid, src, train_msg("shard", r=r, i=i, x=data[s:e]))

    def on_reply(self, tp: TrainParty, src: str, kind: str, msg: dict[str, Any]) -> None:
        """A donor answered ``tp``'s pull (manifest, shard or nack)."""
        pull = tp.pull
        if pull is None or int(msg["r"]) != pull.round:
            return
        now = self.sim.engine.now
        try:
            if pull.session is None:
                if src != pull.manifest_from:
                    return
                if kind != "man":
                    pull.donors.remove(src)
                    self._ask_manifest(tp)
                    return
                manifest = Manifest.from_bytes(bytes(msg["m"]))
                (plan, ds) = self._plan(tp, pull.donors, manifest.total_bytes)
                pull.session = PullSession(manifest, plan, ds, now=now, expected_digest=pull.digest)
                self._actions(tp, pull.session.poll(now))
            elif kind == "nack":
                self.stats["donors_lost"] += 1
                pull.lost += 1
                self._actions(tp, pull.session.on_donor_lost(src, now))
            elif kind == "shard":
                self._actions(tp, pull.session.on_shard(src, int(msg["i"]), bytes(msg["x"]), now))
        except ChaosError as exc:
            self._fail_pull(tp, type(exc).__name__)

    def _actions(self, tp: TrainParty, actions: Sequence[Any]) -> None:
        pull = tp.pull
        assert pull is not None and pull.session is not None
        for a in actions:
            if isinstance(a, CancelRequest):
                continue
            self.send(
                tp.pid, a.donor, train_msg("shard?", r=pull.round, i=a.index, s=a.start, e=a.end)
            )
        session = pull.session
        if session.done:
            data = bytes(session.assemble())
            self.hold(tp, pull.round, pull.digest, data)
            tp.fresh = False
            tp.pull = None
            if tp.signed.get(pull.round, pull.digest) == pull.digest:
                tp.signed[pull.round] = pull.digest
                receipt = Receipt.sign(self.sim.identities[tp.pid], pull.round, pull.digest)
                tp.ledger.add(receipt)
                self.publish(tp, receipt)
            self.stats["pulls_done"] += 1
            if pull.lost:
                self.stats["pulls_survived_donor_loss"] += 1
            return
        deadline = session.next_deadline()
        if deadline is not None:
            pull.token += 1
            token = pull.token
            gen = self.sim.generation.get(tp.pid)
            self.sim.engine.at(deadline + 1e-6, lambda: self._pull_tick(tp, gen, token))

    def _pull_tick(self, tp: TrainParty, gen: int | None, token: int) -> None:
        pull = tp.pull
        if (
            self.parties.get(tp.pid) is not tp
            or self.sim.generation.get(tp.pid) != gen
            or pull is None
            or pull.session is None
            or pull.token != token
        ):
            return
        try:
            before = len(pull.session.live_donors())
            actions = pull.session.tick(self.sim.engine.now)
            lost = before - len(pull.session.live_donors())
            self.stats["donors_lost"] += lost
            pull.lost += lost
            self._actions(tp, actions)
        except ChaosError as exc:
            self._fail_pull(tp, type(exc).__name__)
