"""A shaped multi-host network on one machine: network namespaces, veth pairs, a bridge, ``tc tbf``.

Every host is a network namespace with one interface, ``eth0``, whose peer sits on a bridge in a
namespace of its own (so ``bridge-nf-call-iptables`` can be switched off there without touching
the machine's own firewall). Each link is shaped in both directions with ``tbf``: egress of
``eth0`` is the host's upload, egress of its bridge port is its download. ``tbf`` because the
kernels on the build machines lack ``netem``, ``fq`` and ``fq_codel``; its burst is at least
``max(2 × rate / HZ, 128 KiB)``, below which segmentation-offloaded packets (up to 64 KiB) are
dropped rather than delayed.

Only addresses of one private /24 inside these namespaces are used: no packet leaves them. The
namespaces, and every process started in them, are removed by ``close()``: processes first (a
process left inside a namespace keeps it alive after ``ip netns del``), then the namespaces.
``close()`` is idempotent and bounded in time, so it can run from ``finally``, ``atexit`` and a
signal handler alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000
#: the lowest timer frequency a Linux kernel is built with: the burst that suffices at HZ=100 suffices at all
WORST_CASE_HZ = 100
MIN_BURST = 128 * 1024
#: queue a link keeps beyond its burst, in seconds of its rate (a switch port's buffer)
QUEUE_SECONDS = 0.05


class TopologyError(RuntimeError):
    """The network could not be built (missing tool, kernel feature or privilege)."""


def _run(argv: Sequence[str], timeout: float = 20.0) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TopologyError(f"{' '.join(argv)} failed: {exc}") from None
    if done.returncode != 0:
        raise TopologyError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot build the network (not root, no ``ip``/``tc``), or ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc); run it as root, e.g. sudo"
    for tool in ("ip", "tc"):
        if not any(Path(d, tool).exists() for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin")):
            return f"needs the {tool!r} command (iproute2)"
    return None


def tbf_burst(rate_bits: int) -> int:
    """Bytes of burst for a tbf at ``rate_bits``: enough for any HZ and for offloaded 64 KiB packets."""
    return max(2 * rate_bits // 8 // WORST_CASE_HZ, MIN_BURST)


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge."""

    name: str
    ns: str
    ip: str
    rate_bits: int
    #: the host's veth port on the bridge (in the bridge's namespace)
    port: str


class Topology:
    """Namespaces on one bridge, links shaped with tbf, and the processes started inside them."""

    def __init__(self, prefix: str, subnet: str = "10.77.0") -> None:
        self.prefix = prefix
        self.subnet = subnet
        self.bridge_ns = f"{prefix}-br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []
        self._closed = False

    def create(self) -> None:
        """The bridge in its own namespace, without bridge netfilter."""
        self._add_ns(self.bridge_ns)
        _run(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        # The knobs exist only while br_netfilter is loaded; off, bridged frames skip iptables.
        off = "for f in /proc/sys/net/bridge/bridge-nf-call-*; do [ -w $f ] && echo 0 > $f; done; true"
        _run(["ip", "netns", "exec", self.bridge_ns, "sh", "-c", off])

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Listen backlogs of 1024 and more are not silently cut to a smaller somaxconn.
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.core.somaxconn=4096"])

    def add_host(self, name: str, octet: int, rate_bits: int) -> Host:
        """Namespace ``<prefix>-<name>`` at ``<subnet>.<octet>``, linked to the bridge at ``rate_bits`` each way."""
        host = Host(name, f"{self.prefix}-{name}", f"{self.subnet}.{octet}", rate_bits, f"p{octet}")
        self._add_ns(host.ns)
        veth = ["type", "veth", "peer", "name", "eth0", "netns", host.ns]
        _run(["ip", "-n", self.bridge_ns, "link", "add", host.port, *veth])
        _run(["ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0", "up"])
        _run(["ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0"])
        _run(["ip", "-n", host.ns, "link", "set", "eth0", "up"])
        self.shape(host.ns, "eth0", rate_bits)
        self.shape(self.bridge_ns, host.port, rate_bits)
        self.hosts[name] = host
        return host

    @staticmethod
    def shape(ns: str, dev: str, rate_bits: int) -> None:
        """Egress of ``dev`` in ``ns`` limited to ``rate_bits`` by a tbf."""
        burst = tbf_burst(rate_bits)
        limit = burst + int(rate_bits / 8 * QUEUE_SECONDS)
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
              "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)])  # fmt: skip

    def counters(self, name: str) -> tuple[int, int]:
        """``(rx_bytes, tx_bytes)`` of host ``name``'s ``eth0``."""
        doc = json.loads(_run(["ip", "-n", self.hosts[name].ns, "-j", "-s", "link", "show", "dev", "eth0"]))
        stats = doc[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def spawn(
        self, name: str, argv: Sequence[str], log: Path, env: dict[str, str], cwd: Path
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``name``'s namespace, output to ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[name].ns, *argv],
                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    @staticmethod
    def stop(proc: subprocess.Popen[bytes], within: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``within`` seconds."""
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=within)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    @contextlib.contextmanager
    def inside(self, name: str) -> Iterator[None]:
        """Run this thread's network calls in host ``name``'s namespace (``setns``), then come back."""
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/var/run/netns/{self.hosts[name].ns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise TopologyError(f"setns into {self.hosts[name].ns} failed: {os.strerror(ctypes.get_errno())}")
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise TopologyError(f"setns back to the host namespace failed: {os.strerror(ctypes.get_errno())}")
            os.close(target)
            os.close(own)

    def close(self) -> None:
        """Stop every process started here (and any left in the namespaces), delete the namespaces."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2)
        for ns in reversed(self._namespaces):
            # Anything still inside (a grandchild that outlived its parent) would keep the namespace alive.
            with contextlib.suppress(TopologyError, ValueError):
                for pid in _run(["ip", "netns", "pids", ns], timeout=5).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(TopologyError):
                _run(["ip", "netns", "del", ns], timeout=10)
        self._namespaces.clear()
