"""Signed endpoints on Flower and the party daemon's pieces: the endpoint a party announces,
the link credentials its processes share, and the view the daemon serves by.

The daemon itself, as a real process serving a joiner over mutual TLS, is tested end to end in
``test_flower_lib_join.py`` (``test_a_joiner_pulls_from_party_daemons_over_authenticated_links``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from chaos_flwr import codec
from chaos_flwr.charter import load_charter
from chaos_flwr.errors import ConfigError, DecodeError, PolicyError
from chaos_flwr.flower import durable
from chaos_flwr.flower.daemon import SavedView
from chaos_flwr.flower.keys import charter_path, key_path, make_federation
from chaos_flwr.flower.linkfile import LINK_FILE, link_credentials, read_link_file
from chaos_flwr.identity import Identity
from chaos_flwr.peer import Peer
from chaos_flwr.transport.tls import LinkCredentials


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_federation(tmp_path_factory.mktemp("fed"), 3, founders=2, seed="daemon")


def _founders(fed: Path) -> tuple[Peer, Peer]:
    """Two founders that exchanged their genesis records (both active)."""
    charter = load_charter(charter_path(fed))
    a = Peer(Identity.load(key_path(fed, 0)), charter, incarnation=1)
    b = Peer(Identity.load(key_path(fed, 1)), charter, incarnation=1)
    for out in a.bootstrap(1.0):
        b.handle(out.data, 1.0)
    for out in b.bootstrap(1.0):
        a.handle(out.data, 1.0)
    assert a.is_member and b.is_member
    return a, b


def test_an_endpoint_is_announced_once_superseded_by_a_change_and_converges(fed: Path) -> None:
    a, b = _founders(fed)
    creds = LinkCredentials.create(a.identity, a.policy.federation)
    out = a.announce_endpoint("10.77.0.3:9300", creds.serve_cert_der, 2.0)
    assert [o.to for o in out] == [b.party_id]
    for o in out:
        b.handle(o.data, 2.0)
    ep = b.view().endpoint(a.party_id)
    assert ep is not None and (ep.address, ep.seq, ep.cert) == (
        "10.77.0.3:9300",
        1,
        creds.serve_cert_der,
    )
    # the same endpoint again signs nothing; a new address (IPv6) supersedes it
    assert a.announce_endpoint("10.77.0.3:9300", creds.serve_cert_der, 3.0) == []
    for o in a.announce_endpoint("[2001:db8::1]:9300", creds.serve_cert_der, 3.0):
        b.handle(o.data, 3.0)
    ep = b.view().endpoint(a.party_id)
    assert ep is not None and (ep.host, ep.port, ep.seq) == ("2001:db8::1", 9300, 2)


def test_an_endpoint_needs_membership_and_a_well_formed_address(fed: Path) -> None:
    charter = load_charter(charter_path(fed))
    outsider = Peer(Identity.load(key_path(fed, 2)), charter, incarnation=1)
    creds = LinkCredentials.create(outsider.identity, outsider.policy.federation)
    with pytest.raises(PolicyError, match="not an active member"):
        outsider.announce_endpoint("10.0.0.1:1", creds.serve_cert_der, 1.0)
    a, _ = _founders(fed)
    for bad in ("10.0.0.1", "10.0.0.1:0", "224.0.0.1:80", "0.0.0.0:80"):
        with pytest.raises(DecodeError):
            a.announce_endpoint(bad, creds.serve_cert_der, 1.0)
    assert a.view().endpoint(a.party_id) is None


def test_link_credentials_are_made_once_private_and_shared(fed: Path, tmp_path: Path) -> None:
    ident = Identity.load(key_path(fed, 0))
    first = link_credentials(tmp_path, ident, "fed")
    assert stat.S_IMODE((tmp_path / LINK_FILE).stat().st_mode) == 0o600
    again = link_credentials(tmp_path, ident, "fed")  # another process of the same party
    assert again == first == read_link_file(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-link")]


def test_unusable_link_credentials_are_replaced(fed: Path, tmp_path: Path) -> None:
    ident, other = Identity.load(key_path(fed, 0)), Identity.load(key_path(fed, 1))
    theirs = link_credentials(tmp_path, other, "fed")
    mine = link_credentials(tmp_path, ident, "fed")  # another party's file: replaced
    assert mine.party_id == ident.party_id and mine != theirs
    assert link_credentials(tmp_path, ident, "other-fed").federation == "other-fed"
    # about to expire: a dialling process keeps using them (the daemon serves with them); the
    # serving process renews them, and everyone then reads the new ones
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=29, hours=12)
    stale = LinkCredentials.create(ident, "fed", now=old)
    (tmp_path / LINK_FILE).unlink()
    from chaos_flwr.flower import linkfile

    linkfile._publish(tmp_path, stale, replace=False)
    assert link_credentials(tmp_path, ident, "fed") == stale
    fresh = link_credentials(tmp_path, ident, "fed", renew=True)
    assert fresh != stale and read_link_file(tmp_path) == fresh
    assert link_credentials(tmp_path, ident, "fed") == fresh
    # expired: replaced by anyone
    dead = LinkCredentials.create(ident, "fed", now=old - datetime.timedelta(days=2))
    linkfile._publish(tmp_path, dead, replace=True)
    assert link_credentials(tmp_path, ident, "fed") not in (dead, fresh)
    # made before bindings carried their expiry (no peer accepts them): replaced by anyone
    from cryptography.hazmat.primitives import serialization
    from test_direct_links import _cert_with

    cur = link_credentials(tmp_path, ident, "fed")
    key = serialization.load_pem_private_key(cur.key_pem, password=None)
    legacy_binding = codec.encode({"party": ident.party_id, "sig": b"\x00" * 64})
    legacy = dataclasses.replace(cur, dial_cert_pem=_cert_with(legacy_binding, key, "v1"))
    linkfile._publish(tmp_path, legacy, replace=True)
    renewed = link_credentials(tmp_path, ident, "fed")
    assert renewed != legacy and read_link_file(tmp_path) == renewed
    # malformed: refused with a typed error on read, replaced when needed
    (tmp_path / LINK_FILE).write_bytes(b"\x00garbage")
    with pytest.raises(DecodeError):
        read_link_file(tmp_path)
    assert link_credentials(tmp_path, ident, "fed").party_id == ident.party_id
    # oversized: refused before it is read
    (tmp_path / LINK_FILE).write_bytes(b"x" * (linkfile.LINK_FILE_MAX_BYTES + 1))
    with pytest.raises(ConfigError, match="link credentials"):
        read_link_file(tmp_path)


def test_a_second_publisher_takes_the_first_ones_credentials(fed: Path, tmp_path: Path) -> None:
    from chaos_flwr.flower import linkfile

    ident = Identity.load(key_path(fed, 0))
    first = LinkCredentials.create(ident, "fed")
    linkfile._publish(tmp_path, first, replace=False)
    with pytest.raises(FileExistsError):  # never overwrites what another process published
        linkfile._publish(tmp_path, LinkCredentials.create(ident, "fed"), replace=False)
    assert link_credentials(tmp_path, ident, "fed") == first


def test_the_saved_view_follows_the_party_state_file(fed: Path, tmp_path: Path) -> None:
    a, b = _founders(fed)
    charter = load_charter(charter_path(fed))
    view = SavedView(tmp_path, a.identity, charter)
    assert view().active() == []  # nothing saved yet: nobody is served

    def save(peer: Peer) -> None:
        saved = durable.SavedParty(
            party_id=peer.party_id,
            lifetime="test",
            incarnation=peer.incarnation,
            seq=peer.seq,
            records=[r.to_wire() for r in peer.records],
            charter=peer.federation_tag,
        )
        durable.save(tmp_path, saved, seal=peer.identity.sign)

    save(a)
    assert view().active() == sorted([a.party_id, b.party_id])
    for o in b.leave(5.0):
        a.handle(o.data, 5.0)
    save(a)
    assert view().active() == [a.party_id]  # a member that left is refused from then on
    # a torn or foreign file leaves the last good view in force
    (tmp_path / durable.STATE_FILE).write_bytes(b"torn")
    assert view().active() == [a.party_id] and view.errors == 1
    save(b)  # sealed by another party's key: not this party's view
    assert view().active() == [a.party_id] and view.errors == 2


def test_the_party_command_refuses_bad_input_with_a_clear_message(
    fed: Path, tmp_path: Path
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "chaos_flwr.cli", "party", *args],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip

    base = ["--key", str(key_path(fed, 0)), "--charter", str(charter_path(fed))]
    got = run(*base, "--state-dir", str(tmp_path), "--listen", "127.0.0.1")
    assert got.returncode == 2 and "port" in got.stderr
    got = run("--key", str(tmp_path / "none.key"), "--charter", str(charter_path(fed)),
              "--state-dir", str(tmp_path), "--listen", "127.0.0.1:1")  # fmt: skip
    assert got.returncode == 2 and "none.key" in got.stderr
    bad = tmp_path / "charter.yaml"
    bad.write_text(charter_path(fed).read_text().replace("founders", "foundrs"))
    got = run("--key", str(key_path(fed, 0)), "--charter", str(bad), "--state-dir",
              str(tmp_path), "--listen", "127.0.0.1:1")  # fmt: skip
    assert got.returncode == 2 and "Invalid value" in got.stderr
