"""The joiner side of a pull on Flower: relay steps, and the carrier of the pull's state machine.

Flower has no node-to-node traffic, so the ServerApp relays; but it only *relays*: the joiner
plans the pull (planner-sized shares), checks the donors' signed receipts, verifies the
manifest and every shard, and assembles the state. One relay **step** is two exchanges:

1. ServerApp -> joiner (``query.chaos``, phase ``join``): a control record (the certified round
   and digest, the donors and their signed receipts and the state's size on the first step; the
   donors' replies to the previous step's requests after that). The joiner answers with its
   next requests, one per donor, or ``done`` / ``failed``.
2. ServerApp -> each donor named (phase ``pull``): the request, answered from the donor's
   replica (:func:`chaos_flwr.flower.client.donor.serve_request`); a donor that errs, misses the
   deadline or sends nothing is reported *lost* to the joiner, which re-plans its shards.

What to ask, and when, is the state machine's
(:class:`~chaos_flwr.pull.negotiation.PullNegotiation`); this module does the I/O it
decides: it turns its requests into records for the relay, times the direct links
(:mod:`chaos_flwr.flower.direct`) a donor names, fetches the direct donors' shards over grpc
within the step (all at once, within one budget: a link still busy when it is spent falls back
to the relay), and reads the clock. Records, per RecordDict of a message:

- ``chaos-pull`` (:data:`~chaos_flwr.flower.schema.PULL_DATA_KEY`): the control record;
- ``chaos-pull.<party id>``: the request to / reply from that donor.

:func:`join_step` is one relay step of a party (it checks the donors' receipts, starts or goes on
with its :class:`JoinerPull`, kept in ``Party.joining`` between steps, and holds the verified
state). A donor serves whoever the ServerApp names. That gives the ServerApp nothing it lacks: it
aggregated the state itself. What it cannot do is make a joiner hold a state that no holder
certified: receipts are verified by the joiner and the bytes against their digest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_DIRECT_BATCH_BYTES,
    FLOWER_DIRECT_MIN_BPS,
    FLOWER_DIRECT_TIMEOUT_S,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    PEER_MAX_RECORDS_PER_MESSAGE,
)
from chaos_flwr.errors import ChaosError, DecodeError, ShardIntegrityError
from chaos_flwr.flower.client.endpoint import LinkedParty, link_access
from chaos_flwr.flower.client.sponsors import ask_sponsors
from chaos_flwr.flower.schema import JOIN_TAKE_OP
from chaos_flwr.pull.messages import Reply, read_reply
from chaos_flwr.pull.negotiation import (
    PULL_ASSUMED_BANDWIDTH_BPS,
    Decision,
    PullNegotiation,
    Status,
)
from chaos_flwr.pull.saved import load_negotiation, save_negotiation
from chaos_flwr.state import TrainingState, state_digest

if TYPE_CHECKING:
    from chaos_flwr.flower.direct import LinkAccess

__all__ = ["JoinerPull", "JoiningParty", "join_step", "take_state"]

#: Largest encoded membership record a join's start may carry (the donors' join and endpoint
#: records: an endpoint record holds a link certificate of at most LINK_CERT_MAX_BYTES).
FLOWER_JOIN_MAX_RECORD_BYTES: int = 16 * 1024
#: The kinds of direct-link work a pull's carrier times (:meth:`JoinerPull.stats`).
_PHASES = ("manifest", "fetch")


def _any_address(value: str) -> str:
    from chaos_flwr.membership import parse_address

    parse_address(value)  # DecodeError if malformed; the signed endpoint decides the rest
    return value


def _signed_endpoints(link: LinkAccess | None, donors: list[str]) -> dict[str, str]:
    """Donor -> the address its verified endpoint record signs (the donors that have one)."""
    if link is None:
        return {}
    view = link.view()
    return {d: ep.address for d in donors if (ep := view.endpoint(d)) is not None}


class JoinerPull:
    """The joiner's side of one relayed pull: a :class:`~chaos_flwr.pull.PullNegotiation` and
    the I/O it asks for.

    Parameters
    ----------
    server_round, digest:
        The certified state to pull.
    donors:
        Donor party ids whose receipts the joiner verified.
    min_shard_bytes:
        Smallest shard of the plan.
    total_hint:
        The state's size as the ServerApp named it (saves a step; ``None``: ask the donors).
    direct:
        Use donors' advertised direct addresses (:mod:`chaos_flwr.flower.direct`).
    direct_batch_bytes:
        Bytes asked per grpc request on a direct link.
    direct_timeout_s, direct_min_bps:
        The bound of a step's direct-link work: ``direct_timeout_s`` plus the state's bytes at
        ``direct_min_bps`` (:func:`~chaos_flwr.flower.fetch.direct_budget_s`); a manifest
        request has ``direct_timeout_s`` at most.
    clock:
        Monotonic clock for the direct links' budget and the session's times.
    link:
        This party's link credentials and view (:class:`~chaos_flwr.flower.direct.LinkAccess`):
        direct links are authenticated and encrypted, and a donor is dialled only at the
        endpoint its verified record signs. ``None`` (an unsigned party): relay only.
    """

    def __init__(
        self,
        server_round: int,
        digest: bytes,
        donors: list[str],
        *,
        min_shard_bytes: int = FLOWER_JOIN_MIN_SHARD_BYTES,
        total_hint: int | None = None,
        direct: bool = True,
        direct_batch_bytes: int = FLOWER_DIRECT_BATCH_BYTES,
        direct_timeout_s: float = FLOWER_DIRECT_TIMEOUT_S,
        direct_min_bps: float = FLOWER_DIRECT_MIN_BPS,
        clock: Callable[[], float] = time.monotonic,
        negotiation: PullNegotiation | None = None,
        link: LinkAccess | None = None,
    ) -> None:
        self.negotiation = negotiation or PullNegotiation(
            server_round,
            digest,
            donors,
            min_shard_bytes=min_shard_bytes,
            total_hint=total_hint,
            rates={d: PULL_ASSUMED_BANDWIDTH_BPS for d in donors},
            direct=direct and link is not None,
            address_ok=_any_address,
            addresses=_signed_endpoints(link, donors) if direct else None,
        )
        self.link = link
        self.direct_batch_bytes = direct_batch_bytes
        self.direct_timeout_s, self.direct_min_bps = direct_timeout_s, direct_min_bps
        self.clock = clock
        #: Seconds spent on each kind of direct-link work (manifest, fetch) in this
        #: process: where a pull's time goes, beside its bytes (reported by :meth:`stats`).
        self.phase_s: dict[str, float] = dict.fromkeys(_PHASES, 0.0)

    # -- what the party reads -----------------------------------------------------------------
    @property
    def server_round(self) -> int:
        """The certified round being pulled."""
        return self.negotiation.server_round

    @property
    def state(self) -> TrainingState | None:
        """The verified state, once the pull is done."""
        return self.negotiation.state

    @property
    def error(self) -> str:
        """Why the pull failed (``""`` if it did not)."""
        return self.negotiation.error

    @property
    def received(self) -> dict[str, int]:
        """Bytes received per donor (verified shards, each counted once)."""
        return self.negotiation.received

    @property
    def direct_bytes(self) -> dict[str, int]:
        """The part of :attr:`received` that came over a direct link, per donor."""
        return self.negotiation.direct_bytes

    @property
    def direct_failed(self) -> dict[str, str]:
        """Donors whose direct link failed (or was refused), and why."""
        return self.negotiation.direct_failed

    @property
    def lost(self) -> list[str]:
        """Donors lost during the pull."""
        return self.negotiation.lost

    def stats(self) -> ConfigRecord:
        """The figures the joiner reports with ``done`` (:meth:`PullNegotiation.stats`), and
        the seconds its direct links spent on the manifest and the fetch
        (``direct-manifest-s``, ``direct-fetch-s``)."""
        figures = self.negotiation.stats()
        figures.update({f"direct-{k}-s": round(v, 4) for k, v in self.phase_s.items()})
        return ConfigRecord(figures)  # type: ignore[arg-type]

    # -- the relay steps ----------------------------------------------------------------------
    def start(self, now: float) -> tuple[str, dict[str, ConfigRecord]]:
        """The first requests."""
        return self._carry(self.negotiation.start(now))

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
        read: dict[str, Reply | None] = {}
        for donor, record in replies.items():
            try:
                read[donor] = read_reply(record)
            except ChaosError:
                read[donor] = None  # a reply of no known shape loses its donor
        return self._carry(self.negotiation.on_replies(read, lost, now))

    def _carry(self, decision: Decision) -> tuple[str, dict[str, ConfigRecord]]:
        """Carry out the direct fetches the machine decides, within one budget; return what
        goes through the relay."""
        from chaos_flwr.flower.fetch import carry_direct, direct_budget_s

        n = self.negotiation  # its total: a size it planned for, at most max_state_bytes
        budget = direct_budget_s(
            n.total, fixed_s=self.direct_timeout_s, min_bps=self.direct_min_bps
        )
        decision = carry_direct(
            n, decision, self.link, clock=self.clock, batch_bytes=self.direct_batch_bytes,
            timeout_s=budget, manifest_s=self.direct_timeout_s, phase_s=self.phase_s,
        )  # fmt: skip
        requests = {d: ConfigRecord(r.to_value()) for d, r in decision.relay.items()}  # type: ignore[arg-type]
        return decision.status.value, requests if decision.status == Status.WANT else {}

    def use_link(self, link: LinkAccess | None) -> None:
        """Dial over authenticated links with ``link`` from now on (a pull taken up from a
        saved value has none); ``None`` changes nothing."""
        if link is not None:
            self.link = link

    # -- saved between processes --------------------------------------------------------------
    def to_value(self) -> dict[str, Any]:
        """The pull in progress as plain, versioned values (:mod:`chaos_flwr.pull.saved`)."""
        return save_negotiation(self.negotiation)

    @classmethod
    def from_value(cls, value: Mapping[str, Any], *, link: LinkAccess | None = None) -> JoinerPull:
        """A pull saved by :meth:`to_value` (DecodeError on a bad or foreign value)."""
        negotiation = load_negotiation(value, address_ok=_any_address)
        return cls(0, b"", [], negotiation=negotiation, link=link)


class JoiningParty(LinkedParty, Protocol):
    """What :func:`join_step` uses of a :class:`~chaos_flwr.flower.client.party.Party`."""

    party_id: str
    held_round: int
    held_digest: bytes
    left: bool
    joining: JoinerPull | None
    pending: list[Any]
    joins_done: list[ConfigRecord]
    errors: list[str]

    @property
    def clock(self) -> Callable[[], float]: ...

    def check_receipts(self, record: ConfigRecord | None) -> bool: ...

    def _receipt_ok(self, party: str, rnd: int, digest: bytes, blob: bytes) -> bool: ...

    def _hold(
        self, state: TrainingState, arrays: ArrayRecord | None = ..., digest: bytes = ...
    ) -> None: ...

    def hold(
        self, state: TrainingState, arrays: ArrayRecord | None = ..., digest: bytes = ...
    ) -> None: ...

    def max_signed_round(self) -> int: ...

    def signed_digest(self, rnd: int) -> bytes | None: ...

    def unfinal(self, rnd: int, digest: bytes, audits: object) -> str: ...

    def take_news(self, record: ConfigRecord) -> None: ...

    def ask_to_join(self, record: ConfigRecord, now: float) -> list[Any]: ...


def _start_settings(control: ConfigRecord) -> tuple[int, int | None]:
    """The shard floor and the size hint a start record names (each ignored unless an int
    > 0: the floor then defaults, the size is asked of the donors)."""

    def positive(key: str) -> int | None:
        value = control.get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if ok else None  # type: ignore[return-value]

    return positive("min-shard") or FLOWER_JOIN_MIN_SHARD_BYTES, positive("total")


def _check_start(
    party: JoiningParty, rnd: int, digest: bytes, control: ConfigRecord
) -> tuple[list[str], ConfigRecord | None]:
    """The checks before a joiner takes ``(rnd, digest)`` from anyone: the holders' signed
    receipts (those that verify against the keyring, at least one), the round's audits (a
    final state only) and, for a party that certified another state of this very round, the
    equivocation it shows. Returns the holders whose receipts verify, and the ``failed``
    reply when a check fails (``None`` when all pass)."""
    donors = control.get("donors", [])
    blobs = control.get("receipts", [])
    if not isinstance(donors, list) or not isinstance(blobs, list):
        return [], ConfigRecord({"status": "failed", "error": "bad start record"})
    good = [
        d
        for d, b in zip(donors, blobs, strict=False)
        if isinstance(d, str) and isinstance(b, bytes) and party._receipt_ok(d, rnd, digest, b)
    ]
    if not good:
        return [], ConfigRecord({"status": "failed", "error": "no donor receipt verifies"})
    why = party.unfinal(rnd, digest, control.get("audits"))
    if why:
        party.errors.append(why)
        return [], ConfigRecord({"status": "failed", "error": why})
    if rnd == party.held_round and party.held_round >= 0:
        # it certified another state of this very round: the relay showed the round
        # two ways. Never re-sign; the donors' receipts and its own are the evidence.
        from chaos_flwr.receipts import Receipt

        theirs = [
            Receipt.from_flower(d, rnd, digest, b).encode()
            for d, b in zip(donors, blobs, strict=False)
            if d in good and isinstance(b, bytes)
        ]
        party.check_receipts(ConfigRecord({"receipts": theirs}))
        why = f"EquivocationError: round {rnd} was shown with two digests"
        return [], ConfigRecord({"status": "failed", "error": why})
    return good, None


def take_state(
    party: JoiningParty, rnd: int, digest: bytes, control: ConfigRecord, holders: list[str]
) -> ConfigRecord:
    """Take up the certified state the ServerApp sent in ``control`` (a
    :func:`~chaos_flwr.flower.schema.take_record`), after :func:`_check_start` passed.

    The bytes must hash to ``digest``, which ``holders``' verified receipts name (hashed
    once: the party holds the state under the digest checked here), and decode to a state
    of round ``rnd``. Returns the control reply: ``done`` (the party holds the state; its
    receipt goes out with this reply) or ``failed`` with the typed error, which is also
    noted in the party's errors; a refused state changes nothing held, and the ServerApp
    falls back to the multi-source pull.
    """
    t0 = party.clock()
    data = control.get("state")
    try:
        if not isinstance(data, bytes):
            raise DecodeError("join take record: field 'state' must be bytes")
        if state_digest(data) != digest:
            raise ShardIntegrityError(
                f"the state the ServerApp sent for round {rnd} does not hash to the digest "
                f"that {len(holders)} holder receipt(s) name"
            )
        state = TrainingState.from_bytes(data)
        if state.round != rnd:  # the digest covers the round: only a broken encoder
            raise ShardIntegrityError(f"the state sent is of round {state.round}, not {rnd}")
    except ChaosError as exc:
        why = f"{type(exc).__name__}: {exc}"
        party.errors.append(f"join take of round {rnd} refused: {why}")
        reply = ConfigRecord({"status": "failed", "error": why, "source": "server"})
        party.joins_done.append(reply)
        return reply
    party.joining = None
    party.hold(state, digest=digest)  # the digest just checked: hashed once
    reply = ConfigRecord(
        {"status": "done", "source": "server", "total": len(data), "take-s": party.clock() - t0}
    )
    party.joins_done.append(reply)
    return reply


def _take_records(party: JoiningParty, control: ConfigRecord, now: float) -> None:
    """Take up the donors' join and endpoint records the start carries (a joiner that came
    just now may not hold them): each is verified like any record, so no one can make it dial
    an address its party did not sign; a bad one is noted in ``party.errors``, the pull goes
    on (a donor whose endpoint it cannot verify is pulled through the relay)."""
    blobs = control.get("records", [])
    load = getattr(party.peer, "load_records", None)
    if not isinstance(blobs, list) or not blobs or load is None:
        return
    try:
        if len(blobs) > PEER_MAX_RECORDS_PER_MESSAGE:
            raise DecodeError(f"{len(blobs)} records, above PEER_MAX_RECORDS_PER_MESSAGE")
        values: list[Any] = []
        for blob in blobs:
            if not isinstance(blob, bytes):
                raise DecodeError("a record in the join's start is not bytes")
            values.append(codec.decode(blob, max_bytes=FLOWER_JOIN_MAX_RECORD_BYTES))
        load(values, now)
    except ChaosError as exc:
        name = type(exc).__name__
        party.errors.append(f"the join's donor records were not taken ({name}: {exc})")


def join_step(
    party: JoiningParty,
    record: ConfigRecord,
    control: ConfigRecord,
    replies: Mapping[str, ConfigRecord],
) -> tuple[ConfigRecord, dict[str, ConfigRecord]]:
    """One relay step of this party's pull of the certified state (it is the joiner).

    ``record`` names the certified round and digest; ``control`` starts the pull (donors
    and their signed receipts, checked here against the keyring) or reports lost donors;
    ``replies`` are the donors' answers to the previous step's requests. Returns the
    control reply (``status`` want/done/failed, figures when done) and the requests per
    donor. A verified state is held (and stored with this party's receipt).
    """
    rnd, digest = record.get("round"), record.get("digest")
    if not isinstance(rnd, int) or isinstance(rnd, bool) or not isinstance(digest, bytes):
        return ConfigRecord({"status": "failed", "error": "no round/digest"}), {}
    if party.left:
        return ConfigRecord({"status": "failed", "error": "party left"}), {}
    party.take_news(record)  # the view they bring first (e.g. its own join record)
    skip = control.get("skip", [])
    if isinstance(skip, list) and party.party_id in skip:  # it trains in this round already
        return ConfigRecord({"status": "failed", "error": "it trains in this round"}), {}
    if rnd == party.held_round and digest == party.held_digest:
        party.joining = None
        return ConfigRecord({"status": "done", "error": "already held"}), {}
    signed = party.max_signed_round()
    if rnd <= signed and rnd != party.held_round and party.signed_digest(rnd) != digest:
        # a signing party never takes up (and signs) a second state of a round it signed,
        # nor a state below it that it did not sign: refused before a byte moves
        why = f"ProofError: round {rnd} is not above round {signed}, which this party signed"
        party.errors.append(why)
        return ConfigRecord({"status": "failed", "error": why}), {}
    now = party.clock()
    pull = party.joining
    op = control.get("op")
    if op in ("start", JOIN_TAKE_OP) or pull is None or pull.server_round != rnd:
        good, refused = _check_start(party, rnd, digest, control)
        if refused is not None:
            return refused, {}
        if op == JOIN_TAKE_OP:
            return take_state(party, rnd, digest, control, good), {}
        min_shard, total = _start_settings(control)
        _take_records(party, control, now)
        link = link_access(party)
        if link is not None and not getattr(party.peer, "is_member", True):
            # the start may come with the party's first message: its join is asked for first
            party.pending.extend(party.ask_to_join(record, now))
            ask_sponsors(party, link, good)  # their daemons sign while their nodes train
        pull = JoinerPull(rnd, digest, good, min_shard_bytes=min_shard, total_hint=total, link=link)
        party.joining = pull
        status, requests = pull.start(now)
    else:
        if pull.link is None:  # a pull saved by another process: its links are re-made here
            pull.use_link(link_access(party))
        lost_v = control.get("lost", [])
        lost = {x for x in lost_v if isinstance(x, str)} if isinstance(lost_v, list) else set()
        status, requests = pull.step(replies, lost, now)
    reply = ConfigRecord({"status": status})
    if status != "want":
        reply = pull.stats()
        reply["status"] = status
        party.joining = None
        if status == "done" and pull.state is not None:
            party._hold(pull.state, digest=pull.negotiation.digest)  # it checked the digest
        party.joins_done.append(reply)
        if status == "failed":
            party.errors.append(f"join pull of round {rnd} failed: {pull.error}")
    return reply, requests
