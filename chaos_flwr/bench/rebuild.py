"""Per-message cost of a party against the federation's age, as the deployment engine pays it.

Flower's deployment engine starts a ClientApp process for every message: the party is rebuilt
from its saved state (:func:`~chaos_flwr.flower.client.default_party_factory`), handles the
message and saves its state again. This benchmark signs ``n`` membership records for a party
(link flaps between two founders, each record signed as the protocol signs it) and saves it:
the record frontier keeps only the newest record of each link, so what is saved stays small
whatever ``n`` (the row's ``records`` says how many were saved; ``n`` was the saved count
before compaction). Then, in a **fresh Python process** per sample, it times:

* ``rebuild_s``: the factory build (identity, charter, saved state, peer, replica store);
* ``message_s``: the rebuild plus one relay message (:meth:`Party.process`) and the save that
  ends every message (:meth:`Party.persist`).

Each size is measured three ways: ``sealed`` (the party's own sealed file under its current
charter: records taken up without signature checks, see :mod:`chaos_flwr.flower.durable`),
``verified`` (the same file with its charter digest cleared, so every record is verified again,
as before sealed loads) and ``daemon``: the party daemon holds the party
(:mod:`chaos_flwr.flower.client.service`, served from this process) and the fresh process
sends it the relay message as a ``query.chaos`` ClientApp does
(:func:`~chaos_flwr.flower.client.service.daemon_reply`); its ``message_s`` is the whole
local call, the daemon's handling and save included, and its ``import_s`` what that process
imports (Flower's message types and the client side). Medians of ``repeats`` fresh processes
(the daemon's first call, which builds its party, is left out); the JSON names the load
average. Run: ``chaos-flwr bench rebuild --size 1000 --size 10000 --size 100000``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["measure_daemon_once", "measure_once", "prepare", "run"]

#: Record-set sizes measured by default.
BENCH_REBUILD_SIZES: tuple[int, ...] = (1_000, 10_000)
#: Fresh processes per figure (the median is reported).
BENCH_REBUILD_REPEATS: int = 3
#: Parties of the benchmark federation (all founders).
BENCH_REBUILD_PARTIES: int = 3
#: Seconds a measuring process may take before the benchmark gives up on it.
BENCH_REBUILD_TIMEOUT_S: float = 900.0


def _context(root: Path, partition: int) -> Any:
    from flwr.app import Context, RecordDict

    run_config = {"chaos-keys-dir": str(root / "fed"), "chaos-state-root": str(root / "state")}
    node_config = {"partition-id": partition, "num-partitions": BENCH_REBUILD_PARTIES}
    return Context(1, 100 + partition, node_config, RecordDict(), run_config)  # type: ignore[arg-type]


def prepare(root: Path, n: int) -> int:
    """Save party 0 of a new federation in ``root`` after signing about ``n`` records (the
    frontier keeps the newest per link: see the module docstring).

    The founders bootstrap; then link records between parties 0 and 1 are signed (``link_up``
    by both ends, ``link_down`` by one, epochs rising) until ``n`` records in all were signed.
    Returns the number of records saved (held after compaction).
    """
    from chaos_flwr.flower.client import default_party_factory
    from chaos_flwr.flower.keys import key_path, make_federation
    from chaos_flwr.identity import Identity
    from chaos_flwr.membership import Record, link_body

    keys = make_federation(root / "fed", BENCH_REBUILD_PARTIES, seed="bench-rebuild")
    party = default_party_factory(_context(root, 0))
    peer: Any = party.peer
    ends = [Identity.load(key_path(keys, i)) for i in (0, 1)]
    inc = {e.party_id: peer.incarnation if e.party_id == peer.party_id else 0 for e in ends}
    a, b = ((e.party_id, inc[e.party_id]) for e in ends)
    wire = []
    for epoch in range(1, max(n - len(peer.records), 0) + 1):
        kind = "link_up" if epoch % 2 else "link_down"
        signers = ends if kind == "link_up" else ends[:1]
        body = link_body(kind, peer.policy.federation, a, b, epoch)
        wire.append(Record.sign(body, signers).to_wire())
    peer.load_records(wire, time.time())  # verified once, as received
    party.persist()
    return len(peer.records)


def measure_once(root: Path) -> dict[str, float]:
    """Rebuild party 0 of ``root`` and handle one message (call in a fresh process)."""
    t0 = time.perf_counter()
    from flwr.app import ConfigRecord

    from chaos_flwr.flower.client import default_party_factory

    t1 = time.perf_counter()
    party = default_party_factory(_context(root, 0))
    t2 = time.perf_counter()
    party.process(ConfigRecord({"phase": "relay", "round": 1}), None)
    party.persist()
    t3 = time.perf_counter()
    checks = getattr(getattr(party.peer, "records", None), "cache", None)
    return {
        "import_s": t1 - t0,
        "rebuild_s": t2 - t1,
        "message_s": t3 - t1,
        "signature_checks": float(getattr(checks, "checks", -1)),
    }


def measure_daemon_once(root: Path) -> dict[str, float]:
    """Send party 0's daemon one relay message as its ClientApp would (call in a fresh
    process, with the daemon listening on the party's local socket)."""
    t0 = time.perf_counter()
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from chaos_flwr.flower.client.service import daemon_reply
    from chaos_flwr.flower.schema import CHAOS_RECORD_KEY

    t1 = time.perf_counter()
    context = _context(root, 0)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, context.node_id, 1
    content = RecordDict({CHAOS_RECORD_KEY: ConfigRecord({"phase": "relay", "round": 1})})
    message = Message(content, dst_node_id=context.node_id, message_type="query.chaos")
    reply = daemon_reply(message, context)
    t2 = time.perf_counter()
    if reply is None or CHAOS_RECORD_KEY not in reply.content:
        raise RuntimeError("the party daemon did not answer the relay message")
    return {"import_s": t1 - t0, "message_s": t2 - t1}


def _daemon_samples(root: Path, repeats: int) -> dict[str, float]:
    """:func:`measure_daemon_once` in fresh processes, with party 0's daemon served here."""
    from chaos_flwr.flower.client.service import PartyService
    from chaos_flwr.flower.keys import key_path
    from chaos_flwr.flower.local_socket import LOCAL_SOCKET_FILE, LocalServer
    from chaos_flwr.identity import Identity

    state_dir = root / "state" / "party-0"
    ident = Identity.load(key_path(root / "fed", 0))
    server = LocalServer(
        state_dir / LOCAL_SOCKET_FILE, PartyService(state_dir, str(ident.party_id))
    )
    server.start()
    try:
        samples = [_sample(root, daemon=True) for _ in range(repeats + 1)]
    finally:
        server.stop()
    return _medians(samples[1:])  # the first one built the daemon's party


def _unseal_charter(root: Path) -> None:
    """Clear the saved charter digest (re-sealed): the next rebuild verifies every record."""
    from chaos_flwr.flower import durable
    from chaos_flwr.flower.keys import key_path
    from chaos_flwr.identity import Identity

    ident = Identity.load(key_path(root / "fed", 0))
    state_dir = root / "state" / "party-0"
    saved = durable.load(state_dir, str(ident.party_id), seal=ident.sign)
    assert saved is not None
    durable.save(state_dir, dataclasses.replace(saved, charter=b""), seal=ident.sign)


def _sample(root: Path, *, unseal: bool = False, daemon: bool = False) -> dict[str, float]:
    if unseal:  # every message saves the digest again: clear it before each sample
        _unseal_charter(root)
    fn = "measure_daemon_once" if daemon else "measure_once"
    code = (
        "import json, sys; from pathlib import Path; from chaos_flwr.bench.rebuild import "
        f"{fn}; print(json.dumps({fn}(Path(sys.argv[1]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        check=True,
        capture_output=True,
        text=True,
        timeout=BENCH_REBUILD_TIMEOUT_S,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def run(sizes: tuple[int, ...], repeats: int, work: Path) -> dict[str, Any]:
    """Measure every size, sealed then verified; the JSON-ready figures."""
    rows = []
    for n in sizes:
        root = work / f"n{n}"
        t0 = time.perf_counter()
        held = prepare(root, n)
        setup_s = time.perf_counter() - t0
        size = (root / "state" / "party-0" / "party.state").stat().st_size
        sealed = _medians([_sample(root) for _ in range(repeats)])
        verified = _medians([_sample(root, unseal=True) for _ in range(repeats)])
        daemon = _daemon_samples(root, repeats)
        rows.append(
            {
                "records": held,
                "state_bytes": size,
                "setup_s": setup_s,
                "sealed": sealed,
                "verified": verified,
                "daemon": daemon,
                "daemon_vs_sealed": daemon["message_s"] / sealed["message_s"],
            }
        )
    return {
        "bench": "party-rebuild",
        "repeats": repeats,
        "statistic": "median",
        "loadavg": list(os.getloadavg()),
        "rows": rows,
    }
