"""The relay's read grant (chaos_flwr.flower.grant): a party lets a restarted ServerApp's
fresh link key read its certified states over direct links, and nothing more."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from link_world import DATA, DIGEST, FED, ROUND, access, endpoint_record, ident, records

from chaos_flwr import codec
from chaos_flwr.errors import NotMemberError, StoreError
from chaos_flwr.flower.direct import BytesSource, DirectServer
from chaos_flwr.flower.fetch import fetch_manifest, fetch_ranges
from chaos_flwr.flower.grant import (
    RELAY_GRANT_FILE,
    RELAY_READER,
    RelayGrants,
    _load,
    take_hello,
    write_grant,
)
from chaos_flwr.flower.server.pull import relay_link
from chaos_flwr.gossip import GOSSIP_KEY
from chaos_flwr.transport.links import LinkDialer
from chaos_flwr.transport.tls import LinkCredentials

SPKI = bytes(range(32))


def _granted(state_dir: Path, fed: str = FED, now: float | None = None) -> bytes | None:
    """The key the party's link server serves as the relay now (``None``: none)."""
    clock = time.time if now is None else (lambda: now)
    return next(iter(RelayGrants(state_dir, fed, clock=clock)()), None)


def test_a_grant_names_one_key_for_one_federation_until_it_expires(tmp_path: Path) -> None:
    assert _granted(tmp_path) is None  # none written: none held
    write_grant(tmp_path, FED, SPKI, ttl_s=60.0)
    assert (tmp_path / RELAY_GRANT_FILE).stat().st_mode & 0o777 == 0o600
    assert _granted(tmp_path) == SPKI
    assert _granted(tmp_path, "another-fed") is None
    assert _granted(tmp_path, now=time.time() + 61.0) is None  # expired
    write_grant(tmp_path, FED, bytes(32), ttl_s=60.0)  # a newer hello replaces it
    assert _granted(tmp_path) == bytes(32)


@pytest.mark.parametrize(
    "content",
    [
        b"\x00" * 600,  # past the bound
        codec.encode({"version": 2, "federation": FED, "spki": SPKI, "expires": 1e12}),
        codec.encode({"version": 1, "federation": FED, "spki": b"short", "expires": 1e12}),
        codec.encode({"version": 1, "federation": 7, "spki": SPKI, "expires": 1e12}),
        b"not codec",
    ],
)
def test_a_grant_file_that_is_not_one_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / RELAY_GRANT_FILE).write_bytes(content)
    with pytest.raises(StoreError):
        _load(tmp_path / RELAY_GRANT_FILE)
    assert RelayGrants(tmp_path, FED)() == {}  # the link server grants nothing


def test_a_hello_grants_only_a_well_formed_key_and_takes_a_grant_back(tmp_path: Path) -> None:
    assert take_hello(tmp_path, FED, None) == ""  # the hello names no key: nothing written
    assert not (tmp_path / RELAY_GRANT_FILE).exists()
    assert take_hello(None, FED, SPKI) == "" and take_hello(tmp_path, None, SPKI) == ""
    assert "not bytes" in take_hello(tmp_path, FED, "x" * 32)
    assert "32-byte" in take_hello(tmp_path, FED, b"x" * 31)
    assert not (tmp_path / RELAY_GRANT_FILE).exists()
    assert take_hello(tmp_path, FED, SPKI) == ""
    assert _granted(tmp_path) == SPKI
    assert take_hello(tmp_path, FED, None) == ""  # a later hello without a key revokes it
    assert _granted(tmp_path) is None
    take_hello(tmp_path, FED, SPKI)
    assert take_hello(tmp_path, FED, SPKI, left=True) == ""  # a party that left grants none
    assert not (tmp_path / RELAY_GRANT_FILE).exists()


def test_the_link_server_s_readers_follow_the_file_and_the_clock(tmp_path: Path) -> None:
    now = [time.time()]
    grants = RelayGrants(tmp_path, FED, clock=lambda: now[0])
    assert grants() == {}
    write_grant(tmp_path, FED, SPKI, ttl_s=30.0)
    assert grants() == {SPKI: RELAY_READER}
    now[0] += 31.0
    assert grants() == {}  # expired, with the same file


def _gossip(creds: LinkCredentials, address: str, cert: bytes) -> object:
    async def ask() -> object:
        dialer = LinkDialer(creds)
        try:
            return await dialer.request(
                address, cert, codec.encode({GOSSIP_KEY: b"\0" * 32}), timeout=10.0
            )
        except Exception as exc:  # the typed refusal is the result
            return exc
        finally:
            await dialer.close()

    return asyncio.run(ask())


def test_a_granted_relay_key_reads_states_and_nothing_else(tmp_path: Path) -> None:
    rs = records()
    creds = LinkCredentials.create(ident("a"), FED)
    server = DirectServer(
        BytesSource(ROUND, DIGEST, DATA),
        link=access("a", rs, creds),
        readers=RelayGrants(tmp_path, FED),
    )
    address = server.start()
    try:
        rs.add(endpoint_record(ident("a"), address, creds))
        pa = ident("a").party_id
        relay = relay_link(rs.policy, rs.view)  # a fresh key no charter party vouches for

        def read() -> object:
            got = fetch_ranges({}, {pa: [(0, 100, 4196)]}, server_round=ROUND, digest=DIGEST,
                               timeout_s=10.0, link=relay)[pa]  # fmt: skip
            return got.shards[0][1] if not got.error else got.exc

        assert isinstance(read(), NotMemberError)  # no grant: not a member, refused
        write_grant(tmp_path, FED, relay.creds.spki, ttl_s=60.0)
        assert read() == DATA[100:4196]
        shape = (len(DATA), 1 << 20, -(-len(DATA) // (1 << 20)))
        raw, why = fetch_manifest({}, pa, shape, server_round=ROUND, digest=DIGEST,
                                  timeout_s=10.0, link=relay)  # fmt: skip
        assert why == "" and raw
        refused = _gossip(relay.creds, address, creds.serve_cert_der)
        assert isinstance(refused, NotMemberError) and "no gossip" in str(refused)
        other = relay_link(rs.policy, rs.view)  # another run's key: not the granted one
        got = fetch_ranges({}, {pa: [(0, 0, 10)]}, server_round=ROUND, digest=DIGEST,
                           timeout_s=10.0, link=other)[pa]  # fmt: skip
        assert isinstance(got.exc, NotMemberError)
        write_grant(tmp_path, "another-fed", relay.creds.spki, ttl_s=60.0)
        assert isinstance(read(), NotMemberError)  # a grant for another federation
    finally:
        server.stop()
    assert server.refused.get("NotMemberError", 0) >= 1


def test_a_grant_of_a_member_s_key_leaves_that_member_itself(tmp_path: Path) -> None:
    # the relay knows every member's link key (endpoint records carry it): granting it must not
    # turn the member into a reader (no gossip, no standing); its binding decides
    rs = records()
    creds = LinkCredentials.create(ident("a"), FED)
    heard: list[str] = []

    def gossip(src: str, _value: dict[str, object]) -> bytes:
        heard.append(src)
        return codec.encode({"ok": True})

    server = DirectServer(BytesSource(ROUND, DIGEST, DATA), link=access("a", rs, creds),
                          gossip=gossip, readers=RelayGrants(tmp_path, FED))  # fmt: skip
    address = server.start()
    try:
        rs.add(endpoint_record(ident("a"), address, creds))
        member = LinkCredentials.create(ident("b"), FED)
        write_grant(tmp_path, FED, member.spki, ttl_s=60.0)
        assert _gossip(member, address, creds.serve_cert_der) == codec.encode({"ok": True})
        assert heard == [ident("b").party_id]  # served as b, not as the relay
        outsider = LinkCredentials.create(ident("d"), FED)  # a charter party, never joined
        write_grant(tmp_path, FED, outsider.spki, ttl_s=60.0)
        pa = ident("a").party_id
        got = fetch_ranges({}, {pa: [(0, 0, 10)]}, server_round=ROUND, digest=DIGEST,
                           timeout_s=10.0, link=access("d", rs, outsider))[pa]  # fmt: skip
        assert isinstance(got.exc, NotMemberError)  # the grant is no way in
    finally:
        server.stop()
