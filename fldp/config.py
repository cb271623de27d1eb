"""The typed configuration: every key of every config group, as dataclasses whose fields say what
the key accepts (type, range or choices), what it is for, and its default. The one source of keys:
fldp/schema.py checks a composed config against `KEYS` (derived from `Config`), the reference page
(fldp/schema_doc.py) and the config fuzzer (tests/test_config_fuzz.py) read it, the run-level
sections' defaults reach Hydra from here (`run_defaults`, stored in Hydra's ConfigStore as
`fldp_run`, which conf/config.yaml lists first), and a component's own config (`OuterConfig`,
`StreamingSettings`) checks its values with its fields' specs and states here the combinations it
refuses.

A group's keys (algorithm, topology, model, dataset, cluster) have no default where each option file
sets them (`REQUIRED`); `optional=True` marks a key that variants of its group may lack, and the
default says what its absence means. No torch, no Hydra: a refused config costs only this.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .mesh import DIMS
from .schedule import schedule_of
from .spec import (
    REQUIRED,
    Bool,
    Choice,
    Int,
    ListOf,
    MapOf,
    Num,
    Section,
    Spec,
    Text,
    _is_int,
    check_fields,
    fields_of,
    flat_keys,
    section,
    setting,
)

# The choices of the algorithm's keys
MODES = ("leader_broadcast", "all_replicas")
OUTER = ("sgd", "adam")
REDUCE_DTYPES = (None, "bf16", "fp32")
QUANTIZE = ("int8", "fp8", "int4")  # fldp/quantize.py's CODECS, by name (tests/test_quantize.py)
STREAMING_LAYOUTS = ("strided", "contiguous")
# topology.layouts: one (F, R, S) per set of dimensions an algorithm can have (fldp_layout's keys)
LAYOUTS = ("shard", "replicate_shard", "federation_shard", "federation_replicate_shard")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
FEDAVG = ("algorithm.aggregation", ("fedavg",))  # ... only an aggregating algorithm has
# The keys of a SLURM cluster config (conf/cluster/slurm.yaml, leonardo.yaml): allowed in one, also
# forked locally with cluster.launcher=local, needed when it submits; refused on cluster=local.
SLURM: dict[str, Any] = dict(
    when=("cluster.launcher", ("slurm", "local")), needed_when=("cluster.launcher", ("slurm",))
)
SIMULATE = ("cluster.name", ("simulate",))
# What algorithm.outer's null lr / eps mean, per optimiser. sgd: lr 1 (with momentum 0: FedAvg).
# adam: FedAdam's server lr and tau (= eps) of Reddi et al. 2021, 1e-3 each, with torch's bias
# correction (their Algorithm 2 has none): the first step is about lr * sign(delta), so the shared
# lr 1 would move every weight by ~1 (init std 0.02). sgd's eps is unused.
OUTER_DEFAULTS = {"sgd": {"lr": 1.0, "eps": 1e-8}, "adam": {"lr": 1e-3, "eps": 1e-3}}


def _compiles(v) -> bool:
    re.compile(v)
    return isinstance(v, str)


def _schedule(v) -> bool:
    try:
        schedule_of(v)
    except ValueError:
        return False
    return True


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError("; ".join(problems))


SCALAR = Spec("a string, number or boolean", lambda v: isinstance(v, (str, int, float)))
MESH = Section(fields={d: Int(ge=1) for d in DIMS})


def Even(**kw) -> Spec:
    return Spec(
        "an even integer >= 2",
        lambda v: _is_int(v) and v >= 2 and v % 2 == 0,
        kind="int",
        bounds=(2, None, None, None),
        **kw,
    )


@dataclass(frozen=True)
class OuterConfig:
    """algorithm.outer: the outer optimiser on the pseudo-gradient (fldp/outer.py)."""

    name: str = setting(Choice(*OUTER), "sgd (FedAvg at lr 1, DiLoCo with Nesterov momentum) or adam (FedAdam)", "sgd")
    lr: float | None = setting(Num(gt=0, null=True), "outer learning rate; null: sgd 1.0, adam 1e-3", None)
    momentum: float = setting(Num(ge=0, lt=1), "sgd's momentum (DiLoCo: 0.9)", 0.0)
    nesterov: bool = setting(Bool(), "sgd's Nesterov momentum (DiLoCo: true)", False)
    betas: tuple = setting(
        ListOf("a list of 2 numbers in [0, 1)", item=Num(ge=0, lt=1), length=2), "adam's betas", (0.9, 0.99)
    )
    eps: float | None = setting(Num(gt=0, null=True), "adam's eps; null: 1e-3 (FedAdam's tau)", None)
    reduce_dtype: str | None = setting(
        Choice(*REDUCE_DTYPES), "the all-reduce's dtype; null: the parameters' (the authors' bf16)", None
    )
    quantize: str | None = setting(
        Choice(None, *QUANTIZE, optional=True),
        "the change since the last aggregation sent in 8 or 4 bits with an fp32 scale per block, summed "
        "in fp32 (fldp/quantize.py); null: not quantised",
        None,
    )
    quantize_block: int = setting(
        Even(optional=True), "elements per quantisation scale (even: int4 packs two per byte)", 256
    )
    error_feedback: bool = setting(
        Bool(optional=True), "add what a group's last quantisation lost to its next change", False
    )

    def __post_init__(self):
        _refuse(check_fields(self, "algorithm.outer"))
        _refuse(self.refused())
        for key, value in OUTER_DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)

    def refused(self) -> list[str]:
        """The combinations of its keys that cannot run."""
        out = []
        if self.quantize and self.reduce_dtype is not None:
            out.append(
                f"algorithm.outer.reduce_dtype={self.reduce_dtype} with algorithm.outer.quantize="
                f"{self.quantize}: the quantised exchange sums in fp32; set reduce_dtype to null"
            )
        if self.error_feedback and not self.quantize:
            out.append(
                f"algorithm.outer.error_feedback=true: needs algorithm.outer.quantize ({', '.join(QUANTIZE)}); "
                "without it nothing is lost to feed back"
            )
        if self.nesterov and not self.momentum:
            out.append(f"algorithm.outer.nesterov=True: needs algorithm.outer.momentum > 0, not {self.momentum!r}")
        return out

    @property
    def averages(self) -> bool:
        """Plain FedAvg: the new model is the groups' average itself."""
        return self.name == "sgd" and self.lr == 1 and self.momentum == 0


@dataclass(frozen=True)
class StreamingSettings:
    """algorithm.streaming (fldp/streaming.py): the model aggregated in fragments, at staggered steps."""

    fragments: int = setting(Int(ge=1), "parts the model is aggregated in, A / fragments steps apart; 1: whole", 1)
    layout: str = setting(
        Choice(*STREAMING_LAYOUTS),
        "strided: FSDP unit u in fragment u % P (each spans the depth); contiguous: consecutive units",
        "strided",
    )
    overlap: int = setting(Int(ge=0), "tau: inner steps a fragment's all-reduce stays in flight (< A / fragments)", 0)
    alpha: float = setting(Num(ge=0, le=1), "after a merge: lerp(global, local, alpha); 0 takes the global", 0.0)

    def __post_init__(self):
        _refuse(check_fields(self, "algorithm.streaming"))


@dataclass(frozen=True)
class FedAvgSection:
    """algorithm.fedavg: how the shards are exchanged."""

    bucket_mb: float = setting(Num(gt=0), "FedAvg coalesces local shards into buckets of at most this size (MB)", 25.0)
    mode: str = setting(
        Choice(*MODES, optional=True),
        "leader_broadcast: replica 0 of each group averages, then broadcasts (the paper's Eq. 5); "
        "all_replicas: every replica averages with its peers (the authors' code, Table 4)",
        "leader_broadcast",
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    """algorithm: conf/algorithm/*.yaml, one file per algorithm (a YAML: its mesh dimensions and
    what runs every A steps)."""

    name: str = setting(Text(), "the algorithm's name (records, run directories)")
    dims: list = setting(
        ListOf("a list of mesh dimensions, shard included", item=Choice(*DIMS), min_length=1),
        "the mesh dimensions it has; the others are pinned to 1",
    )
    aggregation: str | None = setting(Choice("fedavg", None), "what runs every A steps: fedavg, or nothing")
    every: Any = setting(
        Spec(
            "an integer A >= 1, or a schedule [[0, A0], [step1, A1], ...] of increasing steps from 0 and periods >= 1",
            _schedule,
            null=True,
        ),
        "aggregation period A (paper: 8), or a schedule; null without aggregation",
    )
    fedavg: FedAvgSection = section(FedAvgSection, "the exchange's settings; null without aggregation", null=True)
    outer: OuterConfig = section(OuterConfig, "the outer optimiser on the pseudo-gradient", optional=True, when=FEDAVG)
    elastic: bool = setting(
        Bool(optional=True, when=FEDAVG),
        "each group a torchft replica group: a failed group is restarted, heals from a live peer and rejoins",
        False,
    )
    streaming: StreamingSettings = section(
        StreamingSettings, "the model aggregated in fragments, at staggered steps", optional=True, when=FEDAVG
    )
    federate: list = setting(
        ListOf(
            "a list of regular expressions",
            item=Spec("a regular expression", _compiles),
            optional=True,
            when=FEDAVG,
        ),
        "parameters averaged across groups (full match of their names); the rest stays local to each group",
        [".*"],
    )


@dataclass(frozen=True)
class Tier:
    """One network tier of topology.network, innermost first."""

    tier: str = setting(Text(), "its name: node, inter-node, ...")
    ranks: int = setting(Int(ge=1), "ranks a collective on it spans at most")
    gbit_s: float = setting(Num(gt=0), "per-rank bottleneck bandwidth, Gbit/s (netns: the link's cap)")
    link: str | None = setting(Choice("node", None, optional=True), "node: a node's ranks share the link (netns)", None)
    delay_ms: float = setting(Num(ge=0, optional=True), "netns: one-way delay added by netem", 0.0)
    latency_ms: float = setting(Num(ge=0, optional=True), "the cost model's per-collective latency", 0.0)


def _section_of(cls: type) -> Section:
    return Section(fields=fields_of(cls))


@dataclass(frozen=True)
class TopologyConfig:
    """topology: conf/topology/*.yaml, the machine a run's ranks are laid out on."""

    name: str = setting(Text(), "the topology's name")
    nodes: int = setting(Int(ge=1), "nodes (hosts)")
    procs_per_node: int = setting(Int(ge=1), "ranks per node (node-major: a sharding group of this size is one node)")
    device: str = setting(Choice("cpu", "cuda"), "where each rank computes")
    memory_gb: float | None = setting(
        Num(gt=0, null=True, optional=True),
        "bytes per device in GB (1e9): whether a layout fits (fldp/memory.py)",
        None,
    )
    layouts: dict = setting(
        MapOf("a mapping of dimensions to {federation, replicate, shard}", value=MESH, keys=LAYOUTS),
        "the (F, R, S) of each set of dimensions an algorithm can have (the mesh's defaults)",
    )
    precision: str = setting(Choice("fp32", "bf16"), "the run's precision on it (trainer.precision's default)")
    network: list = setting(
        ListOf("a list of network tiers, innermost first", min_length=1, item=_section_of(Tier)),
        "its network tiers, innermost first, for the cost model and emulated links",
    )
    emulation_scale: float = setting(Num(gt=0), "comm.emulate's bandwidth = the tiers' x this")
    paper_setting: bool = setting(
        Bool(optional=True), "the dry run names every key in which a run differs from the paper's setting", False
    )
    fedavg_mode: str | None = setting(
        Choice(*MODES, optional=True), "algorithm.fedavg.mode its reference numbers ran with", None
    )
    emulation: str | None = setting(Choice("netns", None, optional=True), "netns: emulated nodes (fldp/netns.py)", None)
    profile: str | None = setting(
        Text(null=True, optional=True),
        "a profile fldp-calibrate wrote (compute, alpha and beta per tier); null: the published figures",
        None,
    )


@dataclass(frozen=True)
class RopeScaling:
    """model.rope_scaling: transformers' rope_scaling."""

    rope_type: str = setting(Choice(*ROPE_TYPES), "transformers' RoPE variant")
    factor: float = setting(Num(ge=1, optional=True), "context scaling factor", None)
    low_freq_factor: float = setting(Num(gt=0, optional=True), "llama3's low-frequency factor", None)
    high_freq_factor: float = setting(Num(gt=0, optional=True), "llama3's high-frequency factor", None)
    original_max_position_embeddings: int = setting(
        Int(ge=1, optional=True), "the context the model was trained with", None
    )
    attention_factor: float = setting(Num(gt=0, optional=True), "yarn/longrope attention scaling", None)
    beta_fast: float = setting(Num(gt=0, optional=True), "yarn's beta_fast", None)
    beta_slow: float = setting(Num(gt=0, optional=True), "yarn's beta_slow", None)


@dataclass(frozen=True)
class ModelConfig:
    """model: conf/model/*.yaml, transformers' LlamaConfig."""

    name: str = setting(Text(), "the model's name")
    vocab_size: int | None = setting(Int(ge=1, null=True), "null: the tokenizer's vocabulary size")
    hidden_size: int = setting(Int(ge=1), "the residual stream's width")
    intermediate_size: int = setting(Int(ge=1), "the MLP's width")
    num_hidden_layers: int = setting(Int(ge=1), "decoder layers (one FSDP unit each)")
    num_attention_heads: int = setting(Int(ge=1), "query heads")
    num_key_value_heads: int = setting(Int(ge=1), "key/value heads (grouped-query attention)")
    max_position_embeddings: int = setting(Int(ge=1), "the longest sequence")
    rope_theta: float = setting(Num(gt=0), "RoPE's base")
    rope_scaling: RopeScaling | None = section(RopeScaling, "RoPE scaling; null: none", null=True)
    rms_norm_eps: float = setting(Num(gt=0), "RMSNorm's epsilon")
    tie_word_embeddings: bool = setting(Bool(), "lm_head shares the embedding's weights")
    initializer_range: float = setting(Num(ge=0), "std of the normal initialisation")
    init_device: str = setting(
        Choice("cpu", "meta"), "cpu: build in full, then shard; meta: build empty, shard, init in place"
    )
    activation_checkpointing: str = setting(
        Choice("none", "full", optional=True),
        "full: each decoder layer's forward run again in its backward instead of keeping its activations",
        "none",
    )


@dataclass(frozen=True)
class DatasetConfig:
    """dataset: conf/dataset/*.yaml, what datasets.load_dataset reads and how it is cut in blocks."""

    name: str = setting(Text(), "the dataset's name")
    path: str = setting(Text(), "datasets.load_dataset path: a builder, a hub id or a local directory")
    config_name: str | None = setting(Text(null=True), "the dataset's configuration; null: its default")
    data_files: dict | None = setting(
        MapOf("a mapping of split to file", value=Text(), null=True), "files by split (the json builder)"
    )
    train_split: str = setting(Text(), "the split trained on")
    eval_split: str = setting(Text(), "the held-out split")
    text_field: str = setting(Text(), "the column holding the text")
    tokenizer: str = setting(Text(), "a tokenizer's hub id or directory")
    block_size: int = setting(Int(ge=2), "tokens per sequence")
    train_blocks: int | None = setting(Int(ge=1, null=True), "null: every full block of the split")
    eval_blocks: int | None = setting(Int(ge=1, null=True), "held-out blocks; null: every full block")
    cache_dir: str = setting(Text(), "where tokenised blocks are cached")
    max_passes: float | None = setting(
        Num(gt=0, null=True), "the most passes a run may make over the training blocks; null: any (logged)", None
    )


@dataclass(frozen=True)
class ClusterConfig:
    """cluster: conf/cluster/*.yaml, where ranks start: forked here (local), one SLURM job (slurm,
    leonardo), or none (simulate)."""

    name: str = setting(Text(), "the cluster's name (cluster=simulate: every group in one process)")
    master_addr: str | None = setting(
        Spec("a host name or address", lambda v: isinstance(v, str) and v != "", null=True, optional=True),
        "the rendezvous host; null: the allocation's first node (SLURM)",
        None,
    )
    master_port: int | None = setting(
        Int(ge=1, le=65535, null=True, optional=True),
        "the rendezvous port; null: a free one (SLURM: from the job id)",
        None,
    )
    timeout_s: float = setting(
        Num(gt=0, optional=True), "process-group timeout: a hung collective ends the run after this", 300
    )
    threads_per_worker: int = setting(Int(ge=1, optional=True), "torch CPU threads per rank", 1)
    restart_failed_groups: bool = setting(
        Bool(optional=True), "algorithm.elastic: a failed federation group is started again", True
    )
    max_restarts: int = setting(Int(ge=0, optional=True), "restarts per group at most", 3)
    join_timeout_s: float = setting(
        Num(gt=0, optional=True),
        "algorithm.elastic: how long an aggregation (and the groups' start) waits for a live group that "
        "is late before going on without it; a failed group is not waited for",
        120,
    )
    device: str = setting(Choice("cpu", "cuda", when=SIMULATE), "cluster=simulate: where the groups compute")
    threads: int | None = setting(
        Int(ge=1, null=True, when=SIMULATE), "cluster=simulate: torch CPU threads; null: torch's default"
    )
    reductions: str = setting(
        Choice("once", "ring", optional=True, when=SIMULATE),
        "cluster=simulate: once: a group's gradient from its whole batch, each reduction one torch.sum "
        "(rounded once); ring: each rank's gradient, each reduction summed along gloo's ring in the "
        "parameters' dtype, rounded at every hop (fldp/ring.py)",
        "once",
    )
    keep_freed_memory: bool = setting(
        Bool(optional=True, when=SIMULATE),
        "cluster=simulate: glibc keeps freed memory for the next large tensor instead of mapping fresh, "
        "zeroed pages every step (fldp.simulate.keep_freed_memory); false: glibc's defaults",
        True,
    )
    stacked_attention: bool = setting(
        Bool(optional=True, when=SIMULATE),
        "cluster=simulate on the CPU, reductions=once: every group's attention one kernel call under vmap "
        "(fldp/stacked_attention.py; in fp32 bit for bit the same); false: transformers' sdpa, group by group",
        True,
    )
    fused_adamw: bool = setting(
        Bool(optional=True, when=SIMULATE),
        "cluster=simulate, reductions=once: AdamW as one fused kernel a parameter (8-10x faster over the "
        "stacked groups; within ~1e-7 of the trainer's loop a step); false: the trainer's loop",
        True,
    )
    noise_scale_every: int | None = setting(
        Int(ge=1, null=True, optional=True, when=SIMULATE),
        "cluster=simulate: the gradient noise scale B_simple at group 0's weights on the step's sequences "
        "(a rank's batch per part; fldp/noise_scale.py), at step 1 and every this many steps; null: never",
        None,
    )
    launcher: str = setting(Choice("slurm", "local", optional=True), "slurm: submit one job; local: fork here", "local")
    dry_run: bool = setting(Bool(**SLURM), "print the job that would be submitted and the mesh; submit nothing")
    wait: bool = setting(Bool(**SLURM), "follow the job to its end; false: return once queued")
    partition: str | None = setting(Text(null=True, **SLURM), "null: the site's default partition")
    account: str | None = setting(Text(null=True, **SLURM), "never committed: from $SBATCH_ACCOUNT or the command line")
    qos: str | None = setting(Text(null=True, **SLURM), "the job's quality of service")
    gpus_per_node: int | None = setting(Int(ge=0, null=True, **SLURM), "on cuda: = topology.procs_per_node")
    cpus_per_task: int = setting(Int(ge=1, **SLURM), "cores per rank")
    mem_gb: float | None = setting(Num(gt=0, null=True, **SLURM), "memory per node; null: the site's default")
    exclusive: bool = setting(Bool(**SLURM), "whole nodes")
    time_min: int = setting(Int(ge=1, **SLURM), "the job's time limit, minutes")
    setup: list = setting(
        ListOf("a list of shell lines", item=Text(), **SLURM), "shell lines run in the job before srun (modules ...)"
    )
    sbatch: dict = setting(
        MapOf("a mapping of sbatch option to value", value=SCALAR, **SLURM), "any other sbatch option"
    )
    folder: str | None = setting(Text(null=True, **SLURM), "submitit's pickles and logs; null: <run dir>/slurm")
    poll_s: float = setting(Num(gt=0, **SLURM), "how often a waiting submitter asks SLURM about the job")
    max_requeue: int = setting(
        Int(ge=0, optional=True, **SLURM), "requeues on the time limit, from the checkpoint saved when warned", 3
    )
    signal_s: int = setting(
        Int(ge=0, le=65535, optional=True, **SLURM), "warned this many seconds before the limit (SIGUSR2)", 120
    )
    node_local_dirs: list = setting(
        ListOf("a list of directories", item=Text(), optional=True, **SLURM),
        "directories each host has its own of: the pre-flight refuses a run directory in them",
        ["/tmp", "/var/tmp", "/dev/shm"],
    )


# The run-level sections: their defaults are here, and reach every composed config through Hydra's
# ConfigStore (`fldp_run`, first in conf/config.yaml's defaults list: a group option and the command
# line still win).


@dataclass(frozen=True)
class MeshConfig:
    """mesh: (F, R, S), outermost first; defaults from the topology's layout for algorithm.dims."""

    federation: int = setting(Int(ge=1), "F: independent groups, averaged every A steps", "${fldp_layout:federation}")
    replicate: int = setting(Int(ge=1), "R: HSDP replicas inside a group", "${fldp_layout:replicate}")
    shard: int = setting(Int(ge=1), "S: ranks a group's model is sharded over", "${fldp_layout:shard}")


@dataclass(frozen=True)
class TrainerConfig:
    """trainer: the inner loop, evaluations and checkpoints."""

    steps: int | None = setting(Int(ge=1, null=True), "optimiser steps; null: one pass over the training blocks", 24)
    batch_size: int = setting(Int(ge=1), "sequences per rank per step (paper: 2 per GPU)", 2)
    precision: str = setting(
        Choice("fp32", "bf16"),
        "fp32, or bf16: the paper's pure bf16 (params, optimiser state, FedAvg)",
        "${topology.precision}",
    )
    eval_every: int = setting(Int(ge=0), "also evaluate every K steps; 0: only at the end", 0)
    eval_batches: int | None = setting(Int(ge=1, null=True), "eval batches per rank; null: the whole split", None)
    progress: bool = setting(Bool(), "a progress bar on rank 0", True)
    checkpoint_every: int = setting(Int(ge=0), "a DCP checkpoint every K steps and at the last; 0: none", 0)
    resume: str | None = setting(
        Choice(None, "auto"), "auto: continue from the newest complete checkpoint in the run directory", None
    )
    skip_finished: bool = setting(Bool(), "multirun: a point whose directory holds summary.json is not run again", True)
    keep_last: int | None = setting(
        Int(ge=0, null=True, optional=True), "keep the newest K checkpoints; null or 0: all", None
    )
    async_save: bool = setting(Bool(optional=True), "write checkpoints in the background (DCP async_save)", False)


@dataclass(frozen=True)
class FsdpConfig:
    """fsdp: FSDP2's options."""

    reshard_root_after_forward: bool = setting(
        Bool(),
        "false: the root unit (embeddings, final norm, lm_head) stays gathered from forward to backward, as "
        "FSDP1 FULL_SHARD (the authors' runs); true: resharded, one more all-gather of it per step",
        False,
    )
    reduce_dtype: str | None = setting(
        Choice(*REDUCE_DTYPES, optional=True),
        "the gradients' reduce-scatter (and HSDP's all-reduce) dtype: null: the parameters' (pure bf16, the "
        "paper's); fp32: cast up, summed, cast back (FSDP2's MixedPrecisionPolicy.reduce_dtype)",
        None,
    )


@dataclass(frozen=True)
class OptimizerConfig:
    """optimizer: the inner optimiser and its schedule."""

    name: str = setting(Choice("adamw", "sgd"), "the inner optimiser", "adamw")
    lr: float = setting(Num(ge=0), "peak learning rate (paper: 3e-4)", 3.0e-4)
    betas: list = setting(
        ListOf("a list of 2 numbers in [0, 1)", item=Num(ge=0, lt=1), length=2), "adamw's betas", [0.9, 0.95]
    )
    weight_decay: float = setting(Num(ge=0), "decoupled weight decay", 0.1)
    momentum: float = setting(Num(ge=0), "sgd only", 0.0)
    warmup: float = setting(Num(ge=0, lt=1), "fraction of the steps: linear warm-up from 0, then cosine to 0", 0.1)
    clip_norm: float | None = setting(
        Num(gt=0, null=True, optional=True),  # optional: a config saved before it means none
        "clip each federation group's gradient to this global L2 norm; null: none (the paper's; torchtitan: 1.0)",
        None,
    )


@dataclass(frozen=True)
class CommConfig:
    """comm: counting and emulating the collectives."""

    measure: bool = setting(Bool(), "count collectives and bytes per mesh dimension (bytes_* records)", True)
    emulate: bool = setting(Bool(), "make each collective last >= bytes / bandwidth of its network tier", False)
    scale: float = setting(Num(gt=0), "emulated bandwidth = the topology's x this", "${topology.emulation_scale}")


@dataclass(frozen=True)
class WandbConfig:
    """wandb: Weights & Biases (offline by default: the run's files, synced when you choose)."""

    mode: str = setting(
        Choice("offline", "online", "disabled"), "offline unless $WANDB_MODE says", "${oc.env:WANDB_MODE,offline}"
    )
    project: str = setting(Text(), "the W&B project", "fldp")
    entity: str | None = setting(Text(null=True), "the W&B entity; null: the user's default", None)
    group: str | None = setting(Text(null=True), "the W&B group; null: none", None)


# torch's generators take a 64-bit seed (the data sampler adds the epoch to it)
SEED = Spec("an integer in [-2**63, 2**63)", lambda v: _is_int(v) and -(2**63) <= v < 2**63)


@dataclass(frozen=True)
class Config:
    """The composed config: five groups and the run-level sections."""

    algorithm: AlgorithmConfig = section(AlgorithmConfig, "what runs: mesh dimensions and every A steps")
    topology: TopologyConfig = section(TopologyConfig, "the machine")
    model: ModelConfig = section(ModelConfig, "the model")
    dataset: DatasetConfig = section(DatasetConfig, "the data")
    cluster: ClusterConfig = section(ClusterConfig, "where ranks start")
    mesh: MeshConfig = section(MeshConfig, "the mesh")
    seed: int = setting(SEED, "the run's seed: initialisation, data order", 42)
    trainer: TrainerConfig = section(TrainerConfig, "the loop")
    fsdp: FsdpConfig = section(FsdpConfig, "FSDP2")
    optimizer: OptimizerConfig = section(OptimizerConfig, "the inner optimiser")
    comm: CommConfig = section(CommConfig, "collectives")
    wandb: WandbConfig = section(WandbConfig, "W&B")


GROUPS = ("algorithm", "topology", "model", "dataset", "cluster")  # set by each option's file
FIELDS = fields_of(Config)
KEYS: dict[str, Spec] = flat_keys(FIELDS)


def run_defaults() -> dict:
    """The run-level sections' defaults, as Hydra composes them (the ConfigStore's `fldp_run`)."""

    def values(spec: Spec):
        if isinstance(spec, Section):
            return {name: values(sub) for name, sub in spec.fields.items()}
        return list(spec.default) if isinstance(spec.default, tuple) else spec.default

    return {name: values(spec) for name, spec in FIELDS.items() if name not in GROUPS}


def default_of(key: str) -> Any:
    """What a dotted key is where a config lacks it (an optional key's absence): its declared default."""
    value = KEYS[key].default
    if value is REQUIRED:
        raise KeyError(f"{key} has no default: each option file of its group sets it")
    return list(value) if isinstance(value, tuple) else value


def build(cls: type, values: dict) -> Any:
    """A typed config from plain values (a section's own typed config for each nested mapping, its
    default for each absent key). No checks beyond the sections' own: fldp.schema checked the whole."""
    kwargs, known = {}, {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not keys of {cls.__name__} ({', '.join(known)})")
    for name, value in values.items():
        nested = known[name].metadata.get("section")
        kwargs[name] = build(nested, value) if nested is not None and isinstance(value, dict) else value
    return cls(**kwargs)


def section_of(cls: type, raw: Any) -> Any:
    """A composed section (a DictConfig or a mapping) as its typed config, built (`build`); a
    composed config's `hydra` node is Hydra's, not the run's. A typed one is returned as it is."""
    if isinstance(raw, cls):
        return raw
    if hasattr(raw, "_metadata"):  # an OmegaConf node
        from omegaconf import OmegaConf

        raw = OmegaConf.to_container(raw, resolve=True)
    return build(cls, {k: v for k, v in dict(raw).items() if not (cls is Config and k == "hydra")})


def load(raw: Any) -> Config:
    """The composed config (a DictConfig or a mapping), resolved, as the typed `Config`: built once,
    after the schema's check, and what the run's components read."""
    return section_of(Config, raw)
