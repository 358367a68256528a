"""The local socket between a party's ClientApps and its daemon: frames, bounds, who may
connect, and what a broken or missing daemon looks like to the caller."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chaos_flwr.errors import ConfigError, OversizeError, PolicyError
from chaos_flwr.flower import local_socket
from chaos_flwr.flower.local_socket import (
    LOCAL_SOCKET_FILE,
    LocalServer,
    LocalSocketError,
    local_call,
)


def _echo(header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
    if header.get("raise") == "policy":
        raise PolicyError("not in the charter")
    if header.get("raise") == "bug":
        raise KeyError("a bug")
    return {"ok": True, "n": len(body), "seen": header}, body[::-1]


@pytest.fixture
def server(tmp_path: Path) -> Any:
    srv = LocalServer(tmp_path / LOCAL_SOCKET_FILE, _echo)
    srv.start()
    yield srv
    srv.stop()


def _raw(path: Path, data: bytes) -> bytes:
    """Send raw bytes, read whatever comes back until the daemon closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _error_of(reply: bytes) -> dict[str, Any]:
    import json

    _magic, _v, n_header, _n_body = struct.unpack(">4sBIQ", reply[:17])
    value: dict[str, Any] = json.loads(reply[17 : 17 + n_header])
    return value


def test_a_request_and_its_reply_round_trip_and_the_socket_is_private(server: Any) -> None:
    body = os.urandom(5 * 1024 * 1024 + 3)  # past one read chunk
    header, reply = local_call(server.path, {"op": "x", "k": [1, "a"]}, body) or ({}, b"")
    assert header == {"ok": True, "n": len(body), "seen": {"op": "x", "k": [1, "a"]}}
    assert reply == body[::-1]
    mode = os.lstat(server.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert server.handled == 1 and server.refused == 0


def test_a_typed_error_comes_back_as_the_same_type_and_a_bug_as_chaos_error(server: Any) -> None:
    with pytest.raises(PolicyError, match="party daemon: not in the charter"):
        local_call(server.path, {"raise": "policy"}, b"")
    from chaos_flwr.errors import ChaosError

    with pytest.raises(ChaosError, match="internal: KeyError") as info:
        local_call(server.path, {"raise": "bug"}, b"")
    assert type(info.value) is ChaosError
    assert local_call(server.path, {}, b"abc") is not None  # the daemon lives on


def test_no_daemon_means_none_and_nothing_sent(tmp_path: Path) -> None:
    assert local_call(tmp_path / LOCAL_SOCKET_FILE, {}, b"") is None  # no file
    assert local_call(tmp_path / "missing" / LOCAL_SOCKET_FILE, {}, b"") is None  # no dir
    stale = tmp_path / LOCAL_SOCKET_FILE
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on: a daemon that died
    assert local_call(stale, {}, b"") is None


def test_a_stale_socket_is_replaced_and_a_second_daemon_refused(tmp_path: Path) -> None:
    path = tmp_path / LOCAL_SOCKET_FILE
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    first = LocalServer(path, _echo)
    first.start()
    try:
        assert local_call(path, {}, b"x") is not None
        with pytest.raises(ConfigError, match="another party daemon already answers"):
            LocalServer(path, _echo).start()
        assert local_call(path, {}, b"x") is not None  # the first one still answers
    finally:
        first.stop()
    assert not path.exists()  # removed on stop


def test_a_path_longer_than_af_unix_allows_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / LOCAL_SOCKET_FILE
    assert len(str(path)) > 107
    srv = LocalServer(path, _echo)
    srv.start()
    try:
        assert path.exists()
        reply = local_call(path, {"a": 1}, b"xy")
        assert reply is not None and reply[1] == b"yx"
    finally:
        srv.stop()


def test_malformed_and_oversized_frames_are_refused_with_typed_errors(server: Any) -> None:
    bad_magic = _raw(server.path, struct.pack(">4sBIQ", b"HTTP", 1, 2, 0))
    assert _error_of(bad_magic)["error"] == "DecodeError"
    big = _raw(server.path, struct.pack(">4sBIQ", b"CHLS", 1, 10**9, 0))
    assert _error_of(big)["error"] == "OversizeError"  # refused before anything is read
    huge_body = _raw(server.path, struct.pack(">4sBIQ", b"CHLS", 1, 2, 2**40))
    assert _error_of(huge_body)["error"] == "OversizeError"
    not_object = _raw(server.path, struct.pack(">4sBIQ", b"CHLS", 1, 2, 0) + b"[]")
    assert _error_of(not_object)["error"] == "DecodeError"
    assert server.refused == 4 and server.handled == 0
    with pytest.raises(OversizeError):
        local_call(server.path, {"pad": "x" * (local_socket.LOCAL_SOCKET_MAX_HEADER_BYTES)}, b"")


def test_a_stalled_peer_is_dropped_and_a_flood_gets_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_socket, "LOCAL_SOCKET_IO_TIMEOUT_S", 0.5)
    monkeypatch.setattr(local_socket, "LOCAL_SOCKET_MAX_CONNECTIONS", 2)
    srv = LocalServer(tmp_path / LOCAL_SOCKET_FILE, _echo)
    srv.start()
    stalled = []
    try:
        for _ in range(2):  # half a frame each, then silence: both slots held
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(srv.path))
            s.sendall(b"CHLS")
            stalled.append(s)
        time.sleep(0.1)
        # refused unread: the reply says busy, or the close beats it (the sender's pipe breaks)
        with pytest.raises(LocalSocketError, match=r"busy|broke off"):
            local_call(srv.path, {}, b"")
        for s in stalled:  # dropped after the I/O timeout, with a DecodeError-family reply
            s.settimeout(5)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            assert _error_of(data)["error"] == "LocalSocketError"
        assert local_call(srv.path, {}, b"ok") is not None  # slots are free again
        assert srv.refused == 3
    finally:
        for s in stalled:
            s.close()
        srv.stop()


def test_another_user_gets_no_answer() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")  # CI and sessions run as root
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="chaos-sock-"))  # /tmp: a path nobody can walk
    os.chmod(where, 0o755)
    server = LocalServer(where / LOCAL_SOCKET_FILE, _echo)
    server.start()
    try:
        os.chmod(server.path, 0o666)  # past the file mode, the peer check still holds
        _connect_as_nobody(server)
    finally:
        server.stop()
        shutil.rmtree(where)


def test_another_user_without_access_to_the_socket_file_falls_back() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")  # CI and sessions run as root
    import shutil
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="chaos-sock-"))
    os.chmod(where, 0o755)
    server = LocalServer(where / LOCAL_SOCKET_FILE, _echo)
    server.start()  # mode 0600: nobody may not even connect
    try:
        assert _as_nobody(lambda: local_call(server.path, {}, b"") is None)  # nothing sent
    finally:
        server.stop()
        shutil.rmtree(where)
    assert server.refused == 0 and server.handled == 0


def _as_nobody(check: Any) -> bool:
    """Run ``check`` in a forked child as user nobody; its truth value."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            os.setgid(65534)
            os.setuid(65534)
            ok = bool(check())
        except BaseException:
            ok = False
        finally:
            os.write(write, bytes([int(ok)]))
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    got = os.read(read, 1)
    os.close(read)
    return got == bytes([1])


def test_stopping_lets_a_request_in_hand_finish(tmp_path: Path) -> None:
    started = threading.Event()

    def slow(header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        started.set()
        time.sleep(1.0)
        return {"ok": True}, b"saved"

    srv = LocalServer(tmp_path / LOCAL_SOCKET_FILE, slow)
    srv.start()
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(local_call(srv.path, {}, b"")))
    t.start()
    assert started.wait(5)
    srv.stop()  # while the handler runs
    t.join(10)
    assert got and got[0] == ({"ok": True}, b"saved")
    assert not srv.path.exists()


def _connect_as_nobody(server: LocalServer) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, connecting
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                local_call(server.path, {}, b"")
                code = 1
            except LocalSocketError:
                code = 0
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == bytes([0])  # the connection closed with no reply
    os.close(read)
    assert server.refused == 1 and server.handled == 0


def test_a_daemon_that_breaks_off_mid_request_is_a_local_socket_error(tmp_path: Path) -> None:
    path = tmp_path / LOCAL_SOCKET_FILE
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(str(path))
    lsock.listen(1)

    def take_and_drop() -> None:
        conn, _ = lsock.accept()
        conn.recv(65536)
        conn.close()  # the request read, no reply: a daemon killed while handling it

    t = threading.Thread(target=take_and_drop)
    t.start()
    try:
        with pytest.raises(LocalSocketError, match=r"broke off|closed"):
            local_call(path, {"op": "x"}, b"abc")
    finally:
        t.join(5)
        lsock.close()
