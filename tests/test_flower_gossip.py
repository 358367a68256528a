"""Gossip over direct links between real party daemons, with the ServerApp down.

Four founders train two rounds with their daemons (``chaos-flwr party``, real processes) and
sign their endpoints; then the ServerApp is gone. One party leaves (its ClientApp signs the
leave; no relay carries it) and another one's daemon is SIGKILLed. The other daemons learn the
leave by gossip, suspect the killed daemon, vote, and hold the fail record at quorum; each
party's next ClientApp message takes up what its daemon heard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_flower_lib_join import World, _initial, free_ports

from chaos_flwr.flower.gossipfile import GOSSIP_FILE, read_heard
from chaos_flwr.flower.keys import charter_path, key_path
from chaos_flwr.membership import ACTIVE, FAILED, LEFT

#: Gossip rounds of the daemons here, and the silence after which they suspect a daemon.
INTERVAL_S = 0.3
SUSPECT_S = 3.0
#: Bound of every wait below.
WAIT_S = 30.0


@pytest.fixture(autouse=True)
def _flower_env(flower_env: Path) -> None:
    """Every test here runs Flower offline with a private FLWR_HOME (tests/conftest.py)."""


def _daemon(w: World, partition: int, addr: str) -> subprocess.Popen[str]:
    log = (w.state_root.parent / f"daemon-{partition}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos_flwr.cli", "party", "--key",
         str(key_path(w.keys, partition)), "--charter", str(charter_path(w.keys)),
         "--state-dir", str(w.state_root / f"party-{partition}"), "--listen", addr,
         "--gossip-interval-s", str(INTERVAL_S), "--suspect-s", str(SUSPECT_S)],
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith(f"serving {addr} as {w.pid(partition)}"), line
    return proc


def _until(what: str, check: Callable[[], bool]) -> None:
    end = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < end, f"not within {WAIT_S} s: {what}"
        time.sleep(0.2)


def _heard(w: World, partition: int) -> dict[str, Any]:
    """The records party ``partition``'s daemon wrote, by (kind, subject)."""
    path = w.state_root / f"party-{partition}"
    if not (path / GOSSIP_FILE).exists():
        return {}
    return {(r.kind, r.subject): r for r in read_heard(path)}


def _log(w: World, partition: int) -> str:
    return (w.state_root.parent / f"daemon-{partition}.log").read_text()


def _endpoints(w: World, partition: int) -> set[str]:
    """Parties whose endpoint party ``partition``'s daemon holds (its saved records and what
    it heard)."""
    from chaos_flwr.flower.durable import load
    from chaos_flwr.identity import Identity
    from chaos_flwr.membership import Record

    path = w.state_root / f"party-{partition}"
    ident = Identity.load(key_path(w.keys, partition))
    saved = load(path, str(ident.party_id), seal=ident.sign)
    records = [Record.from_wire(r) for r in (saved.records if saved else [])]
    heard = list(_heard(w, partition).values())
    return {r.subject for r in records + heard if r.kind == "endpoint"}


def test_with_the_server_down_a_leave_converges_and_a_crash_is_declared_by_gossip(
    tmp_path: Path,
) -> None:
    w = World(tmp_path, 4, founders=4)
    addrs = {p: f"127.0.0.1:{port}" for p, port in enumerate(free_ports(4))}
    daemons = {p: _daemon(w, p, a) for p, a in addrs.items()}
    outs: dict[int, str] = {}
    try:
        for p in range(4):
            w.add(p, **{"chaos-direct-addr": addrs[p]})
        strategy = w.strategy()
        strategy.start(w.grid, _initial(), num_rounds=2, timeout=10)
        assert strategy.rounds[-1].server_round == 2
        # the ServerApp is gone from here on: nothing is relayed any more, and the relay may
        # not have told every party every endpoint; the daemons tell each other
        leaver, crashed, live = w.pid(3), w.pid(2), (0, 1)
        _until("every daemon knows every endpoint", lambda: all(
            _endpoints(w, p) == {w.pid(q) for q in range(4)} for p in range(4)))  # fmt: skip
        _until("the live daemons gossiped with the one that will crash", lambda: all(
            f"gossiping with {crashed}" in _log(w, p) for p in live))  # fmt: skip
        party3 = w.party(3)
        party3.leave()
        party3.persist()  # its leave is in its own state only
        daemons[2].kill()  # a crash: no leave, no goodbye
        daemons[2].wait(timeout=10)
        _until("the leave reached the live daemons", lambda: all(
            ("leave", leaver) in _heard(w, p) for p in live))  # fmt: skip
        _until("the live daemons declared the crashed one failed", lambda: all(
            ("fail", crashed) in _heard(w, p) for p in live))  # fmt: skip
        fail = _heard(w, 0)[("fail", crashed)]
        assert set(fail.signatures) == {w.pid(0), w.pid(1)}  # the quorum of 2 suspecting parties
        # each live party's next ClientApp message takes up what its daemon heard
        for p in live:
            party = w.party(p)
            party.process(None, None)
            view = party.peer.view()  # type: ignore[union-attr]
            assert view.members[leaver].status == LEFT
            assert view.members[crashed].status == FAILED
            assert view.members[w.pid(1 - p)].status == ACTIVE
            assert not [e for e in party.errors if "gossip" in e], party.errors
    finally:
        for p, proc in daemons.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            outs[p] = proc.communicate(timeout=20)[0]
    for p in (0, 1):
        assert daemons[p].returncode == 0
        assert "gossip: " in outs[p] and " answered" in outs[p]
        taken = int(outs[p].split("answered, ")[1].split(" taken")[0])
        # at least the leave (a vote can also come pushed in a request, which "answered" counts)
        assert taken >= 1, outs[p]
        # the run's protocol messages to this party went to its daemon (its local socket)
        assert int(outs[p].split("local socket: ")[1].split(" ")[0]) >= 1, outs[p]
