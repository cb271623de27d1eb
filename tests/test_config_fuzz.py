"""The config fuzzer (issue 14): every key of every config group (fldp.schema.KEYS) and the mesh,
drawn valid and invalid (wrong type, out of range, missing, unknown, of another variant, inconsistent
with another key), applied to real composed configs as Hydra applies command-line overrides. A config
either passes `validate`, or is refused with a ConfigError naming a key that was changed; validate
raises nothing else. A few drawn configs go through the real CLI on local_2: they train one step, or
exit 2 naming a changed key with no worker started.

Deterministic in CI (derandomize, no example database): FUZZ_EXAMPLES in-process and CLI_EXAMPLES
CLI examples. FLDP_FUZZ_EXAMPLES=N draws N in-process (and N // 100 CLI) examples at random instead;
a failure prints the command that reproduces it, and hypothesis's blob replays it exactly.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import QUICK, ROOT, cli
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from fldp import schema
from fldp.errors import ConfigError
from fldp.mesh import DIMS
from fldp.validation import validate

LONG = int(os.environ.get("FLDP_FUZZ_EXAMPLES", 0))
FUZZ_EXAMPLES = LONG or 300
CLI_EXAMPLES = max(4, LONG // 100)
SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=not LONG,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp", "diloco_hsdp")
# composed configs the mutations start from: every algorithm, local and SLURM clusters, both models
BASES = [(f"algorithm={a}", "topology=local_8") for a in ALGORITHMS] + [
    ("algorithm=fl_hsdp", "topology=leonardo_512"),
    ("algorithm=fsdp", "topology=leonardo_512"),
    ("algorithm=fl_fsdp", "topology=slurm_2x4", "cluster=slurm"),
    ("algorithm=hsdp", "topology=slurm_2x4", "cluster=slurm"),
]
CLI_BASE = ("topology=local_2", "trainer.steps=1", *QUICK)
# in CLI runs: keys whose valid values still need what this machine lacks (a network, a GPU, a
# SLURM cluster, a free fixed port) or many steps
CLI_SKIP = {
    "trainer.steps",
    "wandb.mode",
    "topology.device",
    "cluster.launcher",
    "cluster.master_addr",
    "cluster.master_port",
    "cluster.timeout_s",
    # valid, but at 10x their usual size a step can diverge (a run stops on a non-finite loss)
    "optimizer.lr",
    "algorithm.outer.lr",
    "model.initializer_range",
}
GROUPS = {"algorithm", "topology", "model", "dataset", "cluster"}  # `algorithm=...` picks an option
PARSER = OverridesParser.create()


@functools.cache
def base_config(overrides: tuple):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def apply(base: tuple, overrides: list[str]):
    """The config `python -m fldp.train BASE OVERRIDES` runs: Hydra's own override step on the
    composed base (what it does after composing the defaults)."""
    cfg = copy.deepcopy(base_config(base))
    ConfigLoaderImpl._apply_overrides_to_config(PARSER.parse_overrides(overrides), cfg)
    return cfg


def hydra_value(v) -> str:
    """A Python value as a command-line override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # Hydra's quoted strings: a backslash escapes only a quote
        return "'" + v.replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"


# --- values per key: derived from the schema's kinds and bounds, independently of its tests ---------

TIER = {"tier": "node", "ranks": 8, "gbit_s": 100}
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# (valid, invalid) for keys whose spec is a custom test or couples to others
CUSTOM = {
    "algorithm.every": ([1, 4, [[0, 1], [16, 8]]], [0, -1, 1.5, "abc", [[1, 2]], [[0, 2], [0, 4]], [[0, 0]]]),
    "algorithm.federate": (
        [[".*"], ["model\\.layers\\..*", "model\\.norm\\.weight"]],
        [["("], "abc", [1], ["nomatch"]],
    ),
    "seed": ([0, -1, 2**63 - 1], ["abc", 1.5, 2**63, True]),
    "cluster.master_addr": (["127.0.0.1", "localhost"], ["", 7, True]),
    "cluster.sbatch": ([{}], ["abc", 3]),  # Hydra itself refuses a mapping with new keys here
    "topology.network": ([[TIER]], [[], "abc", [{**TIER, "ranks": 0}]]),
    "model.rope_scaling": (
        [None, ROPE, {"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0}],
        ["abc", {"rope_type": "llama3", "factor": 8.0}, {"rope_type": "bogus"}, {"factor": 2.0}],
    ),
    "topology.layouts": ([], ["abc"]),
    "algorithm.dims": (
        [["shard"], ["replicate", "shard"], ["federation", "shard"]],
        [[], ["bogus"], "abc", ["federation", "replicate"]],
    ),  # the last: no shard
    "dataset.data_files": ([None], ["abc", {"train": [1]}]),
    "algorithm.outer.quantize_block": ([2, 64, 256], [0, 1, 7, -2, "abc", 1.5, True]),  # even: int4 packs pairs
}
# keys drawn only invalid here: their valid values move the mesh (drawn jointly below) or the group
INVALID_ONLY = {
    "algorithm.name",
    "topology.nodes",
    "topology.procs_per_node",
    "mesh.federation",
    "mesh.replicate",
    "mesh.shard",
}
MODEL_SHAPE = ("model.hidden_size", "model.num_attention_heads", "model.num_key_value_heads")


def samples(key: str, spec: schema.Spec) -> tuple[list, list]:
    if key in CUSTOM:
        valid, invalid = map(list, CUSTOM[key])
    elif spec.kind in ("int", "num"):
        valid, invalid = _numbers(spec)
    elif spec.kind == "bool":
        valid, invalid = [True, False], ["yes", 1, [True]]
    elif spec.kind == "text":
        valid, invalid = ["x", "some/path_1", 7], ["", True, ["x"], {"a": "x"}]
    elif spec.kind == "choice":
        valid = [c for c in spec.choices if c is not None]
        invalid = [x for x in ("bogus", 3, True) if x not in spec.choices]
    elif spec.kind == "list":
        item_valid, item_invalid = samples("", spec.item)
        n = spec.length or 2
        valid = [item_valid[:n]] if len(item_valid) >= n else []
        invalid = ["abc"] + [[x] * n for x in item_invalid[:2]] + ([item_valid[:1]] if spec.length else [])
    elif spec.kind in ("section", "map"):
        valid, invalid = [], ["abc", 3]
    else:
        valid, invalid = [], []
    (valid if spec.null else invalid).append(None)
    return valid, invalid


def _numbers(spec) -> tuple[list, list]:
    ge, gt, le, lt = spec.bounds
    whole = spec.kind == "int"
    step = 1 if whole else 0.5
    lo = ge if ge is not None else gt
    hi = le if le is not None else lt
    start = (lo if ge is not None else lo + step) if lo is not None else 0
    valid = [start, start + step, start + (7 if whole else 10)]
    if ge is not None and not whole:
        valid.append(int(ge))  # Hydra reads `lr=0` as an int
    if hi is not None:
        valid = [v for v in valid if v < hi or (le is not None and v <= hi)] + [(lo + hi) / 2] * (not whole)
    invalid = ["abc", True, [start]] + ([start + 0.5] if whole else [math.nan, math.inf])
    if lo is not None:
        invalid.append(lo - step if ge is not None else lo)
    if hi is not None:
        invalid.append(hi + step if le is not None else hi)
    return valid, invalid


@dataclass(frozen=True)
class Target:
    name: str  # as fldp.schema names it: topology.network[0].gbit_s
    override: str  # as Hydra's command line does: topology.network.0.gbit_s
    spec: schema.Spec
    present: bool
    null: bool = False  # Hydra cannot delete a key whose value is null
    mapping: bool = False  # Hydra merges a mapping into a mapping: drawn values replace it only if not one


def targets(spec: schema.Section, value: dict, name: str = "", over: str = ""):
    """Every key of the schema reachable in this config: those present, and the optional ones absent
    (drawn with `+`)."""
    for field, sub in spec.fields.items():
        n, o = schema._join(name, field), schema._join(over, field)
        if field not in value:
            if not isinstance(sub, schema.Section):
                yield Target(n, o, sub, False)
            continue
        v = value[field]
        yield Target(n, o, sub, True, v is None, isinstance(v, dict))
        if isinstance(sub, schema.Section) and isinstance(v, dict):
            yield from targets(sub, v, n, o)
        elif isinstance(sub, schema.ListOf) and isinstance(sub.item, schema.Section) and isinstance(v, list):
            for i, item in enumerate(v):
                yield from targets(sub.item, item, f"{n}[{i}]", f"{o}.{i}")
        elif isinstance(sub, schema.MapOf) and isinstance(sub.value, schema.Section) and isinstance(v, dict):
            for k, item in v.items():
                yield from targets(sub.value, item, schema._join(n, k), schema._join(o, k))


@functools.cache
def plain_base(base: tuple) -> dict:
    return schema.plain(base_config(base))


@functools.cache
def base_targets(base: tuple) -> tuple[Target, ...]:
    return tuple(targets(schema.SCHEMA, plain_base(base)))


@dataclass(frozen=True)
class Mutation:
    override: str
    names: tuple  # the schema keys it changes
    valid: bool  # judged alone; the cross-key oracle judges the whole config after


def layout_of(cfg: dict) -> str:
    """The topology.layouts key of a config's algorithm: its dimensions, outermost first."""
    return "_".join(d for d in DIMS if d in (cfg["algorithm"].get("dims") or []))


@st.composite
def key_mutation(draw, base: tuple, skip=frozenset()):
    """One key: set to a valid or an invalid value, added (+) if optional and absent, deleted (~),
    or a misspelt key added next to it."""
    pool = [
        t
        for t in base_targets(base)
        if t.name not in skip | GROUPS
        and not t.name.startswith(tuple(f"{s}." for s in skip))
        and not t.name.startswith(MODEL_SHAPE)
    ]
    t = draw(st.sampled_from(pool))
    valid, invalid = samples(t.name, t.spec)
    if t.mapping:
        valid, invalid = ([v for v in vs if not isinstance(v, dict)] for vs in (valid, invalid))
    if t.name in INVALID_ONLY or t.name.startswith(f"topology.layouts.{layout_of(plain_base(base))}."):
        valid = []
    # valid values as often as all the ways to be wrong together, so that whole configs pass often
    kinds = (
        (["valid"] * 4 if valid else [])
        + (["invalid"] * 2 if invalid else [])
        + ["typo"]
        + (["delete"] if t.present and not t.null else [])
    )
    kind = draw(st.sampled_from(kinds))
    prefix = "" if t.present else "+"
    if kind == "delete":
        return Mutation(f"~{t.override}", (t.name,), valid=t.spec.optional or bool(t.spec.when))
    if kind == "typo":
        parent, _, leaf = t.override.rpartition(".")
        typo = draw(st.sampled_from([leaf + "s", leaf[:-1] + "_", "x" + leaf]))
        n = schema._join(t.name.rpartition(".")[0], typo)
        return Mutation(f"+{schema._join(parent, typo)}={hydra_value(1)}", (n,), valid=False)
    value = draw(st.sampled_from(valid if kind == "valid" else invalid))
    return Mutation(f"{prefix}{t.override}={hydra_value(value)}", (t.name,), valid=kind == "valid")


@st.composite
def mesh_mutation(draw, base: tuple):
    """F, R, S: half the time a layout that fits the world and the algorithm, else any."""
    cfg = plain_base(base)
    world = cfg["topology"]["nodes"] * cfg["topology"]["procs_per_node"]
    sizes = [d for d in (1, 2, 3, 4, 8, 16, 32, 128, 512) if world % d == 0]
    dims = cfg["algorithm"]["dims"]
    fits = [
        (f, r, world // (f * r))
        for f in sizes
        for r in sizes
        if world % (f * r) == 0 and (f == 1 or "federation" in dims) and (r == 1 or "replicate" in dims)
    ]
    dims = st.sampled_from([1, 2, 4, 8, 3, 0])
    f, r, s = draw(st.sampled_from(fits) | st.tuples(dims, dims, dims))
    return Mutation(
        " ".join(f"mesh.{d}={v}" for d, v in zip(("federation", "replicate", "shard"), (f, r, s))),
        ("mesh.federation", "mesh.replicate", "mesh.shard"),
        valid=min(f, r, s) >= 1,
    )


@st.composite
def model_mutation(draw, base: tuple):
    """Hidden size, heads and key/value heads: mostly shapes that work, and some that do not."""
    h, n, k = draw(
        st.sampled_from([(16, 2, 1), (24, 2, 2), (48, 4, 2), (64, 8, 4), (128, 4, 4)])
        | st.tuples(*(st.sampled_from(v) for v in ([8, 12, 16, 24, 48, 63, 64, 66], [1, 2, 3, 4, 6, 8], [1, 2, 3, 4])))
    )
    return Mutation(
        f"model.hidden_size={h} model.num_attention_heads={n} model.num_key_value_heads={k}", MODEL_SHAPE, valid=True
    )


def model_runs(h: int, n: int, k: int) -> bool:
    """What transformers' Llama needs of its shape (test_model_shape_rules_are_transformers' checks
    this against a real model): heads divide the hidden size into an even head dimension (RoPE
    rotates pairs), key/value heads divide the heads."""
    return h % n == 0 and (h // n) % 2 == 0 and n % k == 0


def culprits(cfg: dict, changed: set) -> set:
    """Keys of a config whose values are each valid but do not fit together: the cross-key checks,
    written from what the code needs (not read from the schema's rules)."""
    bad = set()
    a, t, m = cfg["algorithm"], cfg["topology"], cfg["mesh"]
    dims = (m["federation"], m["replicate"], m["shard"])
    if "shard" not in a["dims"]:
        bad |= {"algorithm.dims"}
    elif all(isinstance(d, int) for d in dims):
        world = t["nodes"] * t["procs_per_node"]
        pinned = any(m[d] != 1 for d in DIMS if d not in a["dims"])
        if math.prod(dims) != world or pinned:
            bad |= {
                "mesh.federation",
                "mesh.replicate",
                "mesh.shard",
                "topology.nodes",
                "topology.procs_per_node",
                "algorithm.dims",
                *(f"topology.layouts.{layout_of(cfg)}.{d}" for d in m),
            }
    if not model_runs(*(cfg["model"][k.split(".")[1]] for k in MODEL_SHAPE)):
        bad |= set(MODEL_SHAPE)
    rope = cfg["model"].get("rope_scaling")
    if isinstance(rope, dict) and not set(schema.ROPE_NEEDS.get(rope.get("rope_type"), ())) <= rope.keys():
        bad.add("model.rope_scaling")
    if a["aggregation"] == "fedavg" and "federation" not in a["dims"]:
        bad |= {"algorithm.aggregation", "algorithm.dims"}
    elif a["aggregation"] == "fedavg":
        outer = a.get("outer") or {}
        if outer.get("nesterov") is True and outer.get("momentum", 0) == 0:
            bad |= {"algorithm.outer.nesterov", "algorithm.outer.momentum", "algorithm.outer"}
        if outer.get("quantize") and outer.get("reduce_dtype") is not None:  # the quantised exchange sums in fp32
            bad |= {"algorithm.outer.quantize", "algorithm.outer.reduce_dtype"}
        if outer.get("error_feedback") is True and not outer.get("quantize"):
            bad |= {"algorithm.outer.error_feedback", "algorithm.outer.quantize"}
        if a.get("every") is None:  # fedavg needs a period: either key is the culprit
            bad |= {"algorithm.every", "algorithm.aggregation"}
        if a.get("federate") == ["nomatch"]:
            bad.add("algorithm.federate")
        streaming = a.get("streaming") or {}
        fragments, every = streaming.get("fragments", 1), a.get("every")
        overlap, alpha = streaming.get("overlap", 0), streaming.get("alpha", 0)
        exchanges = bool(overlap) or bool(alpha)  # an all-reduce in flight, or a mix: one period A
        if isinstance(fragments, int) and (fragments > 1 or exchanges):
            units = cfg["model"]["num_hidden_layers"] + 1  # the root and each decoder layer
            if not isinstance(every, int) or every % fragments:
                bad |= {
                    "algorithm.streaming.fragments",
                    "algorithm.every",
                    "algorithm.streaming.overlap",
                    "algorithm.streaming.alpha",
                }
            elif isinstance(overlap, int) and overlap >= every // fragments:
                bad |= {"algorithm.streaming.overlap", "algorithm.every", "algorithm.streaming.fragments"}
            if fragments > units:
                bad |= {"algorithm.streaming.fragments", "model.num_hidden_layers"}
        if overlap and cfg["comm"].get("emulate"):
            bad |= {"algorithm.streaming.overlap", "comm.emulate"}
        if a.get("elastic") is True:  # elastic federation's preconditions (fldp/elastic.py check)
            tr = cfg["trainer"]
            for key, fails in (
                ("topology.device", t["device"] != "cpu"),
                ("cluster.name", cfg["cluster"].get("name") == "simulate"),
                ("algorithm.federate", a.get("federate", [".*"]) != [".*"]),
                ("trainer.checkpoint_every", bool(tr.get("checkpoint_every"))),
                ("trainer.resume", bool(tr.get("resume"))),
                ("comm.emulate", bool(cfg["comm"].get("emulate"))),
                ("algorithm.streaming.fragments", fragments != 1),
                ("algorithm.streaming.overlap", bool(overlap)),
                ("algorithm.streaming.alpha", bool(alpha)),
                ("algorithm.outer.quantize", bool(outer.get("quantize"))),
            ):
                if fails:
                    bad |= {"algorithm.elastic", key}
    slurm = cfg["cluster"].get("launcher") == "slurm"
    if t["device"] == "cuda" and not slurm and not torch.cuda.is_available():
        bad |= {"topology.device", "cluster.launcher"}
    network = t.get("network") or []
    if t.get("emulation") == "netns" and not (
        network and isinstance(network[-1], dict) and network[-1].get("link") == "node"
    ):
        bad |= {"topology.emulation", "topology.network"}  # emulated nodes: the last tier is each node's link
    for key, spec in schema.KEYS.items():  # a variant's keys: needed in it, refused outside it
        if spec.when:
            section, _, leaf = key.rpartition(".")
            holds = schema.Checker(cfg, {}).holds(spec.when)
            parent = schema.Checker(cfg, {}).lookup(section)
            present = isinstance(parent, dict) and leaf in parent
            needed = schema.Checker(cfg, {}).holds(spec.needed_when or spec.when) and not spec.optional
            if (present and not holds) or (not present and needed):
                bad |= {key, spec.when[0]}
    # the changed keys among them, or holding them, or held by them
    return {c for c in changed if any(b == c or b.startswith(c + ".") or c.startswith(b + ".") for b in bad)}


@st.composite
def scenario(draw, bases, skip=frozenset()):
    base = draw(st.sampled_from(bases))
    makers = [key_mutation(base, skip), key_mutation(base, skip), mesh_mutation(base), model_mutation(base)]
    mutations = draw(st.lists(st.one_of(*makers), min_size=1, max_size=3))
    names = [n for m in mutations for n in m.names]
    # one change per key, none inside another's (a deleted section would hide a change in it)
    assume(
        not any(
            a == b or b.startswith((a + ".", a + "[")) for i, a in enumerate(names) for b in names[i + 1 :] + names[:i]
        )
    )
    return base, mutations


def expected(base: tuple, mutations: list[Mutation], cfg) -> set:
    """The keys a refusal may name; empty: the config must pass."""
    invalid = {n for m in mutations if not m.valid for n in m.names}
    if invalid:
        return {n for m in mutations for n in m.names}  # any changed key: an invalid one may break others
    changed = {n for m in mutations for n in m.names}
    return culprits(schema.plain(cfg), changed)


def command(base, mutations) -> str:
    return "python -m fldp.train " + " ".join(shlex.quote(x) for x in [*base, *overrides_of(mutations)])


def overrides_of(mutations) -> list[str]:
    return [o for m in mutations for o in m.override.split(" ")]


def names_one(message: str, keys: set) -> bool:
    """The message names one of the keys, or the section holding it (below a group: model.rope_scaling
    for model.rope_scaling.factor, not model)."""
    shown = set(keys) | {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count("."))}
    return any(re.search(rf"(^|[\s,(]){re.escape(k)}([=:.,\s\[)]|$)", message) for k in shown)


def check_in_process(base, mutations) -> None:
    cfg = apply(base, overrides_of(mutations))
    allowed = expected(base, mutations, cfg)
    event("expected: refused" if allowed else "expected: passes")  # --hypothesis-show-statistics
    try:
        validate(cfg)
    except ConfigError as e:
        assert allowed, f"refused a valid config: {e}\n  {command(base, mutations)}"
        assert names_one(str(e), allowed), (
            f"the refusal names none of {sorted(allowed)}: {e}\n  {command(base, mutations)}"
        )
        return
    except Exception as e:
        raise AssertionError(f"validate raised {type(e).__name__}: {e}\n  {command(base, mutations)}") from e
    assert not allowed, (
        f"accepted an invalid config (expected a refusal naming one of {sorted(allowed)})\n  {command(base, mutations)}"
    )


FIXED = [  # explicit examples, run in every mode
    (BASES[3], [Mutation("seed=abc", ("seed",), False)]),
    (BASES[3], [Mutation("+trainer.step=4", ("trainer.step",), False)]),
    (BASES[3], [Mutation("model.hidden_size=63", ("model.hidden_size",), True)]),
    (BASES[0], [Mutation("+cluster.dry_run=true", ("cluster.dry_run",), True)]),
    (BASES[4], [Mutation("algorithm.every=[[0,1],[16,8]]", ("algorithm.every",), True)]),
]


@settings(max_examples=FUZZ_EXAMPLES, **SETTINGS)
@given(scenario(BASES))
@example(FIXED[0]).via("the issue's seed=abc")
@example(FIXED[1]).via("Hydra's hint for an unknown key")
@example(FIXED[2]).via("the issue's hidden size")
@example(FIXED[3]).via("a SLURM key on a local cluster")
@example(FIXED[4]).via("an aggregation schedule")
def test_fuzzed_configs_pass_or_are_refused_naming_a_changed_key(case):
    base, mutations = case
    check_in_process(base, mutations)


def test_every_shipped_combination_validates():
    """A valid input is never refused: each option of each group, and the experiments."""
    cases = [
        (f"algorithm={a}", f"topology={t}")
        for a in ALGORITHMS
        for t in ("local_2", "local_4", "local_8", "slurm_2x4", "leonardo_512")
    ]
    cases += [
        ("model=llama3_1_8b",),
        ("dataset=clean_mc4_it",),
        ("cluster=slurm",),
        ("cluster=leonardo",),
        ("+experiment=paper_512",),
        ("+experiment=sweep_a_f", "mesh.federation=4"),
        ("+experiment=tiny_repro",),
        ("topology=gpu_1", "cluster=slurm", "cluster.gpus_per_node=1"),
    ]
    for overrides in cases:
        assert schema.problems(base_config(overrides)) == [], overrides
        validate(base_config(overrides))


def test_every_schema_key_is_fuzzed():
    """A key added to the schema is drawn too: present in a base, or addable there with +."""
    layouts = "|".join(schema.LAYOUTS)
    reached = {
        re.sub(rf"\[\d+\]|\.({layouts})\.", lambda m: "." if m.group(1) else "", t.name)
        for b in BASES
        for t in base_targets(b)
    }
    missing = {k for k in schema.KEYS if k not in reached and not isinstance(schema.KEYS[k], schema.Section)}
    assert not missing, missing


def test_model_shape_rules_are_transformers():
    """The fuzzer's model oracle (and the schema's rules) against a real Llama forward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for h in (8, 12, 16, 24, 48, 63, 64, 66):
        for n in (1, 2, 3, 4, 6, 8):
            for k in (1, 2, 3, 4):
                try:
                    model = LlamaForCausalLM(
                        LlamaConfig(
                            vocab_size=16,
                            hidden_size=h,
                            intermediate_size=8,
                            num_hidden_layers=1,
                            num_attention_heads=n,
                            num_key_value_heads=k,
                            use_cache=False,
                        )
                    )
                    x = torch.zeros(1, 4, dtype=torch.long)
                    model(input_ids=x, labels=x)
                    runs = True
                except Exception:
                    runs = False
                # a head dimension of 1 runs only by broadcasting RoPE's pair of frequencies over
                # it (queries come out 2 wide): transformers computes garbage there, the rule refuses it
                broadcast = h % n == 0 and h // n == 1 and n % k == 0
                assert runs == model_runs(h, n, k) or (runs and broadcast), (h, n, k)
                refused = [p for p in schema.problems(_with_model(h, n, k)) if p.startswith("model.")]
                assert bool(refused) != model_runs(h, n, k), (h, n, k, refused)


def _with_model(h, n, k) -> dict:
    cfg = copy.deepcopy(plain_base(BASES[3]))
    cfg["model"].update(hidden_size=h, num_attention_heads=n, num_key_value_heads=k)
    return cfg


@pytest.mark.parametrize(
    "lr,betas,weight_decay,momentum",
    [
        (-1, [0.9, 0.95], 0.1, 0.0),
        (0, [0.9, 0.95], 0.1, 0.0),
        (1, [0.9, 0.95], 0, 0.0),
        (1e-3, [0.9], 0.1, 0.0),
        (1e-3, [1.0, 0.95], 0.1, 0.0),
        (1e-3, [0.9, -0.1], 0.1, 0.0),
        (1e-3, [0.9, 0.95], -0.1, 0.0),
        (1e-3, [0.9, 0.95], 0.1, -0.5),
        (1e-3, [0.9, 0.95], 0.1, 1.5),
        (1e-3, [0, 0], 0.0, 0.9),
    ],
)
def test_optimizer_rules_are_torchs(lr, betas, weight_decay, momentum):
    """The schema's optimiser ranges against torch's AdamW and SGD (the arguments fldp passes)."""
    torch_ok = True
    for make in (
        lambda p: torch.optim.AdamW(p, lr=lr, betas=tuple(map(float, betas)), weight_decay=weight_decay),
        lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum, weight_decay=weight_decay),
    ):
        try:
            make([torch.nn.Parameter(torch.zeros(2))]).step()
        except (ValueError, IndexError):
            torch_ok = False
    cfg = copy.deepcopy(plain_base(BASES[3]))
    cfg["optimizer"].update(lr=lr, betas=betas, weight_decay=weight_decay, momentum=momentum)
    assert (schema.problems(cfg) == []) == torch_ok, schema.problems(cfg)


# --- the real command line ---------------------------------------------------------------------

ISSUE = [
    ("optimizer.lr=-1", "optimizer.lr"),
    ("seed=abc", "seed"),
    ("model.hidden_size=63", "model.hidden_size"),
    ("model.num_attention_heads=3", "model.num_attention_heads"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("cluster.threads_per_worker=0", "cluster.threads_per_worker"),
    ("trainer.eval_batches=-1", "trainer.eval_batches"),
    ("+trainer.step=4", "trainer.step"),
]


def assert_refused_before_workers(out, run_dir: Path, keys: set, cmd: str) -> None:
    assert out.returncode == 2, f"exit {out.returncode}, expected 2\n  {cmd}\n{out.stderr[-3000:]}"
    assert "fldp: config error:" in out.stderr and names_one(out.stderr, keys), (
        f"names none of {sorted(keys)}\n  {cmd}\n{out.stderr[-3000:]}"
    )
    assert "Traceback" not in out.stderr, f"a traceback\n  {cmd}\n{out.stderr[-3000:]}"
    assert "local workers" not in out.stderr and not (run_dir / "metrics.jsonl").exists(), f"a worker started\n  {cmd}"


@pytest.mark.parametrize("override,key", ISSUE, ids=[k for _, k in ISSUE])
def test_the_issues_inputs_exit_2_naming_the_key(tmp_path, override, key):
    """issue 14's seven inputs and issue 13's `+trainer.step=4`, on the default command."""
    args = ["trainer.steps=2", override, f"hydra.run.dir={tmp_path}"]
    out = cli(*args, cwd=tmp_path, timeout=120)
    assert_refused_before_workers(out, tmp_path, {key}, "python -m fldp.train " + " ".join(args))
    assert override.lstrip("+").split("=")[1] in out.stderr  # the value, as given


CLI_BASES = [(f"algorithm={a}", *CLI_BASE) for a in ALGORITHMS]


@pytest.mark.timeout(900)
@settings(max_examples=CLI_EXAMPLES, **SETTINGS)
@given(scenario(CLI_BASES, skip=frozenset(CLI_SKIP)))
@example(
    (
        CLI_BASES[3],
        [
            Mutation("model.hidden_size=48 model.num_attention_heads=4 model.num_key_value_heads=2", MODEL_SHAPE, True),
            Mutation("algorithm.every=[[0,1],[16,8]]", ("algorithm.every",), True),
        ],
    )
).via("trains")
@example(
    (
        CLI_BASES[0],
        [
            Mutation("optimizer.betas=[0,0]", ("optimizer.betas",), True),
            Mutation("model.rms_norm_eps=1", ("model.rms_norm_eps",), True),
        ],
    )
).via("ints for floats")
def test_fuzzed_configs_on_the_command_line(case):
    """Through `python -m fldp.train` on local_2: one step trained, or exit 2 naming a changed key
    before any worker starts, and never a worker's traceback."""
    base, mutations = case
    cfg = apply(base, overrides_of(mutations))
    allowed = expected(base, mutations, cfg)
    run_dir = Path(tempfile.mkdtemp(prefix="fldp-fuzz-"))  # per example: hypothesis reuses fixtures
    args = [*base, *overrides_of(mutations), f"hydra.run.dir={run_dir}"]
    out = cli(*args, cwd=run_dir, timeout=300)
    cmd = "python -m fldp.train " + " ".join(shlex.quote(a) for a in args)
    event(f"exit {out.returncode}" + (" (expected: refused)" if allowed else ""))
    print(f"exit {out.returncode}: {cmd}")
    if out.returncode == 0:
        assert not allowed, f"accepted an invalid config (expected a refusal naming one of {sorted(allowed)})\n  {cmd}"
        assert (run_dir / "summary.json").exists(), cmd
    else:
        # a valid config may still be refused on what only its data shows (vocabulary, block counts)
        changed = {n for m in mutations for n in m.names}
        assert_refused_before_workers(out, run_dir, allowed or changed, cmd)
