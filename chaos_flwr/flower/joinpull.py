"""A joiner pulls the current certified state from several holders, through the relay.

Flower has no node-to-node traffic, so the ServerApp relays; but it only *relays*: the joiner
plans the pull (planner-sized shares), checks the donors' signed receipts, verifies the
manifest and every shard, and assembles the state. One relay **step** is two exchanges:

1. ServerApp -> joiner (``query.chaos``, phase ``join``): a control record (the certified round
   and digest, the donors and their signed receipts on the first step; the donors' replies to
   the previous step's requests after that). The joiner answers with its next requests, one
   per donor, or ``done`` / ``failed``.
2. ServerApp -> each donor named (phase ``pull``): the request, answered from the donor's
   replica (:func:`chaos_flwr.flower.pull.serve_request`); a donor that errs, misses the
   deadline or sends nothing is reported *lost* to the joiner, which re-plans its shards.

Steps: size and manifest (one donor, which plans the shard shape as the joiner will; every
other donor is asked its size in the same step, which is where it names its direct address),
then the shards from all donors at once (and a re-plan step per lost donor or odd manifest).

Direct links (:mod:`chaos_flwr.flower.direct`): a donor whose reply names a loopback address is
probed once (a timed range fetch, folded into a :class:`chaos_flwr.monitor.Monitor` link
estimate); the shards are then planned with those per-donor rates (relay donors keep the
assumed rate) and the direct donors' shards are fetched over grpc during the joiner's own step,
all direct donors at once. A donor whose link fails (unreachable, dropped mid-transfer) falls
back to the relay for the shards it still owes; if it is gone there too it is lost and its
shards are re-planned. A bad shard, direct or relayed, drops the donor. Records, per RecordDict
of a message:

- ``chaos-pull`` (:data:`~chaos_flwr.defaults.FLOWER_PULL_DATA_KEY`): the control record;
- ``chaos-pull.<party id>``: the request to / reply from that donor.

A donor serves whoever the ServerApp names. That gives the ServerApp nothing it lacks: it
aggregated the state itself. What it cannot do is make a joiner hold a state that no holder
certified: receipts are verified by the joiner and the bytes against their digest.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, RecordDict

from chaos_flwr.defaults import (
    FLOWER_DIRECT_BATCH_BYTES,
    FLOWER_DIRECT_PROBE_BYTES,
    FLOWER_DIRECT_TIMEOUT_S,
    FLOWER_JOIN_MAX_STEPS,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    FLOWER_JOIN_REQUEST_TIMEOUT_S,
    FLOWER_PULL_ASSUMED_BANDWIDTH_BPS,
    FLOWER_PULL_DATA_KEY,
)
from chaos_flwr.errors import ChaosError, DecodeError, ShardIntegrityError
from chaos_flwr.monitor import Monitor
from chaos_flwr.planner import Donor as PlanDonor
from chaos_flwr.planner import TransferPlan, plan_transfer
from chaos_flwr.state import Manifest, TrainingState
from chaos_flwr.transfer import CancelRequest, DonorStatus, PullSession, ShardRequest

__all__ = [
    "JoinerPull",
    "donor_key",
    "read_donor_records",
    "start_record",
]

#: Control-record statuses a joiner answers with.
WANT, DONE, FAILED = "want", "done", "failed"


def donor_key(party: str) -> str:
    """RecordDict key of the request to / reply from donor ``party``."""
    return f"{FLOWER_PULL_DATA_KEY}.{party}"


def read_donor_records(content: RecordDict) -> dict[str, ConfigRecord]:
    """The per-donor records (``chaos-pull.<party>``) of a RecordDict, by party id."""
    prefix = f"{FLOWER_PULL_DATA_KEY}."
    out: dict[str, ConfigRecord] = {}
    for key, value in content.items():
        if key.startswith(prefix) and isinstance(value, ConfigRecord):
            out[key[len(prefix) :]] = value
    return out


def start_record(
    donors: list[str], receipts: list[bytes], min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES
) -> ConfigRecord:
    """The first step's control record: the donors and their signed receipts (same order)."""
    return ConfigRecord(
        {
            "op": "start",
            "donors": list(donors),
            "receipts": list(receipts),
            "min-shard": min_shard_bytes,
        }
    )


@dataclass
class JoinerPull:
    """The joiner's side of one relayed pull (sans-I/O; ``now`` is passed in).

    Parameters
    ----------
    server_round, digest:
        The certified state to pull.
    donors:
        Donor party ids whose receipts the joiner verified.
    min_shard_bytes:
        Smallest shard of the plan.
    bandwidth:
        Donor id -> bytes/s prior (default: the assumed rate); a measured estimate wins.
    direct:
        Use donors' advertised direct addresses (:mod:`chaos_flwr.flower.direct`).
    direct_batch_bytes:
        Bytes asked per grpc request on a direct link.
    """

    server_round: int
    digest: bytes
    donors: list[str]
    min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES
    bandwidth: Mapping[str, float] = field(default_factory=dict)
    stage: str = "size"
    total: int | None = None
    plan: TransferPlan | None = None
    session: PullSession | None = None
    lost: list[str] = field(default_factory=list)
    received: dict[str, int] = field(default_factory=dict)
    state: TrainingState | None = None
    error: str = ""
    _live: list[str] = field(default_factory=list)
    _asked: str = ""
    _sent: dict[str, set[int]] = field(default_factory=dict)
    _got: set[int] = field(default_factory=set)
    direct: bool = True
    direct_batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES
    addresses: dict[str, str] = field(default_factory=dict)
    direct_bytes: dict[str, int] = field(default_factory=dict)
    direct_failed: dict[str, str] = field(default_factory=dict)
    plan_rates: dict[str, float] = field(default_factory=dict)
    monitor: Monitor = field(
        default_factory=lambda: Monitor(
            "joiner",
            suspicion_timeout_s=FLOWER_JOIN_REQUEST_TIMEOUT_S,
            heartbeat_interval_s=FLOWER_JOIN_REQUEST_TIMEOUT_S,
        )
    )

    def __post_init__(self) -> None:
        self._live = list(self.donors)

    def _rate(self, donor: str) -> float:
        measured = self.monitor.link(donor).bandwidth_bps
        if measured is not None:
            return measured
        return self.bandwidth.get(donor, FLOWER_PULL_ASSUMED_BANDWIDTH_BPS)

    def _plan_donors(self) -> list[PlanDonor]:
        return [PlanDonor(id=d, bandwidth=self._rate(d)) for d in self._live]

    def _note_address(self, donor: str, rec: ConfigRecord) -> None:
        if not self.direct:
            return
        value = rec.get("direct")
        if value is None:
            return
        from chaos_flwr.flower.direct import check_address

        try:
            self.addresses[donor] = check_address(value)
        except ChaosError as exc:
            self.direct_failed[donor] = f"{type(exc).__name__}: {exc}"

    def _lose(self, donor: str) -> None:
        if donor in self._live:
            self._live.remove(donor)
        if donor not in self.lost:
            self.lost.append(donor)

    def _fail(self, why: str) -> tuple[str, dict[str, ConfigRecord]]:
        self.stage = FAILED
        self.error = why
        return FAILED, {}

    def start(self, now: float) -> tuple[str, dict[str, ConfigRecord]]:
        """The first requests (the state's size from the first donor)."""
        return self.step({}, set(), now)

    def step(
        self, replies: Mapping[str, ConfigRecord], lost: set[str], now: float
    ) -> tuple[str, dict[str, ConfigRecord]]:
        """Consume the donors' replies to the last requests; return status and next requests.

        Returns
        -------
        tuple
            ``(status, requests)``: ``want`` with ``donor -> request``, or ``done`` (the
            verified state is in :attr:`state`) or ``failed`` (:attr:`error` says why).
        """
        try:
            return self._step(replies, lost, now)
        except ChaosError as exc:
            return self._fail(f"{type(exc).__name__}: {exc}")

    def _step(
        self, replies: Mapping[str, ConfigRecord], lost: set[str], now: float
    ) -> tuple[str, dict[str, ConfigRecord]]:
        if self.stage in (DONE, FAILED):
            return self.stage, {}
        if self.stage == "size":
            for donor, rec in replies.items():
                self._note_address(donor, rec)
                if donor != self._asked and not isinstance(rec.get("total"), int):
                    self._lose(donor)
            for donor in sorted(lost - {self._asked}):
                self._lose(donor)
            if self._asked:
                rec = replies.get(self._asked, ConfigRecord())
                value = rec.get("total")
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    self.total = value
                    self.plan = plan_transfer(
                        value, self._plan_donors(), min_shard_bytes=self.min_shard_bytes
                    )
                    asked, self._asked = self._asked, ""
                    self.stage = "manifest"
                    raw = rec.get("manifest")
                    if isinstance(raw, bytes):
                        try:
                            manifest = Manifest.from_bytes(raw)
                            manifest.check_certified(self.digest, value)
                        except (ChaosError, ValueError):
                            self._lose(asked)  # a manifest that does not name the digest
                        else:
                            if (manifest.shard_bytes, manifest.num_shards) == (
                                self.plan.shard_bytes,
                                self.plan.num_shards,
                            ):
                                return self._start_shards(manifest, now)
                else:
                    self._lose(self._asked)
            if self.stage == "size":
                if not self._live:
                    return self._fail("no donor answered with the state size")
                self._asked = self._live[0]
                # size and manifest in one step: the donor plans as the joiner will (same
                # donor count and assumed rates); a manifest of another shape is asked again
                req = ConfigRecord(
                    {
                        "op": "plan-manifest",
                        "donors": len(self._live),
                        "min-shard": self.min_shard_bytes,
                    }
                )
                # every other donor names its size (and direct address) in the same step
                asks = {d: ConfigRecord({"op": "size"}) for d in self._live if d != self._asked}
                return WANT, {self._asked: req, **asks}
        if self.stage == "manifest":
            assert self.total is not None
            if self._asked:
                raw = replies.get(self._asked, ConfigRecord()).get("manifest")
                try:
                    if not isinstance(raw, bytes):
                        raise DecodeError("no manifest in the reply")
                    manifest = Manifest.from_bytes(raw)
                    manifest.check_certified(self.digest, self.total)
                except (ChaosError, ValueError):
                    self._lose(self._asked)
                else:
                    return self._start_shards(manifest, now)
            if not self._live:
                return self._fail("no donor sent a manifest that names the certified digest")
            # plan over the donors left (a lost one must not get shards)
            self.plan = plan_transfer(
                self.total, self._plan_donors(), min_shard_bytes=self.min_shard_bytes
            )
            self._asked = self._live[0]
            req = ConfigRecord(
                {
                    "op": "manifest",
                    "shard-bytes": self.plan.shard_bytes,
                    "num-shards": self.plan.num_shards,
                }
            )
            return WANT, {self._asked: req}
        # shards
        session = self.session
        assert session is not None
        actions: list[object] = []
        for donor, rec in replies.items():
            idx, data = rec.get("index"), rec.get("data")
            if not (isinstance(idx, list) and isinstance(data, list)):
                self._lose(donor)
                actions.extend(session.on_donor_lost(donor, now))
                continue
            answered: set[int] = set()
            for i, chunk in zip(idx, data, strict=False):
                if isinstance(i, int) and isinstance(chunk, bytes):
                    actions.extend(session.on_shard(donor, i, chunk, now))
                    if session.status(donor) == DonorStatus.BAD:
                        break  # a shard failed its hash: the donor's shards are re-planned
                    answered.add(i)
                    if i not in self._got:  # a stolen copy that also arrived counts once
                        self._got.add(i)
                        self.received[donor] = self.received.get(donor, 0) + len(chunk)
            if (
                session.status(donor) == DonorStatus.LIVE
                and self._sent.get(donor, set()) - answered
            ):
                # it answered without some of the shards asked for: it is not a donor to wait on
                actions.extend(session.on_donor_lost(donor, now))
            if session.status(donor) != DonorStatus.LIVE:
                self._lose(donor)
        for donor in sorted(lost):
            self._lose(donor)
            actions.extend(session.on_donor_lost(donor, now))
        return self._advance(actions, now)

    def _advance(self, actions: list[object], now: float) -> tuple[str, dict[str, ConfigRecord]]:
        """Fetch what direct donors owe, then finish or return the relay requests."""
        session = self.session
        assert session is not None
        if self.addresses and not session.done:
            actions = self._fetch_direct(actions, now)
        if session.done:
            state = TrainingState.from_bytes(session.assemble())
            if state.digest() != self.digest or state.round != self.server_round:
                raise ShardIntegrityError("the assembled state is not the certified one")
            self.state = state
            self.stage = DONE
            return DONE, {}
        return self._requests(actions, now)

    def _usable(self) -> dict[str, str]:
        live = set(self._live)
        return {
            d: a for d, a in self.addresses.items() if d in live and d not in self.direct_failed
        }

    def _probe(self, total: int) -> None:
        """Time one range from each direct donor; fold it into the monitor's link estimate."""
        from chaos_flwr.flower.direct import fetch_ranges

        usable = self._usable()
        if not usable or total <= 0:
            return
        size = min(FLOWER_DIRECT_PROBE_BYTES, total)
        got = fetch_ranges(
            usable,
            {d: [(-1, 0, size)] for d in usable},
            server_round=self.server_round,
            digest=self.digest,
            timeout_s=FLOWER_DIRECT_TIMEOUT_S,
        )
        for donor, res in got.items():
            if res.error:
                self.direct_failed[donor] = res.error  # the relay carries its shards
            else:
                self.monitor.observe_transfer(donor, res.nbytes, res.seconds)

    def _fetch_direct(self, actions: list[object], now: float) -> list[object]:
        """Serve the direct donors' requests over grpc (all at once) until none is left;
        return the actions for relay donors (and for direct donors whose link failed)."""
        from chaos_flwr.flower.direct import fetch_ranges

        session = self.session
        assert session is not None
        # one budget for all direct fetches of this step (the relay's phase deadline waits on
        # the step's reply): a link still busy when it is spent falls back to the relay
        until = time.monotonic() + FLOWER_DIRECT_TIMEOUT_S
        for _ in range(FLOWER_JOIN_MAX_STEPS * max(1, len(self.donors))):
            usable = self._usable()
            direct: dict[str, list[ShardRequest]] = {}
            rest: list[object] = []
            for action in actions:
                if isinstance(action, ShardRequest) and action.donor in usable:
                    direct.setdefault(action.donor, []).append(action)
                else:
                    rest.append(action)
            missing = set(session.missing())
            # shards a relay donor is asked for stay with it (no direct steal of them: the
            # relay request leaves only when this step returns, so a steal would always win
            # and leave the relay donor's planned share unused)
            relayed = {
                i
                for d in self._live
                if d not in usable and session.status(d) == DonorStatus.LIVE
                for i in session.inflight(d)
            }
            direct = {
                d: [r for r in rs if r.index in missing and r.index not in relayed]
                for d, rs in direct.items()
            }
            direct = {d: rs for d, rs in direct.items() if rs}
            if not direct or session.done:
                return rest
            got = fetch_ranges(
                usable,
                {d: [(r.index, r.start, r.end) for r in rs] for d, rs in direct.items()},
                server_round=self.server_round,
                digest=self.digest,
                timeout_s=max(until - time.monotonic(), 0.001),
                batch_bytes=self.direct_batch_bytes,
            )
            actions = rest
            elapsed = 0.0
            for donor, res in got.items():
                elapsed = max(elapsed, res.seconds)
                answered: set[int] = set()
                for i, chunk, at in res.shards:
                    actions.extend(session.on_shard(donor, i, chunk, now + at))
                    if session.status(donor) == DonorStatus.BAD:
                        break  # a bad shard: the donor is dropped, its shards re-planned
                    answered.add(i)
                    if i not in self._got:
                        self._got.add(i)
                        self.received[donor] = self.received.get(donor, 0) + len(chunk)
                        self.direct_bytes[donor] = self.direct_bytes.get(donor, 0) + len(chunk)
                self.monitor.observe_transfer(donor, res.nbytes, res.seconds)
                if session.status(donor) != DonorStatus.LIVE:
                    self._lose(donor)
                elif res.error:
                    # the link failed: what it still owes goes through the relay
                    self.direct_failed[donor] = res.error
                    actions.extend(r for r in direct[donor] if r.index not in answered)
            now += elapsed
        return actions

    def _start_shards(self, manifest: Manifest, now: float) -> tuple[str, dict[str, ConfigRecord]]:
        assert self.plan is not None and self.total is not None
        if self.addresses:
            self._probe(self.total)
            # re-plan with the measured rates over the manifest's shard shape
            rated = plan_transfer(
                self.total,
                self._plan_donors(),
                min_shard_bytes=self.min_shard_bytes,
                chain=[manifest.num_shards] if manifest.num_shards else None,
            )
            if (rated.shard_bytes, rated.num_shards) == (manifest.shard_bytes, manifest.num_shards):
                self.plan = rated
        self.plan_rates = {d: self._rate(d) for d in self._live}
        live = set(self._live)
        self.session = PullSession(
            manifest,
            self.plan,
            [d for d in self._plan_donors() if d.id in live],
            now=now,
            expected_digest=self.digest,
            # one relay step carries every request: the ServerApp's per-phase deadline
            # decides who is lost, not a local request timer
            window=max(1, self.plan.num_shards),
            min_timeout_s=FLOWER_JOIN_REQUEST_TIMEOUT_S,
        )
        self.stage = "shards"
        self._asked = ""
        return self._advance(list(self.session.poll(now)), now)

    def _requests(
        self, actions: Sequence[object], now: float
    ) -> tuple[str, dict[str, ConfigRecord]]:
        session = self.session
        assert session is not None
        missing = set(session.missing())
        by_donor: dict[str, dict[int, ShardRequest]] = {}
        for action in actions:
            if isinstance(action, ShardRequest):
                by_donor.setdefault(action.donor, {})[action.index] = action
            elif isinstance(action, CancelRequest):
                by_donor.get(action.donor, {}).pop(action.index, None)
        wanted = {
            d: [r for i, r in sorted(rs.items()) if i in missing] for d, rs in by_donor.items()
        }
        wanted = {d: rs for d, rs in wanted.items() if rs}
        if not wanted:
            return self._fail("no live donor holds the missing shards")
        self._sent = {d: {r.index for r in rs} for d, rs in wanted.items()}
        return WANT, {
            d: ConfigRecord(
                {
                    "op": "shards",
                    "index": [r.index for r in rs],
                    "start": [r.start for r in rs],
                    "end": [r.end for r in rs],
                }
            )
            for d, rs in wanted.items()
        }

    def stats(self) -> ConfigRecord:
        """The figures the joiner reports with ``done``.

        Plan (``plan-*``: shards and bytes per donor as planned), bytes received per donor
        (``recv-*``; ``direct-bytes`` is the part of each that came over a direct link), donors
        lost, donors with a direct address and those whose link failed, and the per-donor rate
        estimates (bytes/s) the plan used (``rate-*``: measured for direct donors, the assumed
        rate for relay-only ones).
        """
        plan = self.plan
        donors = sorted(plan.assignment) if plan is not None else []
        return ConfigRecord(
            {
                "total": self.total or 0,
                "shard-bytes": plan.shard_bytes if plan else 0,
                "num-shards": plan.num_shards if plan else 0,
                "plan-donors": donors,
                "plan-shards": [len(plan.assignment[d]) for d in donors] if plan else [],
                "plan-bytes": [plan.bytes_by_donor().get(d, 0) for d in donors] if plan else [],
                "recv-donors": sorted(self.received),
                "recv-bytes": [self.received[d] for d in sorted(self.received)],
                "lost": list(self.lost),
                "error": self.error,
                "direct-donors": sorted(self.addresses),
                "direct-bytes": [self.direct_bytes.get(d, 0) for d in sorted(self.received)],
                "direct-failed": sorted(self.direct_failed),
                "rate-donors": sorted(self.plan_rates),
                "rate-bps": [float(self.plan_rates[d]) for d in sorted(self.plan_rates)],
            }
        )
