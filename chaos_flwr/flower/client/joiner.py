"""The joiner side of a pull: one relay step of a party's pull of the certified state.

The ServerApp relays; the party plans and verifies with
:class:`~chaos_flwr.flower.joinpull.JoinerPull` (kept in ``Party.joining`` between steps) and
holds the verified state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from flwr.app import ConfigRecord

from chaos_flwr.flower.joinpull import JoinerPull
from chaos_flwr.state import TrainingState

__all__ = ["JoiningParty", "join_step"]


class JoiningParty(Protocol):
    """What :func:`join_step` uses of a :class:`~chaos_flwr.flower.client.party.Party`."""

    held_round: int
    held_digest: bytes
    left: bool
    joining: JoinerPull | None
    joins_done: list[ConfigRecord]
    errors: list[str]

    @property
    def clock(self) -> Callable[[], float]: ...

    def check_receipts(self, record: ConfigRecord | None) -> bool: ...

    def _receipt_ok(self, party: str, rnd: int, digest: bytes, blob: bytes) -> bool: ...

    def _hold(self, state: TrainingState) -> None: ...


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
    if rnd == party.held_round and digest == party.held_digest:
        party.joining = None
        return ConfigRecord({"status": "done", "error": "already held"}), {}
    now = party.clock()
    pull = party.joining
    if control.get("op") == "start" or pull is None or pull.server_round != rnd:
        donors = control.get("donors", [])
        blobs = control.get("receipts", [])
        min_shard = control.get("min-shard")
        if not isinstance(donors, list) or not isinstance(blobs, list):
            return ConfigRecord({"status": "failed", "error": "bad start record"}), {}
        good = [
            d
            for d, b in zip(donors, blobs, strict=False)
            if isinstance(d, str) and isinstance(b, bytes) and party._receipt_ok(d, rnd, digest, b)
        ]
        if not good:
            return ConfigRecord({"status": "failed", "error": "no donor receipt verifies"}), {}
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
            return ConfigRecord({"status": "failed", "error": why}), {}
        pull = JoinerPull(rnd, digest, good)
        if isinstance(min_shard, int) and not isinstance(min_shard, bool) and min_shard > 0:
            pull.min_shard_bytes = min_shard
        party.joining = pull
        status, requests = pull.start(now)
    else:
        lost_v = control.get("lost", [])
        lost = {x for x in lost_v if isinstance(x, str)} if isinstance(lost_v, list) else set()
        status, requests = pull.step(replies, lost, now)
    reply = ConfigRecord({"status": status})
    if status != "want":
        reply = pull.stats()
        reply["status"] = status
        party.joining = None
        if status == "done" and pull.state is not None:
            party._hold(pull.state)
        party.joins_done.append(reply)
        if status == "failed":
            party.errors.append(f"join pull of round {rnd} failed: {pull.error}")
    return reply, requests
