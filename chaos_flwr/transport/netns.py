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

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..defaults import NETNS_COMMAND_TIMEOUT_S, NETNS_TBF_BURST_BYTES, NETNS_TBF_LIMIT_BYTES
from ..errors import NetnsError

__all__ = ["NetnsPair", "check_netns_available", "measure_tcp_rate", "run_cmd", "veth_pair"]

_counter = itertools.count()


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
        errors: list[str] = []
        for ns in (pair.ns_a, pair.ns_b):
            if ns in _namespaces():
                try:
                    run_cmd(["ip", "netns", "del", ns])
                except NetnsError as err:
                    errors.append(str(err))
        # a veth left in the root namespace (failure before the move) is removed too
        for dev in (pair.dev_a, pair.dev_b):
            probe = subprocess.run(
                ["ip", "link", "show", dev], capture_output=True, check=False, timeout=10
            )
            if probe.returncode == 0:
                subprocess.run(["ip", "link", "del", dev], capture_output=True, check=False)
        if errors:
            raise NetnsError("cleanup failed: " + "; ".join(errors))


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
