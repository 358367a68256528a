"""Real kernel links: two network namespaces joined by a veth pair, shaped with ``tc tbf``.

:func:`veth_pair` creates namespaces ``<name>a`` and ``<name>b``, a veth pair between them with
link-local addresses (``169.254.<k>.1`` and ``.2``, which exist only inside the two namespaces),
and optionally a ``tbf`` root qdisc on either side's egress. On exit, normal or by error, it
deletes both namespaces (which removes the veth pair and its qdiscs) and any half-made link.

Only bandwidth is shaped. ``netem`` is not available here, so the kernel links add no latency of
their own; a benchmark that needs WAN latency over netns links adds it in the application (the
:class:`~chaos_flwr.transport.shaping.Shaper` with no rates, only delays) and says so.

Needs root and the ``ip`` and ``tc`` programs; otherwise :class:`~chaos_flwr.errors.NetnsError`
says which is missing.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..defaults import (
    NETNS_COMMAND_TIMEOUT_S,
    NETNS_NOTSENT_LOWAT_BYTES,
    NETNS_STAR_LIMIT_BYTES,
    NETNS_STAR_MTU,
    NETNS_TBF_BURST_BYTES,
    NETNS_TBF_BURST_S,
    NETNS_TBF_LIMIT_BYTES,
)
from ..errors import NetnsError

__all__ = [
    "LAN_MTU",
    "LAN_SUBNET",
    "TCP_WIRE_FACTOR",
    "NetnsLan",
    "NetnsPair",
    "NetnsStar",
    "check_netns_available",
    "lan",
    "lan_prefix",
    "link_counters",
    "measure_tcp_rate",
    "namespaces",
    "run_cmd",
    "star",
    "tcp_wire_factor",
    "veth_pair",
    "wire_rate_bit_s",
]

_counter = itertools.count()

#: Default address range of a :func:`lan`: private, and present only inside its namespaces.
LAN_SUBNET = "10.77.0.0/24"
#: Default MTU of a :func:`lan` (an Ethernet WAN access link's).
LAN_MTU = 1500
#: Most hosts one :func:`lan` may have.
LAN_MAX_HOSTS = 200


def check_netns_available() -> None:
    """Raise :class:`NetnsError` unless this process is root and ``ip`` and ``tc`` exist."""
    if os.geteuid() != 0:
        raise NetnsError("netns mode needs root (network namespaces and tc); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsError(f"netns mode needs the {tool!r} program (iproute2); install it")


def run_cmd(argv: Sequence[str]) -> str:
    """Run one ``ip``/``tc`` command; :class:`NetnsError` with its stderr if it fails."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=NETNS_COMMAND_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NetnsError(f"{' '.join(argv)}: {err}") from None
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class NetnsPair:
    """Two namespaces joined by a veth pair (see :func:`veth_pair`)."""

    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str

    def exec_argv(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def shape(
        self,
        side: str,
        rate_bit_s: int,
        *,
        burst_bytes: int = NETNS_TBF_BURST_BYTES,
        limit_bytes: int = NETNS_TBF_LIMIT_BYTES,
    ) -> None:
        """Put (or replace) a ``tbf`` root qdisc on the egress of side ``"a"`` or ``"b"``."""
        if side not in ("a", "b"):
            raise NetnsError(f"side: must be 'a' or 'b', got {side!r}")
        if rate_bit_s <= 0:
            raise NetnsError(f"rate_bit_s: must be > 0, got {rate_bit_s}")
        ns, dev = (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)
        run_cmd(
            [
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{int(rate_bit_s)}bit", "burst", str(int(burst_bytes)),
                "limit", str(int(limit_bytes)),
            ]
        )  # fmt: skip

    def qdiscs(self, side: str) -> str:
        """``tc qdisc show`` of one side's device (for checks and reports)."""
        ns, dev = (self.ns_a, self.dev_a) if side == "a" else (self.ns_b, self.dev_b)
        return run_cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev])


def _namespaces() -> set[str]:
    out = run_cmd(["ip", "netns", "list"])
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@contextmanager
def veth_pair(
    *,
    name: str | None = None,
    rate_a_bit_s: int | None = None,
    rate_b_bit_s: int | None = None,
) -> Iterator[NetnsPair]:
    """Create two namespaces and a veth pair; delete everything on exit.

    Parameters
    ----------
    name : str or None, optional
        Prefix of the namespace and device names (at most 10 characters); default derived from
        the pid and a counter.
    rate_a_bit_s, rate_b_bit_s : int or None, optional
        ``tbf`` rates of each side's egress in bit/s (``None`` = unshaped).

    Raises
    ------
    NetnsError
        Not root, ``ip``/``tc`` missing, or a command failed (cleanup still runs).
    """
    check_netns_available()
    k = next(_counter)
    base = name or f"cf{os.getpid() % 100000}{k}"
    if len(base) > 10:
        raise NetnsError(f"name: at most 10 characters (device names are short), got {base!r}")
    octet = 1 + (os.getpid() + k) % 250
    pair = NetnsPair(
        ns_a=f"{base}a",
        ns_b=f"{base}b",
        dev_a=f"{base}va",
        dev_b=f"{base}vb",
        addr_a=f"169.254.{octet}.1",
        addr_b=f"169.254.{octet}.2",
    )
    try:
        run_cmd(["ip", "netns", "add", pair.ns_a])
        run_cmd(["ip", "netns", "add", pair.ns_b])
        run_cmd(["ip", "link", "add", pair.dev_a, "type", "veth", "peer", "name", pair.dev_b])
        run_cmd(["ip", "link", "set", pair.dev_a, "netns", pair.ns_a])
        run_cmd(["ip", "link", "set", pair.dev_b, "netns", pair.ns_b])
        sides = ((pair.ns_a, pair.dev_a, pair.addr_a), (pair.ns_b, pair.dev_b, pair.addr_b))
        for ns, dev, addr in sides:
            run_cmd(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
            run_cmd(["ip", "-n", ns, "link", "set", dev, "up"])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        if rate_a_bit_s is not None:
            pair.shape("a", rate_a_bit_s)
        if rate_b_bit_s is not None:
            pair.shape("b", rate_b_bit_s)
        yield pair
    finally:
        # a veth left in the root namespace (failure before the move) is removed too
        _remove_netns((pair.ns_a, pair.ns_b), (pair.dev_a, pair.dev_b))


_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
first = None; n = 0; n_first = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    if first is None: first = time.monotonic(); n_first = len(b)
    n += len(b)
end = time.monotonic()
print(n, n - n_first, end - (first or end), flush=True)
"""

_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
left = int(sys.argv[3]); buf = b"\0" * (1 << 16)
while left > 0:
    k = min(left, len(buf)); c.sendall(buf[:k]); left -= k
c.shutdown(socket.SHUT_WR); c.close()
"""


def measure_tcp_rate(
    pair: NetnsPair, nbytes: int, *, port: int = 45001, timeout_s: float = 30.0
) -> tuple[int, float]:
    """Send ``nbytes`` over TCP from side a to side b; return (bytes received, bytes/s).

    The rate is measured at the receiver from the first to the last byte (connection setup and
    the first read are excluded). Both ends are child processes stopped by pid on exit.
    """
    recv_argv = [sys.executable, "-c", _RECEIVER, pair.addr_b, str(port), str(timeout_s)]
    send_argv = [sys.executable, "-c", _SENDER, pair.addr_b, str(port), str(nbytes), str(timeout_s)]
    recv = subprocess.Popen(
        pair.exec_argv(pair.ns_b, recv_argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None
        line = recv.stdout.readline()
        if line.strip() != "ready":
            raise NetnsError(f"TCP receiver in {pair.ns_b} did not start: {line!r}")
        t0 = time.monotonic()
        send = subprocess.run(
            pair.exec_argv(pair.ns_a, send_argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if send.returncode != 0:
            raise NetnsError(f"TCP sender in {pair.ns_a} failed: {send.stderr.strip()}")
        out, err = recv.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        fields = out.split()
        if recv.returncode != 0 or len(fields) != 3:
            raise NetnsError(f"TCP receiver in {pair.ns_b} failed: {err.strip()}")
        total, timed, seconds = int(fields[0]), int(fields[1]), float(fields[2])
        return total, (timed / seconds if seconds > 0 else float("inf"))
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(timeout=5)


def tcp_wire_factor(mtu: int = 1500) -> float:
    """Wire bytes per TCP payload byte on a veth of ``mtu`` (``tbf`` counts wire bytes).

    A full frame is ``mtu + 14`` bytes (Ethernet header) and carries ``mtu - 52`` payload bytes
    (IPv4 20, TCP 20, timestamps 12): 1514/1448 at MTU 1500.
    """
    return (mtu + 14) / (mtu - 52)


#: :func:`tcp_wire_factor` at MTU 1500.
TCP_WIRE_FACTOR = tcp_wire_factor(1500)


def wire_rate_bit_s(goodput_bytes_s: float, mtu: int = 1500) -> int:
    """The ``tbf`` rate (bit/s) whose TCP payload rate is ``goodput_bytes_s`` bytes/s."""
    return math.ceil(goodput_bytes_s * 8 * tcp_wire_factor(mtu))


def _burst_for(rate_bit_s: int, mtu: int) -> tuple[int, int]:
    # the bucket must hold a whole frame (tbf drops a packet larger than its bucket)
    burst = max(NETNS_TBF_BURST_BYTES, int(rate_bit_s / 8 * NETNS_TBF_BURST_S), 2 * (mtu + 14))
    return burst, max(NETNS_STAR_LIMIT_BYTES, 4 * burst)


def _tbf(ns: str | None, dev: str, rate_bit_s: int, mtu: int) -> None:
    if rate_bit_s <= 0:
        raise NetnsError(f"rate_bit_s: must be > 0, got {rate_bit_s} (device {dev})")
    burst, limit = _burst_for(rate_bit_s, mtu)
    prefix = [] if ns is None else ["ip", "netns", "exec", ns]
    run_cmd(
        [
            *prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{int(rate_bit_s)}bit", "burst", str(burst), "limit", str(limit),
        ]
    )  # fmt: skip


@dataclass(frozen=True)
class NetnsStar:
    """Donor namespaces on one bridge, reached from the root namespace (see :func:`star`).

    Attributes
    ----------
    hub : str
        The namespace holding the bridge.
    namespaces : dict
        Donor name -> its namespace.
    addresses : dict
        Donor name -> its address inside its namespace (where its server binds).
    joiner_address : str
        The root namespace's address on the bridge (the joiner's end).
    rates_bit_s : dict
        Donor name -> ``tbf`` rate of its egress toward the bridge, bit/s.
    joiner_down_bit_s, joiner_up_bit_s : int or None
        ``tbf`` rates of the bridge -> joiner and joiner -> bridge directions (``None`` = none).
    mtu : int
        MTU of every veth and the bridge.
    """

    hub: str
    namespaces: dict[str, str]
    addresses: dict[str, str]
    devices: dict[str, str]
    joiner_address: str
    joiner_device: str
    rates_bit_s: dict[str, int]
    joiner_down_bit_s: int | None
    joiner_up_bit_s: int | None
    mtu: int

    def exec_argv(self, donor: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``donor``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[donor], *argv]

    def qdiscs(self, donor: str) -> str:
        """``tc qdisc show`` of ``donor``'s device."""
        ns = self.namespaces[donor]
        dev = self.devices[donor]
        return run_cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev])


@contextmanager
def star(
    donor_rates_bit_s: Mapping[str, int],
    *,
    joiner_down_bit_s: int | None = None,
    joiner_up_bit_s: int | None = None,
    name: str | None = None,
    mtu: int = NETNS_STAR_MTU,
) -> Iterator[NetnsStar]:
    """One namespace per donor, all on a bridge in a hub namespace, joined to the root namespace.

    Donor ``i`` gets a veth pair: one end (address ``169.254.<o>.<i+2>/24``) in its own
    namespace, shaped with ``tbf`` at its rate on egress (donor -> joiner), the other end a port
    of the bridge. The root namespace (the joiner) has one veth end on the bridge with address
    ``169.254.<o>.1``; the bridge side of that pair is shaped at ``joiner_down_bit_s`` (every
    donor's traffic to the joiner passes it: the joiner's downlink), the root side at
    ``joiner_up_bit_s``. On exit, normal or by error, every namespace is deleted (which removes
    the veths, the bridge and the qdiscs) and a veth left in the root namespace is removed.

    Parameters
    ----------
    donor_rates_bit_s : Mapping[str, int]
        Donor name -> uplink rate in bit/s (1 to 200 donors).
    joiner_down_bit_s, joiner_up_bit_s : int or None, optional
        The joiner's downlink and uplink rates in bit/s (``None`` = unshaped).
    name : str or None, optional
        Prefix of the names (at most 6 characters); default from the pid and a counter.
    mtu : int, optional
        MTU of the veths and the bridge (576 to 65535).

    Raises
    ------
    NetnsError
        Not root, tools missing, a bad rate, or a command failed (cleanup still runs).
    """
    check_netns_available()
    topo, base = _star_topology(donor_rates_bit_s, joiner_down_bit_s, joiner_up_bit_s, name, mtu)
    made_ns: list[str] = []
    root_devs = [topo.joiner_device, f"{base}jb", *(f"{dv}b" for dv in topo.devices.values())]
    try:
        _build_star(topo, base, made_ns)
        yield topo
    finally:
        _remove_netns(reversed(made_ns), root_devs)


def _star_topology(
    donor_rates_bit_s: Mapping[str, int],
    joiner_down_bit_s: int | None,
    joiner_up_bit_s: int | None,
    name: str | None,
    mtu: int,
) -> tuple[NetnsStar, str]:
    """Check :func:`star`'s arguments and name its namespaces, devices and addresses.

    Returns the topology and the prefix of its names.
    """
    if not 576 <= mtu <= 65535:
        raise NetnsError(f"mtu: give 576 to 65535, got {mtu}")
    if not 1 <= len(donor_rates_bit_s) <= 200:
        raise NetnsError(f"donor_rates_bit_s: give 1 to 200 donors, got {len(donor_rates_bit_s)}")
    k = next(_counter)
    base = name or f"s{os.getpid() % 1000}{k % 100}"
    if len(base) > 6:
        raise NetnsError(f"name: at most 6 characters (device names are short), got {base!r}")
    octet = 1 + (os.getpid() * 7 + k) % 250
    donors = list(donor_rates_bit_s)
    topo = NetnsStar(
        hub=f"{base}hub",
        namespaces={d: f"{base}d{i}" for i, d in enumerate(donors)},
        addresses={d: f"169.254.{octet}.{i + 2}" for i, d in enumerate(donors)},
        devices={d: f"{base}d{i}v" for i, d in enumerate(donors)},
        joiner_address=f"169.254.{octet}.1",
        joiner_device=f"{base}jv",
        rates_bit_s={d: int(r) for d, r in donor_rates_bit_s.items()},
        joiner_down_bit_s=joiner_down_bit_s,
        joiner_up_bit_s=joiner_up_bit_s,
        mtu=mtu,
    )
    return topo, base


def _build_star(topo: NetnsStar, base: str, made_ns: list[str]) -> None:
    """Create the hub, the joiner's veth and each donor's namespace, appending to ``made_ns``."""
    hub, mtu = topo.hub, topo.mtu
    run_cmd(["ip", "netns", "add", hub])
    made_ns.append(hub)
    run_cmd(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
    run_cmd(["ip", "-n", hub, "link", "set", "br0", "mtu", str(mtu), "up"])
    # the joiner's end: root namespace <-> bridge
    run_cmd(["ip", "link", "add", topo.joiner_device, "type", "veth", "peer", "name",
             f"{base}jb"])  # fmt: skip
    run_cmd(["ip", "link", "set", f"{base}jb", "netns", hub])
    run_cmd(["ip", "-n", hub, "link", "set", f"{base}jb", "mtu", str(mtu), "master", "br0",
             "up"])  # fmt: skip
    run_cmd(["ip", "addr", "add", f"{topo.joiner_address}/24", "dev", topo.joiner_device])
    run_cmd(["ip", "link", "set", topo.joiner_device, "mtu", str(mtu), "up"])
    if topo.joiner_down_bit_s is not None:
        _tbf(hub, f"{base}jb", topo.joiner_down_bit_s, mtu)
    if topo.joiner_up_bit_s is not None:
        _tbf(None, topo.joiner_device, topo.joiner_up_bit_s, mtu)
    for d in topo.namespaces:
        ns, dev = topo.namespaces[d], topo.devices[d]
        _attach_to_bridge(hub, ns, dev, f"{dev}b", f"{topo.addresses[d]}/24", mtu, made_ns)
        # a donor's socket holds at most this much unsent data (else seconds of replies
        # sit in its send buffer ahead of the link, past any cancel or re-plan)
        run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                 f"net.ipv4.tcp_notsent_lowat={NETNS_NOTSENT_LOWAT_BYTES}"])  # fmt: skip
        _tbf(ns, dev, topo.rates_bit_s[d], mtu)


def _attach_to_bridge(
    hub: str, ns: str, dev: str, port: str, cidr: str, mtu: int, made_ns: list[str]
) -> None:
    """Create namespace ``ns`` (appended to ``made_ns``) with veth ``dev`` at ``cidr``, whose
    peer ``port`` is a port of bridge ``br0`` in namespace ``hub``; both ends up, ``lo`` up."""
    run_cmd(["ip", "netns", "add", ns])
    made_ns.append(ns)
    run_cmd(["ip", "link", "add", dev, "type", "veth", "peer", "name", port])
    run_cmd(["ip", "link", "set", dev, "netns", ns])
    run_cmd(["ip", "link", "set", port, "netns", hub])
    run_cmd(["ip", "-n", hub, "link", "set", port, "mtu", str(mtu), "master", "br0", "up"])
    run_cmd(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])
    run_cmd(["ip", "-n", ns, "link", "set", dev, "mtu", str(mtu), "up"])
    run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])


def _remove_netns(namespaces: Iterable[str], root_devs: Iterable[str]) -> None:
    """Delete ``namespaces`` (in order, those that exist) and ``root_devs`` left in the root.

    Every deletion is tried; a failed namespace deletion raises once all have been tried.
    """
    errors: list[str] = []
    present = _namespaces()
    for ns in namespaces:
        if ns in present:
            try:
                run_cmd(["ip", "netns", "del", ns])
            except NetnsError as err:
                errors.append(str(err))
    for dev in root_devs:
        probe = subprocess.run(
            ["ip", "link", "show", dev], capture_output=True, check=False, timeout=10
        )
        if probe.returncode == 0:
            subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
    if errors:
        raise NetnsError("cleanup failed: " + "; ".join(errors))


def lan_prefix() -> str:
    """The prefix of the names of the LANs this process builds (:func:`lan` without ``name``):
    fixed width, so another process's prefix is never a prefix of it (``t12`` of ``t123``)."""
    return f"t{os.getpid() % 1000:03d}"


def namespaces() -> set[str]:
    """Names of the network namespaces that exist now (``ip netns list``)."""
    return _namespaces()


def link_counters(ns: str | None, dev: str) -> dict[str, int]:
    """Bytes and packets a device sent and received: ``tx_bytes``, ``rx_bytes``, ``tx_packets``,
    ``rx_packets`` (from ``ip -s -j link``, run in namespace ``ns``; ``None`` = this one)."""
    prefix = [] if ns is None else ["-n", ns]
    out = run_cmd(["ip", *prefix, "-s", "-j", "link", "show", "dev", dev])
    try:
        stats = json.loads(out)[0]["stats64"]
        return {
            "tx_bytes": int(stats["tx"]["bytes"]),
            "rx_bytes": int(stats["rx"]["bytes"]),
            "tx_packets": int(stats["tx"]["packets"]),
            "rx_packets": int(stats["rx"]["packets"]),
        }
    except (ValueError, LookupError, TypeError) as err:
        raise NetnsError(f"ip -s -j link show dev {dev}: unexpected output ({err})") from None


@dataclass(frozen=True)
class NetnsLan:
    """Hosts, each in its own namespace, on one bridge in a hub namespace (see :func:`lan`).

    Attributes
    ----------
    hub : str
        The namespace holding the bridge ``br0``.
    namespaces : dict
        Host name -> its namespace.
    addresses : dict
        Host name -> its address on the bridge.
    devices : dict
        Host name -> its veth end inside its namespace (the host's interface).
    ports : dict
        Host name -> the peer veth end, a bridge port in the hub.
    up_bit_s, down_bit_s : dict
        Host name -> ``tbf`` rate of its uplink (egress of its interface) and downlink (egress
        of its bridge port), bit/s; ``None`` = unshaped.
    mtu : int
        MTU of every veth and the bridge.
    """

    hub: str
    namespaces: dict[str, str]
    addresses: dict[str, str]
    devices: dict[str, str]
    ports: dict[str, str]
    up_bit_s: dict[str, int | None]
    down_bit_s: dict[str, int | None]
    mtu: int

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def qdiscs(self, host: str) -> dict[str, str]:
        """``tc -s qdisc show`` (with the bytes each qdisc sent) of ``host``'s link:
        ``{"up": ..., "down": ...}`` (its interface and its bridge port)."""
        ns, dev, port = self.namespaces[host], self.devices[host], self.ports[host]
        show = ["tc", "-s", "qdisc", "show", "dev"]
        return {
            "up": run_cmd(["ip", "netns", "exec", ns, *show, dev]),
            "down": run_cmd(["ip", "netns", "exec", self.hub, *show, port]),
        }

    def pair(self, src: str, dst: str) -> NetnsPair:
        """Hosts ``src`` (side a) and ``dst`` (side b) as a :class:`NetnsPair`, e.g. for
        :func:`measure_tcp_rate` across the bridge."""
        return NetnsPair(
            ns_a=self.namespaces[src],
            ns_b=self.namespaces[dst],
            dev_a=self.devices[src],
            dev_b=self.devices[dst],
            addr_a=self.addresses[src],
            addr_b=self.addresses[dst],
        )

    def counters(self, host: str) -> dict[str, int]:
        """:func:`link_counters` of ``host``'s interface (inside its namespace)."""
        return link_counters(self.namespaces[host], self.devices[host])


@contextmanager
def lan(
    hosts: Mapping[str, tuple[int | None, int | None]],
    *,
    subnet: str = LAN_SUBNET,
    name: str | None = None,
    mtu: int = LAN_MTU,
) -> Iterator[NetnsLan]:
    """Hosts in namespaces of their own on a bridge, each access link shaped both ways.

    Host ``i`` (in the order given) gets namespace ``<name>h<i>`` and a veth pair: one end, with
    the ``i + 1``-th address of ``subnet``, in its namespace (its uplink: ``tbf`` on that end's
    egress), the other a port of bridge ``br0`` in the hub namespace ``<name>hub`` (its downlink:
    ``tbf`` on that port's egress). Nothing is added to the root namespace, so the addresses
    exist only inside the namespaces. On exit, normal or by error, every namespace is deleted
    (with its veths, bridge and qdiscs) and a veth left in the root namespace is removed.
    Processes still running inside the namespaces must be stopped before (the caller's job).

    Parameters
    ----------
    hosts : Mapping[str, tuple]
        Host name -> (uplink, downlink) rates in bit/s (``None`` = unshaped), 1 to
        :data:`LAN_MAX_HOSTS` hosts.
    subnet : str, optional
        IPv4 network of the bridge (a private range such as the default ``10.77.0.0/24``).
    name : str or None, optional
        Prefix of the names (at most 8 characters); default from the pid and a counter.
    mtu : int, optional
        MTU of the veths and the bridge (576 to 65535).

    Raises
    ------
    NetnsError
        Not root, tools missing, a bad argument, or a command failed (cleanup still runs).
    """
    check_netns_available()
    topo = _lan_topology(hosts, subnet, name, mtu)
    made_ns: list[str] = []
    root_devs = [*topo.devices.values(), *topo.ports.values()]
    try:
        run_cmd(["ip", "netns", "add", topo.hub])
        made_ns.append(topo.hub)
        run_cmd(["ip", "-n", topo.hub, "link", "add", "br0", "type", "bridge"])
        run_cmd(["ip", "-n", topo.hub, "link", "set", "br0", "mtu", str(mtu), "up"])
        prefix = ipaddress.ip_network(subnet).prefixlen
        for h, ns in topo.namespaces.items():
            dev, port = topo.devices[h], topo.ports[h]
            cidr = f"{topo.addresses[h]}/{prefix}"
            _attach_to_bridge(topo.hub, ns, dev, port, cidr, mtu, made_ns)
            if topo.up_bit_s[h] is not None:
                _tbf(ns, dev, int(topo.up_bit_s[h] or 0), mtu)
            if topo.down_bit_s[h] is not None:
                _tbf(topo.hub, port, int(topo.down_bit_s[h] or 0), mtu)
        yield topo
    finally:
        _remove_netns(reversed(made_ns), root_devs)


def _lan_topology(
    hosts: Mapping[str, tuple[int | None, int | None]],
    subnet: str,
    name: str | None,
    mtu: int,
) -> NetnsLan:
    """Check :func:`lan`'s arguments and name its namespaces, devices and addresses."""
    if not 576 <= mtu <= 65535:
        raise NetnsError(f"mtu: give 576 to 65535, got {mtu}")
    if not 1 <= len(hosts) <= LAN_MAX_HOSTS:
        raise NetnsError(f"hosts: give 1 to {LAN_MAX_HOSTS} hosts, got {len(hosts)}")
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as err:
        raise NetnsError(f"subnet: not an IPv4 network ({err}), e.g. {LAN_SUBNET}") from None
    if not net.is_private or net.num_addresses - 2 < len(hosts):
        raise NetnsError(f"subnet: {subnet} must be private with room for {len(hosts)} hosts")
    for h, (up, down) in hosts.items():
        for what, rate in (("uplink", up), ("downlink", down)):
            if rate is not None and rate <= 0:
                raise NetnsError(f"hosts.{h}: {what} rate must be > 0 bit/s, got {rate}")
    k = next(_counter)
    base = name or f"{lan_prefix()}{k % 100:02d}"
    if len(base) > 8:
        raise NetnsError(f"name: at most 8 characters (device names are short), got {base!r}")
    addrs = list(itertools.islice(net.hosts(), len(hosts)))
    order = list(hosts)
    return NetnsLan(
        hub=f"{base}hub",
        namespaces={h: f"{base}h{i}" for i, h in enumerate(order)},
        addresses={h: str(addrs[i]) for i, h in enumerate(order)},
        devices={h: f"{base}h{i}v" for i, h in enumerate(order)},
        ports={h: f"{base}h{i}p" for i, h in enumerate(order)},
        up_bit_s={h: hosts[h][0] for h in order},
        down_bit_s={h: hosts[h][1] for h in order},
        mtu=mtu,
    )
