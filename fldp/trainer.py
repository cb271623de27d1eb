"""The one training loop for FSDP, HSDP, FL+FSDP and FL+HSDP.

The algorithms differ only in the mesh they shard over and in whether FedAvg runs every A steps;
everything else (data, model, optimiser, schedule, timing, records) is shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from . import elastic, faults
from .aggregation import FedAvg, FedAvgConfig, fragment_fields
from .checkpoint import Checkpointer, latest
from .comm import CommMeter
from .cost import tier_bandwidth
from .data import Blocks, RankBatches
from .mesh import DIMS, ConfigError, build_mesh, group_mesh, mesh_shape
from .model import DTYPES, build_model, init_weights, llama_config, parallelize
from .netns import summary_fields
from .provenance import run_fields
from .records import PHASES, Recorder
from .schedule import aggregation_steps
from .streaming import Exchange


class PhaseTimer:
    """Wall-clock laps; on CUDA a device synchronise at each boundary so a lap is the phase's
    real duration, not its launch time (as the paper's measurements)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.times = {}
        self.t0 = self.last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.times[phase] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.t0


def build_optimizer(model, opt_cfg):
    if opt_cfg.name == "adamw":
        # torch wants float betas; Hydra reads `optimizer.betas=[0,0]` as ints
        return torch.optim.AdamW(
            model.parameters(), lr=opt_cfg.lr, betas=tuple(map(float, opt_cfg.betas)), weight_decay=opt_cfg.weight_decay
        )
    if opt_cfg.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=opt_cfg.lr, momentum=opt_cfg.momentum, weight_decay=opt_cfg.weight_decay
        )
    raise ConfigError(f"optimizer.name={opt_cfg.name!r}: must be adamw or sgd")


def build_scheduler(optimizer, opt_cfg, steps: int):
    """Linear warm-up over the first `opt_cfg.warmup` of the steps, then cosine to 0 (the paper's)."""
    return get_cosine_schedule_with_warmup(optimizer, int(opt_cfg.warmup * steps), steps)


def total_steps(cfg, blocks: Blocks, world: int) -> int:
    """trainer.steps, or one pass over the training blocks when null (paper: 65,536/(512*2) = 64)."""
    per_epoch = len(blocks.train) // (world * cfg.trainer.batch_size)
    if per_epoch == 0:
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size}: {len(blocks.train)} training "
            f"blocks are too few for one batch on each of {world} ranks"
        )
    return cfg.trainer.steps or per_epoch


def _all_ranks(values: list[float], device) -> torch.Tensor:
    """Every rank's values, one row per rank (a single small collective)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine)
    return out.view(dist.get_world_size(), len(values))


@torch.no_grad()
def evaluate(model, cfg, blocks: Blocks, device, groups: int = 1) -> tuple[list[float], float]:
    """Mean held-out loss and the wall time (max over ranks). groups=1: the world scores one model,
    each rank its slice of the split. groups=F: each federation group (a block of consecutive
    ranks) scores its own model on the whole split, its ranks sharing it: one loss per group."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    size = world // groups
    model.eval()
    batches = RankBatches(blocks.eval, cfg.trainer.batch_size, rank % size, size, cfg.seed, shuffle=False)
    losses = []
    for i, x in enumerate(batches.epoch(0)):
        if cfg.trainer.eval_batches is not None and i >= cfg.trainer.eval_batches:
            break
        x = x.to(device)
        losses.append(model(input_ids=x, labels=x).loss.float().item())
    model.train()
    model.reshard()  # a root kept gathered after forward would hold stale weights once FedAvg runs
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows = _all_ranks([sum(losses), len(losses), time.perf_counter() - start], device).view(groups, size, 3)
    counts = rows[..., 1].sum(dim=1)
    if (counts == 0).any():
        raise ConfigError(
            f"dataset.eval_blocks: {len(blocks.eval)} held-out blocks are too few for one "
            f"batch of {cfg.trainer.batch_size} on each of {size} ranks"
        )
    return (rows[..., 0].sum(dim=1) / counts).tolist(), rows[..., 2].max().item()


# what an evaluation's loss is the loss of (`eval_of` in eval rows and summary.json)
ONE_MODEL, AVERAGE, GROUPS_MEAN = "the one model", "the groups' average model", "the groups' mean loss"
GROUP_MODEL = "this group's own model"  # elastic federation, between aggregations


def eval_row(model, cfg, blocks: Blocks, device, step: int, fedavg, groups_differ: bool, partial: bool = False) -> dict:
    """Score the model, or models, the groups hold; `eval_of` says which loss is the row's `loss`.
    Groups that are identical hold one model: the world scores it, each rank a slice of the split.
    Groups that differ: each group scores its own model on the whole split (`group_perplexity`),
    and the loss is, with full federation (they differ only between aggregations), their plain
    average's, computed aside (the training state is restored bit for bit); with partial federation
    (`partial`: some parameters are never averaged, so the groups always differ) the mean of the
    groups' own losses: their "average" would keep each group's local parameters, no one model."""
    if not (groups_differ or partial):
        (loss,), eval_time = evaluate(model, cfg, blocks, device)
        extra = {"eval_of": ONE_MODEL}
    else:
        group_losses, eval_time = evaluate(model, cfg, blocks, device, groups=fedavg.shape.federation)
        extra = {"group_perplexity": [math.exp(x) for x in group_losses]}
        if partial:
            loss = sum(group_losses) / len(group_losses)
            extra["eval_of"] = GROUPS_MEAN
        else:
            with fedavg.averaged():
                (loss,), average_time = evaluate(model, cfg, blocks, device)
            eval_time += average_time
            extra.update(eval_of=AVERAGE, averaged=True)
    return {"split": "eval", "step": step, "loss": loss, "perplexity": math.exp(loss), "time_eval": eval_time, **extra}


def sharded_model(cfg, vocab_size: int, mesh, device: torch.device):
    """The Llama of cfg.model, sharded with FSDP2 over `mesh` (this rank's federation group), with
    initial weights that depend on the seed alone: the same for every algorithm, mesh and
    `model.init_device` (cpu: built in full, then sharded; meta: only this rank's shard exists)."""
    meta = cfg.model.init_device == "meta"
    model = build_model(llama_config(cfg.model, vocab_size), "meta" if meta else device)
    checkpointing = cfg.model.get("activation_checkpointing", "none")
    model = parallelize(model, mesh, DTYPES[cfg.trainer.precision], cfg.fsdp.reshard_root_after_forward, checkpointing)
    init_weights(model, device, cfg.seed)
    return model


def train(cfg, run_dir: str, blocks: Blocks, device: torch.device, on_step=None, member=None) -> dict | None:
    """Run one experiment on this rank (the process group is initialised). Rank 0 writes the
    records and returns the summary. `on_step(step, model, aggregated)`, if given, runs on every
    rank before the first step (step 0) and after each step (tests inspect the parameters with it).

    member (fldp.elastic.Member): elastic federation. The process group is then this rank's
    federation group alone; the groups meet only at aggregations, through torchft. Group 0's rank 0
    writes the run's records and summary, group g's rank 0 its own in run_dir/group_g/."""
    shape = mesh_shape(cfg)
    world = shape.world
    # the rank's place in the whole run: its data slice and its records
    rank = dist.get_rank() + (member.group * shape.group_size if member else 0)
    local_shape = dataclasses.replace(shape, federation=1) if member else shape
    mesh = build_mesh(local_shape, device.type)
    steps = total_steps(cfg, blocks, world)

    model = sharded_model(cfg, blocks.vocab_size, group_mesh(mesh, local_shape), device)

    fedavg_cfg = FedAvgConfig.from_algorithm(cfg.algorithm)
    federation = elastic_federation(cfg, member, shape) if member else None
    fedavg = (
        FedAvg(model, mesh, shape, fedavg_cfg, last_step=steps, resident=not cfg.trainer.async_save, elastic=federation)
        if fedavg_cfg
        else None
    )
    # parameters left out of algorithm.federate stay local: the groups never hold one model
    partial = fedavg_cfg is not None and not all(fedavg_cfg.federated([n for n, _ in model.named_parameters()]))
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, steps)

    start = 0
    checkpointer = None
    position = {"step": 0}  # the last step trained (a healing peer copies it)
    heal = None
    if federation is not None:
        faults.strike(member.group, member.restart, None, "start")
        federation.track(model, optimizer, scheduler, fedavg, position)
        if member.restart:  # a restarted group: heal from a live peer at the next aggregation
            heal = rejoin(fedavg, federation, position, member)
            start = position["step"]
    elif cfg.trainer.checkpoint_every or cfg.trainer.resume:
        checkpointer = Checkpointer(
            run_dir,
            shape,
            cfg.algorithm.name,
            cfg.trainer.checkpoint_every,
            steps,
            stateful={"outer": fedavg} if fedavg is not None else None,
            keep_last=cfg.trainer.keep_last,
            async_save=cfg.trainer.async_save,
            schedule=fedavg_cfg.schedule if fedavg_cfg else None,
            fragments=fedavg_cfg.streaming.fragments if fedavg_cfg else 1,
        )
        resume_from = latest(run_dir) if cfg.trainer.resume == "auto" else None
        if resume_from is not None:
            start = checkpointer.load(resume_from, model, optimizer, scheduler)
    if on_step is not None and start == 0:
        on_step(0, model, False)  # the initial weights (identical in every group: fldp.init)
    elif on_step is not None and heal:
        on_step(start, model, True)  # healed: the weights of that step's aggregation

    batches_from = RankBatches(blocks.train, cfg.trainer.batch_size, rank, world, cfg.seed).stream
    batches = batches_from(start)
    tokens_per_step = world * cfg.trainer.batch_size * blocks.train.shape[1]
    records = run_dir if not member or member.group == 0 else str(Path(run_dir) / f"group_{member.group}")
    recorder = (
        Recorder(records, cfg, steps, cfg.trainer.progress and rank == 0, resume_from=start)
        if dist.get_rank() == 0
        else None
    )
    if recorder and heal:
        recorder.log(heal)
    timer = PhaseTimer(device)
    train_time, row = (recorder.train_time, recorder.last_row) if recorder else (0.0, {})
    # counts every collective of the step per mesh dimension; with emulation, slows each down to
    # bytes / bandwidth of the network tier its group crosses
    emulated = tier_bandwidth(cfg.topology.network, shape, cfg.comm.scale) if cfg.comm.emulate else None
    meter = CommMeter(mesh, emulated) if cfg.comm.measure or cfg.comm.emulate else None
    counted = [f"{kind}_{d}" for kind in ("bytes", "collectives") for d in DIMS] if meter else []

    step, owed = start, False
    while step < steps:
        step += 1
        with meter or contextlib.nullcontext():
            timer.start()
            x = next(batches).to(device)
            lr = scheduler.get_last_lr()[0]
            loss = model(input_ids=x, labels=x).loss
            timer.lap("forward")
            loss.backward()
            timer.lap("backward")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            timer.lap("optimizer")
            position["step"] = step
            due = fedavg.due(step) if fedavg is not None else Exchange()  # the fragments sent and merged now
            aggregated = bool(due)
            if aggregated:
                if member:
                    faults.strike(member.group, member.restart, step, "aggregation")
                committed = fedavg.exchange(due)
                timer.lap("aggregation")
            else:
                timer.times["aggregation"] = 0.0  # the phase did not run this step
        comm = meter.take() if meter else {}

        # Outside the timed phases: mean loss over ranks; times and bytes as the largest rank's.
        stats = _all_ranks(
            [loss.item(), *(timer.times[p] for p in PHASES), timer.total(), *(comm[k] for k in counted)], device
        )
        mean_loss = stats[:, 0].mean().item()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"non-finite loss ({mean_loss}) at step {step}: stopping")
        largest = stats[:, 1:].max(dim=0).values.tolist()
        times, step_time, counts = largest[: len(PHASES)], largest[len(PHASES)], largest[len(PHASES) + 1 :]
        critical = stats[stats[:, 1 + len(PHASES)].argmax(), 1 : 1 + len(PHASES)].tolist()  # the slowest rank's
        train_time += step_time
        row = {
            "step": step,
            "loss": mean_loss,
            "perplexity": math.exp(mean_loss),
            "lr": lr,
            "tokens": step * tokens_per_step,
            **{f"time_{p}": t for p, t in zip(PHASES, times)},
            "time_step": step_time,
            **{f"critical_{p}": t for p, t in zip(PHASES, critical)},
            "aggregated": aggregated,
            **{k: (int(v) if k.startswith("collectives") else v) for k, v in zip(counted, counts)},
        }
        if aggregated:  # algorithm.streaming: which parts of the model
            row.update(fragment_fields(fedavg.config, due))
        if federation is not None and aggregated:  # the groups alive in it, and whether it was applied
            row.update(participants=fedavg.participants, committed=committed)
        if recorder:
            recorder.log(row)
        faults.strike(rank // shape.group_size, member.restart if member else 0, step, "step")
        if aggregated and federation is not None and federation.healed:
            # a group cut off from the others (its link, for a while) rejoined behind them: it now
            # holds their state at their step, and trains on from there
            heal = heal_row(fedavg, federation, position, member, committed, timer.times["aggregation"])
            if recorder:
                recorder.log(heal)
            step = position["step"]
            batches = batches_from(step)
        if on_step is not None:
            on_step(step, model, aggregated)
        if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step != steps:
            # elastic: each group scores its own model (the groups meet only at aggregations)
            # the groups hold one model only just after every fragment aggregated
            synced = fedavg is not None and due.synced(fedavg.fragments)
            evaluation = eval_row(
                model, cfg, blocks, device, step, fedavg, fedavg is not None and not synced and not member, partial
            )
            if member and not synced:
                evaluation["eval_of"] = GROUP_MODEL
            if recorder:
                recorder.log(evaluation)
        # a checkpoint waits for the step after a fragment's all-reduce in flight is merged (overlap)
        owed = checkpointer is not None and (owed or checkpointer.due(step))
        settled = fedavg is None or not fedavg.in_flight
        if owed and settled:
            checkpointer.save(step, model, optimizer, scheduler)
            owed = False
        if checkpointer is not None and settled:
            checkpointer.stop_if_warned(step, model, optimizer, scheduler, device)  # SLURM's time-limit warning

    if checkpointer is not None:
        checkpointer.finish()  # the last async save, if one is in flight
    # after the last step's forced aggregation every group holds the same model, unless federation is partial
    final = eval_row(model, cfg, blocks, device, steps, fedavg, groups_differ=False, partial=partial)
    if federation is not None:
        federation.shutdown()
    if recorder is None:
        return None
    recorder.log(final)
    summary = run_summary(
        cfg,
        shape,
        fedavg_cfg,
        steps,
        world,
        tokens_per_step,
        train_time,
        row,
        final,
        executed={"executor": "trainer", **summary_fields(cfg)},
    )
    recorder.finish(summary)
    return summary


def elastic_federation(cfg, member, shape):
    """This rank's torchft Manager; its group's rendezvous store (the launcher's) is the Manager's."""
    return elastic.Federation(
        member,
        dist.get_rank(),
        shape.group_size,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        cfg.cluster.timeout_s,
    )


def rejoin(fedavg, federation, position: dict, member) -> dict:
    """A restarted group's first act: join the survivors' next aggregation, heal from one of them
    in it (everything a group holds, the step included) and leave it holding that aggregation's
    result, like them. The heal row for the records."""
    began = time.perf_counter()
    committed = fedavg()
    if not federation.healed:
        raise RuntimeError(
            f"federation group {member.group} restarted, but no live group was left to heal "
            "from: every other group has finished or failed"
        )
    return heal_row(fedavg, federation, position, member, committed, time.perf_counter() - began)


def heal_row(fedavg, federation, position: dict, member, committed: bool, time_heal: float) -> dict:
    """The records' row of a heal (a group collective): the step it healed at, and the group each
    rank copied from (torchft spreads a group's ranks over the live peers)."""
    sources: list = [None] * dist.get_world_size()
    dist.all_gather_object(sources, federation.healed_from)
    return {
        "split": "heal",
        "step": position["step"],
        "group": member.group,
        "restart": member.restart,
        "healed_from": sources,
        "participants": fedavg.participants,
        "committed": committed,
        "time_heal": time_heal,
        "healed_at": time.time(),
    }  # unix time: when it rejoined


def run_summary(
    cfg,
    shape,
    fedavg_cfg,
    steps: int,
    world: int,
    tokens_per_step: int,
    train_time: float,
    last_row: dict,
    final: dict,
    executed: dict,
) -> dict:
    """summary.json: what ran (the setting), how (`executed`: the executor, and the network that
    joined the ranks), and its results (the last training step's and the final evaluation's). One
    definition for the distributed trainer and the simulator (fldp.simulate)."""
    return {
        "algorithm": cfg.algorithm.name,
        "federation": shape.federation,
        "replicate": shape.replicate,
        "shard": shape.shard,
        "every": fedavg_cfg.every if fedavg_cfg else None,
        # the whole schedule as [[start, A], ...] and the steps it aggregated on
        "schedule": [list(p) for p in fedavg_cfg.schedule] if fedavg_cfg else None,
        "aggregation_steps": list(aggregation_steps(fedavg_cfg.schedule, steps)) if fedavg_cfg else None,
        "outer": dataclasses.asdict(fedavg_cfg.outer) if fedavg_cfg else None,
        "federate": list(fedavg_cfg.federate) if fedavg_cfg else None,
        "fragments": fedavg_cfg.streaming.fragments if fedavg_cfg else None,  # algorithm.streaming
        "fedavg_mode": fedavg_cfg.mode if fedavg_cfg and shape.replicate > 1 else None,
        "world_size": world,
        "seed": cfg.seed,
        "steps": steps,
        "topology": cfg.topology.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "precision": cfg.trainer.precision,
        "batch_size": cfg.trainer.batch_size,
        "tokens": steps * tokens_per_step,
        "comm_emulated": bool(cfg.comm.emulate),
        "comm_scale": cfg.comm.scale if cfg.comm.emulate else None,
        **executed,
        "train_time_s": train_time,
        "train_loss": last_row["loss"],
        "train_perplexity": last_row["perplexity"],
        "eval_loss": final["loss"],
        "eval_perplexity": math.exp(final["loss"]),
        "eval_time_s": final["time_eval"],
        "eval_of": final["eval_of"],
        "group_eval_perplexity": final.get("group_perplexity"),
        **run_fields(),
    }
