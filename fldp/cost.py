"""The paper's communication cost model (Eq. 1-5, Table 2) as code, in two variants.

- `paper`: the equations as printed. M is the layer shard size, and it is also passed as the
  message size of the all-gather and reduce-scatter over S ranks: C_AG(M, S) = M (S-1) / (S B_S).
- `exact`: what a ring collective really sends per rank, from the model's real FSDP2 units. An
  all-gather of a layer split in S shards of M bytes sends (S-1) M per rank, S times the printed
  term; FSDP2 pads each parameter's dim 0 to a multiple of S, so M is the padded shard; FedAvg
  sends each rank's unpadded local shards, in `bucket_mb` buckets. The byte counts in
  metrics.jsonl (fldp/comm.py) are checked against this variant, exactly.

Both variants amortise the aggregations over the run as the trainer runs them: their number from
the schedule (fldp.schedule.aggregation_steps, the last step included), only the federated
parameters (`algorithm.federate`), in `algorithm.outer.reduce_dtype` (fp32 sums of bf16 weights
send twice the bytes) or quantised (`algorithm.outer.quantize`: 8 or 4 bits and the scales).

Bandwidths: each mesh dimension's groups span a block of consecutive ranks (shard: S, replicate:
R*S, federation: F*R*S); B for the dimension is that of the smallest network tier holding the
block (`topology.network`, innermost first). Contention between groups sharing a link is not
modelled: the paper's B_n is a per-process bottleneck bandwidth, and so is this.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .aggregation import REDUCE_DTYPES, bucket_indices, federated_mask
from .config import Config, default_of
from .memory import for_config
from .mesh import DIMS, MeshShape, shard_piece
from .quantize import Quantizer, codec_of
from .schedule import aggregation_steps, schedule_of
from .streaming import StreamingConfig

if TYPE_CHECKING:  # imported where used: fldp-cost alone needs rich
    from omegaconf import DictConfig
    from rich.table import Table


# the collectives' time costs, Table 1 (D: message bytes, n: processes, B: bytes/s)
def C_AG(D, n, B):
    return D * (n - 1) / (n * B)  # noqa: E704


def C_RS(D, n, B):
    return D * (n - 1) / (n * B)  # noqa: E704


def C_AR(D, n, B):
    return 2 * D * (n - 1) / (n * B)  # noqa: E704


def C_BC(D, n, B):
    return D / B  # noqa: E704


@dataclass(frozen=True)
class Units:
    """The model as FSDP2 shards it: one unit per decoder layer plus the root. Parameters are kept
    in named_parameters order (FedAvg's bucketing follows it), each with its unit's index."""

    params: tuple[tuple[tuple[int, ...], int], ...]  # (global shape, unit index)
    element_size: int
    names: tuple[str, ...] = ()  # the parameters' names (algorithm.federate matches them)

    @property
    def L(self) -> int:
        return len({unit for _, unit in self.params})

    def total_bytes(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.params) * self.element_size

    def padded_shard_bytes(self, S: int) -> list[int]:
        """Per unit, the bytes one rank holds (and all-gathers) with FSDP2's dim-0 padding."""
        out = [0] * self.L
        for shape, unit in self.params:
            out[unit] += shard_piece(shape[0], S) * math.prod(shape[1:]) * self.element_size
        return out

    def full_bytes(self) -> list[int]:
        """Per unit, its parameters in full (what an all-gather gives), the root last."""
        out = [0] * self.L
        for shape, unit in self.params:
            out[unit] += math.prod(shape) * self.element_size
        return out

    def local_shards(self, S: int, index: int) -> list[int]:
        """Bytes of each parameter's unpadded local shard on shard index `index` (FedAvg's input)."""
        out = []
        for shape, _ in self.params:
            chunk = shard_piece(shape[0], S)
            rows = max(0, min(chunk, shape[0] - index * chunk))
            out.append(rows * math.prod(shape[1:]) * self.element_size)
        return out


def model_units(model, dtype: torch.dtype) -> Units:
    """Units of a (meta-device) transformers Llama as parallelize() wraps it: each decoder layer
    is a unit, the remaining parameters (embeddings, final norm, lm_head) the root unit."""
    unit_of = {id(p): i for i, layer in enumerate(model.model.layers) for p in layer.parameters()}
    root = len(model.model.layers)
    named = list(model.named_parameters())
    params = tuple((tuple(p.shape), unit_of.get(id(p), root)) for _, p in named)
    return Units(
        params=params, element_size=torch.empty((), dtype=dtype).element_size(), names=tuple(n for n, _ in named)
    )


def config_model(conf: Config) -> tuple:
    """A config's Llama on the meta device (the vocabulary from the config, else its tokenizer) and
    its Units in the run's dtype."""
    from .data import load_tokenizer
    from .model import DTYPES, build_model, llama_config

    vocab = conf.model.vocab_size or len(load_tokenizer(conf.dataset.tokenizer))
    model = build_model(llama_config(conf.model, vocab), "meta")
    return model, model_units(model, DTYPES[conf.trainer.precision])


def config_shapes(conf: Config) -> tuple:
    """What config_model gives fldp-plan, from the config alone (no model, no transformers import):
    the Llama's Shapes, its buffers' bytes and its Units in the run's dtype, as config_model's
    model has them (tests/test_memory.py compares the two)."""
    from .memory import Shapes, llama_parameters, rotary_buffers
    from .model import DTYPES, fsdp_unit

    m = conf.model
    vocab = m.vocab_size
    if not vocab:  # config_model's: the tokenizer's vocabulary
        from .data import load_tokenizer

        vocab = len(load_tokenizer(conf.dataset.tokenizer))
    shapes = Shapes(
        m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, vocab
    )
    named = llama_parameters(shapes, bool(m.tie_word_embeddings))
    root = shapes.layers  # model_units' order: decoder layer i is unit i, the root unit last
    params = tuple((shape, fsdp_unit(n) - 1 if fsdp_unit(n) else root) for n, shape in named)
    element = torch.empty((), dtype=DTYPES[conf.trainer.precision]).element_size()
    return shapes, rotary_buffers(shapes), Units(params=params, element_size=element, names=tuple(n for n, _ in named))


def tiers(network, shape: MeshShape) -> dict:
    """Each mesh dimension's tier: the smallest whose block of ranks holds the dimension's groups."""
    extent = {"shard": shape.shard, "replicate": shape.replicate * shape.shard, "federation": shape.world}
    return {dim: next((t for t in network if t["ranks"] >= extent[dim]), network[-1]) for dim in DIMS}


def crossing_flows(shape: MeshShape, dim: str, procs_per_node: int, leaders_only: bool = False) -> int:
    """The most ring edges of `dim`'s groups that leave one node, or enter it, at once: with node-major
    ranks, every group of the dimension runs its collective at the same time, so these flows share
    the node's link. E.g. 2 nodes x 4: FSDP's ring of 8 crosses each way once (1), HSDP's 4
    replicate pairs (i, i+4) four times (4). leaders_only: only replica 0's groups (FedAvg's
    leader_broadcast averages across groups among replica 0 alone)."""
    stride = {"shard": 1, "replicate": shape.shard, "federation": shape.group_size}[dim]
    size = getattr(shape, dim)
    out: Counter[int] = Counter()
    into: Counter[int] = Counter()
    for first in range(shape.world):
        if size == 1 or (first // stride) % size:  # one pass per group, from its first member
            continue
        if leaders_only and shape.coords(first)[1]:
            continue
        members = [first + k * stride for k in range(size)]
        for a, b in zip(members, members[1:] + members[:1]):
            if a // procs_per_node != b // procs_per_node:
                out[a // procs_per_node] += 1
                into[b // procs_per_node] += 1
    return max([1, *out.values(), *into.values()])


def fedavg_mode(conf: Config) -> str:
    """FL+HSDP's mode: the configured algorithm's, else the one the topology's reference numbers ran."""
    if conf.algorithm.fedavg is not None:
        return conf.algorithm.fedavg.mode
    return conf.topology.fedavg_mode or default_of("algorithm.fedavg.mode")


def leads(conf: Config) -> bool:
    """Whether FL+HSDP's FedAvg is leader_broadcast (fedavg_mode): replica 0 of each group averages
    across groups, then broadcasts to its replicas."""
    return fedavg_mode(conf) == "leader_broadcast"


def tier_bandwidth(
    network, shape: MeshShape, scale: float = 1.0, procs_per_node: int | None = None, leaders_only: bool = False
) -> dict[str, float]:
    """Bytes/s of each mesh dimension, per rank: its tier's bandwidth, which is per rank (the paper's
    B_n), or, for a tier with `link: node` (a node's link, e.g. the netns topologies), that link's
    share of one of the flows crossing it at once (`crossing_flows`; needs procs_per_node)."""
    out = {}
    for dim, tier in tiers(network, shape).items():
        leaders = leaders_only and dim == "federation"
        shared = 1
        if tier.get("link") == "node":
            if procs_per_node is None:
                raise ValueError(f"tier_bandwidth: the {dim} tier is a node's link; procs_per_node is needed")
            shared = crossing_flows(shape, dim, procs_per_node, leaders)
        out[dim] = tier["gbit_s"] * 1e9 / 8 * scale / shared
    return out


_DIM_OF = {"broadcast": "replicate"}  # FedAvg's broadcast runs on the replicate groups


@dataclass
class Prediction:
    shape: MeshShape
    every: object  # an integer A, a schedule, or None (no aggregation)
    aggregations_per_step: float = 0.0  # aggregations over the run / its steps (1/A without steps)
    # per step, per rank: bytes sent on each dimension (aggregations amortised over the run)
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    # on a step with / without aggregation: bytes and collectives per dimension
    step_bytes: dict[str, float] = field(default_factory=dict)
    step_collectives: dict[str, int] = field(default_factory=dict)
    aggregation_bytes: dict[str, float] = field(default_factory=dict)
    aggregation_collectives: dict[str, int] = field(default_factory=dict)
    # seconds per step, per term, for both variants
    paper: dict[str, float] = field(default_factory=dict)
    exact: dict[str, float] = field(default_factory=dict)
    # `exact` with gloo's collectives (what a CPU run sends) and a latency per ring step, and the
    # bytes per rank it counts
    gloo: dict[str, float] = field(default_factory=dict)
    gloo_bytes: dict[str, float] = field(default_factory=dict)
    # the dimensions on a `link: node` tier (a netns topology's capped link), the flows crossing it
    # at once per dimension, and B per dimension
    capped: tuple[str, ...] = ()
    flows: dict[str, int] = field(default_factory=dict)
    bandwidth: dict[str, float] = field(default_factory=dict)
    # algorithm.streaming: per fragment, one aggregation's bytes and collectives per dimension (one
    # fragment: the whole model's, as aggregation_bytes), the all-reduces in flight during `overlap`
    # steps; each fragment's gloo seconds (latency included) of its all-reduce on the federation
    # dimension, and of the merge's broadcast to the replicas (leader_broadcast), which overlap cannot hide
    fragment_bytes: list[dict[str, float]] = field(default_factory=list)
    fragment_collectives: list[dict[str, int]] = field(default_factory=list)
    fragment_seconds: list[float] = field(default_factory=list)
    fragment_broadcast_seconds: list[float] = field(default_factory=list)
    fragment_rate: list[float] = field(default_factory=list)  # per fragment, its aggregations per step
    overlap: int = 0

    @property
    def peak_aggregation_bytes(self) -> float:
        """The most federation bytes one rank sends on an aggregation step of the run's periodic
        schedule (one fragment; the last step sends every fragment not in flight)."""
        return max((f.get("federation", 0.0) for f in self.fragment_bytes), default=0.0)

    def exposed_aggregation(self, compute_s: float) -> float:
        """Seconds of aggregation left on the critical path per period A (each fragment once): its
        all-reduce less the `overlap` steps of `compute_s` each it is in flight during (all of it
        without overlap), and the merge's broadcast to the replicas. Only the collectives' time;
        packing, the outer step and unpacking come on top."""
        return sum(
            max(0.0, t - self.overlap * compute_s) + b
            for t, b in zip(self.fragment_seconds, self.fragment_broadcast_seconds)
        )

    def time(self, dims, ring: bool = False) -> float:
        """Seconds per step of the collectives on `dims`: the gloo variant, or (ring=True) the exact one."""
        terms = self.exact if ring else self.gloo
        return sum(v for k, v in terms.items() if _DIM_OF.get(k, k) in dims)

    def capped_time(self, ring: bool = False) -> float:
        """Seconds per step on the capped link (a netns topology's inter-node tier)."""
        return self.time(self.capped, ring)

    def link_bytes(self) -> float:
        """Bytes per step one node sends over its capped link (gloo's collectives, every flow)."""
        return sum(
            sent * self.flows[_DIM_OF.get(k, k)]
            for k, sent in self.gloo_bytes.items()
            if _DIM_OF.get(k, k) in self.capped
        )

    def expected_row(self, aggregated: bool, sent=None, merged=None) -> dict:
        """The bytes_*/collectives_* fields metrics.jsonl must show for one step (rank 0 = the
        maximum over ranks: shard index 0 holds the largest local shards, replica 0 leads).
        Streaming: the fragments whose all-reduce started (`sent`) and those merged, whose new
        weights the leaders broadcast (`merged`); None: the whole model, if `aggregated`."""
        row = {}
        for d in DIMS:
            if sent is None:
                extra_b = self.aggregation_bytes.get(d, 0.0) if aggregated else 0.0
                extra_c = self.aggregation_collectives.get(d, 0) if aggregated else 0
            else:
                which = sent if d == "federation" else merged
                extra_b = sum(self.fragment_bytes[p].get(d, 0.0) for p in which)
                extra_c = sum(self.fragment_collectives[p].get(d, 0) for p in which)
            row[f"bytes_{d}"] = self.step_bytes.get(d, 0.0) + extra_b
            row[f"collectives_{d}"] = self.step_collectives.get(d, 0) + extra_c
        return row


def _fragments(streaming, names: list[str], keep: list[bool]) -> list[int]:
    """Each parameter's fragment as the trainer deals them: over the federated parameters only
    (a parameter left local gets -1, no fragment's)."""
    dealt = iter(streaming.fragment_of([n for n, k in zip(names, keep) if k]))
    return [next(dealt) if k else -1 for k in keep]


def predict(
    units: Units,
    shape: MeshShape,
    bandwidth: dict[str, float],
    every=None,
    mode: str = "leader_broadcast",
    bucket_mb: float = 25.0,
    reshard_root_after_forward: bool = False,
    latency: dict[str, float] | None = None,
    steps: int | None = None,
    federated: list[bool] | None = None,
    reduce_element_size: int | None = None,
    streaming: StreamingConfig | None = None,
    quantizer: Quantizer | None = None,
    grad_element_size: int | None = None,
) -> Prediction:
    """every: an integer A or a schedule (None: no aggregation); steps: the run's length, over which
    the aggregations are amortised (None: the schedule's long-run rate, 1 / its last A); federated:
    per parameter, whether FedAvg averages it (None: all); reduce_element_size: bytes per element of
    FedAvg's all-reduce (None: the parameters'); its broadcast to the replicas carries the new
    weights in the parameters' dtype. streaming: fragments (by units.names) and overlap. quantizer:
    algorithm.outer.quantize, each bucket's change padded to F chunks of whole blocks, sent with its
    scales in an all-to-all and an all-gather ((F - 1) / F of it each, as a ring all-reduce's halves).
    grad_element_size: bytes per element of the gradients' reductions (fsdp.reduce_dtype; None: the parameters')."""
    aggregates = every is not None and shape.federation > 1
    rate = 0.0
    if aggregates:
        schedule = schedule_of(every)
        rate = len(aggregation_steps(schedule, steps)) / steps if steps else 1 / schedule[-1][1]
    pred = Prediction(shape, every, rate)
    keep = federated if federated is not None else [True] * len(units.params)
    # FedAvg's payload per element against the parameters' (a cast to reduce_dtype)
    cast = (reduce_element_size or units.element_size) / units.element_size
    if quantizer is not None:  # the paper's variant: no padding
        cast = quantizer.wire_bytes(quantizer.block) / quantizer.block / units.element_size
    pred.paper = _paper_terms(units, shape, bandwidth, keep, cast, rate, mode)
    grad_cast = (grad_element_size or units.element_size) / units.element_size
    gathers = _step_terms(pred, units, shape, reshard_root_after_forward, grad_cast)
    streaming = streaming or StreamingConfig()
    fragment_weights: list[float] = []  # per fragment, the bytes of its federated local shards on this rank
    fragment_rate: list[float] = []  # per fragment, its aggregations per step
    if aggregates:
        fragment_weights = _fragment_terms(pred, units, keep, cast, bucket_mb, streaming, quantizer, mode)
        fragment_rate = _fragment_rates(streaming, schedule, steps, rate)
        pred.overlap = streaming.overlap
    pred.fragment_rate = fragment_rate
    _exact_terms(pred, bandwidth)
    _gloo_terms(pred, units, bandwidth, latency, gathers, fragment_weights, quantizer is not None)
    return pred


def _paper_terms(units: Units, shape: MeshShape, bandwidth: dict, keep: list[bool], cast: float, rate: float, mode):
    """Eq. 1-5 as printed: M L with M the (unpadded) layer shard size; FedAvg's of the federated ones."""
    F, R, S = shape.federation, shape.replicate, shape.shard
    ML = units.total_bytes() / S
    ML_weights = sum(math.prod(dims) for (dims, _), k in zip(units.params, keep) if k) * units.element_size / S
    return {
        "shard": 2 * C_AG(ML, S, bandwidth["shard"]) + C_RS(ML, S, bandwidth["shard"]),  # Eq. 1
        "replicate": C_AR(ML, R, bandwidth["replicate"]),  # Eq. 2
        "federation": C_AR(ML_weights * cast, F, bandwidth["federation"]) * rate,  # Eq. 3-4
        # Eq. 5
        "broadcast": C_BC(ML_weights, R, bandwidth["replicate"]) * rate
        if R > 1 and mode == "leader_broadcast"
        else 0.0,
    }


def _step_terms(
    pred: Prediction, units: Units, shape: MeshShape, reshard_root_after_forward: bool, grad_cast: float = 1.0
) -> list[int]:
    """Every step's bytes and collectives: FSDP2 units, padding; per unit one reduce-scatter and two
    all-gathers (forward, backward), but one for the root unless it reshards after forward (FSDP1's
    policy); the gradients' reductions `grad_cast` times the parameters' bytes (fsdp.reduce_dtype).
    The all-gathers per unit."""
    R, S, L = shape.replicate, shape.shard, units.L
    padded = units.padded_shard_bytes(S)
    gathers = [2] * (L - 1) + [2 if reshard_root_after_forward else 1]  # the root is the last unit
    if S > 1:
        pred.step_bytes["shard"] = (S - 1) * sum(b * (g + grad_cast) for b, g in zip(padded, gathers))
        pred.step_collectives["shard"] = sum(gathers) + L
    if R > 1:
        pred.step_bytes["replicate"] = 2 * (R - 1) / R * sum(padded) * grad_cast
        pred.step_collectives["replicate"] = L
    return gathers


def _fragment_terms(pred: Prediction, units: Units, keep, cast: float, bucket_mb: float, streaming, quantizer, mode):
    """Each fragment's aggregation bytes and collectives. FedAvg buckets the federated, non-empty
    local shards of each fragment by their own size, then casts; a bucket never spans fragments.
    Returns each fragment's bytes of federated local shards on this rank (what the leaders broadcast)."""
    F, R, S = pred.shape.federation, pred.shape.replicate, pred.shape.shard
    of = _fragments(streaming, list(units.names), keep) if streaming.fragments > 1 else [0] * len(units.params)
    shards = units.local_shards(S, 0)
    weights = []
    for p in range(streaming.fragments):
        local = [b for b, k, f in zip(shards, keep, of) if k and b and f == p]
        # one dtype: buckets split by size alone
        grouped = bucket_indices([(b, torch.float32) for b in local], int(bucket_mb * 2**20))
        buckets = len(grouped)
        bytes_, count = {"federation": 2 * (F - 1) / F * sum(local) * cast}, {"federation": buckets}
        if quantizer is not None:  # per bucket: (F - 1) / F of F padded chunks, twice
            elements = [sum(local[i] for i in g) // units.element_size for g in grouped]
            bytes_["federation"] = sum(2 * (F - 1) * quantizer.wire_bytes(quantizer.chunk(n, F)) for n in elements)
            count["federation"] = 2 * buckets
        if R > 1 and mode == "leader_broadcast":
            bytes_["replicate"], count["replicate"] = (R - 1) / R * sum(local), buckets
        pred.fragment_bytes.append(bytes_)
        pred.fragment_collectives.append(count)
        weights.append(sum(local))
    pred.aggregation_bytes = {d: sum(f.get(d, 0.0) for f in pred.fragment_bytes) for d in pred.fragment_bytes[0]}
    pred.aggregation_collectives = {
        d: sum(f.get(d, 0) for f in pred.fragment_collectives) for d in pred.fragment_collectives[0]
    }
    return weights


def _fragment_rates(streaming, schedule, steps: int | None, rate: float) -> list[float]:
    """Each fragment's aggregations per step: from the plan the trainer follows over the run's
    steps with streaming, else the schedule's rate."""
    if (streaming.fragments > 1 or streaming.exchanges) and steps:
        sends = Counter(p for t in range(1, steps + 1) for p in streaming.exchange(t, schedule[0][1], steps).sends)
        return [sends[p] / steps for p in range(streaming.fragments)]
    return [rate] * streaming.fragments


def _per_step(pred: Prediction, key: str, d: str) -> float:
    """Fragments' `key` (fragment_bytes or fragment_collectives) on dimension d, per step."""
    return sum(getattr(pred, key)[p].get(d, 0) * pred.fragment_rate[p] for p in range(len(pred.fragment_bytes)))


def _exact_terms(pred: Prediction, bandwidth: dict) -> None:
    """Bytes per step per dimension, and the exact variant's seconds: bytes over bandwidth."""
    pred.bytes_per_step = {d: pred.step_bytes.get(d, 0.0) + _per_step(pred, "fragment_bytes", d) for d in DIMS}
    pred.exact = {
        "shard": pred.step_bytes.get("shard", 0.0) / bandwidth["shard"],
        "replicate": pred.step_bytes.get("replicate", 0.0) / bandwidth["replicate"],
        "federation": _per_step(pred, "fragment_bytes", "federation") / bandwidth["federation"],
        "broadcast": _per_step(pred, "fragment_bytes", "replicate") / bandwidth["replicate"],
    }


def _gloo_terms(pred: Prediction, units: Units, bandwidth, latency, gathers, fragment_weights, quantized: bool) -> None:
    """The gloo variant (measured on the netns links, docs/netns.md "What gloo really sends"): gloo's
    reduce-scatter is an all-reduce (2 (S-1) M per rank, twice a ring's) and its broadcast is flat
    (the root sends the whole message to each of the R-1 others); all-gather and all-reduce are
    rings. Every step of a ring (a broadcast: every send) adds its dimension's latency (alpha-beta)."""
    F, R, S, L = pred.shape.federation, pred.shape.replicate, pred.shape.shard, units.L
    lat = {d: (latency or {}).get(d, 0.0) for d in DIMS}
    # steps of one federation collective: a ring all-reduce's 2 (F - 1), or (quantised) the
    # all-to-all's and the all-gather's F - 1 each
    fed_steps = (F - 1) if quantized else 2 * (F - 1)
    broadcasts = "replicate" in pred.aggregation_bytes
    ring = {  # ring steps per step (aggregations amortised over the run)
        "shard": (sum(gathers) * (S - 1) + L * 2 * (S - 1)) if S > 1 else 0,
        "replicate": L * 2 * (R - 1),
        "federation": _per_step(pred, "fragment_collectives", "federation") * fed_steps,
        "broadcast": _per_step(pred, "fragment_collectives", "replicate") * (R - 1) if broadcasts else 0,
    }
    padded = units.padded_shard_bytes(S)
    pred.gloo_bytes = {  # per rank per step
        "shard": (S - 1) * sum(b * (g + 2) for b, g in zip(padded, gathers)),
        "replicate": pred.step_bytes.get("replicate", 0.0),
        "federation": _per_step(pred, "fragment_bytes", "federation"),
        # gloo's broadcast is flat: the leader sends the weights to each of the R-1 others
        "broadcast": sum((R - 1) * w * r for w, r in zip(fragment_weights, pred.fragment_rate)) if broadcasts else 0.0,
    }
    pred.gloo = {
        term: sent / bandwidth[_DIM_OF.get(term, term)] + lat[_DIM_OF.get(term, term)] * ring[term]
        for term, sent in pred.gloo_bytes.items()
    }
    pred.fragment_seconds = [
        f.get("federation", 0.0) / bandwidth["federation"] + lat["federation"] * c["federation"] * fed_steps
        for f, c in zip(pred.fragment_bytes, pred.fragment_collectives)
    ]
    pred.fragment_broadcast_seconds = [
        ((R - 1) * w / bandwidth["replicate"] + lat["replicate"] * c["replicate"] * (R - 1)) if broadcasts else 0.0
        for w, c in zip(fragment_weights, pred.fragment_collectives)
    ]


def predict_for(
    conf: Config, units: Units, aggregates: bool | None = None, shape: MeshShape | None = None, network=None
) -> Prediction:
    """The prediction for a config (or another algorithm and mesh on its topology, or another
    network): the schedule (default A = 8) over the run's steps, the federated parameters, the
    reduce dtype, FedAvg mode and the topology's tiers (a `link: node` tier shared by the flows
    crossing it; `latency_ms` and `delay_ms` per ring step, if given)."""
    from .model import fsdp_reduce_dtype
    from .slurm import planned_steps

    algorithm, topology = conf.algorithm, conf.topology
    shape = shape or MeshShape(conf.mesh.federation, conf.mesh.replicate, conf.mesh.shard)
    if aggregates is None:  # the configured algorithm's (algorithm.aggregation), else the one asked for
        aggregates = bool(algorithm.aggregation)
    federated = federated_mask(algorithm.federate or [".*"], list(units.names)) if units.names else None
    reduce_dtype = REDUCE_DTYPES[algorithm.outer.reduce_dtype]
    grad_dtype = fsdp_reduce_dtype(conf)
    network = network if network is not None else topology.network
    leaders = leads(conf) and shape.replicate > 1
    bandwidth = tier_bandwidth(network, shape, procs_per_node=topology.procs_per_node, leaders_only=leaders)
    on = tiers(network, shape)
    latency = {d: (on[d].get("latency_ms", 0.0) + on[d].get("delay_ms", 0.0)) / 1e3 for d in DIMS}
    pred = predict(
        units,
        shape,
        bandwidth,
        (algorithm.every or 8) if aggregates else None,
        fedavg_mode(conf),
        algorithm.fedavg.bucket_mb if algorithm.fedavg else default_of("algorithm.fedavg.bucket_mb"),
        conf.fsdp.reshard_root_after_forward,
        latency,
        steps=planned_steps(conf, shape.world),
        federated=federated,
        reduce_element_size=reduce_dtype.itemsize if reduce_dtype else None,
        streaming=StreamingConfig.from_algorithm(algorithm) if aggregates else None,
        quantizer=codec_of(algorithm.outer) if aggregates else None,
        grad_element_size=grad_dtype.itemsize if grad_dtype is not None else None,
    )
    pred.capped = tuple(d for d in DIMS if on[d].get("link") == "node")
    pred.flows = {
        d: crossing_flows(shape, d, topology.procs_per_node, leaders and d == "federation") for d in pred.capped
    }
    pred.bandwidth = bandwidth
    return pred


def link_extra(conf: Config, units: Units, aggregates: bool | None = None, shape: MeshShape | None = None) -> float:
    """Seconds per step a netns run adds to the same run on loopback: the collectives of the
    dimensions on the capped link, at the link's rate, less what they cost on the node tier
    (loopback), where a plain local run sends them. 0 without a `link: node` tier."""
    on_link = predict_for(conf, units, aggregates, shape)
    world = conf.topology.nodes * conf.topology.procs_per_node
    loopback = [{**conf.topology.network[0], "ranks": world}]  # every rank on one "node"
    on_loopback = predict_for(conf, units, aggregates, shape, network=loopback)
    return on_link.capped_time() - on_loopback.time(on_link.capped)


# ---------------------------------------------------------------- CLI: python -m fldp.cost
def algorithms_by_layout() -> dict[str, DictConfig]:
    """The algorithms conf/algorithm declares with dimensions of their own (an algorithm that extends
    another inherits its mesh), keyed as topology.layouts is: by the dimensions they have."""
    from omegaconf import OmegaConf

    from .setting import CONF

    out: dict = {}
    for path in sorted((CONF / "algorithm").glob("*.yaml")):
        algorithm = OmegaConf.load(path)
        if "dims" in algorithm:
            out.setdefault("_".join(d for d in DIMS if d in algorithm.dims), algorithm)
    return out


def paper_step_times() -> dict[str, float]:
    """The paper's measured overall step times (Table 4), from analysis/paper_values.json (data of
    the package fldp.analysis, in the wheel as in an editable install)."""
    import json
    from importlib.resources import files

    table4 = json.loads((files("fldp.analysis") / "paper_values.json").read_text())["table4"]
    overall = table4["columns"].index("overall")
    return {a: row[overall] for a, row in table4["mean"].items()}


def table(conf: Config) -> list[dict]:
    """One row per algorithm, on the topology's layout for it."""
    model, units = config_model(conf)
    capacity = conf.topology.memory_gb
    measured = paper_step_times() if conf.topology.name == "leonardo_512" else {}
    rows = []
    algorithms = algorithms_by_layout()
    for key, layout in conf.topology.layouts.items():
        name = algorithms[key].name
        shape = MeshShape(layout["federation"], layout["replicate"], layout["shard"])
        pred = predict_for(conf, units, bool(algorithms[key].aggregation), shape)
        bandwidth = pred.bandwidth
        paper_total, exact_total = sum(pred.paper.values()), sum(pred.exact.values())
        memory = for_config(conf, model, units, shape)
        rows.append(
            {
                "algorithm": name,
                "mesh": str(shape),
                "every": pred.every,
                "aggregations_per_step": pred.aggregations_per_step,
                **{f"B_{d}_gbit_s": bandwidth[d] * 8 / 1e9 for d in DIMS},
                **{f"paper_{k}_s": v for k, v in pred.paper.items()},
                "paper_total_s": paper_total,
                **{f"exact_{k}_s": v for k, v in pred.exact.items()},
                "exact_total_s": exact_total,
                "exact_over_paper": exact_total / paper_total if paper_total else None,
                **{f"bytes_{d}_per_step": pred.bytes_per_step[d] for d in DIMS},
                "measured_step_s": measured.get(name),
                "gloo_total_s": sum(pred.gloo.values()),
                "gloo_capped_s": pred.capped_time() if pred.capped else None,
                # algorithm.streaming: the largest fragment's share of one whole-model aggregation's bytes
                "peak_share": (
                    pred.peak_aggregation_bytes / pred.aggregation_bytes["federation"]
                    if pred.aggregation_bytes.get("federation")
                    else None
                ),
                **{f"memory_{k.replace(' ', '_')}_bytes": v for k, v in memory.terms.items()},
                "memory_peak_bytes": memory.peak,
                "memory_fits": memory.peak <= capacity * 1e9 if capacity else None,
            }
        )
    return rows


def _number(x) -> str:
    """4 significant digits; '-' for a value that does not apply."""
    return "-" if x is None or x != x else f"{x:.4g}"


def _byte_unit(values) -> tuple[str, float]:
    """The largest of GB, MB, kB, B in which the largest value is at least 1."""
    top = max((v for v in values if v == v), default=0.0)
    return next(((u, f) for u, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if top >= f), ("B", 1.0))


def _table(title: str, columns: list[tuple[str, list]], rows) -> Table:
    from rich import box
    from rich.table import Table

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("algorithm", no_wrap=True)
    for header, _ in columns:
        t.add_column(header, justify="right", overflow="fold", min_width=10)  # a number or "federation"
    for i, row in enumerate(rows):
        t.add_row(row["algorithm"], *[v[i] if isinstance(v[i], str) else _number(v[i]) for _, v in columns])
    return t


def _time_columns(rows, prefix: str) -> list[tuple[str, list]]:
    def col(key):
        return [r[f"{prefix}_{key}_s"] for r in rows]  # noqa: E704

    return [
        ("shard [s]", col("shard")),
        ("replicate [s]", col("replicate")),
        ("federation + broadcast [s]", [a + b for a, b in zip(col("federation"), col("broadcast"))]),
        ("total [s]", col("total")),
    ]


INNERMOST_FIRST = tuple(reversed(DIMS))  # shard, replicate, federation: the time columns' order


def tables(conf: Config, rows) -> list:
    """fldp-cost's report as rich tables, each narrow enough for a 100-column terminal."""
    mesh = [
        ("mesh FxRxS", [r["mesh"] for r in rows]),
        *[(f"B {d} [Gbit/s]", [r[f"B_{d}_gbit_s"] for r in rows]) for d in INNERMOST_FIRST],
        ("aggregations / step", [r["aggregations_per_step"] for r in rows]),
    ]
    if any(r["measured_step_s"] is not None for r in rows):
        mesh.append(("paper's step [s]", [r["measured_step_s"] for r in rows]))
    exact = _time_columns(rows, "exact") + [("exact / paper [x]", [r["exact_over_paper"] for r in rows])]
    unit, scale = _byte_unit([r[f"bytes_{d}_per_step"] for r in rows for d in DIMS])
    sent = [(f"{d} [{unit}]", [r[f"bytes_{d}_per_step"] / scale for r in rows]) for d in INNERMOST_FIRST]
    if conf.algorithm.streaming.fragments > 1:
        sent.append(("peak fragment share [fraction]", [r["peak_share"] for r in rows]))
    out = [
        _table("Mesh and bandwidth per rank", mesh, rows),
        _table("Communication time per training step, 'paper': Eq. 1-5 as printed", _time_columns(rows, "paper"), rows),
        _table(
            "Communication time per training step, 'exact': bytes a ring collective sends per rank / B", exact, rows
        ),
    ]
    if any(r["gloo_capped_s"] is not None for r in rows):  # a netns topology
        out.append(
            _table(
                "Communication time per training step with gloo's collectives (see below)",
                [
                    ("total [s]", [r["gloo_total_s"] for r in rows]),
                    ("on the capped link [s]", [r["gloo_capped_s"] for r in rows]),
                ],
                rows,
            )
        )
    return out + [_table("Bytes sent per rank per training step ('exact')", sent, rows), _memory_table(conf, rows)]


def _memory_table(conf: Config, rows):
    """fldp/memory.py's terms at the peak, grouped, and whether it fits topology.memory_gb."""

    def col(*terms):
        return [sum(r[f"memory_{t}_bytes"] for t in terms) / 1e9 for r in rows]

    columns = [
        ("params + optim. [GB]", col("parameters", "optimizer")),
        ("outer [GB]", col("outer")),
        ("gathered [GB]", col("root_unit_gathered", "next_layer_gathered")),
        ("activ. + loss [GB]", col("activations", "loss_backward")),
        ("peak [GB]", [r["memory_peak_bytes"] / 1e9 for r in rows]),
    ]
    capacity = conf.topology.memory_gb
    if capacity:
        columns.append((f"fits {capacity:g} GB", ["yes" if r["memory_fits"] else "no" for r in rows]))
    checkpointing = conf.model.activation_checkpointing
    return _table(
        f"Memory per rank at its peak (fldp/memory.py; activation checkpointing: {checkpointing})", columns, rows
    )


def _print_table(conf: Config, rows) -> None:
    from rich.console import Console

    console = Console(highlight=False, markup=False)  # "[s]" is a unit, not a style
    console.print(
        f"fldp-cost: model={conf.model.name} ({conf.trainer.precision}), topology={conf.topology.name}, "
        f"A={conf.algorithm.every or 8}. Aggregations are amortised over the run's steps.\n"
    )
    for t in tables(conf, rows):
        console.print(t)
    if any(r["measured_step_s"] is not None for r in rows):
        console.print("paper's step: the whole training step the paper measured (its Table 4, overall).")
    if conf.algorithm.streaming.fragments > 1:
        console.print(
            "peak fragment share: the largest streaming fragment's bytes per aggregation / the whole model's."
        )
    if any(r["gloo_capped_s"] is not None for r in rows):
        console.print(
            "B of a `link: node` tier: the node's link / the flows crossing it at once. gloo: 'exact' "
            "with gloo's reduce-scatter (an all-reduce) and broadcast (flat), plus latency_ms per "
            "collective."
        )
    console.print("--csv or --json: every number unrounded, one row per algorithm (docs/communication.md).")


OUTPUTS = ("--json", "--csv")


def _output_format(argv: list[str]) -> str:
    """table, json or csv, taken out of argv (Hydra would refuse them); exit 2 on both."""
    chosen = [a for a in argv if a in OUTPUTS]
    if len(set(chosen)) > 1:
        print("fldp-cost: --json and --csv exclude each other: choose one", file=sys.stderr)
        raise SystemExit(2)
    for a in chosen:
        argv.remove(a)
    return chosen[0].lstrip("-") if chosen else "table"


def main() -> None:
    import json

    import hydra

    from .errors import parsed_or_exit
    from .validation import checked

    output = _output_format(sys.argv)
    # a calculation, not a run: no output directory, no log file
    sys.argv += [
        "hydra.run.dir=.",
        "hydra.output_subdir=null",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
        "hydra/help=fldp_cost",
    ]

    from . import CONF

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    def _run(cfg) -> None:
        conf = parsed_or_exit("fldp-cost", lambda: checked(cfg))
        rows = table(conf)
        if output == "json":
            print(json.dumps(rows, indent=2))
        elif output == "csv":
            import pandas as pd

            print(pd.DataFrame(rows).to_csv(index=False), end="")
        else:
            _print_table(conf, rows)

    _run()


if __name__ == "__main__":
    main()
