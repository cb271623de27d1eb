"""A step-time model by phase (forward, backward, optimizer, aggregation: the run's own records'
names), to set beside the paper's Table 4 (issue 31, item 1; first version, not yet calibrated on
a machine).

Terms, per GPU and step:
- compute: the model's FLOPs (2 per parameter and token in forward, twice that in backward, plus
  causal attention) at a sustained fraction `compute` of the GPU's peak;
- FSDP's all-gathers and reduce-scatters per unit, and HSDP's all-reduce of the gradient shards
  over the replicas, overlapped with compute as FSDP2 prefetches: each decoder layer costs the
  larger of its compute and its collectives; the root unit's gather is exposed before forward
  (it is then held to backward) and its reduction after backward; on CPU ranks sharing too few
  cores (Hardware.overlap false, from a calibration profile) a layer's compute and collectives add;
- a collective: bytes per rank (a ring's: (n-1)/n of the message per all-gather or reduce-scatter,
  twice that per all-reduce) over a bandwidth, plus a latency per ring step (alpha-beta, Thakur,
  Rabenseifner and Gropp 2005). Inside a node: NVLink. Across nodes: a flow gets one NIC port,
  or its share of the node's NICs when more flows cross at once (the node's 400 Gbit/s shared by
  its 4 GPUs), times an efficiency that falls with the nodes the collective spans:
  `network` x nodes^-`span` (MiCS: collectives over more nodes reach less of the link);
- FSDP2's own work per unit and collective beyond the collective (copies in and out, hooks), where
  calibrated (Hardware.fsdp_forward, fsdp_backward: sharded_terms); at S = 1 with replicas only the
  backward's reductions pay it (a gather over one rank is a copy);
- the optimizer: AdamW reads parameters, gradients and two moments and writes three, at HBM speed,
  plus, where calibrated, a fixed part whatever the shard's size (Hardware.optimizer_fixed);
- the aggregation: the federated shards' all-reduce over the groups every A steps, amortised (FedAvg's
  leader_broadcast: replica 0's groups alone cross, then each broadcasts to its replicas).
The free terms (`Efficiency`) are fitted to measured phase times (analysis/steptime_fit.py). A
node measured by fldp-calibrate (`topology.profile`) gives its own terms instead: `hardware_for`,
`Hardware.from_profile`, with `MEASURED`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config, TopologyConfig
    from .cost import Units
    from .memory import Shapes


@dataclass(frozen=True)
class Hardware:
    """Published figures of one node type (defaults: CINECA Leonardo Booster, 4 x A100 64 GB)."""

    peak_flops: float = 312e12  # A100 bf16 dense
    nvlink: float = 100e9  # bytes/s per GPU inside a node (4 x 200 Gbit/s)
    port: float = 12.5e9  # one HDR100 NIC port, bytes/s
    nic: float = 50e9  # a node's 2 x dual-port HDR100 = 400 Gbit/s
    hbm: float = 1.6e12  # bytes/s
    gpus_per_node: int = 4
    # seconds per ring step across nodes and inside one: NCCL's tuning model (src/graph/tuning.cc,
    # hwLat of the Simple protocol's ring: NET 9.6 us, NVLink 3.4 us)
    latency: float = 9.6e-6
    node_latency: float = 3.4e-6
    # the collectives' library: gloo's reduce-scatter is an all-reduce (docs/netns.md), and its
    # all-reduce a ring at any span (NCCL's tuning picks a tree across nodes)
    backend: str = "nccl"
    # collectives run beside compute (a GPU: NCCL on its own streams); ranks that share too few CPU
    # cores pay gloo's sends and reductions on the cores their compute needs, so the two add
    overlap: bool = True
    # measured by fldp-calibrate (Hardware.from_profile, sharded_terms), none in published figures:
    # forward's share of a step's compute (FLOPs: 1/3), seconds of an optimizer step whatever the
    # shard's size (a step per parameter tensor), and seconds FSDP2 spends per unit and collective
    # beyond the collective itself (its copies in and out, hooks) in forward and in backward
    forward_share: float = 1 / 3
    optimizer_fixed: float = 0.0
    fsdp_forward: float = 0.0
    fsdp_backward: float = 0.0

    @classmethod
    def from_profile(cls, profile: dict, base: Hardware | None = None) -> Hardware:
        """The node fldp-calibrate measured (its profile, as read from YAML): the sustained FLOP/s of
        the model's forward + backward (its layers and head) as the peak, so use it with MEASURED;
        the optimizer's bytes/s as the memory's; each tier's beta and alpha; the node's NICs as the
        shared tier's beta times its ranks (else one flow's). What it did not measure comes from
        `base` (default: the published figures)."""
        if profile.get("format") != 1:
            raise ValueError(f"not a profile of fldp-calibrate's format 1: format={profile.get('format')!r}")
        base = base or cls()
        tiers, ranks = profile.get("tiers") or {}, profile["topology"]["procs_per_node"]
        node, across = tiers.get("node"), tiers.get("inter-node")
        shared = tiers.get("inter-node-shared")
        compute = profile["compute"]
        # the trainer's own step's rate where measured, else the bare whole model's, else one layer's;
        # slowed to its slowest rank's (a run's step is that rank's), where measured
        slowest = slowest_rank(compute)
        rate = next(compute[k] for k in ("flop_s_step", "flop_s_model", "flop_s_train") if k in compute) / slowest
        found: dict = {"peak_flops": rate, "gpus_per_node": ranks}
        if "optimizer_bytes_s" in compute:
            found["hbm"] = compute.get("optimizer_bytes_s_step", compute["optimizer_bytes_s"]) / slowest
        if "step_forward_s" in compute:
            found["forward_share"] = compute["step_forward_s"] / (
                compute["step_forward_s"] + compute["step_backward_s"]
            )
        found.update({field: compute[key] for key, field in SHARDED_TERMS.items() if key in compute})
        machine = profile.get("machine") or {}
        found["backend"] = machine.get("backend", base.backend)
        found["overlap"] = overlaps(profile["topology"].get("device", "cuda"), machine.get("cpus"), compute)
        if node:
            found.update(nvlink=node["beta_bytes_s"], node_latency=node["alpha_s"])
        if across:
            found.update(port=across["beta_bytes_s"], latency=across["alpha_s"], nic=across["beta_bytes_s"])
        if shared:
            found["nic"] = shared["beta_bytes_s"] * shared["groups_at_once"]
        return replace(base, **found)


STEP_PHASES = ("forward", "backward", "optimizer")  # the trainer's step as fldp-calibrate times it


def slowest_rank(compute: dict, name: str = "step") -> float:
    """How much longer the slowest rank's trainer step (`name`: step, or sharded_step) took than the
    median rank's (>= 1; 1 where the profile has no `{name}_slowest_s`)."""
    if f"{name}_slowest_s" not in compute:
        return 1.0
    median = sum(compute[f"{name}_{p}_s"] for p in STEP_PHASES)
    return max(1.0, compute[f"{name}_slowest_s"] / median)


# sharded_terms' keys in a profile's compute: Hardware's fields
SHARDED_TERMS = {
    "optimizer_fixed_s": "optimizer_fixed",
    "optimizer_bytes_s_fit": "hbm",
    "fsdp_forward_s": "fsdp_forward",
    "fsdp_backward_s": "fsdp_backward",
}


def sharded_terms(profile: dict, work: Workload) -> dict:
    """What the trainer's step sharded over a node's P ranks (fldp-calibrate's sharded_step_*) adds
    to the one-rank step, each as its slowest rank's: the optimizer's time t(S) = fixed + per-byte
    part / S through the two steps' (S = 1 and P), and FSDP2's seconds per unit and collective
    beyond the model's terms: the sharded step's forward and backward less their prediction (the
    profile's rates and node tier), over its gathers (forward: every unit) and its gathers and
    reductions (backward: every layer's two, the root's reduction). {} without a sharded step."""
    compute = profile["compute"]
    if "sharded_step_forward_s" not in compute:
        return {}
    from .mesh import MeshShape

    P, plain = int(compute["sharded_shard"]), slowest_rank(compute)
    shape = MeshShape(profile["topology"]["nodes"] * profile["topology"]["procs_per_node"] // P, 1, P)
    sharded = slowest_rank(compute, "sharded_step")
    one, many = compute["step_optimizer_s"] * plain, compute["sharded_step_optimizer_s"] * sharded
    raw = (one - many) * P / (P - 1)  # the part that 1/S of the model takes
    per_byte = min(one, max(0.0, raw))
    hw = Hardware.from_profile({**profile, "compute": {k: v for k, v in compute.items() if k not in SHARDED_TERMS}})
    predicted = phases(work, shape, None, hw, MEASURED)
    collectives = dict(zip(("forward", "backward"), fsdp_collectives(work)))
    measured = {p: compute[f"sharded_step_{p}_s"] * sharded for p in collectives}
    excess = {p: measured[p] - predicted[p] for p in collectives}  # beyond the model's other terms
    return {
        "optimizer_fixed_s": one - per_byte,
        "optimizer_bytes_s_fit": 7 * sum(work.unit_bytes) / per_byte if per_byte > 0 else math.inf,
        **{f"fsdp_{p}_s": max(0.0, excess[p]) / n for p, n in collectives.items()},
        # unclamped, as shares of what they come from: fldp.steptime.clamped reads them
        "optimizer_per_byte_share": raw / one,
        **{f"fsdp_{p}_excess_share": excess[p] / measured[p] for p in collectives},
    }


# how far a layout's predicted step may move, by a fit's error, before its ranking is in doubt: the
# median error the model aims at (issue 31). Issue 47: a 50 Mbit/s link's shared tier fitted 21% off
# its measurements, its layouts predicted 6-13% off.
SENSITIVITY = 0.10
# where each tier's fit goes in Hardware (from_profile): its bandwidth and its latency
TIER_TERMS = {"node": ("nvlink", "node_latency"), "inter-node": ("port", "latency"), "inter-node-shared": ("nic", None)}


def slower_tier(hw: Hardware, tier: str, factor: float, shared: bool) -> Hardware:
    """`hw` with one tier's collectives `factor` times as long: its bandwidth divided, its latency
    multiplied (the inter-node tier is also the node's NIC where no shared tier was measured)."""
    bandwidth, latency = TIER_TERMS[tier]
    changes = {bandwidth: getattr(hw, bandwidth) / factor}
    if latency:
        changes[latency] = getattr(hw, latency) * factor
    if tier == "inter-node" and not shared:
        changes["nic"] = hw.nic / factor
    return replace(hw, **changes)


def clamped(profile: dict) -> list[str]:
    """The compute terms sharded_terms held at a bound, one sentence each, with how far the
    calibrated sharded step disagreed: the model's other terms then predict it that much off."""
    c = profile.get("compute") or {}
    notes = []
    for phase in ("forward", "backward"):
        share = c.get(f"fsdp_{phase}_excess_share", 0.0)  # the sharded phase beyond its prediction
        if share < 0:
            notes.append(
                f"FSDP2's {phase} seconds per collective fitted to their bound 0: the model's other terms "
                f"predict the calibrated sharded {phase} {-share:.0%} of it slower than it ran"
            )
    share = c.get("optimizer_per_byte_share", 0.5)  # of the one-rank optimizer's time
    if not 0 <= share <= 1:
        bound = "0: the sharded step's optimizer was not faster" if share < 0 else "the whole: no fixed part"
        notes.append(f"the optimizer's per-byte part fitted to its bound ({bound})")
    return notes


def fsdp_collectives(work: Workload) -> tuple[int, int]:
    """FSDP2's collectives in a sharded step's forward (every unit gathered) and backward (each
    layer gathered and reduced, the root, held since forward, reduced)."""
    units = len(work.unit_bytes)
    return units, 2 * (units - 1) + 1


def overlaps(device: str, cpus: int | None, compute: dict) -> bool:
    """Whether a calibrated machine's collectives run beside its compute: on a GPU, yes; on a CPU
    only with a core for each rank's compute and one for its collectives (gloo's threads)."""
    if device != "cpu":
        return True
    ranks = compute.get("ranks_at_once", 1) * (compute.get("threads") or 1)
    return cpus is not None and cpus >= 2 * ranks


@dataclass(frozen=True)
class Efficiency:
    """What the published figures do not say: fitted."""

    compute: float = 0.5  # sustained share of peak FLOPs
    network: float = 0.5  # share of a flow's bandwidth a collective over 1 node pair reaches
    span: float = 0.05  # efficiency ~ nodes^-span
    latency: float = 1.0  # multiple of the per-step latencies a collective pays (fitted: Table 4)


# a calibrated Hardware (from_profile) is already what the machine sustains
MEASURED = Efficiency(compute=1.0, network=1.0, span=0.0, latency=1.0)
# the published figures' efficiencies fitted to all four rows of the paper's Table 4 (Leonardo):
# analysis/steptime_fit.py's "all four" fit, rounded (tests/test_steptime.py re-fits and compares)
TABLE4_FIT = Efficiency(compute=0.547, network=0.806, span=0.109, latency=9.298)


def efficiency_for(topology: TopologyConfig) -> Efficiency:
    """What to use with hardware_for(topology): a calibrated node's own rates, else Table 4's fit."""
    return MEASURED if topology.profile else TABLE4_FIT


def hardware_for(topology: TopologyConfig) -> Hardware:
    """A topology's node: its profile's (topology.profile, fldp-calibrate's output, a path), else the
    published figures."""
    if not topology.profile:
        return Hardware()
    import yaml

    with open(topology.profile) as f:
        return Hardware.from_profile(yaml.safe_load(f))


@dataclass(frozen=True)
class Workload:
    """One step of one GPU: the model's parameters by FSDP unit (bytes, the root last), its FLOPs
    per token, the tokens per GPU and the parameter bytes per element."""

    unit_bytes: tuple[float, ...]
    flops_per_token: float
    tokens: int
    element: int = 2


def workload_for(conf: Config, built: tuple | None = None) -> Workload:
    """A config's step on one rank: its model's FSDP units in the run's dtype, FLOPs per token at its
    block size, its tokens per rank. built: cost.config_model(conf), if already made."""
    from .cost import config_model
    from .memory import Shapes

    model, units = built or config_model(conf)
    return workload_of(conf, Shapes.of(model.config), units)


def workload_of(conf: Config, shapes: Shapes, units: Units) -> Workload:
    """workload_for from the model's dimensions (memory.Shapes) and its Units alone, without the
    model (fldp-plan's, from cost.config_shapes). The parameters: each once, as model.parameters()."""
    seq = conf.dataset.block_size
    params = sum(math.prod(shape) for shape, _ in units.params)
    per_token = flops_per_token(params, shapes.vocab * shapes.hidden, shapes.layers, shapes.hidden, seq)
    return Workload(tuple(units.full_bytes()), per_token, conf.trainer.batch_size * seq, units.element_size)


def flops_per_token(params: int, embedding: int, layers: int, hidden: int, seq: int) -> float:
    """Forward FLOPs per token: 2 per weight used in a matmul (the embedding lookup is not one) and
    causal attention's two products (2 x 2 x seq/2 x hidden per layer)."""
    return 2 * (params - embedding) + 2 * layers * seq * hidden


def ring(kind: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather or reduce-scatter of an `nbytes` message over n ranks:
    (n-1)/n of it per rank, n-1 steps (alpha-beta)."""
    return 0.0 if n <= 1 else nbytes * (n - 1) / n / bandwidth + (n - 1) * latency


def all_reduce(nbytes: float, n: int, bandwidth: float, latency: float, across_nodes: bool) -> float:
    """Seconds of an all-reduce: 2 (n-1)/n of the message per rank, as a ring or NCCL's double
    binary tree sends it; across nodes NCCL's tuning picks the tree at this scale, whose latency
    grows with log2 n and whose bandwidth does not fall with the ring's span."""
    if n <= 1:
        return 0.0
    steps = 2 * math.ceil(math.log2(n)) if across_nodes else 2 * (n - 1)
    return nbytes * 2 * (n - 1) / n / bandwidth + steps * latency


@dataclass(frozen=True)
class Link:
    """What a mesh dimension's collectives get per rank: bytes/s, latency per step, and the nodes
    they span (1: inside a node)."""

    bandwidth: float
    latency: float
    nodes: int


def dim_link(dim: str, shape, hw: Hardware, eff: Efficiency, leaders: bool = False) -> Link:
    """A mesh dimension's link, ranks node-major: NVLink inside a node; across nodes one NIC port
    per flow, or its share of the node's NICs when more of the dimension's groups cross at once
    (leaders: FedAvg's leader_broadcast, only replica 0's groups cross)."""
    from .cost import crossing_flows

    size, stride = {
        "shard": (shape.shard, 1),
        "replicate": (shape.replicate, shape.shard),
        "federation": (shape.federation, shape.replicate * shape.shard),
    }[dim]
    g = hw.gpus_per_node
    if size <= 1 or size * stride <= g:
        return node_link(hw, eff)
    flows = crossing_flows(shape, dim, g, leaders and dim == "federation")
    nodes = min(size, math.ceil(size * stride / g))
    # a collective over more nodes reaches less of its link (MiCS): nodes^-span
    return Link(min(hw.port, hw.nic / flows) * eff.network * nodes ** (-eff.span), hw.latency * eff.latency, nodes)


def node_link(hw: Hardware, eff: Efficiency) -> Link:
    """Inside a node: NVLink (on emulated nodes, the namespace's loopback)."""
    return Link(hw.nvlink * eff.network, hw.node_latency * eff.latency, 1)


def leader_broadcast(nbytes: float, shape, hw: Hardware, eff: Efficiency, replicate: Link) -> float:
    """Seconds of FedAvg's leader_broadcast: replica 0 of each group sends the average to its R - 1
    replicas. NCCL pipelines it along a ring (the message once per rank, fldp/cost.py's C_BC); gloo's
    is flat, the root sending it to each replica in turn: to those on its own node (node-major
    ranks, replicas S apart) over the node's link, to the others over the replicas' link across
    nodes (issue 47: charging every send across nodes over-predicted R = 4, S = 1 on 4 nodes of 2
    by 25-40%)."""
    R = shape.replicate
    if R <= 1:
        return 0.0
    if hw.backend != "gloo":
        return nbytes / replicate.bandwidth + (R - 1) * replicate.latency
    beside = min(R, math.ceil(hw.gpus_per_node / shape.shard)) - 1
    return sum(
        count * (nbytes / link.bandwidth + link.latency)
        for count, link in ((beside, node_link(hw, eff)), (R - 1 - beside, replicate))
    )


def phases(
    work: Workload, shape, every: int | None, hw: Hardware, eff: Efficiency, leaders: bool = False
) -> dict[str, float]:
    """Seconds per phase of one step (aggregation amortised over A steps). leaders: FedAvg's
    leader_broadcast (cost.fedavg_mode), where replica 0 of each group averages and then broadcasts
    to its replicas; else every replica averages with its peers."""
    *layers, root = work.unit_bytes
    shard, replicate = dim_link("shard", shape, hw, eff), dim_link("replicate", shape, hw, eff)
    S, R = shape.shard, shape.replicate

    def gather(unit):  # the all-gather of a unit's parameters (or reduce-scatter of its gradients)
        return ring("all_gather", unit, S, shard.bandwidth, shard.latency)

    def scatter(unit):  # the reduce-scatter of a unit's gradients; gloo all-reduces them
        if hw.backend == "gloo":
            return all_reduce(unit, S, shard.bandwidth, shard.latency, across_nodes=False)
        return gather(unit)

    def replicas(unit):  # HSDP: the gradient shard all-reduced over the replicas
        return all_reduce(unit / S, R, replicate.bandwidth, replicate.latency, tree and replicate.nodes > 1)

    tree = hw.backend == "nccl"

    # forward + backward: 3 x forward's FLOPs, split as the machine splits them (FLOPs: 1/3 forward)
    compute = 3 * work.flops_per_token * work.tokens / (hw.peak_flops * eff.compute)
    per_layer, per_layer_back = (compute * share / len(layers) for share in (hw.forward_share, 1 - hw.forward_share))
    beside = max if hw.overlap else operator.add  # a layer's compute and its collectives
    forward = gather(root) + sum(beside(per_layer, gather(u)) for u in layers)

    def collectives(unit):  # a layer's in backward
        # FSDP2 gathers on one stream and reduce-scatters, then all-reduces, on another: on one link
        # (or a CPU's shared cores) they add; the replicas' all-reduce on the NIC runs beside NVLink's
        if replicate.nodes > 1 and hw.overlap:
            return max(gather(unit), scatter(unit) + replicas(unit))
        return gather(unit) + scatter(unit) + replicas(unit)

    backward = sum(beside(per_layer_back, collectives(u)) for u in layers)
    backward += scatter(root) + replicas(root)
    if S > 1:  # FSDP2's own work per collective
        in_forward, in_backward = fsdp_collectives(work)
        forward += hw.fsdp_forward * in_forward
        backward += hw.fsdp_backward * in_backward
    elif R > 1:  # gathers over one rank are copies, but every unit's gradients are still reduced
        backward += hw.fsdp_backward * len(work.unit_bytes)
    shard_bytes = sum(work.unit_bytes) / S
    optimizer = hw.optimizer_fixed + 7 * shard_bytes / hw.hbm  # AdamW: reads 4 tensors of the shard, writes 3
    aggregation = 0.0
    if every and shape.federation > 1:
        leads = leaders and R > 1
        fed = dim_link("federation", shape, hw, eff, leads)
        exchange = all_reduce(shard_bytes, shape.federation, fed.bandwidth, fed.latency, tree and fed.nodes > 1)
        if leads:
            exchange += leader_broadcast(shard_bytes, shape, hw, eff, replicate)
        aggregation = exchange / every
    return {"forward": forward, "backward": backward, "optimizer": optimizer, "aggregation": aggregation}
