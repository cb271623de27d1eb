"""Emulated nodes on one machine: one Linux network namespace per node, joined through a bridge,
each node's link capped with tc. Ranks of one node talk over their namespace's loopback (an
address of the namespace is local, so the kernel never sends it through the capped veth); ranks
of different nodes cross two capped hops (their node's uplink, then the peer's downlink), as
through a full-duplex NIC and a switch.

    namespace PREFIX-n<k> (node k): lo, fldp0 = 10.77.0.<k+1>/24, tc on fldp0 (upload)
    namespace PREFIX-sw (switch):   br0, and the other end of every node's veth (n<k>, tc: download)

PREFIX = fldp-<launcher pid>-<its PID namespace's inode>-<its start time, clock ticks after boot>.
Nothing is created in, or routed to, the root namespace: the namespaces hold only these links, so a
worker can reach no address but its peers' and loopback. Each node namespace has a hosts file naming
every node (/etc/netns/NS/hosts, where `ip netns exec` looks), removed with its namespace. A
launcher removes its namespaces when it ends (success, failure, Ctrl-C, SIGTERM); what a SIGKILLed
launcher left behind, the next launcher removes (`reap()`), but only where the name proves its
launcher dead: a launcher of this PID namespace, whose pid runs no process started at that time.
/run/netns may be shared with containers of other PID namespaces, whose launchers' pids mean
nothing here: theirs are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .mesh import ConfigError

if TYPE_CHECKING:
    from .config import Config, TopologyConfig

IFACE = "fldp0"  # each node's interface, inside its namespace (names are per namespace)
SUBNET = "10.77.0"  # addresses exist only inside the run's namespaces
PORT = 29500  # rendezvous port on rank 0's node: its namespace is new, so the port is free
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_MS_BIND, _MS_REC, _MS_SLAVE = 0x1000, 0x4000, 0x80000
_RUN_DIR = "/run/netns"  # where `ip netns` keeps the namespaces' names
_ETC_DIR = "/etc/netns"  # per-namespace files `ip netns exec` mounts over /etc (here: hosts)
_NAME = re.compile(r"fldp-(\d+)-(\d+)-(\d+)-(n\d+|sw)$")  # launcher pid, PID namespace, start time
log = logging.getLogger("fldp")
_MTU = 9000  # jumbo frames, as on cluster fabrics: 0.7% header bytes instead of 4.6%
_BURST = 32 * 1024  # tbf bucket: bytes a link may send at once after an idle spell
# tbf queue, in time at the link's rate. Shallow, as a switch's: a deep one delays the ACKs of one
# direction behind the other direction's data (measured: with 50-100 ms queues a 2-rank all-gather
# took 1.5x its bytes / rate, with 20 ms it did not); deep enough that reno seldom drops
_QUEUE_MS = 20
_CONGESTION = "reno"


@dataclass(frozen=True)
class Link:
    """One node's link to the switch, each direction capped alike."""

    mbit_s: float
    delay_ms: float = 0.0


def enabled(topology: TopologyConfig) -> bool:
    return topology.emulation == "netns"


def link_of(topology: TopologyConfig) -> Link:
    """The inter-node tier of a netns topology: the outermost tier of `topology.network`, whose keys
    fldp.validation.check_link has checked."""
    tier = topology.network[-1]
    return Link(tier["gbit_s"] * 1e3, float(tier.get("delay_ms", 0)))


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int | None:
    """When process `pid` of this PID namespace started (clock ticks after boot), None if none runs:
    a pid alone may have been reused since."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the name
    except (OSError, IndexError, ValueError):
        return None


def owner_prefix() -> str:
    """This process's namespaces' prefix: what reap() needs to prove, later, that it has ended."""
    return f"fldp-{os.getpid()}-{_pid_namespace()}-{_start_time(os.getpid())}"


def dead(ns: str) -> bool:
    """Whether `ns` (an fldp namespace) belongs to a launcher of this PID namespace that has ended."""
    match = _NAME.match(ns)
    if match is None:
        return False  # not a name of ours
    pid, pid_namespace, start = map(int, match.groups()[:3])
    return pid_namespace == _pid_namespace() and _start_time(pid) != start


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def namespaces() -> list[str]:
    """Every fldp namespace on this machine (any launcher's)."""
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line and _NAME.match(line.split()[0])]


def _delete(ns: str) -> bool:
    """`ip netns delete`, and its hosts file; False, with a warning naming the namespace and why, if
    it is still there."""
    shutil.rmtree(f"{_ETC_DIR}/{ns}", ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(_ETC_DIR)  # when empty (ip-netns(8) needs none); left if anything else is in it
    done = _sh("ip", "netns", "delete", ns)
    if done.returncode == 0 or not os.path.lexists(f"{_RUN_DIR}/{ns}"):
        return True
    log.warning(
        "fldp: could not delete network namespace %s (%s); remove it with `ip netns delete %s`",
        ns,
        done.stderr.strip(),
        ns,
    )
    return False


def reap() -> list[str]:
    """Remove the namespaces of this PID namespace's launchers that no longer run (a SIGKILLed
    launcher cannot clean up after itself); returns those removed."""
    return [ns for ns in namespaces() if dead(ns) and _delete(ns)]


class Network:
    """The namespaces and links of one run. create() before forking, enter() in each worker,
    destroy() at the end, whatever happened."""

    def __init__(self, nodes: int, procs_per_node: int, link: Link, prefix: str | None = None):
        self.nodes, self.procs_per_node, self.link = nodes, procs_per_node, link
        self.prefix = prefix or owner_prefix()
        self.switch = f"{self.prefix}-sw"
        self.port = PORT
        self.created: list[str] = []

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node  # ranks are node-major, as on a cluster

    @property
    def master_addr(self) -> str:
        return self.address(0)

    def _run(self, *cmd: str) -> None:
        done = _sh(*cmd)
        if done.returncode:
            raise ConfigError(
                f"emulated network: `{' '.join(cmd)}` failed: {done.stderr.strip()}" + _hint(done.stderr, self.link)
            )

    def _add(self, ns: str) -> None:
        self._run("ip", "netns", "add", ns)
        self.created.append(ns)

    def create(self) -> None:
        reap()
        try:
            self._add(self.switch)
            self._run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for k in range(self.nodes):
                ns, port = self.namespace(k), f"n{k}"
                self._add(ns)
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
                # one congestion control on every machine (a new namespace inherits the host's: bbr
                # here, cubic on Debian); reno is built into every kernel, and with the shallow
                # queue below it drops ~6% of packets where bbr dropped ~45% (4 flows sharing a link)
                self._run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "sh",
                    "-c",
                    f"echo {_CONGESTION} > /proc/sys/net/ipv4/tcp_congestion_control",
                )
                self._run(
                    "ip",
                    "-n",
                    ns,
                    "link",
                    "add",
                    IFACE,
                    "mtu",
                    str(_MTU),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    port,
                    "mtu",
                    str(_MTU),
                    "netns",
                    self.switch,
                )
                # IPv4 only: no link-local IPv6 address that gloo could pick instead
                self._run("ip", "-n", ns, "link", "set", IFACE, "addrgenmode", "none")
                self._run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", IFACE)
                self._run("ip", "-n", ns, "link", "set", IFACE, "up")
                self._run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
                self._shape(ns, IFACE)  # node -> switch (upload)
                self._shape(self.switch, port)  # switch -> node (download)
            self._write_hosts()
        except BaseException:
            self.destroy()
            raise

    def _write_hosts(self) -> None:
        """Every node's address and name, as each namespace's /etc/hosts (`ip netns exec` and
        enter() mount it): c10d looks up the name of every peer that connects to its store, and
        without one it warns once per connection."""
        # each address also as IPv6-mapped: c10d's store listens on both families, so it sees IPv4
        # peers as ::ffff:a.b.c.d
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{prefix}{self.address(k)} {self.namespace(k)} node{k}\n"
            for k in range(self.nodes)
            for prefix in ("", "::ffff:")
        )
        for k in range(self.nodes):
            os.makedirs(f"{_ETC_DIR}/{self.namespace(k)}", exist_ok=True)
            with open(f"{_ETC_DIR}/{self.namespace(k)}/hosts", "w") as f:
                f.write(hosts)

    def _shape(self, ns: str, dev: str) -> None:
        """tbf caps the rate; netem, under it, adds the delay (both directions: one-way delay
        each, so the round trip is 2 x delay_ms)."""
        link = self.link
        limit = max(4 * _MTU, int(link.mbit_s * 1e6 / 8 * _QUEUE_MS / 1e3))
        tbf = ["tbf", "rate", f"{link.mbit_s:g}mbit", "burst", str(_BURST), "limit", str(limit)]
        self._run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        if link.delay_ms > 0:
            self._run(
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{link.delay_ms:g}ms",
                "limit",
                "100000",
            )

    def destroy(self) -> list[str]:
        """Delete the namespaces (their links and qdiscs go with them). Idempotent. Returns those
        that could not be deleted, each also logged as a warning: they stay in `created`, for a
        later destroy() to try again. Never raises: it runs in the launcher's cleanup, where an
        exception would hide the run's own outcome."""
        self.created = [ns for ns in self.created if not _delete(ns)]
        return list(self.created)

    def enter(self, rank: int) -> None:
        """Move this process (one thread: call it first thing in a forked worker, before any
        socket or thread exists) into its node's namespace, and bind gloo to the node's link."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"{_RUN_DIR}/{self.namespace(self.node_of(rank))}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {self.namespace(self.node_of(rank))}: {os.strerror(err)}")
        finally:
            os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = IFACE
        # the node's name as this process's host name, as on a cluster: torchft advertises its
        # servers (manager, checkpoint transport, lighthouse) by host name, which the hosts file
        # below resolves to the node's address in every namespace
        name = self.namespace(self.node_of(rank)).encode()
        if libc.unshare(_CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"host name {name.decode()} for an emulated node: {os.strerror(err)}")
        # the node's hosts file over /etc/hosts, in a mount namespace of this process alone (as `ip
        # netns exec` does; nothing propagates back to the machine's mounts). Only names depend on it:
        # if it fails, c10d warns about unnamed peers and the run goes on.
        hosts = f"{_ETC_DIR}/{self.namespace(self.node_of(rank))}/hosts".encode()
        if (
            libc.unshare(_CLONE_NEWNS) != 0
            or libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0
            or libc.mount(hosts, b"/etc/hosts", None, _MS_BIND, None) != 0
        ):
            log.debug("emulated nodes: no hosts file for rank %d: %s", rank, os.strerror(ctypes.get_errno()))

    def describe(self) -> dict:
        return {
            "nodes": self.nodes,
            "procs_per_node": self.procs_per_node,
            "mbit_s": self.link.mbit_s,
            "delay_ms": self.link.delay_ms,
            "queue_ms": _QUEUE_MS,
            "burst_kb": _BURST / 1024,
            "mtu": _MTU,
            "tcp": _CONGESTION,
        }


def _hint(stderr: str, link: Link) -> str:
    if "qdisc kind is unknown" in stderr and link.delay_ms > 0:
        return (
            f"\n(this kernel has no netem qdisc for delay_ms={link.delay_ms:g}: CONFIG_NET_SCH_NETEM; "
            "set topology.network[-1].delay_ms=0)"
        )
    return ""


def from_config(conf: Config) -> Network | None:
    link = link_of(conf.topology) if enabled(conf.topology) else None
    return Network(conf.topology.nodes, conf.topology.procs_per_node, link) if link else None


def summary_fields(conf: Config) -> dict:
    """What joined the ranks of the trainer, for summary.json (the simulator's: `none`): `netns` (emulated nodes, with the link), `sleep`
    (comm.emulate: loopback plus sleeps of bytes / tier bandwidth), `loopback` (forked here), or
    `external` (ranks started by torchrun/srun: whatever network joins their hosts)."""
    if conf.comm.emulate:
        return {"network": "sleep", "network_link": None}
    network = from_config(conf)
    if network is not None:
        return {"network": "netns", "network_link": network.describe()}
    from .launch import FORKED  # set in the workers run_local forks

    return {"network": "loopback" if FORKED else "external", "network_link": None}
