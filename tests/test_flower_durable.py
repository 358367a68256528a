"""A party's protocol state outlives one ClientApp process (chaos_flwr.flower.durable).

Flower's deployment engine runs every message in a new ClientApp process. These tests emulate
that on a fake Grid: after every message the node's cached Party is dropped, so the next
message builds a new Party from the same state directory (same SuperNode process, so the
same party life).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_grid import FakeGrid, FakeNode
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from chaos_flwr import codec
from chaos_flwr.charter import load_charter
from chaos_flwr.errors import StoreError
from chaos_flwr.flower import durable
from chaos_flwr.flower.client import Party, default_party_factory, enable, forget_party, party_for
from chaos_flwr.flower.keys import charter_path, load_federation, make_federation
from chaos_flwr.flower.server import ChaosStrategy, JoinSettings, PhaseSettings
from chaos_flwr.store import ReplicaStore


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _initial() -> ArrayRecord:
    rng = np.random.default_rng(3)
    return ArrayRecord(
        {
            "w": Array(rng.normal(size=(3, 4096)).astype(np.float32)),
            "b": Array(np.zeros(3, np.float32)),
        }
    )


class PerMessage:
    """A federation on a fake Grid whose every message runs on a freshly built Party."""

    def __init__(self, tmp: Path, n: int, *, founders: int = 3, per_message: bool = True) -> None:
        self.keys = make_federation(tmp / "fed", n, founders=founders, seed="durable")
        self.fed = load_federation(self.keys)
        self.charter = load_charter(charter_path(self.keys))
        self.state_root = tmp / "state"
        self.grid = FakeGrid()
        self.nodes: dict[int, FakeNode] = {}
        self.hooks: dict[int, Any] = {}
        self.per_message = per_message
        self.builds = 0
        self.incarnations: dict[int, list[int]] = {}
        self.app = ClientApp()

        @self.app.train()
        def train(msg: Message, ctx: Context) -> Message:
            rnd = int(msg.content["config"]["server-round"])
            hook = self.hooks.pop(rnd, None)
            if hook is not None:
                hook()
            k = int(ctx.node_config["partition-id"]) + 1
            out = {
                name: Array((a.numpy() * (1 - 0.01 * k) + 0.01 * k * rnd).astype(np.float32))
                for name, a in msg.content["arrays"].items()
            }
            content = RecordDict(
                {"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": 10 * k})}
            )
            return Message(content, reply_to=msg)

        @self.app.evaluate()
        def evaluate(msg: Message, ctx: Context) -> Message:
            metrics = MetricRecord({"s": float(msg.content["arrays"]["w"].numpy().sum())})
            metrics["num-examples"] = 1
            return Message(RecordDict({"metrics": metrics}), reply_to=msg)

        enable(self.app)

    def _handler(self, partition: int) -> Any:
        def handle(msg: Message, ctx: Context) -> Message:
            table = self.app._chaos_parties.by_node  # type: ignore[attr-defined]
            key = (ctx.run_id, ctx.node_id)
            if key not in table:
                self.builds += 1
            reply = self.app(msg, ctx)
            party = table.get(key)
            if party is not None and party.peer is not None:
                self.incarnations.setdefault(partition, []).append(party.peer.incarnation)
            if self.per_message:
                table.pop(key, None)  # the process ends: nothing stays in memory
            return reply

        return handle

    def add(self, partition: int) -> FakeNode:
        node = self.grid.add_node(
            self._handler(partition),
            node_config={"partition-id": partition},
            run_config={"chaos-keys-dir": str(self.keys), "chaos-state-root": str(self.state_root)},
        )
        self.nodes[partition] = node
        return node

    def party(self, partition: int) -> Party:
        return party_for(self.nodes[partition].context, self.app)

    def pid(self, partition: int) -> str:
        return self.fed.party_ids[partition]

    def strategy(self, source: str = "peers") -> ChaosStrategy:
        return ChaosStrategy(
            FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=2),
            charter=self.charter,
            phases=PhaseSettings(phase_timeout_s=2.0),
            joins=JoinSettings(source=source),  # peers: a pull that spans several messages
        )


def test_a_joiner_pulls_and_trains_when_every_message_is_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    w = PerMessage(tmp_path, 4)
    for p in range(3):
        w.add(p)
    joiner: dict[str, FakeNode] = {}
    w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=5, timeout=10)
    jp = w.pid(3)
    founders = sorted(w.pid(p) for p in range(3))

    joins = [(r, j) for r in strategy.rounds for j in r.joins if j.party == jp]
    assert joins, "the joiner never pulled"
    rlog, join = joins[-1]
    assert join.ok and join.error == "", join.error
    assert len(join.bytes_per_donor) >= 2 and set(join.donors) <= set(founders)
    assert sum(join.bytes_per_donor.values()) == join.total_bytes
    assert join.steps >= 3  # the pull spanned several messages, so several "processes"
    pulled = ReplicaStore(w.state_root / "party-3" / "replicas").get(join.server_round)
    assert pulled.digest() == join.digest == rlog.digest
    n = joiner["n"].node_id
    after = [r for r in strategy.rounds if r.server_round > rlog.server_round]
    assert after and all(n in r.trained for r in after)
    assert strategy.rounds[-1].members == {"active": sorted([*founders, jp])}
    assert w.builds > 20  # the parties really were rebuilt, message after message


def test_a_joiner_takes_the_servers_state_when_every_message_is_a_new_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAOS_KEEP_REPLICAS", "8")  # it reads the joined round back later
    w = PerMessage(tmp_path, 4)
    for p in range(3):
        w.add(p)
    joiner: dict[str, FakeNode] = {}
    w.hooks[2] = lambda: joiner.setdefault("n", w.add(3))
    strategy = w.strategy(source="auto")
    strategy.start(w.grid, _initial(), num_rounds=5, timeout=10)
    ((rlog, join),) = [(r, j) for r in strategy.rounds for j in r.joins if j.party == w.pid(3)]
    assert join.ok and join.source == "server" and join.steps == 1, join.error
    # what the one message carried was saved before the reply left the "process"
    pulled = ReplicaStore(w.state_root / "party-3" / "replicas").get(join.server_round)
    assert pulled.digest() == join.digest == rlog.digest
    n = joiner["n"].node_id
    after = [r for r in strategy.rounds if r.server_round > rlog.server_round]
    assert after and all(n in r.trained for r in after)


def test_founders_keep_their_incarnation_and_do_not_re_bootstrap(tmp_path: Path) -> None:
    w = PerMessage(tmp_path, 3)
    for p in range(3):
        w.add(p)
    strategy = w.strategy()
    strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    for p in range(3):
        incs = w.incarnations[p]
        assert len(incs) > 5 and len(set(incs)) == 1, incs  # one life, one incarnation
    party = w.party(0)
    records = list(party.peer.records)  # type: ignore[union-attr]
    joins = [r for r in records if r.kind == "join" and r.subject == w.pid(0)]
    assert len(joins) == 1  # bootstrapped once, not once per message
    assert [r.server_round for r in strategy.rounds if r.trained] == [1, 2, 3]
    assert len(strategy.rounds[-1].trained) == 3


def test_a_real_restart_takes_a_higher_incarnation_and_keeps_the_records(tmp_path: Path) -> None:
    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=2, timeout=10)
    before = w.party(1)
    inc, held = before.peer.incarnation, list(before.peer.records)  # type: ignore[union-attr]
    forget_party(w.nodes[1].context)  # the SuperNode process died: a real restart
    after = w.party(1)
    assert after is not before
    assert after.peer.incarnation > inc  # type: ignore[union-attr]
    # every record it held is still held, or superseded by one held now (the frontier: its new
    # join supersedes the join of its old incarnation)
    now = after.peer.records  # type: ignore[union-attr]
    assert all(now.covers(r.body) for r in held)
    superseded = [r for r in held if r.record_id not in now]
    assert [(r.kind, r.body["subject"]) for r in superseded] == [("join", after.party_id)]
    assert after.held_round == before.held_round  # and its replica, from the store


def test_a_corrupt_state_file_is_discarded_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = PerMessage(tmp_path, 3)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    state_dir = w.state_root / "party-2"
    path = state_dir / durable.STATE_FILE
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="hash mismatch"):
        durable.load(state_dir, w.pid(2))
    inc = w.incarnations[2][-1]
    with caplog.at_level("WARNING", logger="chaos_flwr.flower.durable"):
        party = w.party(2)
    assert "discarding the saved party state" in caplog.text
    assert (state_dir / f"{durable.STATE_FILE}.bad").is_file()
    assert party.peer.incarnation > inc  # type: ignore[union-attr]  # a fresh life, not a fork
    with pytest.raises(StoreError, match="saved for party"):
        durable.save(state_dir, durable.SavedParty("someone-else", "x", 1, 1))
        durable.load(state_dir, w.pid(2))


_KILLER = """
import os, sys, signal
from pathlib import Path
from chaos_flwr.flower import durable
def slow(fd, data):
    os.write(fd, data[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
durable._write_all = slow
state = durable.SavedParty("p", "life", 7, 99, records=[{"x": b"y" * 4096}])
durable.save(Path(sys.argv[1]), state)
"""


def test_a_sigkill_mid_save_leaves_the_previous_state_loadable(tmp_path: Path) -> None:
    old = durable.SavedParty("p", "life", 7, 42, pending=[("q", b"env")])
    durable.save(tmp_path, old)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, str(tmp_path)],
        env={**os.environ},
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob(".tmp-party-*"))  # the half-written file is there
    loaded = durable.load(tmp_path, "p")
    assert loaded is not None and loaded.seq == 42 and loaded.pending == [("q", b"env")]
    assert not list(tmp_path.glob(".tmp-party-*"))  # the dead writer's leftover is removed


def test_saved_state_round_trips_exactly(tmp_path: Path) -> None:
    state = durable.SavedParty(
        "p",
        "1:2",
        5,
        17,
        replay={"a": [5, 17, 3]},
        records=[{"body": {"k": 1}}],
        pending=[("a", b"\x00\x01")],
        join_asked=(12.5, ("a", "b")),
        links_asked=[("b", 1, 5)],
        joins_done=[{"status": "done", "bytes": 9}],
        receipts=[b"r"],
        evidence=[b"e"],
        evidence_sent=1,
    )
    durable.save(tmp_path, state, fsync=True)
    assert durable.load(tmp_path, "p") == state
    durable.save(tmp_path, state, fsync=False)
    assert durable.load(tmp_path, "p") == state
    assert durable.load(tmp_path / "none", "p") is None
    assert durable.lifetime_token() == f"{os.getppid()}:{durable.lifetime_token().split(':')[1]}"


def test_a_cached_party_gives_way_when_another_process_saved_after_it(tmp_path: Path) -> None:
    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    ctx = w.nodes[0].context
    cached = w.party(0)
    assert w.party(0) is cached and cached.is_current()
    other = default_party_factory(ctx)  # a second worker of the same SuperNode
    assert other.peer.incarnation == cached.peer.incarnation  # type: ignore[union-attr]
    other.pending.extend(other.peer.tick(time.time() + 3600))  # type: ignore[union-attr]
    other.persist()
    assert not cached.is_current()
    now = w.party(0)
    assert now is not cached
    assert now.peer.seq == other.peer.seq > cached.peer.seq  # type: ignore[union-attr]


def test_a_state_file_not_sealed_by_the_partys_key_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the file holds a pickled pull: only the holder of the party's key may write one it takes up
    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    mine, other = w.party(2), w.party(1)
    assert mine.signer is not None and other.signer is not None
    state_dir = w.state_root / "party-2"
    path = state_dir / durable.STATE_FILE
    assert path.read_bytes().startswith(durable.SEALED_MAGIC)
    saved = durable.load(state_dir, w.pid(2), seal=mine.signer)
    assert saved is not None and saved.party_id == w.pid(2)
    for forged_seal in (None, other.signer):  # written without a key, or with another's
        durable.save(state_dir, saved, seal=forged_seal)
        assert durable.load(state_dir, w.pid(2)) == saved  # well-formed, hash intact
        with pytest.raises(StoreError, match="not sealed by this party's key"):
            durable.load(state_dir, w.pid(2), seal=mine.signer)
    inc = mine.peer.incarnation  # type: ignore[union-attr]
    forget_party(w.nodes[2].context)
    with caplog.at_level("WARNING", logger="chaos_flwr.flower.durable"):
        rebuilt = w.party(2)
    assert "not sealed by this party's key" in caplog.text
    assert (state_dir / f"{durable.STATE_FILE}.bad").is_file()
    assert rebuilt.peer.incarnation > inc  # type: ignore[union-attr]  # a fresh life


def _write_body(state_dir: Path, value: dict[str, Any]) -> None:
    """Write a well-formed, unsealed state file holding ``value`` (as an older version would)."""
    import hashlib

    from chaos_flwr import codec

    body = codec.encode(value)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / durable.STATE_FILE).write_bytes(
        durable.STATE_MAGIC + hashlib.sha256(body).digest() + body
    )


def test_a_format_1_state_is_migrated_and_a_pickled_pull_is_dropped(tmp_path: Path) -> None:
    state = durable.SavedParty("p", "1:2", 5, 17, joins_done=[{"status": "done"}])
    value = state.to_value()
    assert value["format"] == durable.SAVED_FORMAT == 2 and value["joining"] is None
    old = {k: v for k, v in value.items() if k != "format"}
    old["joining"] = b""  # format 1: the pickled pull's bytes, empty when none was running
    _write_body(tmp_path, old)
    assert durable.load(tmp_path, "p") == state  # migrated as it was
    old["joining"] = b"\x80\x05pickled"  # a pull was in progress: dropped, never unpickled
    _write_body(tmp_path, old)
    assert durable.load(tmp_path, "p") == state  # the rest (ledger, incarnation...) is kept
    _write_body(tmp_path, {**value, "format": 99})
    with pytest.raises(StoreError, match="format 99 is unknown"):
        durable.load(tmp_path, "p")


def test_a_saved_pull_is_explicit_values_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    from chaos_flwr.flower.client.joiner import JoinerPull

    pull = JoinerPull(3, b"\x01" * 32, ["a", "b"], total_hint=1000)
    status, requests = pull.start(0.0)
    assert status == "want" and set(requests) == {"a", "b"}
    state = durable.SavedParty("p", "1:2", 5, 17, joining=pull.to_value())
    durable.save(tmp_path, state)
    loaded = durable.load(tmp_path, "p")
    assert loaded is not None and loaded == state
    again = loaded.joiner_pull()
    assert isinstance(again, JoinerPull) and again.server_round == 3
    assert again.negotiation.stage == pull.negotiation.stage == "manifest"
    assert again.negotiation.plan == pull.negotiation.plan
    bad = durable.SavedParty("p", "1:2", 5, 17, joining={**pull.to_value(), "v": 7})
    with pytest.raises(StoreError, match="join pull unreadable"):
        bad.joiner_pull()


# -- a party's own sealed records are not re-verified (issue 18 item 3, issue 15 item 2) -------
def _sealed_world(tmp_path: Path) -> tuple[PerMessage, Path, durable.SavedParty]:
    w = PerMessage(tmp_path, 3, per_message=False)
    for p in range(3):
        w.add(p)
    w.strategy().start(w.grid, _initial(), num_rounds=2, timeout=10)
    state_dir = w.state_root / "party-2"
    saved = durable.load(state_dir, w.pid(2), seal=w.party(2).signer)
    assert saved is not None
    return w, state_dir, saved


def test_a_rebuilt_party_takes_up_its_own_sealed_records_without_signature_checks(
    tmp_path: Path,
) -> None:
    w, _, saved = _sealed_world(tmp_path)
    cached = w.party(2)
    assert saved.sealed and saved.charter == cached.peer.federation_tag  # type: ignore[union-attr]
    assert len(saved.records) > 3
    rebuilt = default_party_factory(w.nodes[2].context)  # the next message's process
    peer = rebuilt.peer
    assert peer is not None and peer.incarnation == cached.peer.incarnation  # type: ignore[union-attr]
    assert peer.records.ids() == cached.peer.records.ids()  # type: ignore[union-attr]
    assert peer.view().digest == cached.peer.view().digest  # type: ignore[union-attr]
    assert peer.records.cache.checks == 0  # no record signature verified again


def test_records_saved_under_another_charter_are_verified_one_by_one(tmp_path: Path) -> None:
    w, state_dir, saved = _sealed_world(tmp_path)
    signer = w.party(2).signer
    for charter in (b"", b"\x01" * 32):  # a file of an older version; another charter's
        durable.save(state_dir, dataclasses.replace(saved, charter=charter), seal=signer)
        again = durable.load(state_dir, w.pid(2), seal=signer)
        assert again is not None and again.sealed and again.charter == charter
        rebuilt = default_party_factory(w.nodes[2].context)
        assert rebuilt.peer.records.cache.checks >= len(saved.records)  # type: ignore[union-attr]
        assert rebuilt.peer.records.ids() == w.party(2).peer.records.ids()  # type: ignore[union-attr]


def _tampered(saved: durable.SavedParty) -> durable.SavedParty:
    """``saved`` with one record's body changed (its signatures left as they were)."""
    records = [dict(r) for r in saved.records]
    join = next(r for r in records if r["body"]["kind"] == "join")
    join["body"] = {**join["body"], "at": join["body"]["at"] + 1.0}
    return dataclasses.replace(saved, records=records)


def test_a_tampered_record_in_the_sealed_file_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w, state_dir, saved = _sealed_world(tmp_path)
    mine = w.party(2)
    path = state_dir / durable.STATE_FILE
    seal = path.read_bytes()[len(durable.SEALED_MAGIC) + 32 :][:64]
    body = codec.encode(_tampered(saved).to_value())
    # the body changed and its hash recomputed, the old seal kept: the seal does not match
    path.write_bytes(durable.SEALED_MAGIC + hashlib.sha256(body).digest() + seal + body)
    with pytest.raises(StoreError, match="not sealed by this party's key"):
        durable.load(state_dir, w.pid(2), seal=mine.signer)
    # the body changed, the hash kept: the hash does not match
    raw = path.read_bytes()
    good = durable.SEALED_MAGIC + hashlib.sha256(body).digest()
    path.write_bytes(raw[: len(good) - 32] + b"\x00" * 32 + raw[len(good) :])
    with pytest.raises(StoreError, match="hash mismatch"):
        durable.load(state_dir, w.pid(2), seal=mine.signer)
    # the factory discards it and starts a fresh life from the relay, the record unheld
    inc = mine.peer.incarnation  # type: ignore[union-attr]
    with caplog.at_level("WARNING", logger="chaos_flwr.flower.durable"):
        rebuilt = default_party_factory(w.nodes[2].context)
    assert "discarding the saved party state" in caplog.text
    assert rebuilt.peer.incarnation > inc  # type: ignore[union-attr]
    assert len(rebuilt.peer.records) < len(saved.records)  # type: ignore[union-attr]
