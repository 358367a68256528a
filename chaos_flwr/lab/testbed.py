"""A multi-site Flower deployment on one machine: hosts in network namespaces, shaped WAN links.

:func:`wan_testbed` builds, from a WAN profile (:mod:`chaos_flwr.transport.shaping`'s YAML: an
access link per party), one network namespace per host on a bridge of its own
(:func:`chaos_flwr.transport.netns.lan`, addresses in ``10.77.0.0/24`` that exist only inside
the namespaces), with each host's uplink and downlink shaped by ``tc tbf``. The SuperLink runs
in the server host's namespace, bound to its address, with TLS (a CA and a certificate for that
address made at set-up with ``cryptography``) and SuperNode authentication (a key pair per
institution, registered with ``flwr supernode register``); each institution's SuperNode runs
in its own namespace. The ``flwr`` CLI (runs, registrations) runs in the server's namespace.

Only bandwidth is shaped: ``netem`` is missing here, so the profile's latencies are recorded
(:attr:`WanTestbed.latency_ms`) and reported, not applied by the kernel.

On exit, normal, by error, by Ctrl-C or by SIGTERM, every process started is stopped by pid,
then every namespace (with its veths, bridge and qdiscs) is deleted.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import FrameType
from typing import Any

from chaos_flwr.errors import ConfigError, TransportError
from chaos_flwr.lab.deployment import ClusterSite, DeploymentCluster
from chaos_flwr.lab.tls import TlsFiles, make_auth_key, make_tls
from chaos_flwr.transport.netns import NetnsLan, lan, wire_rate_bit_s
from chaos_flwr.transport.shaping import WanProfile, load_profile

__all__ = [
    "DEFAULT_SERVER",
    "WanTestbed",
    "default_profile_path",
    "host_rates_bit_s",
    "load_testbed_profile",
    "wan_testbed",
]

#: The profile's party that hosts the SuperLink unless told otherwise.
DEFAULT_SERVER = "superlink"
#: How long a party daemon may take to listen after it is started (its imports and key load).
TESTBED_DAEMON_START_S: float = 60.0
#: What the testbed says about latency (``netem`` is missing on this machine).
LATENCY_NOTE = "latency_ms from the profile, recorded only: netem is missing, links add none"


def default_profile_path() -> Path:
    """The shipped profile ``chaos_flwr/bench/profiles/testbed5.yaml``."""
    return Path(str(resources.files("chaos_flwr.bench") / "profiles" / "testbed5.yaml"))


def load_testbed_profile(path: Path | str | None = None) -> WanProfile:
    """Load a WAN profile (the shipped ``testbed5.yaml`` if ``path`` is None)."""
    return load_profile(path if path is not None else default_profile_path())


def host_rates_bit_s(
    profile: WanProfile, hosts: Sequence[str]
) -> dict[str, tuple[int | None, int | None]]:
    """Host -> (uplink, downlink) ``tbf`` rates in bit/s whose TCP payload rates are the
    profile's ``up_mb_s``/``down_mb_s`` (``None`` where the profile sets none)."""
    out: dict[str, tuple[int | None, int | None]] = {}
    for h in hosts:
        link = profile.link(h)
        up = None if link.up_bps is None else wire_rate_bit_s(link.up_bps)
        down = None if link.down_bps is None else wire_rate_bit_s(link.down_bps)
        out[h] = (up, down)
    return out


@dataclass
class WanTestbed:
    """A running testbed (see :func:`wan_testbed`).

    Attributes
    ----------
    net : NetnsLan
        The namespaces, addresses, devices and rates.
    cluster : DeploymentCluster
        The SuperLink (in the server's namespace) and the SuperNodes started so far.
    profile : WanProfile
        The WAN profile it was built from.
    server : str
        The host running the SuperLink.
    institutions : list of str
        The hosts that may run a SuperNode (the server too, if it is listed).
    tls : TlsFiles
        The CA and the SuperLink's certificate and key.
    auth_keys : dict
        Institution -> its SuperNode's private authentication key (registered at set-up).
    auth_public : dict
        Institution -> the public half of that key (registered again after a disk loss).
    daemons : dict
        Institution -> the process of the party daemon last started there.
    """

    net: NetnsLan
    cluster: DeploymentCluster
    profile: WanProfile
    server: str
    institutions: list[str]
    tls: TlsFiles
    auth_keys: dict[str, Path] = field(default_factory=dict)
    auth_public: dict[str, Path] = field(default_factory=dict)
    daemons: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_ms(self) -> dict[str, float]:
        """Host -> its access link's one-way latency from the profile (not applied)."""
        return {h: self.profile.link(h).latency_ms for h in self.net.namespaces}

    def start_supernode(self, host: str, node_config: Mapping[str, object]) -> float:
        """Start ``host``'s SuperNode in its namespace (authenticated, over TLS); return the
        wall-clock time it started."""
        if host not in self.auth_keys:
            raise ConfigError(f"host: {host!r} is not an institution of this testbed")
        key = self.auth_keys[host] if self.cluster.site.supernode_auth else None
        return self.cluster.start_supernode(
            host, node_config, netns=self.net.namespaces[host], auth_key=key
        )

    def start_party_daemon(self, host: str, node_config: Mapping[str, object], port: int) -> str:
        """Start ``host``'s party daemon (``chaos-flwr party``) in its namespace, serving on
        its address at ``port`` with the key, charter and state directory of ``node_config``;
        wait until it listens and return the address (what ``chaos-direct-addr`` names).

        Raises
        ------
        TransportError
            It exited or did not listen within ``TESTBED_DAEMON_START_S``.
        """
        import sys

        address = f"{self.net.addresses[host]}:{port}"
        cmd = [sys.executable, "-m", "chaos_flwr.cli", "party", "--key",
               str(node_config["chaos-key"]), "--charter", str(node_config["chaos-charter"]),
               "--state-dir", str(node_config["chaos-state-dir"]), "--listen", address]  # fmt: skip
        log = self.cluster.logs / f"party-{host}.log"
        start = log.stat().st_size if log.exists() else 0  # a restart appends to it
        if host in self.daemons and self.daemons[host].poll() is None:
            raise ConfigError(f"the party daemon of {host} is already running")
        proc = self.cluster.spawn(cmd, log.name, self.net.namespaces[host])
        self.daemons[host] = proc
        deadline = time.monotonic() + TESTBED_DAEMON_START_S
        while time.monotonic() < deadline and proc.poll() is None:
            with log.open("rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            if f"serving {address} " in text:
                return address
            time.sleep(0.1)
        raise TransportError(f"the party daemon of {host} did not start; see {log.name}")

    def kill_party_daemon(self, host: str) -> list[int]:
        """SIGKILL ``host``'s party daemon (a crash; none started: nothing); return the pids."""
        proc = self.daemons.pop(host, None)
        if proc is None or proc.poll() is not None:
            return []
        return self.cluster.kill(proc)

    def restart_superlink(self, *, lose_disk: bool = False) -> float:
        """SIGKILL the SuperLink (and its ServerApps) and start it again; with ``lose_disk``
        its host's disk is lost first (its state and ``FLWR_HOME`` deleted) and every
        institution's SuperNode key is registered again, as its operator would. Return the
        time it was killed."""
        t = self.cluster.restart_superlink(lose_disk=lose_disk)
        if lose_disk and self.cluster.site.supernode_auth:
            for public in self.auth_public.values():
                self.cluster.register_supernode(public)
        return t

    def counters(self) -> dict[str, dict[str, int]]:
        """Host -> bytes and packets its interface sent and received so far."""
        return {h: self.net.counters(h) for h in self.net.namespaces}

    def qdiscs(self) -> dict[str, dict[str, str]]:
        """Host -> ``tc qdisc show`` of its uplink and downlink."""
        return {h: self.net.qdiscs(h) for h in self.net.namespaces}

    def describe(self) -> dict[str, Any]:
        """Hosts with their address, namespace, rates (bit/s) and latency, and the server."""
        hosts = {
            h: {
                "namespace": self.net.namespaces[h],
                "address": self.net.addresses[h],
                "device": self.net.devices[h],
                "up_bit_s": self.net.up_bit_s[h],
                "down_bit_s": self.net.down_bit_s[h],
                "latency_ms": self.profile.link(h).latency_ms,
                "role": ("superlink" if h == self.server else "")
                + ("+" if h == self.server and h in self.institutions else "")
                + ("supernode" if h in self.institutions else ""),
            }
            for h in self.net.namespaces
        }
        return {
            "server": self.server,
            "superlink": f"{self.net.addresses[self.server]}:{self.cluster.port}",
            "hosts": hosts,
            "latency": LATENCY_NOTE,
        }


@contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM (and SIGINT, already) raise in the main thread while the testbed is up, so its
    cleanup runs; a second signal is ignored, so it cannot abort that cleanup (processes left
    running in namespaces already gone); the previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def _raise(signum: int, _frame: FrameType | None) -> None:
        if fired:
            return  # the cleanup the first one started runs to its end
        fired.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in previous:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def wan_testbed(
    profile: WanProfile,
    work_dir: Path,
    *,
    app_dir: Path,
    server: str = DEFAULT_SERVER,
    institutions: Sequence[str] | None = None,
    supernode_auth: bool = True,
    name: str | None = None,
) -> Iterator[WanTestbed]:
    """Build the testbed of ``profile``; remove everything it made on exit.

    Parameters
    ----------
    profile : WanProfile
        An access link per host (``up_mb_s``, ``down_mb_s``, ``latency_ms``).
    work_dir : Path
        Certificates, keys, ``FLWR_HOME`` and logs go here (kept).
    app_dir : Path
        The Flower app that runs will use.
    server : str, optional
        The host running the SuperLink (a party of ``profile``).
    institutions : Sequence[str] or None, optional
        Hosts that run a SuperNode (may include ``server``: the SuperLink at an institution);
        default every party but ``server``.
    supernode_auth : bool, optional
        Require registered SuperNode keys (Flower's ``--enable-supernode-auth``).
    name : str or None, optional
        Prefix of the namespace names (at most 8 characters).

    Raises
    ------
    ConfigError
        ``server`` or an institution is not in the profile.
    NetnsError
        Not root, ``ip``/``tc`` missing, or a command failed (cleanup still runs).
    TransportError
        The SuperLink did not start or a registration failed (cleanup still runs).
    """
    hosts = list(profile.parties)
    if server not in profile.parties:
        raise ConfigError(f"server: {server!r} is not a party of the profile ({hosts})")
    insts = list(institutions) if institutions is not None else [h for h in hosts if h != server]
    unknown = [h for h in insts if h not in profile.parties]
    if unknown or not insts:
        raise ConfigError(f"institutions: give parties of the profile ({hosts}), got {insts}")
    work = Path(work_dir)
    with _stop_on_signals(), lan(host_rates_bit_s(profile, hosts), name=name) as net:
        address = net.addresses[server]
        tls = make_tls(work / "certs", [address, "127.0.0.1"])
        site = ClusterSite(
            host=address, netns=net.namespaces[server], tls=tls, supernode_auth=supernode_auth
        )
        with DeploymentCluster(app_dir, work / "home", site=site) as cluster:
            bed = WanTestbed(net, cluster, profile, server, insts, tls)
            for h in insts:
                private, public = make_auth_key(work / "certs", h)
                if supernode_auth:
                    cluster.register_supernode(public)
                bed.auth_keys[h] = private
                bed.auth_public[h] = public
            yield bed
