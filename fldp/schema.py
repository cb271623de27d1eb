"""The schema of the composed config: every key of every config group, its type and range or choices.

`check(cfg)` runs first in `fldp.train.validate`, before any worker starts or any job is submitted.
It resolves every interpolation (`${oc.env:...}`, `${topology...}`) and refuses, naming the key, the
value and what would be valid:
- a key the schema does not know, also one added with `+` (`+trainer.step=4`), with the nearest
  known key; group appends (`+experiment=...`) add known keys only and pass;
- a key that is missing, or belongs to another variant of its group (`cluster.dry_run` on
  `cluster=local`, which has no `cluster.launcher`);
- a value of the wrong type or out of range (`seed=abc`, `optimizer.lr=-1`);
- a model whose shape cannot work (RULES: heads dividing the hidden size, ...).
Checks that need more than one group's keys stay where they were (`mesh_shape`, `FedAvgConfig`).

The schema is data: KEYS maps each dotted key to a Spec. A key another branch adds is one line here.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .mesh import DIMS
from .schedule import schedule_of

# The choices of the algorithm's keys (fldp.aggregation builds its configs on them)
MODES = ("leader_broadcast", "all_replicas")
OUTER = ("sgd", "adam")
REDUCE_DTYPES = (None, "bf16", "fp32")
QUANTIZE = ("int8", "fp8", "int4")


@dataclass(frozen=True)
class Spec:
    """What one key accepts. `what` says it in words (error messages). `null`: null is valid too;
    `optional`: the key may be absent (variants of its group lack it); `when` = (key, values): the key
    is a setting only where that other key has one of those values (the SLURM clusters' keys: set on
    cluster=local, they would silently do nothing), and needed there (or where `needed_when` holds)
    unless optional."""

    what: str
    test: Callable[[Any], bool] = lambda v: True  # containers: their parts are checked instead
    null: bool = False
    optional: bool = False
    when: tuple | None = None
    needed_when: tuple | None = None  # (key, values) where it is needed, if narrower than `when`
    kind: str = "custom"  # int, num, bool, text, choice, section, list, map: what a fuzzer draws
    bounds: tuple = ()  # int, num: (ge, gt, le, lt)
    choices: tuple = ()  # choice

    def __str__(self) -> str:
        return self.what + (" or null" if self.null else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.null
        try:
            return bool(self.test(value))
        except (TypeError, ValueError, re.error):
            return False


@dataclass(frozen=True)
class Section(Spec):
    """A mapping with fixed keys, each with its Spec (`fields`); a dotted key's parent."""

    what: str = "a mapping"
    kind: str = "section"
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ListOf(Spec):
    """A list whose items each satisfy `item` (a Spec or a Section), of `length` items if given."""

    what: str = "a list"
    kind: str = "list"
    item: Spec = None  # type: ignore[assignment]  # every ListOf names one (keyword-only in spirit)
    length: int | None = None
    min_length: int = 0


@dataclass(frozen=True)
class MapOf(Spec):
    """A mapping with open keys (or only `keys`), every value satisfying `value`."""

    what: str = "a mapping"
    kind: str = "map"
    value: Spec = None  # type: ignore[assignment]  # every MapOf names one
    keys: tuple | None = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds(ge, gt, le, lt) -> tuple[str, Callable]:
    """Words and test for a range: `>= 1`, `in [0, 1)`, ..."""
    low = (ge, "[", lambda v: v >= ge) if ge is not None else (gt, "(", lambda v: v > gt) if gt is not None else None
    high = (le, "]", lambda v: v <= le) if le is not None else (lt, ")", lambda v: v < lt) if lt is not None else None
    if low and high:
        return f" in {low[1]}{low[0]:g}, {high[0]:g}{high[1]}", lambda v: low[2](v) and high[2](v)
    if low:
        return f" {'>=' if low[1] == '[' else '>'} {low[0]:g}", low[2]
    if high:
        return f" {'<=' if high[1] == ']' else '<'} {high[0]:g}", high[2]
    return "", lambda v: True


def Int(ge=None, gt=None, le=None, lt=None, **kw) -> Spec:
    words, inside = _bounds(ge, gt, le, lt)
    return Spec("an integer" + words, lambda v: _is_int(v) and inside(v), kind="int", bounds=(ge, gt, le, lt), **kw)


def Num(ge=None, gt=None, le=None, lt=None, **kw) -> Spec:
    """A finite number; integers count (Hydra reads `lr=1` as one)."""
    words, inside = _bounds(ge, gt, le, lt)
    return Spec("a number" + words, lambda v: _is_number(v) and inside(v), kind="num", bounds=(ge, gt, le, lt), **kw)


def Bool(**kw) -> Spec:
    return Spec("true or false", lambda v: isinstance(v, bool), kind="bool", **kw)


def Text(**kw) -> Spec:
    """A non-empty string; a number too, since Hydra reads `cluster.account=12345` as one."""
    return Spec("a string", lambda v: (isinstance(v, str) and v != "") or _is_number(v), kind="text", **kw)


def Choice(*values, **kw) -> Spec:
    words = ", ".join("null" if v is None else str(v) for v in values)
    return Spec(
        f"one of {words}",
        lambda v: any(v == c and type(v) is type(c) for c in values),
        null=None in values,
        kind="choice",
        choices=values,
        **kw,
    )


def _compiles(v) -> bool:
    re.compile(v)
    return isinstance(v, str)


def _schedule(v) -> bool:
    try:
        schedule_of(v)
    except ConfigError:
        return False
    return True


SCALAR = Spec("a string, number or boolean", lambda v: isinstance(v, (str, int, float)))
MESH = Section(fields={d: Int(ge=1) for d in DIMS})
# The keys of a SLURM cluster config (conf/cluster/slurm.yaml, leonardo.yaml): allowed in one, also
# forked locally with cluster.launcher=local, needed when it submits; refused on cluster=local.
SLURM: dict[str, Any] = dict(
    when=("cluster.launcher", ("slurm", "local")), needed_when=("cluster.launcher", ("slurm",))
)
FEDAVG = ("algorithm.aggregation", ("fedavg",))  # ... only an aggregating algorithm has
# topology.layouts: one (F, R, S) per set of dimensions an algorithm can have (fldp_layout's keys)
LAYOUTS = ("shard", "replicate_shard", "federation_shard", "federation_replicate_shard")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# Every key of every config group: conf/<group>/*.yaml and conf/config.yaml. A section is any key
# with dotted children; list it only to make it nullable or optional.
KEYS: dict[str, Spec] = {
    # algorithm: conf/algorithm/*.yaml
    "algorithm.name": Text(),
    "algorithm.dims": ListOf("a list of mesh dimensions, shard included", item=Choice(*DIMS), min_length=1),
    "algorithm.aggregation": Choice("fedavg", None),
    "algorithm.every": Spec(
        "an integer A >= 1, or a schedule [[0, A0], [step1, A1], ...] of increasing steps from 0 and periods >= 1",
        _schedule,
        null=True,
    ),
    "algorithm.fedavg": Section(null=True),
    "algorithm.fedavg.bucket_mb": Num(gt=0),
    "algorithm.fedavg.mode": Choice(*MODES, optional=True),
    "algorithm.outer": Section(optional=True, when=FEDAVG),
    "algorithm.outer.name": Choice(*OUTER),
    "algorithm.outer.lr": Num(gt=0, null=True),  # null: the optimiser's own (OUTER_DEFAULTS)
    "algorithm.outer.momentum": Num(ge=0, lt=1),
    "algorithm.outer.nesterov": Bool(),
    "algorithm.outer.betas": ListOf("a list of 2 numbers in [0, 1)", item=Num(ge=0, lt=1), length=2),
    "algorithm.outer.eps": Num(gt=0, null=True),  # null: the optimiser's own (OUTER_DEFAULTS)
    "algorithm.outer.reduce_dtype": Choice(*REDUCE_DTYPES),
    # fldp/quantize.py: optional, so a config written before them composes as it did
    "algorithm.outer.quantize": Choice(None, *QUANTIZE, optional=True),
    "algorithm.outer.quantize_block": Spec(
        "an even integer >= 2",
        lambda v: _is_int(v) and v >= 2 and v % 2 == 0,
        kind="int",
        bounds=(2, None, None, None),
        optional=True,
    ),
    "algorithm.outer.error_feedback": Bool(optional=True),
    "algorithm.elastic": Bool(optional=True, when=FEDAVG),
    # algorithm.streaming (fldp/streaming.py): the model aggregated in fragments, at staggered steps
    "algorithm.streaming": Section(optional=True, when=FEDAVG),
    "algorithm.streaming.fragments": Int(ge=1),
    "algorithm.streaming.layout": Choice("strided", "contiguous"),
    "algorithm.streaming.overlap": Int(ge=0),
    "algorithm.streaming.alpha": Num(ge=0, le=1),
    "algorithm.federate": ListOf(
        "a list of regular expressions", item=Spec("a regular expression", _compiles), optional=True, when=FEDAVG
    ),
    # topology: conf/topology/*.yaml
    "topology.name": Text(),
    "topology.nodes": Int(ge=1),
    "topology.procs_per_node": Int(ge=1),
    "topology.device": Choice("cpu", "cuda"),
    # bytes per device, in GB (1e9): whether a layout fits (fldp/memory.py); absent: not said
    "topology.memory_gb": Num(gt=0, null=True, optional=True),
    "topology.layouts": MapOf("a mapping of dimensions to {federation, replicate, shard}", value=MESH, keys=LAYOUTS),
    "topology.precision": Choice("fp32", "bf16"),
    "topology.network": ListOf(
        "a list of network tiers, innermost first",
        min_length=1,
        item=Section(
            fields={
                "tier": Text(),
                "ranks": Int(ge=1),
                "gbit_s": Num(gt=0),
                "link": Choice("node", None, optional=True),  # netns: the node's link is shared
                "delay_ms": Num(ge=0, optional=True),  # netns: one-way delay (netem)
                "latency_ms": Num(ge=0, optional=True),
            }
        ),
    ),  # netns: the cost model's per-collective latency
    "topology.emulation_scale": Num(gt=0),
    "topology.paper_setting": Bool(optional=True),
    "topology.fedavg_mode": Choice(*MODES, optional=True),
    "topology.emulation": Choice("netns", None, optional=True),  # netns: emulated nodes
    # model: conf/model/*.yaml (transformers' LlamaConfig)
    "model.name": Text(),
    "model.vocab_size": Int(ge=1, null=True),
    "model.hidden_size": Int(ge=1),
    "model.intermediate_size": Int(ge=1),
    "model.num_hidden_layers": Int(ge=1),
    "model.num_attention_heads": Int(ge=1),
    "model.num_key_value_heads": Int(ge=1),
    "model.max_position_embeddings": Int(ge=1),
    "model.rope_theta": Num(gt=0),
    "model.rope_scaling": Section(null=True),
    "model.rope_scaling.rope_type": Choice(*ROPE_TYPES),
    "model.rope_scaling.factor": Num(ge=1, optional=True),
    "model.rope_scaling.low_freq_factor": Num(gt=0, optional=True),
    "model.rope_scaling.high_freq_factor": Num(gt=0, optional=True),
    "model.rope_scaling.original_max_position_embeddings": Int(ge=1, optional=True),
    "model.rope_scaling.attention_factor": Num(gt=0, optional=True),
    "model.rope_scaling.beta_fast": Num(gt=0, optional=True),
    "model.rope_scaling.beta_slow": Num(gt=0, optional=True),
    "model.rms_norm_eps": Num(gt=0),
    "model.tie_word_embeddings": Bool(),
    "model.initializer_range": Num(ge=0),
    "model.init_device": Choice("cpu", "meta"),
    # recompute each decoder layer in backward; optional: a model config written before it means none
    "model.activation_checkpointing": Choice("none", "full", optional=True),
    # dataset: conf/dataset/*.yaml
    "dataset.name": Text(),
    "dataset.path": Text(),
    "dataset.config_name": Text(null=True),
    "dataset.data_files": MapOf("a mapping of split to file", value=Text(), null=True),
    "dataset.train_split": Text(),
    "dataset.eval_split": Text(),
    "dataset.text_field": Text(),
    "dataset.tokenizer": Text(),
    "dataset.block_size": Int(ge=2),
    "dataset.train_blocks": Int(ge=1, null=True),
    "dataset.eval_blocks": Int(ge=1, null=True),
    "dataset.cache_dir": Text(),
    # cluster: conf/cluster/local.yaml, and the SLURM ones (slurm.yaml, leonardo.yaml)
    "cluster.name": Text(),
    # the clusters that start ranks (absent from cluster=simulate, which starts none)
    "cluster.master_addr": Spec(
        "a host name or address", lambda v: isinstance(v, str) and v != "", null=True, optional=True
    ),
    "cluster.master_port": Int(ge=1, le=65535, null=True, optional=True),
    "cluster.timeout_s": Num(gt=0, optional=True),
    "cluster.threads_per_worker": Int(ge=1, optional=True),
    # elastic federation (fldp/elastic.py): the launcher restarts a failed group (a job step under SLURM)
    "cluster.restart_failed_groups": Bool(optional=True),
    "cluster.max_restarts": Int(ge=0, optional=True),
    # cluster=simulate (fldp/simulate.py): one process, no ranks
    "cluster.device": Choice("cpu", "cuda", when=("cluster.name", ("simulate",))),
    "cluster.threads": Int(ge=1, null=True, when=("cluster.name", ("simulate",))),
    "cluster.launcher": Choice("slurm", "local", optional=True),  # absent: conf/cluster/local.yaml
    "cluster.dry_run": Bool(**SLURM),
    "cluster.wait": Bool(**SLURM),
    "cluster.partition": Text(null=True, **SLURM),
    "cluster.account": Text(null=True, **SLURM),
    "cluster.qos": Text(null=True, **SLURM),
    "cluster.gpus_per_node": Int(ge=0, null=True, **SLURM),
    "cluster.cpus_per_task": Int(ge=1, **SLURM),
    "cluster.mem_gb": Num(gt=0, null=True, **SLURM),
    "cluster.exclusive": Bool(**SLURM),
    "cluster.time_min": Int(ge=1, **SLURM),
    "cluster.setup": ListOf("a list of shell lines", item=Text(), **SLURM),
    "cluster.sbatch": MapOf("a mapping of sbatch option to value", value=SCALAR, **SLURM),
    "cluster.folder": Text(null=True, **SLURM),
    "cluster.poll_s": Num(gt=0, **SLURM),
    "cluster.max_requeue": Int(ge=0, optional=True, **SLURM),  # ops: requeue on time limit
    "cluster.signal_s": Int(ge=0, le=65535, optional=True, **SLURM),  # ops: sbatch --signal=USR2@N
    "cluster.node_local_dirs": ListOf("a list of directories", item=Text(), optional=True, **SLURM),  # preflight
    # conf/config.yaml
    "mesh.federation": Int(ge=1),
    "mesh.replicate": Int(ge=1),
    "mesh.shard": Int(ge=1),
    # torch's generators take a 64-bit seed (the data sampler adds the epoch to it)
    "seed": Spec("an integer in [-2**63, 2**63)", lambda v: _is_int(v) and -(2**63) <= v < 2**63),
    "trainer.steps": Int(ge=1, null=True),
    "trainer.batch_size": Int(ge=1),
    "trainer.precision": Choice("fp32", "bf16"),
    "trainer.eval_every": Int(ge=0),
    "trainer.eval_batches": Int(ge=1, null=True),
    "trainer.progress": Bool(),
    "trainer.checkpoint_every": Int(ge=0),
    "trainer.resume": Choice(None, "auto"),
    "trainer.skip_finished": Bool(),  # multirun: skip points holding summary.json
    "trainer.keep_last": Int(ge=0, null=True, optional=True),  # ops: prune older checkpoints
    "trainer.async_save": Bool(optional=True),  # ops: DCP async_save
    "fsdp.reshard_root_after_forward": Bool(),
    "optimizer.name": Choice("adamw", "sgd"),
    "optimizer.lr": Num(ge=0),  # torch: "Invalid learning rate" below 0
    "optimizer.betas": ListOf("a list of 2 numbers in [0, 1)", item=Num(ge=0, lt=1), length=2),
    "optimizer.weight_decay": Num(ge=0),
    "optimizer.momentum": Num(ge=0),
    "optimizer.warmup": Num(ge=0, lt=1),  # a fraction of the steps
    "optimizer.clip_norm": Num(gt=0, null=True, optional=True),  # a group's gradient norm; absent: older configs
    "comm.measure": Bool(),
    "comm.emulate": Bool(),
    "comm.scale": Num(gt=0),
    "wandb.mode": Choice("offline", "online", "disabled"),
    "wandb.project": Text(),
    "wandb.entity": Text(null=True),
    "wandb.group": Text(null=True),
}


@dataclass(frozen=True)
class Rule:
    """A condition over several keys (their checked values, in order) and what it requires (words,
    or a function of the values giving them)."""

    keys: tuple
    holds: Callable
    requires: str | Callable


ROPE_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

RULES = (
    Rule(
        ("model.hidden_size", "model.num_attention_heads"),
        lambda h, n: h % n == 0,
        "model.num_attention_heads must divide model.hidden_size",
    ),
    Rule(
        ("model.hidden_size", "model.num_attention_heads"),
        lambda h, n: h % n or h // n % 2 == 0,
        "the head dimension model.hidden_size / model.num_attention_heads must be even (RoPE rotates pairs)",
    ),
    Rule(
        ("model.num_attention_heads", "model.num_key_value_heads"),
        lambda n, k: n % k == 0,
        "model.num_key_value_heads must divide model.num_attention_heads (grouped-query attention)",
    ),
    Rule(
        ("model.rope_scaling",),
        lambda r: r is None or set(ROPE_NEEDS.get(r["rope_type"], ())) <= r.keys(),
        lambda r: f"rope_type {r['rope_type']} needs {', '.join(ROPE_NEEDS[r['rope_type']])} (transformers)",
    ),
)


def _tree(keys: dict[str, Spec]) -> Section:
    """The flat table as nested Sections."""
    root = Section()
    for key, spec in keys.items():
        *parents, name = key.split(".")
        node = root
        for p in parents:
            node = node.fields.setdefault(p, Section())
        node.fields[name] = (
            spec
            if not isinstance(spec, Section)
            else Section(
                what=spec.what,
                null=spec.null,
                optional=spec.optional,
                when=spec.when,
                fields={**node.fields.get(name, Section()).fields, **spec.fields},
            )
        )
    return root


SCHEMA = _tree(KEYS)


def show(value) -> str:
    """A value as in a config: true, null, 'text', [0.9]."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def _join(key: str, name) -> str:
    return f"{key}.{name}" if key else str(name)


UNRESOLVED = object()  # a value whose interpolation failed (reported once, as such)


def plain(node, key: str = "", sources: dict | None = None, errors: dict | None = None):
    """The config as plain Python, every interpolation resolved. `sources[key]`: the interpolation a
    value came from (for messages); `errors[key]`: why one could not be resolved (its value is then
    UNRESOLVED, and the other keys are still checked)."""
    sources = {} if sources is None else sources
    errors = {} if errors is None else errors
    try:
        if node._is_interpolation():
            sources[key] = node._value()
            node = node._dereference_node()
        missing = node._is_missing()
    except OmegaConfBaseException as e:
        errors[key] = f"{key}={node._value()}: cannot be resolved ({type(e).__name__}: {str(e).splitlines()[0]})"
        return UNRESOLVED
    if missing:
        errors[key] = f"{key}=???: a value is missing"
        return UNRESOLVED
    if isinstance(node, DictConfig) and not node._is_none():
        return {str(k): plain(node._get_node(k), _join(key, k), sources, errors) for k in node.keys()}
    if isinstance(node, ListConfig) and not node._is_none():
        return [plain(node._get_node(i), f"{key}[{i}]", sources, errors) for i in range(len(node))]
    return node._value()


class _Check:
    """One pass over a plain config: every problem found, as `key=value: ...` lines."""

    def __init__(self, root: dict, sources: dict):
        self.root, self.sources = root, sources
        self.problems: list[str] = []
        self.failed: set[str] = set()

    def bad(self, key: str, value, must: str) -> None:
        origin = f" (from {self.sources[key]})" if key in self.sources else ""
        self.problems.append(f"{key}={show(value)}{origin}: {must}")
        self.failed.add(key)

    def missing(self, key: str, spec: Spec) -> None:
        self.problems.append(f"{key}: missing; must be {spec}")
        self.failed.add(key)

    def holds(self, when: tuple) -> bool:
        return self.lookup(when[0]) in when[1]

    def lookup(self, key: str):
        value: Any = self.root
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def value(self, key: str, value, spec: Spec) -> None:
        if value is UNRESOLVED:
            self.failed.add(key)
        elif isinstance(spec, Section):
            self.section(key, value, spec)
        elif isinstance(spec, MapOf):
            self.mapping(key, value, spec)
        elif isinstance(spec, ListOf):
            self.items(key, value, spec)
        elif not spec.accepts(value):
            self.bad(key, value, f"must be {spec}")

    def section(self, key: str, value, spec: Section) -> None:
        if value is None and spec.null:
            return
        if not isinstance(value, dict):
            return self.bad(
                key, value, f"must be a mapping of {', '.join(spec.fields)}" + (" or null" if spec.null else "")
            )
        needed, misplaced = [], []  # a variant's keys, told once per condition (a SLURM cluster's 14)
        for name, sub in spec.fields.items():
            if name not in value and not sub.optional:
                if sub.when is None:
                    self.missing(_join(key, name), sub)
                elif self.holds(sub.needed_when or sub.when):
                    needed.append((_join(key, name), sub))
        for name, v in value.items():
            sub = spec.fields.get(name)
            where = _join(key, name)
            if sub is None:
                near = difflib.get_close_matches(name, spec.fields, n=1)
                self.bad(
                    where,
                    v,
                    "no such setting"
                    + (f" (did you mean {_join(key, near[0])}?)" if near else "")
                    + f"; {key or 'the config'} has: {', '.join(spec.fields)}",
                )
            elif sub.when and not self.holds(sub.when):
                misplaced.append((where, sub))
            else:
                self.value(where, v, sub)
        for keys in (needed, misplaced):
            if keys:
                when = keys[0][1].when
                self.failed.update(k for k, _ in keys)
                self.problems.append(
                    f"{', '.join(k for k, _ in keys)}: "
                    + (
                        f"missing, needed where {when[0]}={show(self.lookup(when[0]))}"
                        if keys is needed
                        else f"set, but settings only where {when[0]} is {' or '.join(when[1])}, "
                        f"not {when[0]}={show(self.lookup(when[0]))}"
                    )
                )

    def mapping(self, key: str, value, spec: MapOf) -> None:
        if value is None and spec.null:
            return
        if not isinstance(value, dict):
            return self.bad(key, value, f"must be {spec}")
        for name, v in value.items():
            if spec.keys is not None and name not in spec.keys:
                self.bad(_join(key, name), v, f"no such setting; keys of {key}: {', '.join(spec.keys)}")
            else:
                self.value(_join(key, name), v, spec.value)

    def items(self, key: str, value, spec: ListOf) -> None:
        if value is None and spec.null:
            return
        if (
            not isinstance(value, (list, tuple))
            or len(value) < spec.min_length
            or (spec.length is not None and len(value) != spec.length)
        ):
            return self.bad(key, value, f"must be {spec}")
        for i, v in enumerate(value):
            self.value(f"{key}[{i}]", v, spec.item)

    def rules(self) -> None:
        """The rules whose keys all passed their own checks."""

        def affected(k):  # the key, a key inside it, or a section holding it failed
            return any(f == k or f.startswith((k + ".", k + "[")) or k.startswith(f + ".") for f in self.failed)

        for rule in RULES:
            if any(affected(k) for k in rule.keys):
                continue
            values = [self.lookup(k) for k in rule.keys]
            if not rule.holds(*values):
                shown = ", ".join(f"{k}={show(v)}" for k, v in zip(rule.keys, values))
                words = rule.requires(*values) if callable(rule.requires) else rule.requires
                self.problems.append(f"{shown}: {words}")


def problems(cfg) -> list[str]:
    """Every problem of a composed config (a DictConfig or a plain dict), as `key=value: what's wrong`."""
    sources: dict = {}
    errors: dict = {}
    root = plain(cfg, "", sources, errors) if isinstance(cfg, DictConfig) else cfg
    check = _Check(root, sources)
    check.problems.extend(errors.values())
    check.section("", root, SCHEMA)
    check.rules()
    return check.problems


def check(cfg) -> None:
    """Raise ConfigError listing every problem of a composed config."""
    found = problems(cfg)
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} settings are invalid:\n  " + "\n  ".join(found))


def check_values(values: dict) -> None:
    """Check a few keys (dotted, as in KEYS) outside a whole config: the dataclasses built from them."""
    found = _Check({}, {})
    for key, value in values.items():
        found.value(key, value, KEYS[key])
    if found.problems:
        raise ConfigError("; ".join(found.problems))
