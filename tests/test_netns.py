"""Emulated nodes (fldp/netns.py): real namespaces, a real capped link, real processes. Traffic
between nodes crosses the cap and scales with it, traffic inside a node does not, nothing is left
behind (not even by a SIGKILLed launcher), and a machine that cannot build the network says so
before any worker starts. Needs root and iproute2; skipped without them (FLDP_REQUIRE_NETNS=1, set
by CI, makes that an error)."""

import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import cli, cluster, compose_cfg, needs_netns, read_rows
from omegaconf import OmegaConf

from fldp import netns, validation
from fldp.cost import Units, crossing_flows, predict, tier_bandwidth
from fldp.launch import run_local
from fldp.mesh import ConfigError, MeshShape
from fldp.validation import validate

FAST = ["wandb.mode=disabled", "trainer.progress=false", "trainer.eval_batches=1"]
MB = 2**20
SLOW_LINK = "topology.network=[{tier:node,ranks:4,gbit_s:2,latency_ms:2},{tier:inter-node,ranks:8,gbit_s:0.02,link:node,delay_ms:0}]"


def _link_tx() -> int:
    """Bytes this process's namespace has sent on its node's link (/proc/net/dev is per namespace)."""
    for line in open("/proc/net/dev"):
        name, _, fields = line.partition(":")
        if name.strip() == netns.IFACE:
            return int(fields.split()[8])
    raise AssertionError(f"no {netns.IFACE} here: not inside an emulated node")


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _inside_vs_across(out, device):
    """Ranks 0, 1 on node 0 and 2, 3 on node 1: 4 MiB all-reduced inside node 0, then across the
    link by the pair (0, 2) alone. Medians of 3 each, and node 0's bytes on the link."""
    rank = dist.get_rank()
    inside = dist.new_group([0, 1])
    across = dist.new_group([0, 2])
    x = torch.ones(MB)  # 4 MiB of fp32
    result = {"inside": [], "across": [], "tx_inside": 0, "tx_across": 0}
    for name, group, members in (("inside", inside, (0, 1)), ("across", across, (0, 2))):
        tx = _link_tx()
        for _ in range(3):
            result[name].append(_timed(lambda: dist.all_reduce(x, group=group) if rank in members else None))
        dist.barrier()
        result[f"tx_{name}"] = _link_tx() - tx
    if rank == 0:
        out.write_text(json.dumps(result))


def _measure(tmp_path, mbit_s: float) -> dict:
    out = tmp_path / f"{mbit_s:g}.json"
    network = netns.Network(2, 2, netns.Link(mbit_s))
    run_local(_inside_vs_across, (out,), 4, "cpu", cluster(), network)
    assert not [ns for ns in netns.namespaces() if ns.startswith(network.prefix + "-")]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def at_two_rates(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("links")
    return _measure(tmp, 40), _measure(tmp, 80)


@needs_netns
@pytest.mark.timeout(120)
def test_traffic_between_nodes_crosses_the_capped_link_and_scales_with_its_rate(at_two_rates):
    slow, fast = at_two_rates
    for r, mbit in ((slow, 40), (fast, 80)):
        # a 2-rank ring all-reduce sends the whole 4 MiB each way: node 0 puts it (plus headers) on the link
        assert 4 * MB <= r["tx_across"] / 3 <= 4.2 * MB, r
        wire = 4 * MB * 8 / (mbit * 1e6)  # 0.84 s at 40 Mbit/s
        assert statistics.median(r["across"]) >= 0.9 * wire, r
    ratio = statistics.median(slow["across"]) / statistics.median(fast["across"])
    assert 1.6 <= ratio <= 2.4, (ratio, slow, fast)  # the rate ratio is 2


@needs_netns
@pytest.mark.timeout(120)
def test_ranks_of_one_node_do_not_cross_the_link(at_two_rates):
    for r in at_two_rates:
        assert r["tx_inside"] < 64 * 1024, r  # the barriers' bytes, not the 4 MiB all-reduce
    # far below the 0.84 s the link takes at 40 Mbit/s, and not slower at half the rate
    slow, fast = (statistics.median(r["inside"]) for r in at_two_rates)
    assert slow < 0.3 * statistics.median(at_two_rates[0]["across"]), at_two_rates
    assert slow < 2 * fast + 0.05, at_two_rates


@needs_netns
def test_a_worker_resolves_every_node_by_name_and_the_machine_s_hosts_stay(tmp_path):
    network = netns.Network(2, 1, netns.Link(100))
    before = Path("/etc/hosts").read_text()
    network.create()
    try:
        out = tmp_path / "names"
        pid = os.fork()
        if pid == 0:  # a worker, as run_local makes one
            try:
                network.enter(1)
                out.write_text(" ".join(socket.gethostbyaddr(network.address(k))[0] for k in range(2)))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert out.read_text() == f"{network.namespace(0)} {network.namespace(1)}"
        assert Path("/etc/hosts").read_text() == before
    finally:
        assert network.destroy() == []
    assert not list(Path("/etc/netns").glob(f"{network.prefix}-*"))


def _fldp_namespaces(pid: int) -> list[str]:
    return [ns for ns in netns.namespaces() if ns.startswith(f"fldp-{pid}-")]


@needs_netns
@pytest.mark.timeout(240)
def test_fsdp_pays_the_link_every_step_fl_fsdp_only_when_it_aggregates(tmp_path):
    """The issue's "done when": both run on netns_2x4, record the network, FSDP's steps are clearly
    slower than FL+FSDP's steps without aggregation, and no namespace is left. The link at 20 Mbit/s,
    not the topology's 50: FSDP's 6.8 MB a step then take ~2.7 s of it, far above what load adds to
    a step's compute (a fresh-clone CI with 3 pytest workers on 2 cores: FL+FSDP's plain step 1.06 s,
    FSDP's 1.58 s at 50 Mbit/s, under the 1.5x asked)."""
    rows, summaries = {}, {}
    for algorithm in ("fsdp", "fl_fsdp"):
        run_dir = tmp_path / algorithm
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fldp.train",
                f"algorithm={algorithm}",
                "topology=netns_2x4",
                SLOW_LINK,
                "trainer.steps=3",
                *FAST,
                f"hydra.run.dir={run_dir}",
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, stderr = proc.communicate(timeout=200)
        assert proc.returncode == 0, stderr[-3000:]
        assert not _fldp_namespaces(proc.pid), "namespaces left behind"
        assert not list(Path("/etc/netns").glob(f"fldp-{proc.pid}-*")), "hosts files left behind"
        # every peer that connects to rank 0's store has a name (c10d warned once per rank without)
        assert "hostname of the client socket cannot be retrieved" not in stderr, stderr[-3000:]
        rows[algorithm] = read_rows(run_dir)
        summaries[algorithm] = json.loads((run_dir / "summary.json").read_text())
    for s in summaries.values():
        assert s["network"] == "netns"
        assert s["network_link"]["nodes"] == 2 and s["network_link"]["procs_per_node"] == 4
        assert s["network_link"]["mbit_s"] > 0
    fsdp = statistics.median(r["time_step"] for r in rows["fsdp"][1:])
    fl_plain = [r["time_step"] for r in rows["fl_fsdp"][1:] if not r["aggregated"]]
    assert fl_plain and fsdp > 1.5 * max(fl_plain), (rows["fsdp"], rows["fl_fsdp"])
    assert [r["aggregated"] for r in rows["fl_fsdp"]] == [False, False, True]  # the last step's


@needs_netns
@pytest.mark.timeout(240)
def test_a_sigkilled_launchers_namespaces_are_removed_by_the_next_start(tmp_path):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fldp.train",
            "algorithm=fl_fsdp",
            "topology=netns_2x4",
            "trainer.steps=500",
            *FAST,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 150
    while not (run_dir / "metrics.jsonl").exists():  # mid-run: the workers train in their namespaces
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never started"
        time.sleep(0.1)
    left = _fldp_namespaces(proc.pid)
    assert len(left) == 3  # 2 nodes and the switch
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _fldp_namespaces(proc.pid) == left  # SIGKILL runs no cleanup: the next start must
    assert len(list(Path("/etc/netns").glob(f"fldp-{proc.pid}-*"))) == 2  # the nodes' hosts files

    out = cli(
        "algorithm=fl_fsdp",
        "topology=netns_2x4",
        "trainer.steps=1",
        *FAST,
        f"hydra.run.dir={tmp_path / 'next'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not _fldp_namespaces(proc.pid), "the killed launcher's namespaces are still there"
    assert not list(Path("/etc/netns").glob(f"fldp-{proc.pid}-*")), "its hosts files are still there"
    assert not [ns for ns in netns.namespaces() if netns.dead(ns)]


_SLEEPER = """
import sys, time
from fldp import netns
from fldp.launch import run_local
from omegaconf import OmegaConf
def sleep(device):
    time.sleep(300)
cl = OmegaConf.create({"master_addr": "127.0.0.1", "master_port": None, "timeout_s": 60, "threads_per_worker": 1})
run_local(sleep, (), 2, "cpu", cl, netns.Network(2, 1, netns.Link(10)))
"""


@needs_netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_of_the_launcher_removes_its_namespaces(tmp_path, sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLEEPER], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 40
    while len(_fldp_namespaces(proc.pid)) < 3 or len(_children(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    workers = _children(proc.pid)
    proc.send_signal(sig)
    proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert not _fldp_namespaces(proc.pid)
    time.sleep(0.5)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")], "workers left"


def _children(pid: int) -> list[int]:
    kids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return kids


def _listed(prefix: str) -> list[str]:
    """`ip netns list`'s names that start with `prefix-`, whatever fldp makes of them."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot


@needs_netns
@pytest.mark.timeout(60)
def test_reap_removes_only_the_namespaces_of_launchers_that_provably_ended():
    """A launcher that ended and a pid now held by another process (its start time differs) are
    reaped; a running launcher, and a launcher of another PID namespace, are not."""
    sleeper = subprocess.Popen(["sleep", "30"])
    start = _start_time(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    here, me = os.stat("/proc/self/ns/pid").st_ino, os.getpid()
    # fldp-<launcher pid>-<its PID namespace's inode>-<its start time>-<node>
    names = {
        "ended": f"fldp-{sleeper.pid}-{here}-{start}-sw",
        "reused": f"fldp-{me}-{here}-{_start_time(me) + 1}-sw",
        "running": f"fldp-{me}-{here}-{_start_time(me)}-sw",
        "foreign": f"fldp-{sleeper.pid}-{here + 1}-{start}-sw",
    }
    try:
        for name in names.values():
            subprocess.run(["ip", "netns", "add", name], check=True)
        reaped = netns.reap()
        assert {names["ended"], names["reused"]} <= set(reaped)
        left = set(netns.namespaces())
        assert names["running"] in left and names["foreign"] in left
        assert names["ended"] not in left and names["reused"] not in left
    finally:
        for name in names.values():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


_FOREIGN = """
import sys
from fldp import netns
network = netns.Network(1, 1, netns.Link(10))
try:
    network._add(network.switch)  # a launcher's namespace (create() would also reap)
    print(network.prefix, flush=True)
    sys.stdin.read()  # until the test closes it
finally:
    network.destroy()
"""


@needs_netns
@pytest.mark.timeout(60)
def test_a_live_launcher_in_another_pid_namespace_keeps_its_namespaces():
    """/run/netns shared with a container: a launcher there has a pid that runs nothing here, and
    reap() from here must not take it for a dead one. Its pid is set to one free here."""
    pid = next(p for p in range(31000, 20000, -1) if not os.path.exists(f"/proc/{p}"))
    proc = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "sh",
            "-c",
            f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$0" -c "$1"; :',
            sys.executable,
            _FOREIGN,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = None
    try:
        prefix = proc.stdout.readline().strip()
        if not prefix:
            pytest.fail(f"the launcher did not start: {proc.stderr.read()[-2000:]}")
        assert prefix.split("-")[1] == str(pid), prefix
        assert len(_listed(prefix)) == 1 and not os.path.exists(f"/proc/{pid}")
        netns.reap()
        assert len(_listed(prefix)) == 1, "a live launcher's namespace was reaped"
        proc.stdin.close()  # the launcher ends, and removes its namespace
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        assert not _listed(prefix)
    finally:
        proc.kill()
        proc.wait()
        for name in _listed(prefix) if prefix else []:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@needs_netns
@pytest.mark.timeout(60)
def test_destroy_reports_a_namespace_it_could_not_delete(caplog):
    network = netns.Network(1, 1, netns.Link(10))
    path = f"/run/netns/{network.switch}"
    try:
        network._add(network.switch)
        # a second mount on its name: `ip netns delete` unmounts one, then cannot unlink it (EBUSY)
        subprocess.run(["mount", "--bind", path, path], check=True)
        with caplog.at_level(logging.WARNING, logger="fldp"):
            assert network.destroy() == [network.switch]
        assert f"could not delete network namespace {network.switch}" in caplog.text
        assert network.switch in netns.namespaces()
        subprocess.run(["umount", path], check=True)
        assert network.destroy() == [] and network.switch not in netns.namespaces()  # tried again
    finally:
        while subprocess.run(["umount", path], capture_output=True).returncode == 0:
            pass
        subprocess.run(["ip", "netns", "delete", network.switch], capture_output=True)


def test_without_ip_the_run_fails_before_any_worker_naming_it(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    out = cli(
        "algorithm=fsdp",
        "topology=netns_2x4",
        *FAST,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=120,
        env={"PATH": str(empty)},
    )  # python is called by its full path
    assert out.returncode == 2, out.stderr[-2000:]
    if os.geteuid() == 0:
        assert "needs the `ip` command (Debian: apt-get install iproute2)" in out.stderr, out.stderr[-2000:]
    else:
        assert "needs root" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_without_root_validation_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"topology=netns_2x4 \(emulation=netns\) needs root .*uid 1000"):
        validate(compose_cfg("topology=netns_2x4"))


@pytest.mark.parametrize(
    "override,key",
    [
        ("topology.network.1.gbit_s=0", "topology.network[1].gbit_s=0"),
        ("topology.network.1.delay_ms=-1", "topology.network[1].delay_ms=-1"),
        ("topology.network.1.link=rank", "topology.network[1].link='rank'"),
        ("comm.emulate=true", "comm.emulate=true"),
        ("topology.emulation=vde", "topology.emulation='vde'"),
    ],
)
def test_bad_link_settings_name_the_key(monkeypatch, override, key):
    monkeypatch.setattr(validation, "missing_tools", lambda name: None)  # the keys are checked first
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("topology=netns_2x4", override))
    assert key in str(e.value)


def test_the_cost_model_shares_a_node_link_among_the_flows_crossing_it():
    # 2 nodes x 4: FSDP's ring of 8 crosses each way once; HSDP's and FL+FSDP's pairs (i, i+4) four times
    assert crossing_flows(MeshShape(1, 1, 8), "shard", 4) == 1
    assert crossing_flows(MeshShape(1, 2, 4), "replicate", 4) == 4
    assert crossing_flows(MeshShape(2, 1, 4), "federation", 4) == 4
    assert crossing_flows(MeshShape(2, 2, 2), "federation", 4) == 4
    assert crossing_flows(MeshShape(2, 2, 2), "federation", 4, leaders_only=True) == 2
    # 4 nodes x 2
    assert crossing_flows(MeshShape(1, 4, 2), "replicate", 2) == 2
    network = OmegaConf.create([{"ranks": 4, "gbit_s": 8}, {"ranks": 8, "gbit_s": 0.08, "link": "node"}])
    b = tier_bandwidth(network, MeshShape(1, 2, 4), procs_per_node=4)
    assert b == {"shard": 1e9, "replicate": 0.08e9 / 8 / 4, "federation": 0.08e9 / 8}  # F=1: no flows
    # without `link: node` a tier's bandwidth is per rank, as before (Leonardo's figures)
    assert (
        tier_bandwidth([{"ranks": 4, "gbit_s": 8}, {"ranks": 8, "gbit_s": 0.08}], MeshShape(1, 2, 4))["replicate"]
        == 1e7
    )


def test_the_gloo_variant_counts_what_gloo_sends():
    # one unit (the root, gathered once per step) of 4,000 bytes on S=2: all-gather (S-1) M, and gloo's
    # reduce-scatter is an all-reduce: 2 (S-1) M, where a ring reduce-scatter sends (S-1) M
    units = Units(params=(((4, 250), 0),), element_size=4)
    bw = {"shard": 1000.0, "replicate": 1000.0, "federation": 500.0}
    p = predict(units, MeshShape(1, 1, 2), bw, latency={"shard": 0.5})
    assert p.exact["shard"] == pytest.approx(2 * 2000 / 1000)
    # + latency x 3 ring steps: 1 for the all-gather on 2 ranks, 2 for the reduce-scatter (an all-reduce)
    assert p.gloo["shard"] == pytest.approx(3 * 2000 / 1000 + 3 * 0.5)
    # leader_broadcast on R=3: gloo's broadcast is flat, the root sends the shard to each of R-1
    fl = predict(units, MeshShape(2, 3, 2), bw, every=4)
    assert fl.gloo["broadcast"] == pytest.approx(2 * 2000 / 4 / 1000)
    assert fl.exact["broadcast"] == pytest.approx(2 / 3 * 2000 / 4 / 1000)
