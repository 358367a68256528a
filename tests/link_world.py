"""A small federation for the authenticated direct-link tests, and the donor process they dial.

Parties come from seeds (tests only): founders ``a`` (the donor), ``b``, ``c``, ``e`` joined,
``d`` a charter party that never joined, ``x`` outside the charter. Run as a script, this module
is the donor: it serves ``DATA`` over an authenticated :class:`DirectServer` for party ``a``,
prints ``serving ADDR`` and ``endpoint HEX`` (its signed endpoint record), and on SIGTERM prints
``refused JSON`` (its refusals by error class) and exits 0.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from chaos_flwr import codec
from chaos_flwr.flower.direct import BytesSource, DirectServer, LinkAccess, LinkLimits, on_signals
from chaos_flwr.identity import Identity
from chaos_flwr.membership import Policy, Record, RecordSet, endpoint_body, join_body
from chaos_flwr.transport.shaping import Shaper, parse_profile
from chaos_flwr.transport.tls import LinkCredentials

FED = "link-fed"
CHARTER = ("a", "b", "c", "d", "e")
JOINED = ("a", "b", "c", "e")
ROUND = 3
DATA = hashlib.shake_256(b"link-world").digest(6 * 1024 * 1024)  # 6 MiB, above one reply
DIGEST = hashlib.sha256(DATA).digest()


def ident(name: str) -> Identity:
    """The identity of a named test party."""
    return Identity.from_seed(f"link-world/{name}", name)


def policy() -> Policy:
    """The federation's policy (charter parties ``a``..``e``; all but ``d`` are founders, so
    ``d`` is a member only once sponsored)."""
    keys = {ident(n).party_id: ident(n).public_key for n in CHARTER}
    founders = frozenset(ident(n).party_id for n in JOINED)
    return Policy(FED, keys, founders, sponsors_required=1, failure_quorum=2)


def records(extra: list[Record] | None = None) -> RecordSet:
    """A record set holding the joins of ``JOINED`` (and ``extra``)."""
    rs = RecordSet(policy())
    for n in JOINED:
        i = ident(n)
        rs.add(Record.sign(join_body(FED, i.party_id, 0, 0.0), [i]))
    for r in extra or []:
        rs.add(r)
    return rs


def endpoint_record(
    who: Identity, address: str, creds: LinkCredentials, *, seq: int = 1, inc: int = 0
) -> Record:
    """``who``'s signed endpoint record for ``address`` and ``creds``' serve certificate."""
    body = endpoint_body(FED, who.party_id, inc, seq, address, creds.serve_cert_der)
    return Record.sign(body, [who])


def access(name: str, rs: RecordSet, creds: LinkCredentials | None = None) -> LinkAccess:
    """``name``'s link access over the record set ``rs`` (fresh credentials by default)."""
    c = creds if creds is not None else LinkCredentials.create(ident(name), FED)
    return LinkAccess(c, rs.policy, rs.view)


def main(argv: list[str]) -> int:
    """The donor process (``argv[0]``: JSON of :class:`LinkLimits` fields; ``argv[1]``: an
    uplink in MB/s that paces its replies, optional)."""
    limits = LinkLimits(**json.loads(argv[0])) if argv else LinkLimits()
    shaper = None
    if len(argv) > 1:
        profile = parse_profile({"parties": {"a": {"up_mb_s": float(argv[1])}}})
        shaper = Shaper(profile, "a")
    me = ident("a")
    creds = LinkCredentials.create(me, FED)
    rs = records()
    view: Callable[[], Any] = rs.view
    link = LinkAccess(creds, rs.policy, view)
    server = DirectServer(
        BytesSource(ROUND, DIGEST, DATA), "127.0.0.1:0", link=link, limits=limits, shaper=shaper
    )
    address = server.start()
    own = endpoint_record(me, address, creds)
    rs.add(own)
    stop = threading.Event()
    restore = on_signals(stop, [signal.SIGTERM])
    print(f"serving {address}", flush=True)
    print(f"endpoint {codec.encode(own.to_wire()).hex()}", flush=True)
    try:
        stop.wait()
    finally:
        server.stop()
        restore()
    print(f"refused {json.dumps(server.refusals(), sort_keys=True)}", flush=True)
    carrier = server._carrier
    peak = getattr(carrier, "peak_concurrent", 0)
    print(f"served {server.requests_served} {server.bytes_served} {peak}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
