"""The ServerApp's own view of the federation, from the signed records it relays.

The ServerApp holds no key and decides nothing: it reads the membership records (join, leave,
fail, link_up, link_down) inside the envelopes it relays, checks each with membership's
stateless validation against the charter (signatures and the signatures each event needs), and
folds them with :class:`chaos_flwr.membership.RecordSet` into the same view the parties
compute. It cannot forge a record, so it cannot make a party a member, or drop one, by itself.

It also measures how long each membership change takes to **settle**: from the first relay of
the record until every live member has applied it (it sent an envelope carrying the record, or
answered a message that delivered one: peers apply what they receive before they answer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from chaos_flwr import codec
from chaos_flwr.errors import ChaosError
from chaos_flwr.flower.server.logs import SERVER_MAX_EVENTS, MembershipEvent
from chaos_flwr.membership import (
    PROOF_KIND,
    Policy,
    Record,
    RecordSet,
    SignatureCache,
    supersedes,
    validate_record,
)
from chaos_flwr.wire import open_sealed

__all__ = ["ServerView"]

#: Envelope kinds that carry complete membership records, and where.
_RECORD_KINDS = {"rec", "join_done"}


def _about(body: dict[str, Any]) -> tuple[str, ...]:
    """What a record is about: its link ``(a, b)`` or its subject (supersession stays inside)."""
    if body["kind"] in ("link_up", "link_down"):
        return (str(body["a"]), str(body["b"]))
    return (str(body["subject"]),)


class ServerView:
    """Records -> view, as the ServerApp relays them (see module docstring).

    Parameters
    ----------
    charter:
        The federation's verified charter (keyring and policy).
    clock:
        The ServerApp's clock (times of first relay and settling).
    """

    def __init__(self, charter: Any, clock: Callable[[], float]) -> None:
        self.policy = Policy.from_charter(charter)
        self.keyring = dict(self.policy.keyring)
        self.cache = SignatureCache()
        self.records = RecordSet(self.policy, self.cache)
        self.clock = clock
        self.events: list[MembershipEvent] = []
        self.refused: int = 0
        self._by_id: dict[str, MembershipEvent] = {}
        self._has: dict[str, set[str]] = {}
        # record id -> body of the events still settling: a party that applied a record
        # superseding one of them has that one's effect too (it may never receive it: a
        # record superseded before it arrives is not held, see "Compaction" in internals)
        self._body: dict[str, dict[str, Any]] = {}
        # (party, subject or link) -> the frontier of the settling records it applied there
        # (bounded by the charter: parties x (members + links) x at most two bodies)
        self._seen: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = {}
        self._env: dict[bytes, tuple[str, ...]] = {}

    # -- observation --------------------------------------------------------------------------
    def active(self) -> set[str]:
        """Party ids the view lists as active."""
        return set(self.records.view().active())

    def members(self) -> dict[str, list[str]]:
        """Status -> sorted party ids."""
        out: dict[str, list[str]] = {}
        for pid, m in self.records.view().members.items():
            out.setdefault(m.status, []).append(pid)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def status(self, party: str) -> str | None:
        """``active`` / ``left`` / ``failed``, or ``None`` for a party with no record."""
        m = self.records.member(party)
        return None if m is None else m.status

    # -- feeding ------------------------------------------------------------------------------
    def _records_in(self, data: bytes) -> tuple[str, list[Record]]:
        env = open_sealed(data, self.keyring, verify=self.cache.verify)
        if env.kind == PROOF_KIND:  # one record, the envelope itself its sender's signature
            try:
                return env.sender, [Record.from_own(env)]
            except ChaosError:
                self.refused += 1
                return env.sender, []
        if env.kind not in _RECORD_KINDS:
            return env.sender, []
        values = env.payload.get("records") if env.kind == "rec" else [env.payload.get("record")]
        out: list[Record] = []
        for value in values if isinstance(values, list) else []:
            try:
                out.append(Record.from_wire(value))
            except ChaosError:
                self.refused += 1
        return env.sender, out

    def sent(self, data: bytes, server_round: int) -> list[MembershipEvent]:
        """A party handed ``data`` to the relay: fold the records it carries; new events."""
        if data in self._env:
            return []
        try:
            sender, records = self._records_in(data)
        except ChaosError:
            self.refused += 1
            return []
        if not records:
            return []
        now = self.clock()
        fresh: list[MembershipEvent] = []
        rids: list[str] = []
        for record in records:
            rid = record.record_id
            rids.append(rid)
            if not self.records.covers(record.body):  # held or superseded: no signature check
                try:
                    validate_record(record, self.policy, self.cache)
                except ChaosError:
                    self.refused += 1
                    continue
                if self.records.add(record, validated=True):
                    event = MembershipEvent(record.kind, record.subject, rid, server_round, now)
                    self.events.append(event)
                    self._by_id[rid] = event
                    self._has[rid] = set()
                    self._body[rid] = record.body
                    fresh.append(event)
            self._applied(sender, rid)
        self._env[data] = tuple(rids)
        self._trim()
        return fresh

    def _trim(self) -> None:
        """Keep the newest ``SERVER_MAX_EVENTS`` events (and envelope index entries)."""
        extra = len(self.events) - SERVER_MAX_EVENTS
        if extra > 0:
            for event in self.events[:extra]:
                self._by_id.pop(event.record_id, None)
                self._has.pop(event.record_id, None)
                self._body.pop(event.record_id, None)
            del self.events[:extra]
        if len(self._env) > SERVER_MAX_EVENTS:  # the oldest envelopes (insertion order)
            for data in list(self._env)[: len(self._env) - SERVER_MAX_EVENTS]:
                del self._env[data]

    def sync(self, values: Iterable[bytes]) -> int:
        """Fold records a party reports holding (a restarted ServerApp catching up); returns
        how many were new. They are past events: no :class:`MembershipEvent` is made."""
        added = 0
        for raw in values:
            try:
                record = Record.from_wire(codec.decode(raw))
                if self.records.covers(record.body):
                    continue
                validate_record(record, self.policy, self.cache)
            except (ChaosError, ValueError):
                self.refused += 1
                continue
            added += int(self.records.add(record, validated=True))
        return added

    def delivered(self, party: str, envelopes: Iterable[bytes]) -> None:
        """``party`` answered a message that delivered ``envelopes``: it applied their records."""
        for data in envelopes:
            for rid in self._env.get(data, ()):
                self._applied(party, rid)

    def _applied(self, party: str, rid: str) -> None:
        """``party`` applied record ``rid`` (a settling one): note it in the party's frontier of
        applied records about the same subject or link, which covers every record it
        supersedes. Constant work: at most two bodies per party and subject or link."""
        has = self._has.get(rid)
        body = self._body.get(rid)
        if has is None or body is None or party not in self.keyring:
            return  # (a node's claimed id that is no charter party is not tracked)
        has.add(party)
        seen = self._seen.setdefault((party, _about(body)), [])
        if any(b == body or supersedes(b, body) for b in seen):
            return
        seen[:] = [b for b in seen if not supersedes(body, b)] + [body]

    def _covered(self, party: str, body: dict[str, Any]) -> bool:
        """Whether ``party`` applied this record or one that supersedes it."""
        seen = self._seen.get((party, _about(body)), ())
        return any(b == body or supersedes(b, body) for b in seen)

    def settle(self, live: set[str]) -> None:
        """Close the events every live member (``live`` and active) has applied."""
        now = self.clock()
        active = self.active() & live
        done: list[str] = []
        for rid, has in self._has.items():
            event = self._by_id[rid]
            need = active - {event.subject} - has
            body = self._body[rid]
            if all(self._covered(party, body) for party in need):
                event.settle_s = now - event.first_seen
                done.append(rid)
        for rid in done:
            del self._has[rid]
            self._body.pop(rid, None)
        if done and not self._has:
            self._env.clear()  # nothing left to track: drop the envelope index
