"""fldp-calibrate: measure this machine (issue 31, item 2), as nccl-tests does, for the step-time
model (fldp/steptime.py) to use instead of published figures.

    fldp-calibrate topology=local_4 model=tiny_llama [calibrate.out=profile.yaml] [calibrate.sizes=[4096,65536]]

- compute: the model's own step, built from the config on the topology's device in the run's
  precision, on the run's tokens per rank (trainer.batch_size x dataset.block_size) and the run's
  threads per rank, timed (median after warm-up), as FLOP/s by steptime.flops_per_token's definition
  (backward: twice forward): the whole model and an AdamW step over it where they fit in
  WHOLE_MODEL_BYTES, else one decoder layer and the head; where whole, also the trainer's own step
  (trainer_step: FSDP2 on a one-rank mesh, the run's optimizer, and again sharded over each node's
  ranks), which the step-time model uses; every rank at once, as in a run (a CPU node's ranks share
  its cores), the median rank's kept, and the slowest rank's step;
- collectives: the topology's ranks as real processes (gloo on cpu, NCCL on cuda; on emulated nodes
  inside their namespaces, as fldp-train starts them), per network tier: `node` (the ranks of
  each node, every node at once, as a run's groups), `inter-node` (one rank per node) and `inter-node-shared` (every rank of every node at
  once, one ring per local rank: a node's link shared by its ranks). Each of all-gather,
  reduce-scatter and all-reduce at every size of calibrate.sizes (bytes of the whole message: the
  all-gather's output, the reduce-scatter's input), the slowest rank's time per repetition, median.
  Then alpha (seconds per ring step) and beta (bytes/s per rank) by least squares on the ring model
  t = steps x alpha + wire bytes / beta, (n-1) steps and (n-1)/n of the message per all-gather or
  reduce-scatter, twice both per all-reduce (gloo's reduce-scatter is an all-reduce: docs/netns.md).

It writes a profile (YAML; calibrate.out, else profile.yaml in a new outputs/DATE/TIME_calibrate) and
prints it as tables. A topology uses it with topology.profile=PATH (steptime.Hardware.from_profile).
cluster=slurm submits the same measurement as one SLURM job of the topology's shape.

calibrate.* keys: out (path), sizes (bytes, a list), repeats (>= 1; step_repeats >= 1 for the
trainer's step), warmup (>= 0), shared (bool: the inter-node-shared tier)."""

from __future__ import annotations

import datetime
import difflib
import functools
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from .errors import ConfigError, Interrupted, WorkerError, parsed_or_exit, tool_arguments
from .steptime import STEP_PHASES

if TYPE_CHECKING:
    from .config import Config

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB, x4
FORMAT = 1  # the profile's layout; steptime.Hardware.from_profile reads this one


@dataclass(frozen=True)
class Settings:
    """calibrate.* keys."""

    out: str | None = None
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    step_repeats: int = 15  # the trainer's step: cheap, and steptime.sharded_terms divides its differences
    warmup: int = 2
    shared: bool = True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    "out": ("a path", lambda v: isinstance(v, str) and v != ""),
    "sizes": (
        "a list of message sizes in bytes, each an integer >= 4",
        lambda v: v and all(_is_int(s) and s >= 4 for s in v),
    ),
    "repeats": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "step_repeats": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "warmup": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "shared": ("true or false", lambda v: isinstance(v, bool)),
}


def settings_of(overrides: list[str]) -> tuple[Settings, list[str]]:
    """The calibrate.* overrides, checked (ConfigError naming the key), and the others for Hydra."""
    values: dict[str, Any] = {}
    rest = []
    known = [f.name for f in fields(Settings)]
    for o in overrides:
        key, eq, text = o.lstrip("+").partition("=")
        if not key.startswith("calibrate."):
            rest.append(o)
            continue
        name = key.removeprefix("calibrate.")
        if name not in known or not eq:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean calibrate.{near[0]}?)" if near else f" (known: {', '.join(known)})"
            raise ConfigError(f"{o}: not a calibrate setting{hint}" if name not in known else f"{o}: needs a value")
        try:
            value = yaml.safe_load(text) if text else None
        except yaml.YAMLError:
            value = None
        if name == "sizes" and _is_int(value):
            value = [value]
        if name == "out" and value is not None:
            value = text  # a path, as written
        what, ok = _CHECKS[name]
        if value is None or not ok(value):
            raise ConfigError(f"calibrate.{name}={text}: must be {what}")
        values[name] = tuple(value) if name == "sizes" else value
    return Settings(**values), rest


def compose(overrides: list[str]) -> Config:
    """The config, checked as fldp-train checks it, and the emulated nodes' requirements; typed."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from . import CONF
    from .slurm import submits
    from .validation import check_launch, check_slurm, checked

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    conf = checked(cfg)
    check_launch(conf, forks_locally=not submits(conf.cluster))
    if submits(conf.cluster):
        check_slurm(conf)
    return conf


# ---------------------------------------------------------------- the ring model and its fit


def wire(kind: str, n: int, backend: str) -> tuple[float, float]:
    """(ring steps, share of the message each rank sends) of one collective over n ranks."""
    if kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo"):
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


@dataclass(frozen=True)
class Fit:
    alpha_s: float  # seconds per ring step
    beta_bytes_s: float  # bytes/s per rank
    residual: float  # root mean square of (model - measured) / measured


def fit(rows: list[tuple[float, float, float]]) -> Fit:
    """Least squares of t = steps x alpha + bytes / beta over (steps, bytes sent, seconds) rows,
    alpha and 1/beta kept >= 0 (scipy's nnls). Each row is weighted by 1/t, so the error is
    relative: unweighted, the largest messages' seconds would swamp the small ones that fix alpha."""
    from scipy.optimize import nnls

    X = np.array([[s, b] for s, b, _ in rows], dtype=float)
    y = np.array([t for _, _, t in rows], dtype=float)
    if len(rows) < 2 or np.any(y <= 0):
        raise ValueError(f"fit: needs at least 2 rows of positive times, got {rows}")
    (alpha, inverse), _ = nnls(X / y[:, None], np.ones_like(y))
    residual = float(np.sqrt(np.mean(((X @ [alpha, inverse] - y) / y) ** 2)))
    return Fit(float(alpha), float(1.0 / inverse) if inverse > 0 else math.inf, residual)


def rows_of(measured: dict[str, list[list[float]]], n: int, backend: str) -> list[tuple[float, float, float]]:
    """A tier's table ({kind: [[bytes, seconds], ...]}) as fit()'s rows."""
    out = []
    for kind, table in measured.items():
        steps, share = wire(kind, n, backend)
        out += [(steps, share * nbytes, seconds) for nbytes, seconds in table]
    return out


# ---------------------------------------------------------------- what is measured, on the ranks


@dataclass(frozen=True)
class Tier:
    name: str
    groups: tuple[tuple[int, ...], ...]  # timed at once; the ranks of each run one collective
    what: str


def tiers_of(nodes: int, procs_per_node: int, shared: bool = True) -> list[Tier]:
    """The groups each tier is measured on, ranks node-major (as fldp-train places them)."""
    out = []
    if procs_per_node > 1:  # every node's at once, as a run's groups run theirs (on CPU they share cores)
        nodes_ranks = tuple(tuple(range(k * procs_per_node, (k + 1) * procs_per_node)) for k in range(nodes))
        out.append(Tier("node", nodes_ranks, "the ranks of each node, every node at once"))
    if nodes > 1:
        leaders = tuple(k * procs_per_node for k in range(nodes))
        out.append(Tier("inter-node", (leaders,), "one rank per node"))
        if shared and procs_per_node > 1:
            rings = tuple(tuple(k + j for k in leaders) for j in range(procs_per_node))
            out.append(Tier("inter-node-shared", rings, f"all {procs_per_node} ranks of each node at once"))
    return out


def _collective(kind: str, nbytes: int, n: int, dtype, device, group):
    """A closure running one collective of an nbytes message (rounded to n equal parts)."""
    import torch
    import torch.distributed as dist

    element = torch.empty((), dtype=dtype).element_size()
    part = max(1, nbytes // element // n)
    whole = torch.ones(part * n, dtype=dtype, device=device)
    piece = torch.ones(part, dtype=dtype, device=device)
    # the names torch 2.13 prefers, else the older ones (what FSDP2 calls, either way)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    run = {
        "all_gather": lambda: gather(whole, piece, group=group),
        "reduce_scatter": lambda: scatter(piece, whole, group=group),
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
    }[kind]
    return run, part * n * element


def _once(run, device) -> float:
    import torch

    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_tier(tier: Tier, settings: Settings, dtype, device) -> dict[str, list[list[float]]]:
    """On every rank (each creates every group, in order): the tier's table on rank 0, {kind:
    [[bytes, median seconds], ...]}, each repetition's time the slowest rank's of every group."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = [dist.new_group(list(g)) for g in tier.groups]
    mine = next((g for g, members in zip(groups, tier.groups) if rank in members), None)
    n = len(tier.groups[0])
    times = torch.zeros(len(KINDS), len(settings.sizes), settings.repeats, dtype=torch.float64)
    sent = [[0] * len(settings.sizes) for _ in KINDS]
    for i, kind in enumerate(KINDS):
        for j, size in enumerate(settings.sizes):
            run, sent[i][j] = _collective(kind, size, n, dtype, device, mine)
            for r in range(settings.warmup + settings.repeats):
                dist.barrier()  # every group starts together: the shared tier's flows overlap
                took = _once(run, device) if mine is not None else 0.0
                if r >= settings.warmup:
                    times[i, j, r - settings.warmup] = took
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    times = times.cpu()
    return {
        kind: [[sent[i][j], statistics.median(times[i, j].tolist())] for j in range(len(settings.sizes))]
        for i, kind in enumerate(KINDS)
    }


def _median_time(fn, settings: Settings, device) -> float:
    return statistics.median([_once(fn, device) for _ in range(settings.warmup + settings.repeats)][settings.warmup :])


def measure_compute(conf: Config, settings: Settings, device) -> dict:
    """One decoder layer of the model on the run's tokens per rank: forward, forward + backward."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from .cost import config_model
    from .model import DTYPES
    from .steptime import flops_per_token

    model, _ = config_model(conf)  # on the meta device: the config and the parameter counts
    config, dtype = model.config, DTYPES[conf.trainer.precision]
    batch, seq = conf.trainer.batch_size, conf.dataset.block_size
    torch.manual_seed(0)
    with torch.device(device):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
        rope = LlamaRotaryEmbedding(config)
        x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
        rotary = rope(x, torch.arange(seq).unsqueeze(0))
    forward = _median_time(lambda: layer(x, position_embeddings=rotary), settings, device)
    train = _median_time(lambda: layer(x, position_embeddings=rotary).float().sum().backward(), settings, device)
    layer_flops = flops_per_token(sum(p.numel() for p in layer.parameters()), 0, 1, config.hidden_size, seq)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    tokens = batch * seq
    model_flops = flops_per_token(params, embedding, config.num_hidden_layers, config.hidden_size, seq)
    whole = params * dtype.itemsize * 4 <= WHOLE_MODEL_BYTES
    step: dict = {}
    if whole:  # the model's own step: its layers, head, norms and the framework's overhead
        model_train, optimizer, opt_bytes = _whole_model(config, dtype, batch, seq, settings, device)
        step = trainer_step(conf, config.vocab_size, settings, device)
        step["flop_s_step"] = 3 * model_flops * tokens / (step["step_forward_s"] + step["step_backward_s"])
        step["optimizer_bytes_s_step"] = 7 * opt_bytes / step["step_optimizer_s"]
    else:  # its layers and its head (lm_head and the loss), as they take their time
        head_train, optimizer = _head_and_optimizer(layer, x, config, settings, device)
        model_train = config.num_hidden_layers * train + head_train
        opt_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    return {
        "whole_model": whole,
        "model_train_s": model_train,
        "flop_s_model": 3 * model_flops * tokens / model_train,
        "optimizer_s": optimizer,
        "optimizer_bytes_s": 7 * opt_bytes / optimizer,  # AdamW reads 4 tensors, writes 3 (steptime)
        "tokens_per_rank": tokens,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "layer_forward_s": forward,
        "layer_train_s": train,
        "flops_per_token_layer": layer_flops,
        "flops_per_token_model": flops_per_token(params, embedding, config.num_hidden_layers, config.hidden_size, seq),
        "flop_s_forward": layer_flops * tokens / forward,
        "flop_s_train": 3 * layer_flops * tokens / train,  # backward: twice forward's FLOPs
        **step,
    }


# a model whose parameters, gradients and AdamW's moments fit in this is timed whole (tiny_llama:
# ~10 MB); a larger one by one decoder layer and its head
WHOLE_MODEL_BYTES = 1 << 30


def _whole_model(config, dtype, batch: int, seq: int, settings: Settings, device) -> tuple[float, float, int]:
    """Seconds of the whole model's forward + backward on the run's tokens and of one AdamW step
    over it, and its parameters' bytes."""
    import torch

    from .model import build_model

    model = build_model(config, device).to(dtype)
    with torch.device(device):
        ids = torch.randint(config.vocab_size, (batch, seq))
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-12)

    def train():
        model(input_ids=ids, labels=ids).loss.backward()

    train_s = _median_time(train, settings, device)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return train_s, _median_time(adamw.step, settings, device), nbytes


def trainer_step(conf: Config, vocab_size: int, settings: Settings, device) -> dict:
    """The trainer's own step, every rank at once: the model as fldp.trainer shards it and the run's
    optimizer; forward (with the loss), backward and the optimizer timed as fldp.step.TrainStep
    times them (median of calibrate.step_repeats after warm-up). It holds what the bare model's step
    does not: FSDP2's hooks, DTensor parameters and an optimizer over them. On two meshes: `step_*`
    one rank each (F = the world, each rank its own group, as an 8x1x1 run), and `sharded_step_*`
    sharded over each node's ranks (F = the nodes, S = procs_per_node, as a 2x1x4 run on 2 nodes of
    4), which holds FSDP2's collectives inside a node and the optimizer on 1/S of the model
    (steptime.sharded_terms). Their repetitions alternate: steptime.sharded_terms works from the
    two steps' difference, which a machine whose speed drifts (a shared VM) would otherwise move."""
    import torch
    import torch.distributed as dist

    from .mesh import MeshShape

    world, per_node = dist.get_world_size(), conf.topology.procs_per_node
    shapes = {"step": MeshShape(world, 1, 1)}
    if per_node > 1 and world % per_node == 0:
        shapes["sharded_step"] = MeshShape(world // per_node, 1, per_node)
    steps = {name: _step_of(conf, vocab_size, shape, device) for name, shape in shapes.items()}
    ids = torch.randint(vocab_size, (conf.trainer.batch_size, conf.dataset.block_size), device=device)
    laps: dict[str, list[dict]] = {name: [] for name in steps}
    for _ in range(settings.warmup + settings.step_repeats):
        for name, step in steps.items():
            dist.barrier()  # each step starts together, as a run's do after their records' all-gather
            laps[name].append(step(ids))
    out: dict = {"sharded_shard": per_node} if "sharded_step" in steps else {}
    for name, taken in laps.items():
        kept = taken[settings.warmup :]
        out.update({f"{name}_{p}_s": statistics.median(t[p] for t in kept) for p in STEP_PHASES})
        out[f"{name}_laps_s"] = [sum(t.values()) for t in kept]  # for the slowest rank's (_median_over_ranks)
    return out


def _step_of(conf: Config, vocab_size: int, shape, device):
    """The trainer's model on `shape` and the run's optimizer: a function of the tokens that takes
    one step and gives its phases' seconds, timed as fldp.step.TrainStep times them."""
    from .mesh import build_mesh, group_mesh
    from .step import PhaseTimer
    from .trainer import build_optimizer, sharded_model

    model = sharded_model(conf, vocab_size, group_mesh(build_mesh(shape, device.type), shape), device)
    optimizer = build_optimizer(model, conf.optimizer)
    timer = PhaseTimer(device)

    def step(ids) -> dict:
        timer.start()
        loss = model(input_ids=ids, labels=ids).loss
        timer.lap("forward")
        loss.backward()
        timer.lap("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.lap("optimizer")
        return timer.times

    return step


def _head_and_optimizer(layer, x, config, settings: Settings, device) -> tuple[float, float]:
    """Seconds of the head's forward + backward (lm_head and the loss on the run's tokens) and of
    one AdamW step over the decoder layer's parameters."""
    import torch

    hidden = x.detach().reshape(-1, config.hidden_size).requires_grad_(True)
    with torch.device(device):
        head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(x.dtype)
        labels = torch.randint(config.vocab_size, (hidden.shape[0],))

    def head_train():
        torch.nn.functional.cross_entropy(head(hidden).float(), labels).backward()

    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    adamw = torch.optim.AdamW(layer.parameters(), lr=1e-12)
    return _median_time(head_train, settings, device), _median_time(adamw.step, settings, device)


def _median_over_ranks(computed: list[dict]) -> dict:
    """The ranks' compute measurements as one: each time and rate the median rank's; and
    `step_slowest_s`, each repetition's trainer step of its slowest rank, median over repetitions:
    what a run records as its step (fldp.step.step_row's time_step), where the median rank is not."""
    slowest = {}
    for name in ("step", "sharded_step"):
        laps = [c.pop(f"{name}_laps_s") for c in computed if f"{name}_laps_s" in c]
        if laps:
            slowest[f"{name}_slowest_s"] = statistics.median(max(rep) for rep in zip(*laps))
    out = dict(computed[0], ranks_at_once=len(computed), **slowest)
    for key in (
        "layer_forward_s",
        "layer_train_s",
        "flop_s_forward",
        "flop_s_train",
        "model_train_s",
        "flop_s_model",
        "optimizer_s",
        "optimizer_bytes_s",
        "step_forward_s",
        "step_backward_s",
        "step_optimizer_s",
        "flop_s_step",
        "optimizer_bytes_s_step",
        *(f"sharded_step_{p}_s" for p in STEP_PHASES),
    ):
        if key in out:
            out[key] = statistics.median(c[key] for c in computed)
    return out


def calibrate_rank(conf: Config, settings: Settings, out: str, device) -> None:
    """Every rank: the compute, all ranks at once (the median rank's; a GPU each has its own, the
    cores of a CPU node its ranks share, as in a run), before the tiers' collectives and again after
    each tier; rank 0 writes the profile with each compute term the median of those measurements
    (one measurement carried a shared VM's passing slowness into every layout's prediction, issue 47)."""
    import torch.distributed as dist

    from .model import DTYPES

    topology = conf.topology
    dtype = DTYPES[conf.trainer.precision]
    tiers = tiers_of(topology.nodes, topology.procs_per_node, settings.shared)
    computes, measured = [_compute_on_all_ranks(conf, settings, device)], {}
    for tier in tiers:
        measured[tier.name] = time_tier(tier, settings, dtype, device)
        computes.append(_compute_on_all_ranks(conf, settings, device))
    if dist.get_rank() == 0:
        write(profile(conf, settings, tiers, measured, median_over_samples(computes), dist.get_backend()), out)


def _compute_on_all_ranks(conf: Config, settings: Settings, device) -> dict:
    import torch.distributed as dist

    dist.barrier()  # every rank computes at once, as in a run: on a CPU the node's ranks share its cores
    computed: list = [None] * dist.get_world_size()
    dist.all_gather_object(computed, measure_compute(conf, settings, device))
    return _median_over_ranks(computed)


def median_over_samples(samples: list[dict]) -> dict:
    """The compute measured several times during a calibration, as one: each number the median of
    its measurements (flags and counts the first's); `compute_steps_s`: each measurement's step (the
    trainer's one-rank forward + backward where measured, else the model's), and `compute_spread`:
    the slowest over the fastest, less 1 (26-39% on the 2-core VM with nothing else running, in
    profiles whose layouts were then predicted within 15%: recorded, not a reason to doubt them)."""
    out = dict(samples[0], compute_samples=len(samples))
    for key, value in samples[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(s[key] for s in samples)
    step = [
        s["step_forward_s"] + s["step_backward_s"] if "step_forward_s" in s else s["model_train_s"] for s in samples
    ]
    out["compute_steps_s"], out["compute_spread"] = step, max(step) / min(step) - 1
    return out


def profile(conf: Config, settings: Settings, tiers: list[Tier], measured: dict, compute: dict, backend: str) -> dict:
    """What fldp-calibrate writes: the machine, the compute, each tier's fit and its table."""
    from .netns import from_config
    from .provenance import source_commit
    from .steptime import sharded_terms, workload_for

    out_tiers = {}
    for tier in tiers:
        n = len(tier.groups[0])
        found = fit(rows_of(measured[tier.name], n, backend))
        out_tiers[tier.name] = {
            "what": tier.what,
            "ranks_per_group": n,
            "groups_at_once": len(tier.groups),
            "alpha_s": found.alpha_s,
            "beta_bytes_s": found.beta_bytes_s,
            "residual": found.residual,
            "sizes": list(settings.sizes),
            "measured": measured[tier.name],  # {kind: [[bytes, median seconds], ...]}
        }
    network = from_config(conf)
    t = conf.topology
    out = {
        "format": FORMAT,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "machine": _machine(conf, backend),
        "topology": {"name": t.name, "nodes": t.nodes, "procs_per_node": t.procs_per_node, "device": t.device},
        "emulated_link": network.describe() if network else None,
        "model": {"name": conf.model.name, "precision": conf.trainer.precision},
        "settings": {"repeats": settings.repeats, "step_repeats": settings.step_repeats, "warmup": settings.warmup},
        "compute": compute,
        "tiers": out_tiers,
    }
    # the sharded step against the model's terms: the optimizer's fixed part, FSDP2's own work
    out["compute"] = {**compute, **sharded_terms(out, workload_for(conf))}
    return out


def _machine(conf: Config, backend: str) -> dict:
    import torch

    cuda = conf.topology.device == "cuda" and torch.cuda.is_available()
    return {
        "system": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "device": torch.cuda.get_device_name() if cuda else _cpu_model(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a TorchVersion, which yaml cannot write
        "backend": backend,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write(prof: dict, out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(prof, sort_keys=False))
    tmp.replace(path)  # whole or not at all


# ---------------------------------------------------------------- the command


def default_out() -> str:
    """Where a run's records go (conf/config.yaml's hydra.run.dir pattern), named calibrate."""
    now = datetime.datetime.now()
    return str(Path("outputs", now.strftime("%Y-%m-%d"), now.strftime("%H-%M-%S") + "_calibrate", "profile.yaml"))


def run(conf: Config, settings: Settings, out: str) -> bool:
    """The measurement on this machine's forked ranks (in their namespaces on emulated nodes), or
    as one SLURM job; False when nothing was measured (a dry run)."""
    from .launch import run_local
    from .netns import from_config
    from .slurm import submits

    if submits(conf.cluster):
        return _submit(conf, settings, out)
    world = conf.topology.nodes * conf.topology.procs_per_node
    run_local(calibrate_rank, (conf, settings, out), world, conf.topology.device, conf.cluster, from_config(conf))
    return True


def _slurm_task(conf: Config, run_dir: str, settings: Settings, out: str) -> None:
    """A task of the SLURM job: its rank, then rank 0 writes the summary fldp.slurm.outcome wants."""
    import json

    import torch.distributed as dist

    from .launch import from_environment, init_process_group

    env = from_environment()
    if env is None:
        raise RuntimeError("fldp-calibrate: not a task of a multi-task SLURM step")
    device = init_process_group(env, conf.topology.device, conf.cluster.timeout_s)
    calibrate_rank(conf, settings, out, device)
    if env.rank == 0:
        Path(run_dir, "summary.json").write_text(json.dumps({"profile": out}))
    dist.destroy_process_group()


def _submit(conf: Config, settings: Settings, out: str) -> bool:
    """One job of topology.nodes x procs_per_node tasks, as fldp-train submits a run (fldp.slurm)."""
    from .mesh import MeshShape
    from .preflight import no_slurm
    from .slurm import follow, job_folder_of, job_parameters, sbatch_script, submit_job

    shape = MeshShape(1, 1, conf.topology.nodes * conf.topology.procs_per_node)
    run_dir = str(Path(out).absolute().parent)
    conf = replace(
        conf,
        cluster=replace(conf.cluster, max_requeue=0),  # a measurement has no checkpoint to requeue from
        algorithm=replace(conf.algorithm, name="calibrate"),  # the job's name: fldp-calibrate-<topology>
        topology=replace(conf.topology, paper_setting=False),  # a measurement, not a run of the paper's setting
    )
    if conf.cluster.dry_run:
        script = sbatch_script(job_parameters(conf, shape), job_folder_of(conf.cluster, run_dir))
        print(f"fldp-calibrate: dry run (cluster={conf.cluster.name}): nothing submitted\n{script}")
        return False
    if missing := no_slurm(conf):
        raise ConfigError(missing[0])
    task = functools.partial(_slurm_task, settings=settings, out=str(Path(out).absolute()))
    job = submit_job(conf, run_dir, shape, task)
    follow(job, run_dir, conf.cluster.poll_s)
    return True


def main(argv: list[str] | None = None) -> None:
    args = tool_arguments(argv, __doc__)
    if args is None:
        return

    def parse():
        settings, overrides = settings_of(args)
        return settings, overrides, compose(overrides)

    settings, overrides, conf = parsed_or_exit("fldp-calibrate", parse)
    out = settings.out or default_out()
    start = time.monotonic()
    try:
        measured = run(conf, settings, out)
    except Interrupted as e:  # the workers were stopped and the namespaces removed
        print(f"fldp-calibrate: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except (ConfigError, WorkerError) as e:
        print(f"fldp-calibrate: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if measured:
        prof = yaml.safe_load(Path(out).read_text())
        prof["unreliable"] = judged(overrides, out)
        write(prof, out)
        print_profile(prof, out, time.monotonic() - start)


def judged(overrides: list[str], out: str) -> list[str]:
    """What makes the new profile doubtful for its own topology's layouts (fldp.plan.caveats, at
    fldp-plan's default A values): written into it, and printed."""
    from . import plan

    configs = plan.compose([*overrides, f"+topology.profile={Path(out).absolute()}"])
    fitting, _ = plan.ranked(plan.candidates(configs, [4, 8, 16]))
    return plan.caveats(configs, fitting)


def print_profile(prof: dict, out: str, took_s: float) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, markup=False)
    c, t = prof["compute"], prof["topology"]
    console.print(
        f"fldp-calibrate: topology={t['name']} ({t['nodes']} x {t['procs_per_node']} ranks, {t['device']}, "
        f"{prof['machine']['backend']}), model={prof['model']['name']} ({prof['model']['precision']}), {took_s:.0f} s"
    )
    console.print(
        f"compute, one decoder layer on {c['tokens_per_rank']} tokens per rank: "
        f"forward {c['flop_s_forward'] / 1e9:.3g} GFLOP/s, forward + backward {c['flop_s_train'] / 1e9:.3g} GFLOP/s"
    )
    if "step_forward_s" in c:
        console.print(_step_line(c))
    fits = Table(title="Collectives: t = steps x alpha + bytes per rank / beta", box=box.SIMPLE_HEAD)
    for header in ("tier", "ranks x groups", "alpha [us]", "beta [MB/s per rank]", "residual [%]"):
        fits.add_column(header, justify="left" if header == "tier" else "right")
    for name, tier in prof["tiers"].items():
        fits.add_row(
            name,
            f"{tier['ranks_per_group']} x {tier['groups_at_once']}",
            f"{tier['alpha_s'] * 1e6:.4g}",
            f"{tier['beta_bytes_s'] / 1e6:.4g}",
            f"{tier['residual'] * 100:.3g}",
        )
    console.print(fits)
    for name, tier in prof["tiers"].items():
        table = Table(title=f"{name}: median seconds", box=box.SIMPLE_HEAD)
        table.add_column("bytes", justify="right")
        for kind in KINDS:
            table.add_column(kind, justify="right")
        for i in range(len(tier["sizes"])):
            table.add_row(str(tier["measured"][KINDS[0]][i][0]), *[f"{tier['measured'][k][i][1]:.4g}" for k in KINDS])
        console.print(table)
    for note in prof.get("unreliable", []):
        console.print(f"UNRELIABLE: {note}")
    console.print(f"profile: {out} (use it with +topology.profile={out})")


def _step_line(c: dict) -> str:
    """The trainer's step as calibrated: its phases, and what the sharded one adds."""
    line = "trainer step, median rank: " + ", ".join(f"{p} {c[f'step_{p}_s'] * 1e3:.3g} ms" for p in STEP_PHASES)
    if "sharded_step_forward_s" in c:
        line += (
            f"\nsharded over {c['sharded_shard']} ranks: "
            + ", ".join(f"{p} {c[f'sharded_step_{p}_s'] * 1e3:.3g} ms" for p in STEP_PHASES)
            + f"\n  optimizer {c['optimizer_fixed_s'] * 1e3:.3g} ms fixed + the shard's bytes at "
            f"{c['optimizer_bytes_s_fit'] / 1e6:.4g} MB/s; FSDP2's own work per unit and collective: "
            f"forward {c['fsdp_forward_s'] * 1e3:.3g} ms, backward {c['fsdp_backward_s'] * 1e3:.3g} ms"
        )
    return line


if __name__ == "__main__":
    main()
