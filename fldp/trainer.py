"""The one training loop for FSDP, HSDP, FL+FSDP and FL+HSDP.

The algorithms differ only in the mesh they shard over and in whether FedAvg runs every A steps;
everything else (data, model, optimiser, schedule, timing, records) is shared. `train` wires the
components, each with one job: the step (fldp.step), evaluations (fldp.evaluation), checkpoints
(Checkpoints), the records (RunRecords), elastic heals (fldp.healing) and fault drills (fldp.faults).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from . import elastic, faults
from .aggregation import FedAvg, FedAvgConfig
from .checkpoint import Checkpointer, latest
from .comm import CommMeter
from .config import CommConfig, Config, OptimizerConfig, TrainerConfig, load
from .cost import tier_bandwidth
from .data import Blocks, RankBatches
from .evaluation import AVERAGE, GROUPS_MEAN, ONE_MODEL, Evaluation  # noqa: F401  (fldp.simulate's, from here)
from .healing import Healing
from .mesh import MeshShape, build_mesh, group_mesh, mesh_shape
from .model import (
    DTYPES,
    build_model,
    fsdp_reduce_dtype,
    init_weights,
    llama_config,
    parallelize,
    parameter_counts,
)
from .netns import summary_fields
from .provenance import run_fields
from .records import Recorder
from .schedule import aggregation_steps
from .step import PhaseTimer, TrainingState, TrainStep, step_row  # noqa: F401  (PhaseTimer: fldp.simulate's)


def build_optimizer(model, opt_cfg: OptimizerConfig, fused: bool = False):
    """optimizer.name's torch optimiser (its spec admits adamw and sgd only); `fused`: AdamW's one
    kernel a parameter (the same arithmetic, rounded within ~1e-7 of the loop's: the simulator's)."""
    if opt_cfg.name == "adamw":
        # torch wants float betas; Hydra reads `optimizer.betas=[0,0]` as ints
        return torch.optim.AdamW(
            model.parameters(),
            lr=opt_cfg.lr,
            betas=(float(opt_cfg.betas[0]), float(opt_cfg.betas[1])),
            weight_decay=opt_cfg.weight_decay,
            fused=fused or None,
        )
    return torch.optim.SGD(
        model.parameters(), lr=opt_cfg.lr, momentum=opt_cfg.momentum, weight_decay=opt_cfg.weight_decay
    )


def build_scheduler(optimizer, opt_cfg: OptimizerConfig, steps: int):
    """Linear warm-up over the first `opt_cfg.warmup` of the steps, then cosine to 0 (the paper's)."""
    return get_cosine_schedule_with_warmup(optimizer, int(opt_cfg.warmup * steps), steps)


def total_steps(trainer: TrainerConfig, blocks: Blocks, world: int) -> int:
    """trainer.steps, or one pass over the training blocks when null (paper: 65,536/(512*2) = 64)."""
    per_epoch = len(blocks.train) // (world * trainer.batch_size)
    if per_epoch == 0:  # the rule is fldp.validation.check_blocks', checked before any worker starts
        raise RuntimeError(f"{len(blocks.train)} training blocks: not one batch per rank (check_blocks)")
    return trainer.steps or per_epoch


def sharded_model(conf: Config, vocab_size: int, mesh, device: torch.device):
    """The Llama of conf.model, sharded with FSDP2 over `mesh` (this rank's federation group), with
    initial weights that depend on the seed alone: the same for every algorithm, mesh and
    `model.init_device` (cpu: built in full, then sharded; meta: only this rank's shard exists)."""
    meta = conf.model.init_device == "meta"
    model = build_model(llama_config(conf.model, vocab_size), "meta" if meta else device)
    model = parallelize(
        model,
        mesh,
        DTYPES[conf.trainer.precision],
        conf.fsdp.reshard_root_after_forward,
        conf.model.activation_checkpointing,
        fsdp_reduce_dtype(conf),
    )
    init_weights(model, device, conf.seed)
    return model


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this rank stands in the run: the whole run's mesh shape, the mesh of its process group
    (elastic: its federation group alone), its rank in the whole run (its data slice, its records)
    and the run's length."""

    shape: MeshShape
    local_shape: MeshShape
    mesh: Any  # torch's DeviceMesh over local_shape
    rank: int
    steps: int
    tokens_per_step: int

    @classmethod
    def of(cls, conf: Config, blocks: Blocks, device: torch.device, member=None) -> Placement:
        shape = mesh_shape(conf)
        local_shape = dataclasses.replace(shape, federation=1) if member else shape
        rank = dist.get_rank() + (member.group * shape.group_size if member else 0)
        mesh = build_mesh(local_shape, device.type)
        steps = total_steps(conf.trainer, blocks, shape.world)
        tokens = shape.world * conf.trainer.batch_size * blocks.train.shape[1]
        return cls(shape, local_shape, mesh, rank, steps, tokens)

    @property
    def group(self) -> int:
        """This rank's federation group."""
        return self.rank // self.shape.group_size


def build(conf: Config, blocks: Blocks, device: torch.device, place: Placement, member=None):
    """What this rank trains (TrainingState) and, elastic, its torchft Federation (else None)."""
    model = sharded_model(conf, blocks.vocab_size, group_mesh(place.mesh, place.local_shape), device)
    fedavg_cfg = FedAvgConfig.from_algorithm(conf.algorithm)
    federation = elastic_federation(conf.cluster, member, place.shape) if member else None
    fedavg = (
        FedAvg(
            model,
            place.mesh,
            place.shape,
            fedavg_cfg,
            last_step=place.steps,
            resident=not conf.trainer.async_save,
            elastic=federation,
        )
        if fedavg_cfg
        else None
    )
    optimizer = build_optimizer(model, conf.optimizer)
    scheduler = build_scheduler(optimizer, conf.optimizer, place.steps)
    state = TrainingState(model, optimizer, scheduler, fedavg, clip_norm=conf.optimizer.clip_norm)
    return state, federation


def comm_meter(comm: CommConfig, network: list, place: Placement) -> CommMeter | None:
    """comm.measure or comm.emulate: counts every collective of a step per mesh dimension; with
    emulation, slows each down to bytes / bandwidth of the network tier (topology.network) its group crosses."""
    if not (comm.measure or comm.emulate):
        return None
    emulated = tier_bandwidth(network, place.shape, comm.scale) if comm.emulate else None
    return CommMeter(place.mesh, emulated)


class Checkpoints:
    """trainer.checkpoint_every, trainer.resume and SLURM's time-limit warning for one rank's state.
    Without a Checkpointer (none configured, or an elastic run, where peers heal a group) it does nothing."""

    def __init__(self, checkpointer: Checkpointer | None, state: TrainingState, device: torch.device):
        self.checkpointer, self.state, self.device = checkpointer, state, device
        self.owed = False  # a save due while a fragment's all-reduce was in flight

    @classmethod
    def open(
        cls,
        trainer: TrainerConfig,
        algorithm: str,
        run_dir: str,
        place: Placement,
        state: TrainingState,
        device,
        elastic: bool,
    ) -> Checkpoints:
        if elastic or not (trainer.checkpoint_every or trainer.resume):
            return cls(None, state, device)
        fedavg_cfg = state.fedavg.config if state.fedavg is not None else None
        checkpointer = Checkpointer(
            run_dir,
            place.shape,
            algorithm,
            trainer.checkpoint_every,
            place.steps,
            stateful={"outer": state.fedavg} if state.fedavg is not None else None,
            keep_last=trainer.keep_last,
            async_save=trainer.async_save,
            schedule=fedavg_cfg.schedule if fedavg_cfg else None,
            fragments=fedavg_cfg.streaming.fragments if fedavg_cfg else 1,
        )
        return cls(checkpointer, state, device)

    def resume(self, run_dir: str, resume) -> None:
        """trainer.resume=auto: the state of the run's latest complete checkpoint, if any."""
        if self.checkpointer is None or resume != "auto":
            return
        saved = latest(run_dir)
        if saved is not None:
            s = self.state
            s.step = self.checkpointer.load(saved, s.model, s.optimizer, s.scheduler)

    def after(self, step: int) -> None:
        """After a step: save when due, or stop on the warning signal, once no all-reduce is in flight."""
        if self.checkpointer is None:
            return
        s = self.state
        # a checkpoint waits for the step after a fragment's all-reduce in flight is merged (overlap)
        self.owed = self.owed or self.checkpointer.due(step)
        if s.fedavg is not None and s.fedavg.in_flight:
            return
        if self.owed:
            self.checkpointer.save(step, s.model, s.optimizer, s.scheduler)
            self.owed = False
        self.checkpointer.stop_if_warned(step, s.model, s.optimizer, s.scheduler, self.device)

    def finish(self) -> None:
        """Wait for the last async save, if one is in flight."""
        if self.checkpointer is not None:
            self.checkpointer.finish()


class RunRecords:
    """This rank's part in the records: rank 0 of its process group writes them (metrics.jsonl, W&B,
    summary.json; elastic: group g's in run_dir/group_g/, g > 0); every rank keeps the training time
    and last training row the summary reports."""

    def __init__(self, recorder: Recorder | None):
        self.recorder = recorder
        self.train_time: float = recorder.train_time if recorder else 0.0
        self.last_row: dict = recorder.last_row if recorder else {}

    @classmethod
    def open(cls, cfg, run_dir: str, place: Placement, member, start: int) -> RunRecords:
        where = run_dir if not member or member.group == 0 else str(Path(run_dir) / f"group_{member.group}")
        progress = cfg.trainer.progress and place.rank == 0
        return cls(Recorder(where, cfg, place.steps, progress, resume_from=start) if dist.get_rank() == 0 else None)

    def log(self, row: dict) -> None:
        if self.recorder:
            self.recorder.log(row)

    def step(self, row: dict) -> None:
        """A training step's row (fldp.step.step_row)."""
        self.train_time += row["time_step"]
        self.last_row = row
        self.log(row)

    def finish(self, cfg, conf: Config, place: Placement, fedavg, final: dict, params: dict) -> dict | None:
        """The final evaluation's row and summary.json; the summary (rank 0 only, else None)."""
        if self.recorder is None:
            return None
        self.recorder.log(final)
        summary = run_summary(
            cfg,
            place.shape,
            fedavg.config if fedavg is not None else None,
            place.steps,
            place.shape.world,
            place.tokens_per_step,
            self.train_time,
            self.last_row,
            final,
            executed={"executor": "trainer", **summary_fields(conf)},
            params=params,
        )
        self.recorder.finish(summary)
        return summary


def evaluation_of(
    conf: Config, state: TrainingState, blocks: Blocks, device, place: Placement, elastic: bool
) -> Evaluation:
    """The run's evaluations, given the trainer's own settings (trainer.*) and the seed."""
    return Evaluation(
        state.model, conf.trainer, conf.seed, blocks, device, state.fedavg, state.partial, elastic, place.steps
    )


def train(cfg, run_dir: str, blocks: Blocks, device: torch.device, on_step=None, member=None) -> dict | None:
    """Run one experiment on this rank (the process group is initialised). Rank 0 writes the
    records and returns the summary. `on_step(step, state, aggregated)`, if given, runs on every
    rank before the first step (step 0) and after each step with the TrainingState (model,
    optimizer, scheduler, fedavg): tests inspect the parameters and the optimiser with it.

    member (fldp.elastic.Member): elastic federation. The process group is then this rank's
    federation group alone; the groups meet only at aggregations, through torchft. Group 0's rank 0
    writes the run's records and summary, group g's rank 0 its own in run_dir/group_g/.

    cfg: as composed (the records keep it); the rest reads it typed (fldp.config.load)."""
    conf = load(cfg)
    place = Placement.of(conf, blocks, device, member)
    drills = faults.Drills(place.group, member.restart if member else 0, elastic=member is not None)
    drills.start()  # before the group's torchft Manager exists: the others have not heard of it yet
    state, federation = build(conf, blocks, device, place, member)
    healing = Healing(state, federation, member) if federation is not None else None
    checkpoints = Checkpoints.open(
        conf.trainer, conf.algorithm.name, run_dir, place, state, device, elastic=federation is not None
    )
    heal = None
    if healing is not None and member.restart:  # a restarted group: heal from a live peer at the next aggregation
        heal = healing.rejoin()
    checkpoints.resume(run_dir, conf.trainer.resume)
    if on_step is not None and (state.step == 0 or heal):
        on_step(state.step, state, bool(heal))  # the initial weights (identical in every group: fldp.init), or healed
    train_step = TrainStep(
        state,
        RankBatches(blocks.train, conf.trainer.batch_size, place.rank, place.shape.world, conf.seed),
        device,
        comm_meter(conf.comm, conf.topology.network, place),
        drills,
    )
    records = RunRecords.open(cfg, run_dir, place, member, state.step)
    if heal:
        records.log(heal)
    evaluation = evaluation_of(conf, state, blocks, device, place, elastic=member is not None)
    while state.step < place.steps:
        outcome = train_step()
        row = step_row(
            outcome, state.fedavg, federation is not None, place.tokens_per_step, device, place.shape.group_size
        )
        records.step(row)
        drills.step(outcome.step)
        # a group cut off from the others (its link, for a while) rejoined behind them: it now holds
        # their state at their step, and trains on from there
        if healing is not None and (heal := healing.after(outcome)):
            records.log(heal)
        if on_step is not None:
            on_step(state.step, state, outcome.aggregated)
        if evaluation.due(state.step):
            records.log(evaluation.periodic(state.step, outcome.exchange))
        checkpoints.after(state.step)
    checkpoints.finish()
    final = evaluation.final()
    if federation is not None:
        federation.shutdown()
    return records.finish(cfg, conf, place, state.fedavg, final, parameter_counts(state.model))


def elastic_federation(cluster, member, shape):
    """This rank's torchft Manager; its group's rendezvous store (the launcher's) is the Manager's.
    cluster: the typed cluster section (its timeouts)."""
    return elastic.Federation(
        member,
        dist.get_rank(),
        shape,
        (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        cluster.timeout_s,
        cluster.join_timeout_s,
    )


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
    params: dict,
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
        **params,  # fldp.model.parameter_counts: the model-size ladder's x
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
