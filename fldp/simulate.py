"""The four algorithms in one process: the F federation groups trained side by side (`cluster=simulate`).

What the distributed trainer computes, without the communication. Each federation group is one model
replica; the F replicas' parameters are stacked along a leading dimension and run at once with
torch.func (vmap over functional_call of the same transformers Llama), so 128 groups cost one batched
step, not 128. Inside a group, FSDP and HSDP compute one full-batch step on the group's sequences:
FSDP2 averages the ranks' gradients over the group (reduce-scatter; HSDP also all-reduces across
replicas), and the mean of R x S equal-size batches' mean losses is the mean loss of their union, so
the group's gradient is that of its whole batch. HSDP's math is therefore FSDP's.

Shared with the trainer, not copied: the data each rank reads (fldp.data: WorldBatches is every
rank's RankBatches at once), the initial weights (fldp.init), the optimiser and its schedule, the
aggregation rule (FedAvgConfig.due), the aggregation itself (fldp.stacked: the trainer's buckets,
cut as its ranks hold them, and their arithmetic, fldp.buckets.Bucket), the records
(fldp.records.Recorder) and summary.json (trainer.run_summary). AdamW is elementwise, so one AdamW over the stacked parameters is F AdamWs.
What differs is only floating-point order: the collectives sum in another order than torch.sum
(fp32: agreement within 1e-5, tested). In bf16 a collective rounds at every hop and this sum once;
cluster.reductions=ring computes each rank's gradient and sums each reduction along gloo's ring
(fldp/ring.py): the trainer's bf16 parameters to the bit (tests/test_ring.py).
"""

from __future__ import annotations

import ctypes
import math
import time
import warnings
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from . import stacked_attention
from .aggregation import FedAvgConfig, fragment_fields
from .config import load
from .data import Blocks, WorldBatches
from .mesh import mesh_shape
from .model import DTYPES, build_model, fsdp_reduce_dtype, fsdp_unit, init_weights, llama_config, parameter_counts
from .noise_scale import estimate
from .records import PHASES, Recorder
from .ring import fsdp_unit_mean
from .stacked import StackedFedAvg
from .streaming import Exchange
from .trainer import (
    AVERAGE,
    GROUPS_MEAN,
    ONE_MODEL,
    PhaseTimer,
    build_optimizer,
    build_scheduler,
    run_summary,
    total_steps,
)

# vmap has no batching rule for flash attention on other devices than the CPU (fldp.stacked_attention
# gives the CPU kernel one) and loops over the groups inside that one op; the warning would repeat
warnings.filterwarnings("ignore", message=".*not yet implemented the batching rule.*")

EVAL_CHUNK = 256  # held-out sequences per forward pass (bounds the logits' memory)
RANK_BLOCK = 32  # ranks whose gradients cluster.reductions=ring computes in one batched backward


@torch.no_grad()
def clip_groups(stacked: list[torch.Tensor], clip_norm: float) -> torch.Tensor:
    """Each group's gradients clipped as the trainer clips them (fldp.step.clip_gradients): scaled by
    min(1, clip_norm / (norm + 1e-6)), norm the L2 norm of that group's gradients alone (row g of
    every stacked gradient). Returns the F norms before clipping, in the gradients' dtype as torch's."""
    grads = [p.grad for p in stacked if p.grad is not None]
    # squares summed in fp32, not torch's CPU vector_norm: on a 4096 x 64 gradient it errs by 5e-5 (measured vs fp64)
    norms = torch.stack([g.flatten(1).float().pow(2).sum(dim=1) for g in grads]).sum(dim=0).sqrt().to(grads[0].dtype)
    scale = torch.clamp(clip_norm / (norms + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))
    return norms


class Groups(nn.Module):
    """The F groups' parameters, stacked: parameter `name` of group g is `self[name][g]`."""

    def __init__(self, model: nn.Module, groups: int):
        super().__init__()
        self.names = [name for name, _ in model.named_parameters()]  # a tied lm_head once, as the trainer
        self.stacked = nn.ParameterList(
            nn.Parameter(p.detach().unsqueeze(0).expand(groups, *p.shape).clone()) for _, p in model.named_parameters()
        )

    def __getitem__(self, name: str) -> nn.Parameter:
        return self.stacked[self.names.index(name)]

    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.stacked))


def rank_gradients(loss, groups: dict[str, torch.Tensor], ranks: torch.Tensor):
    """Each rank's gradient of its own loss: `loss(params, x)` batched over groups and ranks,
    groups' parameters [F, ...], ranks' sequences [F, n, B, T] -> (losses [F, n], {name: [F, n, ...]}).
    Each rank gets its own leaf copy, so that autograd leaves each rank's gradient apart
    (torch.func.grad would differentiate attention through its math decomposition: 65% of q_proj's
    bf16 gradient differed from the trainer's backward, measured). RANK_BLOCK ranks at a time: vmap
    runs CPU attention rank by rank, and its backward costs the square of the ranks it batches."""
    losses: list[torch.Tensor] = []
    blocks: dict[str, list[torch.Tensor]] = {n: [] for n in groups}
    for block in torch.split(ranks, RANK_BLOCK, dim=1):
        copies = block.shape[1]
        params = {n: p.detach().unsqueeze(1).repeat_interleave(copies, 1).requires_grad_() for n, p in groups.items()}
        block_losses = loss(params, block)
        block_losses.sum().backward()
        losses.append(block_losses.detach())
        for n, p in params.items():
            blocks[n].append(cast(torch.Tensor, p.grad))
    return torch.cat(losses, dim=1), {n: torch.cat(g, dim=1) for n, g in blocks.items()}


def noise_fields(
    every: int | None, batch: int, loss, groups: dict[str, torch.Tensor], x: torch.Tensor, step: int
) -> dict:
    """cluster.noise_scale_every: the gradient noise scale at group 0's weights before the step, on
    every rank's batch (trainer.batch_size sequences) of the step x [F, ..., T] (fldp/noise_scale.py),
    at step 1 and every that many."""
    if not every or (step != 1 and step % every):
        return {}
    parts = x.reshape(1, -1, batch, x.shape[-1])  # [1, world, batch, T]
    _, grads = rank_gradients(loss, {n: p[:1] for n, p in groups.items()}, parts)
    return estimate([g[0] for g in grads.values()], batch)


class Simulation:
    """One run: the model, its F stacked groups, the optimiser, and the aggregation."""

    def __init__(self, cfg, blocks: Blocks, device: torch.device):
        self.cfg, self.blocks, self.device = cfg, blocks, device  # cfg: as composed, for the records
        self.conf = conf = load(cfg)  # the typed config it reads
        self.shape = shape = mesh_shape(cfg)  # composed: its errors name where the mesh came from
        self.steps = total_steps(conf.trainer, blocks, shape.world)
        model = build_model(llama_config(conf.model, blocks.vocab_size), device)
        # every group's attention one call: in fp32 bit for bit sdpa's; not the ring's (its bf16 kernel
        # blocks a larger batch otherwise, and the ring is the trainer's bf16 to the bit, group by group)
        once = conf.cluster.reductions == "once"
        if device.type == "cpu" and once and conf.cluster.stacked_attention:
            model.config._attn_implementation = stacked_attention.register()
        for p in model.parameters():  # pure low precision, as fldp.model.parallelize
            p.data = p.data.to(DTYPES[conf.trainer.precision])
        init_weights(model, device, conf.seed)
        self.model, self.buffers = model, dict(model.named_buffers())
        self.groups = Groups(model, shape.federation)
        # fused: 8-10x faster over F stacked copies than the loop; the ring keeps the trainer's loop (to the bit)
        self.optimizer = build_optimizer(self.groups, conf.optimizer, once and conf.cluster.fused_adamw)
        self.scheduler = build_scheduler(self.optimizer, conf.optimizer, self.steps)
        self.fedavg = FedAvgConfig.from_algorithm(conf.algorithm)
        self.clip_norm = conf.optimizer.clip_norm
        # the trainer's buckets and their arithmetic, for the groups stacked (fldp.stacked); ring: each rank's gradient
        self.ring = not once  # cluster.reductions=ring: every reduction summed along the ring (fldp/ring.py)
        self.reduce_dtype = fsdp_reduce_dtype(conf)  # ring only (fldp.train refuses it else)
        groups = self.groups.by_name()
        self.federation = StackedFedAvg(self.fedavg, groups, shape.shard, self.ring) if self.fedavg else None
        self.federated = self.federation.federated if self.federation else []
        # parameters left out of algorithm.federate stay local: the groups never hold one model
        self.partial = self.fedavg is not None and len(self.federated) < len(self.groups.names)

    # --- the model, batched over groups --------------------------------------------------------
    def _loss(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, (params, self.buffers), args=(), kwargs={"input_ids": x, "labels": x}).loss

    def losses(self, params: dict, x: torch.Tensor) -> torch.Tensor:
        """Each group's mean loss on its own sequences: params [F, ...], x [F, B, T] -> [F]."""
        return vmap(self._loss)(params, x)

    def ring_gradients(self, x: torch.Tensor) -> torch.Tensor:
        """cluster.reductions=ring: each rank's gradient of its own mean loss (x [F, R*S*batch, T],
        rank r * S + s of group g at [g, r * S + s]), reduced as FSDP2 reduces them, per unit
        (fldp.ring.fsdp_unit_mean), into the groups' .grad. Returns every rank's loss [F, R*S]."""
        shape, groups = self.shape, self.groups.by_name()
        ranks = x.reshape(shape.federation, shape.replicate * shape.shard, -1, x.shape[-1])
        losses, grads = rank_gradients(vmap(vmap(self._loss)), groups, ranks)
        for unit in sorted({fsdp_unit(n) for n in groups}):
            names = [n for n in groups if fsdp_unit(n) == unit]
            reduced = fsdp_unit_mean([grads[n] for n in names], shape.replicate, shape.shard, self.reduce_dtype)
            for name, grad in zip(names, reduced):
                groups[name].grad = grad
        return losses

    def batches(self):
        """Every step, each group's sequences [F, R*S*batch, T]: the batches of its ranks as each
        rank of the distributed trainer reads them (ranks r // (R*S) = g, in rank order)."""
        conf = self.conf
        for x in WorldBatches(self.blocks.train, conf.trainer.batch_size, self.shape.world, conf.seed).stream():
            yield x.reshape(self.shape.federation, -1, x.shape[-1]).to(self.device)

    def exchange(self, due: Exchange) -> None:
        """The aggregation after a step: the trainer's bucket arithmetic over the stacked groups."""
        cast(StackedFedAvg, self.federation).exchange(due)  # called only where there is a federation

    # --- evaluation ------------------------------------------------------------------------------
    def held_out(self, ranks: int) -> torch.Tensor:
        """The held-out sequences `ranks` ranks score in the trainer's evaluation (each rank its
        RankBatches slice, unshuffled, up to trainer.eval_batches), in another order: the mean is the same)."""
        trainer, out = self.conf.trainer, []
        held_out = WorldBatches(self.blocks.eval, trainer.batch_size, ranks, self.conf.seed, shuffle=False)
        for i, x in enumerate(held_out.epoch(0)):
            if trainer.eval_batches is not None and i >= trainer.eval_batches:
                break
            out.append(x.flatten(0, 1))
        if not out:  # the rule is fldp.validation.check_blocks', checked before the simulation starts
            raise RuntimeError(f"{len(self.blocks.eval)} held-out blocks: not one batch per rank (check_blocks)")
        return torch.cat(out).to(self.device)

    @torch.no_grad()
    def evaluate(self, params: dict, ranks: int) -> torch.Tensor:
        """Mean held-out loss of each model in `params` (stacked [G, ...]) on the whole split: [G]."""
        x = self.held_out(ranks)
        total = torch.zeros(next(iter(params.values())).shape[0], dtype=torch.float64, device=self.device)
        for chunk in torch.split(x, EVAL_CHUNK):
            loss = vmap(self._loss, in_dims=(0, None))(params, chunk)
            total += loss.double() * len(chunk)  # equal-length sequences: a token mean is a sequence mean
        return total / len(x)

    def eval_row(self, step: int, groups_differ: bool) -> dict:
        """As fldp.evaluation.eval_row: groups that are identical hold one model, scored on the world's
        slices of the split; groups that differ are each scored on the whole split, and the loss is
        their plain average's (full federation) or the mean of their losses (partial federation)."""
        start = time.perf_counter()
        params = self.groups.by_name()
        world, F = self.shape.world, self.shape.federation
        if not (groups_differ or self.partial):
            loss = self.evaluate({n: p[:1] for n, p in params.items()}, world).item()
            extra: dict = {"eval_of": ONE_MODEL}
        else:
            group_losses = self.evaluate(params, world // F).tolist()
            extra = {"group_perplexity": [math.exp(x) for x in group_losses]}
            if self.partial:
                loss = sum(group_losses) / len(group_losses)
                extra["eval_of"] = GROUPS_MEAN
            else:
                loss = self.evaluate(cast(StackedFedAvg, self.federation).averaged(), world).item()
                extra.update(eval_of=AVERAGE, averaged=True)
        return {
            "split": "eval",
            "step": step,
            "loss": loss,
            "perplexity": math.exp(loss),
            "time_eval": time.perf_counter() - start,
            **extra,
        }

    # --- the run ---------------------------------------------------------------------------------
    def train_row(self, step: int, losses: torch.Tensor, lr: float, tokens: int, timer, due: Exchange) -> dict:
        """A step's record, as the trainer's."""
        times, step_time = timer.times, timer.total()
        mean_loss = losses.mean().item()  # every group has R*S ranks: the mean over ranks (ring: [F, R*S])
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"non-finite loss ({mean_loss}) at step {step}: stopping")
        row = {
            "step": step,
            "loss": mean_loss,
            "perplexity": math.exp(mean_loss),
            "lr": lr,
            "tokens": tokens,
            **{f"time_{p}": times[p] for p in PHASES},
            "time_step": step_time,
            **{f"critical_{p}": times[p] for p in PHASES},  # one process
            "aggregated": bool(due),
        }
        if due:  # as the trainer's rows
            row.update(fragment_fields(cast(FedAvgConfig, self.fedavg), due))  # due: there is a federation
        return row

    def run(self, run_dir: str) -> dict:
        trainer, shape, steps = self.conf.trainer, self.shape, self.steps
        tokens_per_step = shape.world * trainer.batch_size * self.blocks.train.shape[1]
        recorder = Recorder(run_dir, self.cfg, steps, trainer.progress)
        noise_every = self.conf.cluster.noise_scale_every
        batches, train_time, row = self.batches(), 0.0, {}
        timer = PhaseTimer(self.device)  # the trainer's laps: on CUDA, synchronised at each boundary
        for step in range(1, steps + 1):
            x = next(batches)
            loss = vmap(vmap(self._loss))
            noise = noise_fields(noise_every, trainer.batch_size, loss, self.groups.by_name(), x, step)  # off the clock
            timer.start()
            lr = self.scheduler.get_last_lr()[0]
            if self.ring:  # forward and backward in one call: the time is the backward's
                timer.lap("forward")
                losses = self.ring_gradients(x).double()
            else:
                losses = self.losses(self.groups.by_name(), x)
                timer.lap("forward")
                losses.sum().backward()  # group g's parameters get the gradient of group g's loss alone
            timer.lap("backward")
            norms = clip_groups(list(self.groups.stacked), self.clip_norm) if self.clip_norm is not None else None
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            timer.lap("optimizer")
            due = self.fedavg.exchange(step, steps) if self.fedavg is not None else Exchange()
            if due:
                self.exchange(due)
                timer.lap("aggregation")
            else:
                timer.times["aggregation"] = 0.0  # the phase did not run this step
            row = self.train_row(step, losses, lr, step * tokens_per_step, timer, due) | noise
            if norms is not None:  # as the trainer's rows: each group's, before clipping
                row["grad_norm"] = norms.tolist()
            train_time += row["time_step"]
            recorder.log(row)
            if trainer.eval_every and step % trainer.eval_every == 0 and step != steps:
                synced = self.fedavg is not None and due.synced(self.fedavg.streaming.fragments)
                recorder.log(self.eval_row(step, self.fedavg is not None and not synced))
        final = self.eval_row(steps, groups_differ=False)
        recorder.log(final)
        summary = run_summary(
            self.cfg,
            shape,
            self.fedavg,
            steps,
            shape.world,
            tokens_per_step,
            train_time,
            row,
            final,
            executed={"executor": "simulator", "network": "none", "network_link": None},
            params=parameter_counts(self.model),
        )
        recorder.finish(summary)
        return summary


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(keep: bool = True) -> bool:
    """glibc: large blocks from the heap, and freed memory kept for the next allocation, instead of
    each large tensor mapped afresh and its pages zeroed by the kernel one fault at a time. Every
    step of the simulator allocates the same large tensors again (the logits: tokens x vocabulary,
    268 MB at the paper's shape; measured on this VM: allocating and filling one 253 ms, kept 23 ms).
    keep=False: glibc's defaults back (for a benchmark). False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mmap_max, trim = (0, 1 << 40) if keep else (65536, 128 * 1024)
    return bool(libc.mallopt(M_MMAP_MAX, mmap_max)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))


def run(cfg, run_dir: str, blocks: Blocks) -> dict:
    """`cluster=simulate`: the whole run in this process."""
    cluster = load(cfg).cluster
    if cluster.threads:
        torch.set_num_threads(cluster.threads)
    keep_freed_memory(cluster.keep_freed_memory)
    return Simulation(cfg, blocks, torch.device(cluster.device)).run(run_dir)
