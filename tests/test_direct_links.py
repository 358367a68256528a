"""Authenticated, encrypted direct links (chaos_flwr.flower.direct with a LinkAccess).

A real donor process (tests/link_world.py, party ``a``) serves 6 MiB over grpc mutual TLS on
127.0.0.1; this process dials it as members, a non-member, impostors and a flood, and checks
each refusal's typed error on the dialler's side and the donor's own count of it.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from link_world import (
    DATA,
    DIGEST,
    FED,
    ROUND,
    access,
    endpoint_record,
    ident,
    records,
)

from chaos_flwr import codec
from chaos_flwr.errors import (
    EndpointError,
    LinkAuthError,
    LinkBusyError,
    LinkQuotaError,
    NotMemberError,
    ReplyTooLargeError,
    RequestTooLargeError,
    StoreError,
)
from chaos_flwr.flower.direct import BytesSource, DirectServer, LinkLimits
from chaos_flwr.flower.fetch import fetch_ranges
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Record, RecordSet, leave_body
from chaos_flwr.transport import tls
from chaos_flwr.transport.links import LinkDialer
from chaos_flwr.transport.tls import BINDING_OID, LinkCredentials

HERE = Path(__file__).parent
MiB = 1024 * 1024


class Donor:
    """The donor process: its address, signed endpoint record and final report."""

    def __init__(self, limits: dict[str, Any] | None = None, up_mb_s: float | None = None) -> None:
        shaping = [] if up_mb_s is None else [str(up_mb_s)]
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "link_world.py"), json.dumps(limits or {}), *shaping],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line[0] == "serving", line
        self.address = line[1]
        kind, hexed = self.proc.stdout.readline().split()
        assert kind == "endpoint"
        self.record = Record.from_wire(codec.decode(bytes.fromhex(hexed)))
        self.refused: dict[str, int] = {}
        self.served = (0, 0, 0)  # requests, bytes, most requests in service at once

    def rss_kib(self, field: str = "VmRSS") -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(field)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=20)
            for line in out.splitlines():
                if line.startswith("refused "):
                    self.refused = json.loads(line.split(" ", 1)[1])
                elif line.startswith("served "):
                    n, nbytes, peak = line.split()[1:]
                    self.served = (int(n), int(nbytes), int(peak))
        if self.proc.poll() is None:  # pragma: no cover - only if terminate hung
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def donor() -> Iterator[Donor]:
    d = Donor()
    try:
        yield d
    finally:
        d.stop()


def _view(d: Donor, *extra: Record) -> RecordSet:
    return records([d.record, *extra])


def _fetch(d: Donor, name: str, rs: RecordSet, creds: LinkCredentials | None = None,
           offered: str | None = None, span: tuple[int, int] = (0, 1000)) -> Any:  # fmt: skip
    a = ident("a").party_id
    got = fetch_ranges(
        {a: offered if offered is not None else d.address},
        {a: [(0, *span)]},
        server_round=ROUND, digest=DIGEST, timeout_s=10.0, link=access(name, rs, creds),
    )  # fmt: skip
    return got[a]


def _request(d: Donor, creds: LinkCredentials, value: Any) -> bytes:
    data = value if isinstance(value, bytes) else codec.encode(value)

    async def go() -> bytes:
        dialer = LinkDialer(creds)
        try:
            return await dialer.request(d.address, d.record.body["cert"], data, timeout=10.0)
        finally:
            await dialer.close()

    return asyncio.run(go())


def test_a_member_pulls_over_the_signed_endpoint_and_the_bytes_are_the_donors(
    donor: Donor,
) -> None:
    got = _fetch(donor, "b", _view(donor), span=(0, len(DATA)))  # > one reply: split in pieces
    assert got.exc is None and got.error == ""
    assert [i for i, _, _ in got.shards] == [0]
    assert got.shards[0][1] == DATA and got.nbytes == len(DATA)
    wrong = _fetch(donor, "b", _view(donor), span=(0, 10))
    assert wrong.exc is None
    other = fetch_ranges(  # a state the donor does not hold: typed, as the donor raised it
        {ident("a").party_id: donor.address}, {ident("a").party_id: [(0, 0, 10)]},
        server_round=ROUND + 1, digest=DIGEST, timeout_s=10.0, link=access("b", _view(donor)),
    )[ident("a").party_id]  # fmt: skip
    assert isinstance(other.exc, StoreError) and not other.shards


def test_a_non_member_is_refused_with_not_member_error(donor: Donor) -> None:
    got = _fetch(donor, "x", _view(donor))  # x signs its own binding; x is not in the charter
    assert isinstance(got.exc, NotMemberError) and not got.shards
    inactive = _fetch(donor, "d", _view(donor))  # a charter party that never joined
    assert isinstance(inactive.exc, NotMemberError) and "not an active member" in got.error + (
        inactive.error
    )


class _Impostor:
    """Claims ``party_id`` but signs with another key."""

    def __init__(self, party_id: str, signer: Any) -> None:
        self.party_id = party_id
        self.sign = signer.sign


def test_a_member_id_with_the_wrong_key_is_refused_with_link_auth_error(donor: Donor) -> None:
    fake = LinkCredentials.create(_Impostor(ident("b").party_id, ident("x")), FED)
    got = _fetch(donor, "b", _view(donor), creds=fake)
    assert isinstance(got.exc, LinkAuthError) and not got.shards
    assert "does not verify" in got.error


def test_a_relay_supplied_address_no_record_signs_is_never_dialled(donor: Donor) -> None:
    import socket

    with socket.socket() as trap:  # where a lying relay points the joiner
        trap.bind(("127.0.0.1", 0))
        trap.listen(4)
        trap.settimeout(0.5)
        host, port = trap.getsockname()
        got = _fetch(donor, "b", _view(donor), offered=f"{host}:{port}")
        assert isinstance(got.exc, EndpointError) and "not the one its endpoint record signs" in (
            got.error
        )
        with pytest.raises(TimeoutError):
            trap.accept()  # nobody connected
    unsigned = records()  # no endpoint record of the donor at all: nothing to dial
    none = _fetch(donor, "b", unsigned)
    assert isinstance(none.exc, EndpointError) and not none.shards
    # a donor that left is no longer dialled even with its endpoint record held
    me = ident("a")
    from chaos_flwr.membership import leave_body

    gone = _view(donor, Record.sign(leave_body(FED, me.party_id, 0), [me]))
    assert isinstance(_fetch(donor, "b", gone).exc, EndpointError)


def _cert_with(binding: bytes, key: ec.EllipticCurvePrivateKey, name: str) -> bytes:
    """A dial certificate for ``key`` carrying someone else's ``binding`` (issued by the public
    root, as anyone can)."""
    root_key, root = tls._root()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, name)]))
        .issuer_name(root.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.UnrecognizedExtension(BINDING_OID, binding), critical=False)
        .sign(root_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_replayed_binding_or_certificate_of_another_party_is_refused(donor: Donor) -> None:
    real = LinkCredentials.create(ident("b"), FED)  # b's credentials, seen by x on the wire
    stolen = x509.load_pem_x509_certificate(real.dial_cert_pem)
    binding = stolen.extensions.get_extension_for_oid(BINDING_OID).value
    assert isinstance(binding, x509.UnrecognizedExtension)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = serialization.Encoding.PEM
    replay = LinkCredentials(
        party_id=real.party_id, federation=FED,
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        serve_cert_pem=real.serve_cert_pem,
        dial_cert_pem=_cert_with(binding.value, key, "x"),
    )  # fmt: skip
    got = _fetch(donor, "b", _view(donor), creds=replay)
    assert isinstance(got.exc, LinkAuthError) and "copied" in got.error
    # b's whole certificate without b's key: TLS cannot complete, nothing is served
    no_key = LinkCredentials(
        party_id=real.party_id, federation=FED, key_pem=replay.key_pem,
        serve_cert_pem=real.serve_cert_pem, dial_cert_pem=real.dial_cert_pem,
    )  # fmt: skip
    bare = _fetch(donor, "b", _view(donor), creds=no_key)
    assert bare.exc is not None and not bare.shards


def test_an_impostor_server_at_the_signed_address_fails_the_handshake(donor: Donor) -> None:
    # x listens somewhere; a record of a (signed by a) names x's address with a's real cert:
    # the dialler pins a's certificate, so x cannot answer as a
    x_server = DirectServer(
        BytesSource(ROUND, DIGEST, DATA),
        link=access("x", records()),
    )
    x_server.start()
    try:
        assert x_server.address
        a = ident("a")
        moved = Record.sign(
            {**donor.record.body, "seq": 2, "port": int(x_server.address.rsplit(":", 1)[1])}, [a]
        )
        got = _fetch(donor, "b", _view(donor, moved), offered=x_server.address)
        assert isinstance(got.exc, LinkAuthError) and "handshake" in got.error
        assert x_server.requests_served == 0
    finally:
        x_server.stop()


def test_oversized_and_amplifying_requests_are_refused_with_their_types(donor: Donor) -> None:
    creds = LinkCredentials.create(ident("c"), FED)
    with pytest.raises(RequestTooLargeError):
        _request(donor, creds, b"\x00" * (100 * 1024))  # above LINK_MAX_REQUEST_BYTES
    ask = {"round": ROUND, "digest": DIGEST}
    with pytest.raises(ReplyTooLargeError):  # 60 bytes asking for 6 MiB in one request
        _request(donor, creds, {**ask, "start": [0], "end": [len(DATA)]})
    with pytest.raises(ReplyTooLargeError):  # the same 1 MiB range, many times over
        _request(donor, creds, {**ask, "start": [0] * 8, "end": [MiB] * 8})
    with pytest.raises(RequestTooLargeError, match="ranges"):  # small, but too many ranges
        _request(donor, creds, {**ask, "start": [0] * 2000, "end": [1] * 2000})
    ok = codec.decode(_request(donor, creds, {**ask, "start": [5], "end": [9]}))
    assert ok == {"data": [DATA[5:9]]}


def test_the_donor_counts_each_refusal_by_its_type() -> None:
    d = Donor()  # its own donor process: exact counts, whatever else ran
    try:
        assert isinstance(_fetch(d, "x", _view(d)).exc, NotMemberError)
        fake = LinkCredentials.create(_Impostor(ident("b").party_id, ident("x")), FED)
        assert isinstance(_fetch(d, "b", _view(d), creds=fake).exc, LinkAuthError)
        assert isinstance(_fetch(d, "b", _view(d), offered="127.0.0.1:1").exc, EndpointError)
        creds = LinkCredentials.create(ident("c"), FED)
        ask = {"round": ROUND, "digest": DIGEST}
        with pytest.raises(ReplyTooLargeError):
            _request(d, creds, {**ask, "start": [0], "end": [len(DATA)]})
        with pytest.raises(StoreError):
            _request(d, creds, {**ask, "digest": b"x" * 32, "start": [0], "end": [4]})
        assert _fetch(d, "b", _view(d), span=(0, 10)).shards[0][1] == DATA[:10]
    finally:
        d.stop()
    # (no EndpointError: the dialler refused that address, the donor never saw it)
    assert d.refused == {
        "NotMemberError": 1,
        "LinkAuthError": 1,
        "ReplyTooLargeError": 1,
        "StoreError": 1,
    }
    assert d.served[:2] == (1, 10)


def test_per_peer_window_quota_refuses_with_link_quota_error() -> None:
    now = [0.0]
    limits = LinkLimits(peer_window_bytes=3 * MiB, peer_window_s=60.0)
    rs = records()
    a = ident("a")
    creds = LinkCredentials.create(a, FED)
    server = DirectServer(
        BytesSource(ROUND, DIGEST, DATA), link=access("a", rs, creds), limits=limits,
        clock=lambda: now[0],
    )  # fmt: skip
    address = server.start()
    try:
        rs.add(endpoint_record(a, address, creds))
        pid = a.party_id

        def pull(name: str) -> Any:
            return fetch_ranges(
                {}, {pid: [(0, 0, 2 * MiB)]}, server_round=ROUND, digest=DIGEST, timeout_s=10.0,
                link=access(name, rs),
            )[pid]  # fmt: skip

        assert pull("b").exc is None
        second = pull("b")
        assert isinstance(second.exc, LinkQuotaError) and not second.shards
        assert pull("c").exc is None  # the window is per peer
        now[0] = 61.0
        assert pull("b").exc is None  # a new window
        assert server.refusals() == {"LinkQuotaError": 1}
    finally:
        server.stop()


def _stalled_calls(address: str, serve_cert: bytes, creds: LinkCredentials, n: int) -> Any:
    """Open ``n`` link calls as ``creds``' holder that never send their request; return the
    channel, the calls and a task per call that reads its outcome."""
    import grpc
    import grpc.aio

    channel = grpc.aio.secure_channel(
        address,
        grpc.ssl_channel_credentials(
            root_certificates=tls.serve_cert_pem_of(serve_cert),
            private_key=creds.key_pem,
            certificate_chain=creds.dial_cert_pem,
        ),
        options=[("grpc.ssl_target_name_override", tls.LINK_SERVER_NAME)],
    )
    never = asyncio.Event()

    async def nothing() -> Any:  # the request never comes
        await never.wait()
        yield b""

    call = channel.stream_stream("/chaos.Link/Call")
    calls = [call(nothing()) for _ in range(n)]
    return channel, calls, [asyncio.ensure_future(c.read()) for c in calls]


async def _outcome(task: Any) -> str:
    """The error class a stalled call ended with (its grpc details' prefix), or
    ``"stalled"`` if it had not ended in 5 s."""
    import grpc.aio

    try:
        await asyncio.wait_for(task, 5.0)
    except TimeoutError:
        return "stalled"
    except grpc.aio.AioRpcError as exc:
        return (exc.details() or "").partition(":")[0]
    return "served"


def test_a_dialler_that_never_sends_its_request_holds_no_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chaos_flwr.transport import links

    monkeypatch.setattr(links, "LINK_REQUEST_READ_S", 1.0)
    rs = records()
    a = ident("a")
    creds = LinkCredentials.create(a, FED)
    server = DirectServer(BytesSource(ROUND, DIGEST, DATA), link=access("a", rs, creds))
    address = server.start()
    cert = creds.serve_cert_der
    ask = codec.encode({"round": ROUND, "digest": DIGEST, "start": [0], "end": [10]})
    outsider = LinkCredentials.create(Identity.from_seed("outsider", "x"), FED)

    async def go() -> tuple[list[str], list[str], bytes, bytes]:
        # a dialler no charter party vouches for: every call refused as it starts, so the
        # 8 calls (grpc's whole backstop) do not lock the members out
        ch1, _, out_tasks = _stalled_calls(address, cert, outsider, 8)
        # a member holds at most LINK_MAX_CONCURRENT_PER_PEER slots, each until its read ends
        ch2, _, c_tasks = _stalled_calls(address, cert, LinkCredentials.create(ident("c"), FED), 3)
        dialer = LinkDialer(LinkCredentials.create(ident("b"), FED))
        try:
            outsiders = [await _outcome(t) for t in out_tasks]
            served_b = await dialer.request(address, cert, ask, timeout=5.0)
            members = [await _outcome(t) for t in c_tasks]
            served_after = await dialer.request(address, cert, ask, timeout=5.0)
            return outsiders, members, served_b, served_after
        finally:
            await dialer.close()
            await ch1.close()
            await ch2.close()

    try:
        rs.add(endpoint_record(a, address, creds))
        outsiders, members, served_b, served_after = asyncio.run(go())
    finally:
        server.stop()
    assert set(outsiders) <= {"LinkAuthError", "NotMemberError"} and len(outsiders) == 8
    assert sorted(members) == ["LinkBusyError", "TransportError", "TransportError"]
    assert codec.decode(served_b)["data"][0] == DATA[:10] == codec.decode(served_after)["data"][0]
    refused = server.refusals()
    assert refused.get("LinkAuthError", 0) + refused.get("NotMemberError", 0) == 8
    assert refused["LinkBusyError"] == 1 and refused["TransportError"] == 2


@pytest.mark.slow
def test_a_flood_of_concurrent_requests_is_refused_busy_and_memory_stays_bounded() -> None:
    d = Donor(up_mb_s=200.0)  # paced replies (>= 20 ms per 4 MiB): the requests overlap
    try:
        creds = LinkCredentials.create(ident("e"), FED)
        ask = {"round": ROUND, "digest": DIGEST, "start": [0], "end": [4 * MiB]}
        assert len(codec.decode(_request(d, creds, ask))["data"][0]) == 4 * MiB  # warm up
        base = d.rss_kib()
        peak = [base]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], d.rss_kib())
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()

        async def flood() -> list[Any]:
            # three members, 16 requests each (one party alone has at most
            # LINK_MAX_CONCURRENT_PER_PEER in service)
            dialers = [LinkDialer(c) for c in (creds, *(LinkCredentials.create(ident(n), FED)
                                                        for n in ("b", "c")))]  # fmt: skip
            try:
                return await asyncio.gather(
                    *(
                        dialer.request(d.address, d.record.body["cert"], codec.encode(ask),
                                       timeout=30.0)
                        for dialer in dialers
                        for _ in range(16)
                    ),
                    return_exceptions=True,
                )  # fmt: skip
            finally:
                for dialer in dialers:
                    await dialer.close()

        try:
            results = asyncio.run(flood())
        finally:
            done.set()
            watcher.join()
        served = [r for r in results if isinstance(r, bytes)]
        busy = [r for r in results if isinstance(r, LinkBusyError)]
        assert len(served) + len(busy) == 48, [r for r in results if not isinstance(r, bytes)][:3]
        assert len(served) >= 4 and len(busy) >= 24
        grown_mib = (max(peak[0], d.rss_kib("VmHWM")) - base) / 1024
        print(f"flood: {len(served)} served, {len(busy)} busy, RSS +{grown_mib:.0f} MiB")
        # 48 x 4 MiB unbounded would need ~400 MiB of replies at once (plus copies)
        assert grown_mib < 120
    finally:
        d.stop()
    # the donor refused them itself (a few may be refused by grpc's backstop limit, uncounted)
    assert 0 < d.refused.get("LinkBusyError", 0) <= len(busy)
    assert d.served[0] == len(served) + 1 and d.served[2] == 4  # LINK_MAX_CONCURRENT_REQUESTS


@pytest.mark.parametrize("listen", ["[::1]:0", "127.0.0.1:0"])
def test_links_over_ipv6_and_a_host_name_from_signed_endpoints(listen: str) -> None:
    rs = records()
    a = ident("a")
    creds = LinkCredentials.create(a, FED)
    server = DirectServer(BytesSource(ROUND, DIGEST, DATA), listen, link=access("a", rs, creds))
    address = server.start()
    try:
        port = address.rsplit(":", 1)[1]
        # announce a host name for the IPv4 server (what a multi-site deployment does)
        signed = address if listen.startswith("[") else f"localhost:{port}"
        rs.add(endpoint_record(a, signed, creds))
        pid = a.party_id
        got = fetch_ranges(
            {}, {pid: [(0, 100, 200)]}, server_round=ROUND, digest=DIGEST, timeout_s=10.0,
            link=access("b", rs),
        )[pid]  # fmt: skip
        assert got.exc is None and got.shards[0][1] == DATA[100:200]
        assert rs.endpoint(pid) is not None and rs.endpoint(pid).address == signed  # type: ignore[union-attr]
    finally:
        server.stop()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_dialler_keeps_one_channel_per_party_and_a_bounded_number_in_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chaos_flwr.errors import ChaosError
    from chaos_flwr.transport import links

    monkeypatch.setattr(links, "LINK_DIALER_MAX_CHANNELS", 5)
    cert = LinkCredentials.create(ident("a"), FED).serve_cert_der

    async def go() -> tuple[int, int]:
        dialer = LinkDialer(LinkCredentials.create(ident("b"), FED))
        try:
            for _ in range(12):  # party a moves to a new endpoint before every dial
                with pytest.raises(ChaosError):
                    await dialer.request(
                        f"127.0.0.1:{_closed_port()}", cert, b"x", timeout=2.0, party="a"
                    )
            one_party = len(dialer._channels)
            for _ in range(12):  # endpoints no party is named for
                with pytest.raises(ChaosError):
                    await dialer.request(f"127.0.0.1:{_closed_port()}", cert, b"x", timeout=2.0)
            return one_party, len(dialer._channels)
        finally:
            await dialer.close()

    assert asyncio.run(go()) == (1, 5)


def test_a_party_its_own_signature_admits_is_served_before_its_join_arrives() -> None:
    import dataclasses

    from chaos_flwr.transport.links import LinkAccess

    rs = records()  # d is on the charter, not a founder, and has not joined
    d = ident("d").party_id
    creds = LinkCredentials.create(ident("a"), FED)
    with pytest.raises(NotMemberError):
        LinkAccess(creds, rs.policy, rs.view).authorize(d)  # it needs a sponsor
    open_door = dataclasses.replace(rs.policy, sponsors_required=0)
    LinkAccess(creds, open_door, rs.view).authorize(d)  # its own join would admit it
    with pytest.raises(NotMemberError):  # not on the charter: never
        LinkAccess(creds, open_door, rs.view).authorize(ident("x").party_id)
    # a founder that left is refused: leaving ends its reads, until its new join arrives
    e = ident("e")
    LinkAccess(creds, rs.policy, rs.view).authorize(e.party_id)
    rs.add(Record.sign(leave_body(FED, e.party_id, 0), [e]))
    for policy in (rs.policy, open_door):
        with pytest.raises(NotMemberError):
            LinkAccess(creds, policy, rs.view).authorize(e.party_id)


def test_a_channel_let_go_while_a_call_is_on_it_closes_after_the_call() -> None:
    from chaos_flwr.errors import ChaosError

    d = Donor(up_mb_s=4.0)  # a 4 MiB reply takes about a second
    try:
        ask = codec.encode({"round": ROUND, "digest": DIGEST, "start": [0], "end": [4 * MiB]})
        a = ident("a").party_id
        other = LinkCredentials.create(ident("a"), FED).serve_cert_der  # a's next certificate

        async def go() -> Any:
            dialer = LinkDialer(LinkCredentials.create(ident("b"), FED))
            try:
                slow = asyncio.ensure_future(
                    dialer.request(d.address, d.record.body["cert"], ask, timeout=30.0, party=a)
                )
                await asyncio.sleep(0.3)  # the call is under way; a moves to a new endpoint
                with pytest.raises(ChaosError):
                    await dialer.request(
                        f"127.0.0.1:{_closed_port()}", other, b"x", timeout=2.0, party=a
                    )
                assert len(dialer._channels) == 1  # the first channel was let go
                return await slow
            finally:
                await dialer.close()

        got = asyncio.run(go())
    finally:
        d.stop()
    assert codec.decode(got)["data"][0] == DATA[: 4 * MiB]
