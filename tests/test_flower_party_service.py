"""A party's protocol messages answered by its daemon over the local socket
(chaos_flwr.flower.client.service): the ClientApp builds no party for them, the daemon continues
the same life (no fresh incarnation at each hand-over), and every bad request is refused with a
typed error."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from test_flower_lib_join import World, _initial

from chaos_flwr.errors import DaemonMismatchError, DecodeError
from chaos_flwr.flower import durable
from chaos_flwr.flower.client import default_party_factory, factory
from chaos_flwr.flower.client.service import PartyService, daemon_reply
from chaos_flwr.flower.keys import charter_path, key_path
from chaos_flwr.flower.local_socket import LOCAL_SOCKET_FILE, LocalServer, LocalSocketError
from chaos_flwr.flower.schema import CHAOS_RECORD_KEY, server_record
from chaos_flwr.lab.launch import free_port


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _world(tmp_path: Path, **kw: Any) -> World:
    """Three founders, each with its SuperNode."""
    w = World(tmp_path, 3, **kw)
    for p in range(3):
        w.add(p)
    return w


@contextlib.contextmanager
def _daemons(w: World, parts: dict[int, int]) -> Iterator[dict[int, PartyService]]:
    """In-process party services: state directory of partition p, party of partition parts[p]."""
    servers, services = [], {}
    for p, who in parts.items():
        state = w.state_root / f"party-{p}"
        state.mkdir(parents=True, exist_ok=True)
        services[p] = PartyService(state, w.pid(who))
        servers.append(LocalServer(state / LOCAL_SOCKET_FILE, services[p]))
        servers[-1].start()
    try:
        yield services
    finally:
        for s in servers:
            s.stop()


def _count_incarnations(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    fresh: list[Path] = []
    inner = factory._incarnation

    def counted(settings: Any) -> int:
        fresh.append(settings.state_dir)
        return inner(settings)

    monkeypatch.setattr(factory, "_incarnation", counted)
    return fresh


def _query(w: World, p: int) -> Message:
    party = w.party(p)
    record = server_record(
        [], phase="relay", server_round=party.held_round, digest=party.held_digest
    )
    content = RecordDict({CHAOS_RECORD_KEY: record})
    return Message(content, dst_node_id=w.nodes[p].node_id, message_type="query.chaos")


def _saved(w: World, p: int) -> Any:
    from chaos_flwr.identity import Identity

    ident = Identity.load(key_path(w.keys, p))
    return durable.load(w.state_root / f"party-{p}", str(ident.party_id), seal=ident.sign)


def test_a_run_s_protocol_messages_go_to_the_daemons_in_one_life_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = _count_incarnations(monkeypatch)
    w = _world(tmp_path)
    with _daemons(w, {0: 0, 1: 1, 2: 2}) as services:
        strategy = w.strategy()
        strategy.start(w.grid, _initial(), num_rounds=3, timeout=10)
    nodes = {w.nodes[p].node_id for p in range(3)}
    assert [r.server_round for r in strategy.rounds][-3:] == [1, 2, 3]
    assert all(set(r.trained) == nodes for r in strategy.rounds if r.server_round >= 1)
    for p in range(3):
        queries = w.nodes[p].received.count("query.chaos")
        assert queries >= 1 and services[p].answered == queries  # every one, by the daemon
    # the daemon and the ClientApp hand the party over without a restart: one incarnation each
    assert sorted(fresh) == sorted(w.state_root / f"party-{p}" for p in range(3))


def test_the_daemon_continues_a_life_and_a_new_supernode_life_starts_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _world(tmp_path)
    with _daemons(w, {0: 0, 1: 1, 2: 2}) as services:
        w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
        before = _saved(w, 0)
        reply = daemon_reply(_query(w, 0), w.nodes[0].context)
        assert reply is not None and CHAOS_RECORD_KEY in reply.content
        same = _saved(w, 0)
        assert (same.incarnation, same.lifetime) == (before.incarnation, before.lifetime)
        assert same.seq >= before.seq
        monkeypatch.setattr(durable, "lifetime_token", lambda: "4242:1")  # a restarted SuperNode
        answered = services[0].answered
        assert daemon_reply(_query(w, 0), w.nodes[0].context) is not None
        after = _saved(w, 0)
        assert after.incarnation > before.incarnation and after.lifetime == "4242:1"
        assert services[0].answered == answered + 1
        # the SuperNode restarts again and its first message is a train one: the ClientApp
        # starts the new life (a fresh incarnation) and saves; the daemon, asked next,
        # continues that life instead of restarting the party a second time
        monkeypatch.setattr(durable, "lifetime_token", lambda: "4343:1")
        started = factory.build_party(w.nodes[0].context, lifetime="4343:1")
        started.persist()
        assert started.peer.incarnation > after.incarnation  # type: ignore[union-attr]
        assert daemon_reply(_query(w, 0), w.nodes[0].context) is not None
        third = _saved(w, 0)
        assert (third.incarnation, third.lifetime) == (started.peer.incarnation, "4343:1")  # type: ignore[union-attr]


def _header(w: World, p: int, **over: Any) -> dict[str, Any]:
    node_config = {
        "partition-id": p,
        "chaos-key": str(key_path(w.keys, p)),
        "chaos-charter": str(charter_path(w.keys)),
        "chaos-state-dir": str(w.state_root / f"party-{p}"),
    }
    header = {
        "op": "query.chaos", "run_id": 1, "node_id": 7, "node_config": node_config,
        "run_config": {}, "lifetime": "1:1", "restart": False,
    }  # fmt: skip
    header.update(over)
    return header


def _body() -> bytes:
    from flwr.common.serde import recorddict_to_proto

    content = RecordDict({CHAOS_RECORD_KEY: ConfigRecord({"phase": "relay", "round": 0})})
    return bytes(recorddict_to_proto(content).SerializeToString())


def test_bad_requests_are_refused_with_typed_errors(tmp_path: Path) -> None:
    w = World(tmp_path, 3)
    state = w.state_root / "party-0"
    state.mkdir(parents=True)
    service = PartyService(state, w.pid(0))
    head, reply = service(_header(w, 0), _body())  # a good one, for contrast
    assert head == {"ok": True} and service.answered == 1
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    answer = recorddict_from_proto(ProtoRecordDict.FromString(reply))
    assert isinstance(answer[CHAOS_RECORD_KEY], ConfigRecord)
    bad: list[tuple[dict[str, Any], bytes, type[Exception], str]] = [
        (_header(w, 0, op="train"), _body(), DecodeError, "unknown operation"),
        (_header(w, 0, run_id=-1), _body(), DecodeError, "run_id"),
        (_header(w, 0, node_id=True), _body(), DecodeError, "node_id"),
        (_header(w, 0, node_config=[1]), _body(), DecodeError, "node_config"),
        (_header(w, 0, run_config={"x": float("nan")}), _body(), DecodeError, "run_config"),
        (_header(w, 0, lifetime="x" * 300), _body(), DecodeError, "lifetime"),
        (_header(w, 0, restart="yes"), _body(), DecodeError, "restart"),
        (_header(w, 0), b"\xff\x00garbage", DecodeError, "does not parse"),
        (_header(w, 1), _body(), DaemonMismatchError, "holds the party of"),  # another dir
    ]
    other_key = _header(w, 0)
    other_key["node_config"]["chaos-key"] = str(key_path(w.keys, 1))  # this dir, another key
    bad.append((other_key, _body(), DaemonMismatchError, "this party daemon is"))
    files = {f.name: f.stat().st_mtime_ns for f in state.iterdir() if f.is_file()}
    for header, body, error, words in bad:
        with pytest.raises(error, match=words):
            service(header, body)
    assert service.answered == 1
    # refused before anything was built: the party's own files are as they were
    assert {f.name: f.stat().st_mtime_ns for f in state.iterdir() if f.is_file()} == files
    assert all(p.party_id == w.pid(0) for p in service.parties.by_node.values())
    head, _ = service(_header(w, 0, run_id=2), _body())  # a later run: one party held
    assert head == {"ok": True} and list(service.parties.by_node) == [(2, 7)]


def test_a_daemon_of_another_party_is_not_used_and_the_message_handled_here(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = _world(tmp_path)
    with _daemons(w, {0: 1}) as services:  # party 0's directory, but the daemon of party 1
        w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
        reply = w.app(_query(w, 0), w.nodes[0].context)
    assert not reply.has_error() and CHAOS_RECORD_KEY in reply.content
    assert services[0].answered == 0 and "this party daemon is" in caplog.text
    assert w.party(0).party_id == w.pid(0)


def test_a_message_that_fails_in_the_daemon_leaves_no_stale_party_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.errors import PolicyError
    from chaos_flwr.flower.client import service as service_mod

    w = _world(tmp_path)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)  # no daemon yet
    state = w.state_root / "party-0"
    daemon = PartyService(state, w.pid(0))  # a daemon started now
    inner = service_mod.chaos_reply

    def fails(parties: Any, content: Any, context: Any) -> Any:
        parties(context)  # the party is built, then the message fails before its save
        raise PolicyError("refused")

    monkeypatch.setattr(service_mod, "chaos_reply", fails)
    with pytest.raises(PolicyError):
        daemon(_header(w, 0, node_id=w.nodes[0].node_id, lifetime=durable.lifetime_token()),
               _body())  # fmt: skip
    monkeypatch.setattr(service_mod, "chaos_reply", inner)
    # meanwhile a ClientApp signs something and saves (a train message, say)
    before = _saved(w, 0).seq
    clientapp = w.party(0)
    clientapp.disconnect(w.pid(1))  # a link_down it signs: its sequence number moves on
    clientapp.persist()
    signed = _saved(w, 0).seq
    assert signed > before
    kept = _saved(w, 0).records  # with the link_down it signed
    head, _ = daemon(
        _header(w, 0, node_id=w.nodes[0].node_id, lifetime=durable.lifetime_token()), _body()
    )
    assert head == {"ok": True}
    held = next(iter(daemon.parties.by_node.values()))
    assert held.peer.seq >= signed  # type: ignore[union-attr]  # took up the newer save
    after = _saved(w, 0)
    assert after.seq >= signed  # and did not save over it with older numbers
    assert all(r in after.records for r in kept)  # nor drop what it signed


def test_a_message_whose_thread_holds_the_turn_is_handled_here_not_deadlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.flower.client import lock

    monkeypatch.setattr(lock, "FLOWER_PARTY_LOCK_WAIT_S", 2.0)  # a deadlock fails fast
    w = _world(tmp_path)
    with _daemons(w, {0: 0}) as services:
        w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
        answered = services[0].answered
        assert answered >= 1
        # a wrapper (the churn emulation) took the party's turn around the message
        with lock.party_lock(w.state_root / "party-0"):
            reply = w.app(_query(w, 0), w.nodes[0].context)
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        assert services[0].answered == answered  # handled in this process, under its turn
        assert daemon_reply(_query(w, 0), w.nodes[0].context) is not None  # and then the daemon's
        assert services[0].answered == answered + 1


def test_the_churn_wrapper_without_a_scenario_leaves_queries_to_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos_flwr.flower.client import lock
    from chaos_flwr.lab import churn

    monkeypatch.setattr(lock, "FLOWER_PARTY_LOCK_WAIT_S", 2.0)
    w = World(tmp_path, 3)
    churn.apply(w.app)  # as the examples do: no scenario in the run config
    for p in range(3):
        w.add(p)
    with _daemons(w, {0: 0, 1: 1, 2: 2}) as services:
        w.strategy().start(w.grid, _initial(), num_rounds=2, timeout=10)
    for p in range(3):
        assert services[p].answered == w.nodes[p].received.count("query.chaos") >= 1


def test_a_daemon_that_breaks_off_leaves_the_message_unhandled_here(tmp_path: Path) -> None:
    import socket
    import threading

    w = _world(tmp_path)
    w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)  # no daemons: in process
    state = w.state_root / "party-0"
    before = (state / durable.STATE_FILE).stat().st_mtime_ns
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(str(state / LOCAL_SOCKET_FILE))
    lsock.listen(1)

    def die_mid_request() -> None:
        conn, _ = lsock.accept()
        conn.recv(1 << 20)
        conn.close()

    t = threading.Thread(target=die_mid_request)
    t.start()
    try:
        with pytest.raises(LocalSocketError):
            w.app(_query(w, 0), w.nodes[0].context)
    finally:
        t.join(5)
        lsock.close()
    assert (state / durable.STATE_FILE).stat().st_mtime_ns == before  # not handled twice
    # the socket file is stale now: the ClientApp handles the next message itself
    reply = w.app(_query(w, 0), w.nodes[0].context)
    assert not reply.has_error() and CHAOS_RECORD_KEY in reply.content
    assert (state / durable.STATE_FILE).stat().st_mtime_ns != before


def test_an_app_with_its_own_party_factory_does_not_use_the_daemon(tmp_path: Path) -> None:
    built: list[int] = []

    def own(context: Context) -> Any:
        built.append(context.node_id)
        return default_party_factory(context)

    w = _world(tmp_path, factory=own)
    with _daemons(w, {0: 0}) as services:
        w.strategy().start(w.grid, _initial(), num_rounds=1, timeout=10)
    assert services[0].answered == 0 and w.nodes[0].node_id in built


def test_the_party_command_makes_its_socket_private_and_removes_it_or_makes_none(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, 3)
    state = w.state_root / "party-0"
    base = [
        sys.executable, "-m", "chaos_flwr.cli", "party", "--key", str(key_path(w.keys, 0)),
        "--charter", str(charter_path(w.keys)), "--state-dir", str(state), "--no-gossip",
    ]  # fmt: skip
    for extra, socket_made in (([], True), (["--no-local"], False)):
        addr = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen(
            [*base, "--listen", addr, *extra], stdout=subprocess.PIPE, text=True,
            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith(f"serving {addr} as {w.pid(0)}"), line
            sock = state / LOCAL_SOCKET_FILE
            assert sock.exists() is socket_made
            assert (f"ClientApps at {sock}" in line) is socket_made
            if socket_made:
                assert oct(sock.stat().st_mode & 0o777) == "0o600"
        finally:
            proc.send_signal(signal.SIGTERM)
            out = proc.communicate(timeout=20)[0]
        assert proc.returncode == 0
        assert ("local socket: 0 message(s) answered" in out) is socket_made
        assert not (state / LOCAL_SOCKET_FILE).exists()
