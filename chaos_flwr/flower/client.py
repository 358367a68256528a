"""The client side: an existing ``ClientApp`` adopts Chaos with :func:`enable`.

The change to a plain Flower app is::

    from chaos_flwr.flower import enable   # 1
    app = ClientApp()
    ...                                     # @app.train() / @app.evaluate() as before
    enable(app)                             # 2

:func:`enable` registers the ``query.chaos`` handler and wraps the app's train/evaluate handlers
so that Chaos records riding on those messages are taken off before the handler sees them and
the party's outgoing envelopes and receipt are put on the reply.

Party settings come from Flower's ``node_config`` (``chaos-key``, ``chaos-charter``,
``chaos-state-dir``); a missing or wrong one is a :class:`~chaos_flwr.errors.ConfigError` that
names it.

Signed runs in simulation
-------------------------
Simulation SuperNodes get only ``node_config = {partition-id, num-partitions}``. For them the
run config may name a federation folder written by
:func:`chaos_flwr.flower.keys.make_federation`:

- ``chaos-keys-dir``: the folder; the party's key is ``party-<partition-id>.key`` in it and
  the charter is its ``charter.yaml``;
- ``chaos-state-root``: the party's state directory is ``<root>/party-<partition-id>``.

A ``node_config`` key (``chaos-key``, ``chaos-charter``, ``chaos-state-dir``) wins over the run
config fallback when both are present.

Helpers that drive a party from outside (churn scenarios) get it with :func:`party_for` and
call :meth:`Party.leave`, :meth:`Party.connect` or :meth:`Party.disconnect`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from chaos_flwr import codec
from chaos_flwr.defaults import (
    FLOWER_CHAOS_RECORD_KEY,
    FLOWER_JOIN_MIN_SHARD_BYTES,
    FLOWER_JOIN_RETRY_S,
    FLOWER_PULL_DATA_KEY,
)
from chaos_flwr.errors import ChaosError, ConfigError, StoreError, TransportError
from chaos_flwr.flower.joinpull import JoinerPull, donor_key, read_donor_records
from chaos_flwr.flower.relay import OutgoingLike, PeerProtocol, party_record, split_chaos
from chaos_flwr.state import TrainingState, from_array_record, to_array_record
from chaos_flwr.store import ReplicaStore

if TYPE_CHECKING:
    from chaos_flwr.flower.durable import SavedParty
    from chaos_flwr.receipts import Equivocation, ReceiptLedger

__all__ = [
    "NODE_CHARTER",
    "NODE_KEY",
    "NODE_PARTITION_ID",
    "NODE_STATE_DIR",
    "RUN_KEYS_DIR",
    "RUN_STATE_ROOT",
    "RUN_UNSIGNED",
    "Party",
    "PartySettings",
    "certified_digest",
    "enable",
    "forget_party",
    "party_for",
    "party_settings",
    "receipt_bytes",
]

#: ``node_config`` key: path of the party's Ed25519 key file.
NODE_KEY = "chaos-key"
#: ``node_config`` key: path of the federation's signed charter (YAML).
NODE_CHARTER = "chaos-charter"
#: ``node_config`` key: directory of the party's durable state (replicas, records).
NODE_STATE_DIR = "chaos-state-dir"
#: ``run_config`` key: run parties with no identity (relay and receipts *unsigned*), e.g. to
#: measure carrier overhead in simulation, where SuperNodes have no per-node config.
RUN_UNSIGNED = "chaos-unsigned"
#: ``run_config`` key: federation folder (``party-<partition-id>.key`` + ``charter.yaml``) for
#: SuperNodes without per-node Chaos settings (simulation).
RUN_KEYS_DIR = "chaos-keys-dir"
#: ``run_config`` key: root of the parties' state directories (``<root>/party-<partition-id>``).
RUN_STATE_ROOT = "chaos-state-root"
#: ``node_config`` key Flower's simulation engine sets on every virtual SuperNode.
NODE_PARTITION_ID = "partition-id"
#: File in a party's state directory that says it left the federation (it stays out).
LEFT_MARKER = "left"


def certified_digest(arrays: ArrayRecord, server_round: int, strategy_state: bytes = b"") -> bytes:
    """Digest of the training state ``(arrays, server_round, strategy_state)``, as receipts
    certify it.

    It is :meth:`chaos_flwr.state.TrainingState.digest` of the state built from the
    ArrayRecord, so receipts, replica files and shard manifests name the same digest.
    ``strategy_state`` is the inner strategy's opaque state (e.g. FedAdam's moments).
    """
    return from_array_record(arrays, round=server_round, strategy_state=strategy_state).digest()


def receipt_bytes(party: str, server_round: int, digest: bytes) -> bytes:
    """The exact bytes a party signs to certify that it holds ``digest`` after a round."""
    return codec.encode(
        {"kind": "receipt", "party": party, "round": server_round, "digest": digest}
    )


@dataclass(frozen=True)
class PartySettings:
    """Where a party's durable things are (from ``node_config``).

    Attributes
    ----------
    key_path, charter_path:
        The party's key and the charter; ``None`` only in unsigned mode.
    state_dir:
        Directory for the party's replica and records (created if missing).
    unsigned:
        True when the run asked for identity-less parties (:data:`RUN_UNSIGNED`).
    direct_addr:
        The party's direct replica server (``node_config`` ``chaos-direct-addr``, a loopback
        ``host:port``; see :mod:`chaos_flwr.flower.direct`), or ``""`` for relay only.
    """

    key_path: Path | None
    charter_path: Path | None
    state_dir: Path | None
    unsigned: bool
    direct_addr: str = ""


def _path_setting(context: Context, key: str) -> Path | None:
    value = context.node_config.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"node_config '{key}' must be a non-empty path string, got {value!r}")
    return Path(value).expanduser()


def _run_path(context: Context, key: str) -> Path | None:
    value = context.run_config.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"run_config '{key}' must be a path string, got {value!r}")
    return Path(value).expanduser()


def _partition_id(context: Context, why: str) -> int:
    value = context.node_config.get(NODE_PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(
            f"node_config '{NODE_PARTITION_ID}' is missing or not an int ({value!r}); run "
            f"config '{why}' needs it to pick this SuperNode's files"
        )
    try:
        pid = int(value)
    except ValueError:
        raise ConfigError(f"node_config '{NODE_PARTITION_ID}' is not an int: {value!r}") from None
    if pid < 0:
        raise ConfigError(f"node_config '{NODE_PARTITION_ID}' must be >= 0, got {pid}")
    return pid


def party_settings(context: Context) -> PartySettings:
    """Read and check the party settings of a SuperNode.

    ``node_config`` keys win; missing ones fall back to the run config's ``chaos-keys-dir`` /
    ``chaos-state-root`` with the node's ``partition-id`` (module docstring).

    Raises
    ------
    ConfigError
        A setting is missing (and the run is not unsigned), or a path does not exist / is not
        what it should be. The message names the ``node_config`` or ``run_config`` key.
    """
    from chaos_flwr.defaults import FLOWER_DIRECT_NODE_KEY, FLOWER_FEDERATION_KEY_PREFIX
    from chaos_flwr.flower.direct import check_address
    from chaos_flwr.flower.keys import charter_path, key_path

    direct = context.node_config.get(FLOWER_DIRECT_NODE_KEY)
    try:
        direct_addr = "" if direct is None else check_address(direct)
    except ConfigError as exc:
        raise ConfigError(f"node_config '{FLOWER_DIRECT_NODE_KEY}': {exc}") from None
    unsigned = bool(context.run_config.get(RUN_UNSIGNED, False))
    key = _path_setting(context, NODE_KEY)
    charter = _path_setting(context, NODE_CHARTER)
    state = _path_setting(context, NODE_STATE_DIR)
    src = {NODE_KEY: f"node_config '{NODE_KEY}'", NODE_CHARTER: f"node_config '{NODE_CHARTER}'"}
    src[NODE_STATE_DIR] = f"node_config '{NODE_STATE_DIR}'"
    keys_dir = _run_path(context, RUN_KEYS_DIR)
    state_root = _run_path(context, RUN_STATE_ROOT)
    if keys_dir is not None and (key is None or charter is None):
        if not keys_dir.is_dir():
            raise ConfigError(f"run_config '{RUN_KEYS_DIR}': {keys_dir} is not a directory")
        pid = _partition_id(context, RUN_KEYS_DIR)
        if key is None:
            key = key_path(keys_dir, pid)
            src[NODE_KEY] = f"run_config '{RUN_KEYS_DIR}'"
        if charter is None:
            charter = charter_path(keys_dir)
            src[NODE_CHARTER] = f"run_config '{RUN_KEYS_DIR}'"
    if state is None and state_root is not None:
        pid = _partition_id(context, RUN_STATE_ROOT)
        state = state_root / f"{FLOWER_FEDERATION_KEY_PREFIX}{pid}"
        src[NODE_STATE_DIR] = f"run_config '{RUN_STATE_ROOT}'"
    if unsigned and key is None and charter is None:
        return PartySettings(None, None, state, True, direct_addr)
    for name, path in ((NODE_KEY, key), (NODE_CHARTER, charter), (NODE_STATE_DIR, state)):
        if path is None:
            raise ConfigError(
                f"node_config '{name}' is missing: start the SuperNode with --node-config "
                f'\'{NODE_KEY}="..." {NODE_CHARTER}="..." {NODE_STATE_DIR}="..."\' '
                f"(in simulation: run config '{RUN_KEYS_DIR}' and '{RUN_STATE_ROOT}'; or set "
                f"run config '{RUN_UNSIGNED}=true' for an identity-less test run)"
            )
    assert key is not None and charter is not None and state is not None
    if not key.is_file():
        raise ConfigError(f"{src[NODE_KEY]}: no key file at {key}; run chaos-flwr keygen")
    if not charter.is_file():
        raise ConfigError(f"{src[NODE_CHARTER]}: no charter file at {charter}")
    if state.exists() and not state.is_dir():
        raise ConfigError(f"{src[NODE_STATE_DIR]}: {state} exists and is not a directory")
    return PartySettings(key, charter, state, unsigned, direct_addr)


@dataclass
class Party:
    """One party's Chaos runtime inside a ClientApp process.

    Parameters
    ----------
    party_id:
        The party's id (``identity.party_id_of(public key)``).
    peer:
        The sans-I/O protocol peer fed with every envelope the relay delivers; ``None`` for a
        relay-only party (it routes nothing and speaks no membership protocol).
    signer:
        Signs receipts (``Identity.sign``); ``None`` means receipts go out *unsigned* (empty
        receipt blob), and a verifying server does not count them.
    clock:
        Wall clock handed to the peer as ``now``.
    store:
        The party's replica store: every certified state is written there (with the party's
        signed receipt as its certificate) and :meth:`restore` takes it up after a restart.
    """

    party_id: str
    peer: PeerProtocol | None = None
    signer: Callable[[bytes], bytes] | None = None
    clock: Callable[[], float] = time.time
    held_round: int = -1
    held_digest: bytes = b""
    held_arrays: ArrayRecord | None = None
    errors: list[str] = field(default_factory=list)
    pending: list[OutgoingLike] = field(default_factory=list)
    store: ReplicaStore | None = None
    left: bool = False
    keyring: Mapping[str, bytes] | None = None
    held_state: TrainingState | None = None
    joining: JoinerPull | None = None
    joins_done: list[ConfigRecord] = field(default_factory=list)
    _join_asked: tuple[float | None, tuple[str, ...]] = field(default=(None, ()), repr=False)
    evidence: list[Equivocation] = field(default_factory=list)
    auto_link: bool = True
    state_dir: Path | None = None
    direct_addr: str = ""
    _links_asked: set[tuple[str, int, int]] = field(default_factory=set, repr=False)
    _ledger: ReceiptLedger | None = field(default=None, repr=False)
    _evidence_sent: int = field(default=0, repr=False)
    _bytes: bytes = field(default=b"", repr=False)
    _bytes_round: int = field(default=-1, repr=False)
    lifetime: str = ""
    _saved_as: tuple[int, int] | None = field(default=None, repr=False)

    # -- durable state (chaos_flwr.flower.durable) -----------------------------------------------
    def saved(self) -> SavedParty:
        """What this party must keep until its next message (see :mod:`.durable`)."""
        from chaos_flwr.flower.durable import SavedParty, ledger_receipts

        peer = self.peer
        replay_of = getattr(peer, "replay_state", None)
        replay = replay_of() if replay_of is not None else {}
        records = getattr(peer, "records", None)
        return SavedParty(
            party_id=self.party_id,
            lifetime=self.lifetime,
            incarnation=int(getattr(peer, "incarnation", 0)),
            seq=int(getattr(peer, "seq", 0)),
            replay=replay,
            records=[r.to_wire() for r in records or ()],
            pending=[(o.to, bytes(o.data)) for o in self.pending],
            join_asked=self._join_asked,
            links_asked=sorted(self._links_asked),
            joining=None if self.joining is None else self.joining.to_value(),
            joins_done=[dict(c.items()) for c in self.joins_done],
            receipts=ledger_receipts(self._ledger),
            evidence=[ev.encode() for ev in self.evidence],
            evidence_sent=self._evidence_sent,
        )

    def take_up(self, saved: SavedParty, *, same_life: bool) -> None:
        """Take up a saved state: the ledger and evidence always; when ``same_life`` also the
        pending envelopes and the join progress (a real restart starts those afresh).

        Raises
        ------
        chaos_flwr.errors.StoreError
            The join pull or a receipt in the saved state is unreadable.
        """
        from chaos_flwr.receipts import Equivocation, Receipt, ReceiptLedger

        if self.keyring is not None and saved.receipts:
            self._ledger = ReceiptLedger(dict(self.keyring))
            try:
                self._ledger.add_all([Receipt.decode(b) for b in saved.receipts])
                self.evidence = [Equivocation.decode(b) for b in saved.evidence]
            except ChaosError as exc:
                raise StoreError(f"saved party state: bad receipt or evidence ({exc})") from exc
            self._evidence_sent = min(saved.evidence_sent, len(self.evidence))
        if not same_life:
            return
        from chaos_flwr.peer import Outgoing

        self.joining = saved.joiner_pull()
        self.pending = [Outgoing(to, data) for to, data in saved.pending]
        self._join_asked = saved.join_asked
        self._links_asked = set(saved.links_asked)
        self.joins_done = [ConfigRecord(d) for d in saved.joins_done]

    def is_current(self) -> bool:
        """Whether the state file is still the one this party object last saved (another
        process of the same party, e.g. a second simulation worker, has not saved since)."""
        if self._saved_as is None or self.state_dir is None:
            return True
        from chaos_flwr.flower.durable import STATE_FILE

        try:
            st = (self.state_dir / STATE_FILE).stat()
        except OSError:
            return False
        return (st.st_ino, st.st_mtime_ns) == self._saved_as

    def persist(self) -> None:
        """Save the party's state to its state directory (before a reply leaves the process).

        A failed save is noted in :attr:`errors` and the old file is removed, so the next
        process starts as a real restart (fresh incarnation) instead of reusing sequence
        numbers this one already sent.
        """
        if self.state_dir is None or self.peer is None:
            return
        from chaos_flwr.flower import durable

        try:
            path = durable.save(self.state_dir, self.saved(), seal=self.signer)
            st = path.stat()
            self._saved_as = (st.st_ino, st.st_mtime_ns)
        except (StoreError, OSError) as exc:
            self._saved_as = None
            self.errors.append(f"StoreError: {exc}")
            durable.LOG.warning("chaos-flwr: %s", exc)
            with contextlib.suppress(OSError):
                (self.state_dir / durable.STATE_FILE).unlink()

    # -- membership actions (churn scenarios, operators) ----------------------------------------
    def _need_peer(self, action: str) -> PeerProtocol:
        if self.peer is None:
            raise ConfigError(
                f"party {self.party_id} has no protocol peer (unsigned run); it cannot {action}"
            )
        return self.peer

    def leave(self) -> None:
        """Leave the federation: sign a leave record (sent with the party's next reply).

        From then on the party answers nothing more as a member: its train/evaluate handlers
        reply with an error, it sends no receipt and serves no shards; relay messages are still
        answered so that the leave record gets out.

        Raises
        ------
        chaos_flwr.errors.PolicyError
            The party is not an active member.
        chaos_flwr.errors.ConfigError
            The party has no protocol peer (unsigned run).
        """
        peer = self._need_peer("leave")
        action = getattr(peer, "leave", None)
        if action is None:
            raise ConfigError(f"the peer of {self.party_id} has no leave action")
        self.pending.extend(action(self.clock()))
        self.left = True
        if self.state_dir is not None:  # leaving is durable: a restart does not rejoin
            try:
                self.state_dir.mkdir(parents=True, exist_ok=True)
                (self.state_dir / LEFT_MARKER).write_text(f"{self.party_id}\n")
            except OSError as exc:
                self.errors.append(f"StoreError: cannot write the leave marker: {exc}")

    def connect(self, other_party_id: str) -> None:
        """Ask ``other_party_id`` for a link (a signed link-up record, both ends sign).

        Raises
        ------
        chaos_flwr.errors.PolicyError
            Either end is not an active member, or ``other_party_id`` is this party.
        """
        peer = self._need_peer("connect")
        self.pending.extend(peer.connect(other_party_id, self.clock()))  # type: ignore[attr-defined]

    def disconnect(self, other_party_id: str) -> None:
        """Take the link to ``other_party_id`` down (a signed link-down record).

        Raises
        ------
        chaos_flwr.errors.PolicyError
            There is no up link between the two parties.
        """
        peer = self._need_peer("disconnect")
        self.pending.extend(peer.disconnect(other_party_id, self.clock()))  # type: ignore[attr-defined]

    def _receipt(self) -> bytes:
        if self.signer is None or self.held_round < 0 or self.left:
            return b""
        return self.signer(receipt_bytes(self.party_id, self.held_round, self.held_digest))

    def _hold(self, state: TrainingState, arrays: ArrayRecord | None = None) -> None:
        self.held_round = state.round
        self.held_digest = state.digest()
        self.held_state = state
        self.held_arrays = arrays if arrays is not None else to_array_record(state)
        if self.store is not None:
            try:
                self.store.put(state, certificate=self._receipt())
            except StoreError as exc:  # the replica stays in memory only; say so
                self.errors.append(f"StoreError: {exc}")

    def _signed_digest(self, rnd: int) -> bytes | None:
        """The digest this party already holds (and signed) for round ``rnd``, if any."""
        if rnd == self.held_round and self.held_digest:
            return self.held_digest
        if self.store is not None and rnd in self.store.rounds():
            try:
                with self.store.open(rnd, verify=False) as replica:
                    return replica.state_digest
            except StoreError:
                return None
        return None

    def _own_receipt_ok(self, state: TrainingState, certificate: bytes) -> bool:
        """Whether ``certificate`` is this party's signed receipt for ``state``."""
        if self.keyring is None:  # no keyring to check with: the store's digest check is all
            return True
        key = self.keyring.get(self.party_id)
        if key is None:
            return False
        from chaos_flwr.errors import SignatureError
        from chaos_flwr.identity import verify_signature

        try:
            verify_signature(
                key, certificate, receipt_bytes(self.party_id, state.round, state.digest())
            )
        except SignatureError:
            return False
        return True

    def restore(self) -> bool:
        """Take up the newest replica of the party's store (a restart with its disk).

        The replica must hash to its digest (the store checks) and carry this party's own
        signed receipt for it (its certificate). Returns whether a replica was taken up. A
        corrupt or uncertified replica is noted in :attr:`errors` and ignored: the party then
        holds nothing and rejoins as a joiner. A replica of an older round makes the party a
        joiner that catches up (the ServerApp has it pull the current state).
        """
        if self.store is None:
            return False
        try:
            state = self.store.latest()
            cert = self.store.certificate(state.round) if state is not None else b""
        except StoreError as exc:
            self.errors.append(f"StoreError: {exc}")
            return False
        if state is None:
            return False
        if not self._own_receipt_ok(state, cert):
            self.errors.append(
                f"StoreError: replica of round {state.round} does not carry this party's "
                "signed receipt; ignored"
            )
            return False
        self.held_round = state.round
        self.held_digest = state.digest()
        self.held_state = state
        self.held_arrays = to_array_record(state)
        return True

    def serve(self, record: ConfigRecord, request: ConfigRecord) -> ConfigRecord | None:
        """Answer a pull request from the held replica, if it is the state the request names."""
        if self.held_state is None or self.left:
            return None
        if record.get("round") != self.held_round or record.get("digest") != self.held_digest:
            return None
        if self._bytes_round != self.held_round:
            self._bytes = self.held_state.to_bytes()
            self._bytes_round = self.held_round
        from chaos_flwr.flower.pull import serve_request

        try:
            return serve_request(self._bytes, request, direct_addr=self.direct_addr)
        except ChaosError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return None

    def join_step(
        self, record: ConfigRecord, control: ConfigRecord, replies: Mapping[str, ConfigRecord]
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
        if self.left:
            return ConfigRecord({"status": "failed", "error": "party left"}), {}
        if rnd == self.held_round and digest == self.held_digest:
            self.joining = None
            return ConfigRecord({"status": "done", "error": "already held"}), {}
        now = self.clock()
        pull = self.joining
        if control.get("op") == "start" or pull is None or pull.server_round != rnd:
            donors = control.get("donors", [])
            blobs = control.get("receipts", [])
            if not isinstance(donors, list) or not isinstance(blobs, list):
                return ConfigRecord({"status": "failed", "error": "bad start record"}), {}
            good = [
                d
                for d, b in zip(donors, blobs, strict=False)
                if isinstance(d, str)
                and isinstance(b, bytes)
                and self._receipt_ok(d, rnd, digest, b)
            ]
            if not good:
                return ConfigRecord({"status": "failed", "error": "no donor receipt verifies"}), {}
            if rnd == self.held_round and self.held_round >= 0:
                # it certified another state of this very round: the relay showed the round
                # two ways. Never re-sign; the donors' receipts and its own are the evidence.
                from chaos_flwr.receipts import Receipt

                theirs = [
                    Receipt.from_flower(d, rnd, digest, b).encode()
                    for d, b in zip(donors, blobs, strict=False)
                    if d in good and isinstance(b, bytes)
                ]
                self.check_receipts(ConfigRecord({"receipts": theirs}))
                why = f"EquivocationError: round {rnd} was shown with two digests"
                return ConfigRecord({"status": "failed", "error": why}), {}
            min_shard, total = _start_settings(control)
            pull = JoinerPull(rnd, digest, good, min_shard_bytes=min_shard, total_hint=total)
            self.joining = pull
            status, requests = pull.start(now)
        else:
            lost_v = control.get("lost", [])
            lost = {x for x in lost_v if isinstance(x, str)} if isinstance(lost_v, list) else set()
            status, requests = pull.step(replies, lost, now)
        reply = ConfigRecord({"status": status})
        if status != "want":
            reply = pull.stats()
            reply["status"] = status
            self.joining = None
            if status == "done" and pull.state is not None:
                self._hold(pull.state)
            self.joins_done.append(reply)
            if status == "failed":
                self.errors.append(f"join pull of round {rnd} failed: {pull.error}")
        return reply, requests

    def check_receipts(self, record: ConfigRecord | None) -> bool:
        """Compare the receipts the relay forwards (the previous round's) with this party's own.

        Each forwarded receipt is verified against the keyring; two valid receipts for one
        round with different digests are equivocation evidence
        (:class:`chaos_flwr.receipts.Equivocation`): it is kept in :attr:`evidence`, logged in
        :attr:`errors` as an ``EquivocationError`` and reported with the party's next reply.
        Returns whether the party holds any evidence (it then refuses to train).
        """
        blobs = record.get("receipts") if record is not None else None
        if isinstance(blobs, list) and blobs and self.keyring is not None:
            from chaos_flwr.receipts import Receipt, ReceiptLedger

            if self._ledger is None:
                self._ledger = ReceiptLedger(dict(self.keyring))
            ledger = self._ledger
            found: list[Equivocation] = []
            own = self._receipt()
            if own:
                found += ledger.add_all(
                    [Receipt.from_flower(self.party_id, self.held_round, self.held_digest, own)]
                )
            theirs: list[Receipt] = []
            for blob in blobs:
                if isinstance(blob, bytes):
                    try:
                        theirs.append(Receipt.decode(blob))
                    except ChaosError as exc:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
            found += ledger.add_all(theirs)
            for ev in found:
                self.evidence.append(ev)
                self.errors.append(f"EquivocationError: {ev.error()}")
        return bool(self.evidence)

    def _auto_links(self, now: float) -> list[OutgoingLike]:
        """A member links up with every active member it has no live link with (the lower id
        asks; a link someone took down stays down). Links are what :meth:`disconnect` drops
        and what the monitor's failure votes follow."""
        peer = self.peer
        if not self.auto_link or peer is None or self.left or not getattr(peer, "is_member", 0):
            return []
        records = getattr(peer, "records", None)
        connect = getattr(peer, "connect", None)
        if records is None or connect is None:
            return []
        out: list[OutgoingLike] = []
        for other in records.view().active():
            if other <= self.party_id:
                continue
            link = records.link(self.party_id, other)
            if link is not None and (link.live or link.state != "up"):
                continue
            m = records.member(other)
            key = (other, getattr(m, "incarnation", 0), getattr(peer, "incarnation", 0))
            if key in self._links_asked:
                continue
            self._links_asked.add(key)
            try:
                out.extend(connect(other, now))
            except ChaosError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
        return out

    def _maybe_join(self, record: ConfigRecord, now: float) -> list[OutgoingLike]:
        """A non-member asks for a sponsored join when it hears from the relay.

        Sponsors: the active members the relay lists (a hint; the join record needs their
        signatures anyway), else the charter's founders. Asked again, of the new list, when
        the list changes and the party is still not a member after ``FLOWER_JOIN_RETRY_S``.
        """
        peer = self.peer
        if peer is None or self.left or getattr(peer, "is_member", True):
            return []
        hint = record.get("members", [])
        members = [m for m in hint if isinstance(m, str)] if isinstance(hint, list) else []
        policy = getattr(peer, "policy", None)
        keys = set(self.keyring or {})
        sponsors = sorted(m for m in members if m != self.party_id and (not keys or m in keys))
        if not sponsors and policy is not None:
            sponsors = sorted(set(policy.founders) - {self.party_id})
        if not sponsors:
            return []
        asked_at, asked = self._join_asked
        if asked_at is not None and (
            now - asked_at < FLOWER_JOIN_RETRY_S or set(asked) == set(sponsors)
        ):
            return []
        request = getattr(peer, "request_join", None)
        if request is None:
            return []
        try:
            out: list[OutgoingLike] = list(request(now, sponsors))
        except ChaosError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return []
        self._join_asked = (now, tuple(sponsors))
        return out

    def _receipt_ok(self, party: str, rnd: int, digest: bytes, blob: bytes) -> bool:
        if self.keyring is None:
            return True  # an unsigned run: nothing to check receipts with
        key = self.keyring.get(party)
        if key is None:
            return False
        from chaos_flwr.errors import SignatureError
        from chaos_flwr.identity import verify_signature

        try:
            verify_signature(key, blob, receipt_bytes(party, rnd, digest))
        except SignatureError:
            return False
        return True

    def process(self, record: ConfigRecord | None, arrays: ArrayRecord | None) -> ConfigRecord:
        """Handle the Chaos record of one incoming message; return the reply's Chaos record."""
        now = self.clock()
        outgoing: list[OutgoingLike] = list(self.pending)
        self.pending.clear()
        if record is not None and self.peer is not None:
            for data in _envelopes(record):
                try:
                    outgoing.extend(self.peer.handle(data, now))
                except ChaosError as exc:  # a bad envelope changes nothing; note and go on
                    self.errors.append(f"{type(exc).__name__}: {exc}")
        if record is not None and self.peer is not None:
            outgoing.extend(self._maybe_join(record, now))
            outgoing.extend(self._auto_links(now))
        if self.peer is not None:
            outgoing.extend(self.peer.tick(now))
        if record is not None and record.get("phase") == "certify" and arrays is not None:
            rnd = record.get("round", -1)
            sstate = record.get("strategy-state", b"")
            if (
                isinstance(rnd, int)
                and not isinstance(rnd, bool)
                and rnd >= 0
                and isinstance(sstate, bytes)
                and not self.left
            ):
                state = from_array_record(arrays, round=rnd, strategy_state=sstate)
                # a signing party never signs two states of one round, nor goes back a round
                # (an unsigned party's "receipts" prove nothing, so it takes what it is sent)
                signed = self._signed_digest(rnd) if self.signer is not None else None
                if signed is not None and signed != state.digest():
                    # it signed another state for this round: it never signs a second one
                    # (the relay showed the round two ways; the held state stays)
                    self.errors.append(
                        f"EquivocationError: round {rnd} offered with digest "
                        f"{state.digest().hex()[:16]} after this party signed "
                        f"{signed.hex()[:16]}; refused"
                    )
                elif self.signer is not None and rnd < self.held_round:
                    # rounds only move forward: an older round (its replica possibly pruned,
                    # so not checkable above) is never taken up again
                    self.errors.append(
                        f"PolicyError: certify of round {rnd} below the held round "
                        f"{self.held_round}; refused"
                    )
                else:
                    self._hold(state, arrays)
        receipt = self._receipt()
        out = party_record(
            self.party_id,
            outgoing,
            receipt_round=-1 if self.left else self.held_round,
            receipt_digest=b"" if self.left else self.held_digest,
            receipt=receipt,
        )
        self.check_receipts(record)
        if len(self.evidence) > self._evidence_sent:
            out["evidence"] = [ev.encode() for ev in self.evidence]
            self._evidence_sent = len(self.evidence)
        if record is not None and record.get("sync") and self.peer is not None:
            # a (re)started ServerApp rebuilds its view from the records the parties hold;
            # records carry their own signatures, so this needs no envelope
            held = getattr(self.peer, "records", None)
            out["records"] = [codec.encode(r.to_wire()) for r in held or ()]
        return out


def _start_settings(control: ConfigRecord) -> tuple[int, int | None]:
    """The shard floor and the size hint a start record names (each ignored unless an int
    > 0: the floor then defaults, the size is asked of the donors)."""

    def positive(key: str) -> int | None:
        value = control.get(key)
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if ok else None  # type: ignore[return-value]

    return positive("min-shard") or FLOWER_JOIN_MIN_SHARD_BYTES, positive("total")


def _envelopes(record: ConfigRecord) -> Sequence[bytes]:
    env = record.get("env", [])
    if not isinstance(env, list):
        return []
    return [e for e in env if isinstance(e, bytes)]


PartyFactory = Callable[[Context], Party]


def default_party_factory(context: Context) -> Party:
    """Build the party of a SuperNode from its settings (see :func:`party_settings`).

    A signed party needs the identity, charter and peer layers; where this build lacks one,
    a :class:`~chaos_flwr.errors.ConfigError` says which (nothing falls back to unsigned).
    """
    settings = party_settings(context)
    store = ReplicaStore(settings.state_dir / "replicas") if settings.state_dir else None
    if settings.unsigned:
        party = Party(party_id=f"unsigned-{context.node_id}", store=store)
        party.restore()
        return party
    assert settings.key_path is not None and settings.charter_path is not None
    from chaos_flwr.identity import Identity

    ident = Identity.load(settings.key_path)
    saved, same_life = _saved_state(context, settings, str(ident.party_id), ident.sign)
    try:
        peer, out = _build_peer(ident, settings, saved, same_life=same_life)
    except ChaosError as exc:  # a saved record that does not verify: start from the relay
        from chaos_flwr.flower.durable import LOG

        LOG.warning("chaos-flwr: saved party state refused (%s); a fresh incarnation", exc)
        saved, same_life = None, False
        peer, out = _build_peer(ident, settings)
    keyring = dict(peer.policy.keyring) if hasattr(peer, "policy") else None
    party = Party(
        party_id=str(ident.party_id),
        peer=peer,
        signer=ident.sign,
        store=store,
        keyring=keyring,
        state_dir=settings.state_dir,
        lifetime=_lifetime(),
        direct_addr=_direct_server(settings),
    )
    if saved is not None:
        try:
            party.take_up(saved, same_life=same_life)
        except StoreError as exc:
            from chaos_flwr.flower.durable import LOG

            LOG.warning("chaos-flwr: saved party state partly unreadable (%s)", exc)
            party.errors.append(f"StoreError: {exc}")
    if settings.state_dir is not None and (settings.state_dir / LEFT_MARKER).is_file():
        # it left the federation before this restart: it stays out (delete the marker, or use
        # a fresh state directory, to come back as a joiner)
        party.left = True
        return party
    party.restore()
    party.pending.extend(out)
    return party


def _direct_server(settings: PartySettings) -> str:
    """The direct address this party advertises to joiners (``""``: relay only).

    If nothing listens on ``chaos-direct-addr`` yet, this process serves the party's replica
    store there (the simulation engine's workers outlive one message). If the address is taken,
    a ``chaos-flwr serve-replica`` daemon is assumed to serve it (the deployment engine starts a
    process per message); should that be wrong, joiners fall back to the relay, and every byte is
    checked against the certified digest either way.
    """
    if not settings.direct_addr or settings.state_dir is None:
        return ""
    from chaos_flwr.flower.direct import ensure_server

    with contextlib.suppress(TransportError):  # taken: the daemon's (see above)
        ensure_server(settings.state_dir, settings.direct_addr)
    return settings.direct_addr


def _incarnation(settings: PartySettings) -> int:
    """A fresh incarnation for this start of the party: above every earlier one.

    The saved one (``<state-dir>/incarnation``) plus one, and never below the wall clock in
    milliseconds, so a party restarted *without* its disk still comes back above what the
    federation's view holds for it (its old sequence numbers would be refused as replays).
    """
    saved = -1
    path = settings.state_dir / "incarnation" if settings.state_dir is not None else None
    if path is not None and path.is_file():
        try:
            saved = int(path.read_text().strip())
        except ValueError:
            saved = -1
    inc = max(saved + 1, int(time.time() * 1000))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{inc}\n")
        except OSError:
            pass  # the clock floor still keeps the next start above this one
    return inc


#: (run id, node id) of parties whose next build is a real restart (:func:`forget_party`).
_RESTARTED: set[tuple[int, int]] = set()


def _lifetime() -> str:
    from chaos_flwr.flower.durable import lifetime_token

    return lifetime_token()


def _saved_state(
    context: Context,
    settings: PartySettings,
    party_id: str,
    seal: Callable[[bytes], bytes] | None = None,
) -> tuple[SavedParty | None, bool]:
    """The party's saved state (a bad or foreign-sealed file is discarded with a warning) and
    whether this process continues the life it was saved in (same SuperNode process, no
    forget_party)."""
    key = (context.run_id, context.node_id)
    restarted = key in _RESTARTED
    _RESTARTED.discard(key)
    if settings.state_dir is None:
        return None, False
    from chaos_flwr.flower.durable import load_or_discard

    saved = load_or_discard(settings.state_dir, party_id, seal=seal)
    same = saved is not None and not restarted and saved.lifetime == _lifetime()
    return saved, same


def _build_peer(
    ident: Any, settings: PartySettings, saved: SavedParty | None = None, *, same_life: bool = False
) -> tuple[PeerProtocol, list[OutgoingLike]]:
    """Build the protocol peer from the identity and the verified charter.

    The ``saved`` records and replay state are taken up (records re-verified; a bad one
    raises). When ``same_life`` (the life it was saved in, continued in a new process) the
    peer also keeps the saved incarnation and sequence number and nothing is bootstrapped.
    Otherwise (a start or a real restart) it gets a fresh incarnation; a founder bootstraps
    the federation's records and a non-founder asks for a sponsored join when it first hears
    from the relay (:meth:`Party.process`).
    """
    try:
        from chaos_flwr.charter import load_charter
    except ImportError as exc:  # the charter layer has not landed in this build
        raise ConfigError(
            f"node_config '{NODE_CHARTER}' is set but this chaos-flwr build has no charter layer "
            "(chaos_flwr.charter); a signed party cannot be built without it"
        ) from exc
    from chaos_flwr.peer import Peer

    assert settings.charter_path is not None
    try:
        charter = load_charter(settings.charter_path)
    except ChaosError as exc:
        raise ConfigError(f"node_config '{NODE_CHARTER}': {exc}") from exc
    if saved is not None and same_life:
        peer = Peer(
            ident, charter, incarnation=saved.incarnation, seq=saved.seq, replay_state=saved.replay
        )
        peer.load_records(saved.records, time.time())
        return peer, []
    replay = saved.replay if saved is not None else None
    peer = Peer(ident, charter, incarnation=_incarnation(settings), replay_state=replay)
    if saved is not None:
        peer.load_records(saved.records, time.time())
    out: list[OutgoingLike] = []
    if charter.is_founder(ident.party_id):
        out.extend(peer.bootstrap(time.time()))
    return peer, out


#: Parties of this process by (enable() call number, run id, node id). Module-level, not on the
#: app: Flower's simulation engine cloudpickles the ClientApp into every worker call, so each
#: message runs on a fresh copy of the app; the copies (and party_for) must share one party.
_PARTY_TABLES: dict[int, dict[tuple[int, int], Party]] = {}
_ENABLE_CALLS: list[int] = [0]


class _Parties:
    """The parties of one enabled ClientApp in this process, one per (run, node)."""

    def __init__(self, factory: PartyFactory) -> None:
        self.factory = factory
        # the n-th enable() of a process: the same in the driver and in a worker that imports
        # the app's module, so an unpickled copy finds the worker's table
        self.token = _ENABLE_CALLS[0]
        _ENABLE_CALLS[0] += 1

    @property
    def by_node(self) -> dict[tuple[int, int], Party]:
        """This app's parties by (run id, node id), shared by every copy of the app."""
        return _PARTY_TABLES.setdefault(self.token, {})

    def __call__(self, context: Context) -> Party:
        key = (context.run_id, context.node_id)
        party = self.by_node.get(key)
        if party is not None and not party.is_current():
            party = None  # another process continued this party's life: take up its state
        if party is None:
            party = self.factory(context)
            self.by_node[key] = party
        return party


#: The party tables of the ClientApps enabled in this process, oldest first.
_ENABLED: list[_Parties] = []


def party_for(context: Context, app: ClientApp | None = None) -> Party:
    """The party of this node and run (the one the enabled ClientApp uses), built if needed.

    Churn scenarios wrap an enabled ClientApp and call :meth:`Party.leave`,
    :meth:`Party.connect` or :meth:`Party.disconnect` on what this returns.

    Parameters
    ----------
    context:
        The node's Flower ``Context`` (the one the handlers get).
    app:
        The enabled ClientApp; default: the newest enabled app that has a party for this
        node, else the newest enabled app.

    Raises
    ------
    ConfigError
        ``app`` is not enabled, or no ClientApp was enabled in this process.
    """
    if app is not None:
        parties = getattr(app, "_chaos_parties", None)
        if not isinstance(parties, _Parties):
            raise ConfigError("party_for: this ClientApp is not Chaos-enabled (chaos_flwr.enable)")
        return parties(context)
    if not _ENABLED:
        raise ConfigError("party_for: no ClientApp has been enabled (chaos_flwr.enable) here")
    key = (context.run_id, context.node_id)
    for parties in reversed(_ENABLED):
        party = parties.by_node.get(key)
        if party is not None:
            return party
    return _ENABLED[-1](context)


def forget_party(context: Context) -> None:
    """Drop the cached party of this node and run in every enabled app (a crash that loses the
    process: the next message builds the party anew, from its disk)."""
    key = (context.run_id, context.node_id)
    for parties in _ENABLED:
        parties.by_node.pop(key, None)
    _RESTARTED.add(key)


def _wrap(
    fn: Callable[[Message, Context], Message], parties: _Parties
) -> Callable[[Message, Context], Message]:
    def wrapped(message: Message, context: Context) -> Message:
        record = split_chaos(message)
        if record is not None and parties(context).left:
            # a party that left answers nothing more as a member (its leave record waits in
            # ``pending`` for the next relay message)
            return Message(
                Error(ErrorCode.MOD_FAILED_PRECONDITION, "party left the federation"),
                reply_to=message,
            )
        if record is not None and message.metadata.message_type.startswith("train"):
            party = parties(context)
            if party.check_receipts(record):
                # it will not train on a round that was shown two ways (evidence goes out
                # with its next relay reply)
                return Message(
                    Error(ErrorCode.MOD_FAILED_PRECONDITION, str(party.evidence[0].error())),
                    reply_to=message,
                )
        reply = fn(message, context)
        if record is None:
            return reply
        arrays = message.content.array_records
        first = next(iter(arrays.values()), None)
        party = parties(context)
        out = party.process(record, first)
        party.persist()
        if reply.has_content():
            content = RecordDict(dict(reply.content.items()))
            content[FLOWER_CHAOS_RECORD_KEY] = out
            reply.content = content
        return reply

    wrapped.__name__ = getattr(fn, "__name__", "wrapped")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    return wrapped


def enable(app: ClientApp, *, party_factory: PartyFactory | None = None) -> ClientApp:
    """Make ``app`` a Chaos party: register ``query.chaos`` and wrap train/evaluate handlers.

    Call it after the app's ``@app.train()`` / ``@app.evaluate()`` handlers are registered.

    Parameters
    ----------
    app:
        A ``ClientApp`` built with decorators (not with a legacy ``client_fn``).
    party_factory:
        Builds the party of a node from its ``Context``; default
        :func:`default_party_factory`, which reads ``node_config``.

    Returns
    -------
    ClientApp
        The same ``app``.
    """
    parties = _Parties(party_factory or default_party_factory)
    registered: dict[str, Callable[[Message, Context], Message]] | None = getattr(
        app, "_registered_funcs", None
    )
    if registered is None or getattr(app, "_call", None) is not None:
        raise ConfigError(
            "app: chaos_flwr.flower.enable needs a ClientApp built with @app.train()/"
            "@app.evaluate() decorators, not one built from a legacy client_fn"
        )
    if "query.chaos" in registered:
        raise ConfigError("app: Chaos is already enabled on this ClientApp")
    for name in list(registered):
        if name.startswith(("train.", "evaluate.")):
            registered[name] = _wrap(registered[name], parties)
    app._chaos_parties = parties  # type: ignore[attr-defined]
    _ENABLED.append(parties)

    @app.query("chaos")
    def chaos_query(message: Message, context: Context) -> Message:
        record = split_chaos(message)
        first = next(iter(message.content.array_records.values()), None)
        party = parties(context)
        request = message.content.get(FLOWER_PULL_DATA_KEY)
        phase = record.get("phase") if record is not None else None
        extra: dict[str, ConfigRecord] = {}
        if record is not None and phase == "join" and isinstance(request, ConfigRecord):
            # this party is the joiner: it pulls before its receipt goes out below
            ctl, requests = party.join_step(record, request, read_donor_records(message.content))
            extra[FLOWER_PULL_DATA_KEY] = ctl
            for donor, req in requests.items():
                extra[donor_key(donor)] = req
        out = party.process(record, first)
        content = RecordDict({FLOWER_CHAOS_RECORD_KEY: out})
        if record is not None and phase == "pull" and isinstance(request, ConfigRecord):
            served = party.serve(record, request)
            if served is not None:
                content[FLOWER_PULL_DATA_KEY] = served
        for key, rec in extra.items():
            content[key] = rec
        party.persist()  # before any envelope of this reply leaves the process
        return Message(content, reply_to=message)

    return app
