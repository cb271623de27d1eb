"""Held-out evaluation: the loss of the model, or models, the federation groups hold, every
trainer.eval_every steps and once at the end of a run."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from .comm import all_ranks
from .config import TrainerConfig
from .data import Blocks, RankBatches
from .streaming import Exchange

# what an evaluation's loss is the loss of (`eval_of` in eval rows and summary.json)
ONE_MODEL, AVERAGE, GROUPS_MEAN = "the one model", "the groups' average model", "the groups' mean loss"
GROUP_MODEL = "this group's own model"  # elastic federation, between aggregations


@torch.no_grad()
def evaluate(
    model, trainer: TrainerConfig, seed: int, blocks: Blocks, device, groups: int = 1
) -> tuple[list[float], float]:
    """Mean held-out loss and the wall time (max over ranks). groups=1: the world scores one model,
    each rank its slice of the split. groups=F: each federation group (a block of consecutive
    ranks) scores its own model on the whole split, its ranks sharing it: one loss per group."""
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    size = world // groups
    model.eval()
    batches = RankBatches(blocks.eval, trainer.batch_size, rank % size, size, seed, shuffle=False)
    losses = []
    for i, x in enumerate(batches.epoch(0)):
        if trainer.eval_batches is not None and i >= trainer.eval_batches:
            break
        x = x.to(device)
        losses.append(model(input_ids=x, labels=x).loss.float().item())
    model.train()
    model.reshard()  # a root kept gathered after forward would hold stale weights once FedAvg runs
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows = all_ranks([sum(losses), len(losses), time.perf_counter() - start], device).view(groups, size, 3)
    counts = rows[..., 1].sum(dim=1)
    if (counts == 0).any():  # the rule is fldp.validation.check_blocks', checked before any worker starts
        raise RuntimeError(f"{len(blocks.eval)} held-out blocks: not one batch per rank (check_blocks)")
    return (rows[..., 0].sum(dim=1) / counts).tolist(), rows[..., 2].max().item()


def eval_row(
    model,
    trainer: TrainerConfig,
    seed: int,
    blocks: Blocks,
    device,
    step: int,
    fedavg,
    groups_differ: bool,
    partial=False,
) -> dict:
    """Score the model, or models, the groups hold; `eval_of` says which loss is the row's `loss`.
    Groups that are identical hold one model: the world scores it, each rank a slice of the split.
    Groups that differ: each group scores its own model on the whole split (`group_perplexity`),
    and the loss is, with full federation (they differ only between aggregations), their plain
    average's, computed aside (the training state is restored bit for bit); with partial federation
    (`partial`: some parameters are never averaged, so the groups always differ) the mean of the
    groups' own losses: their "average" would keep each group's local parameters, no one model."""
    if not (groups_differ or partial):
        (loss,), eval_time = evaluate(model, trainer, seed, blocks, device)
        extra: dict[str, Any] = {"eval_of": ONE_MODEL}
    else:
        group_losses, eval_time = evaluate(model, trainer, seed, blocks, device, groups=fedavg.shape.federation)
        extra = {"group_perplexity": [math.exp(x) for x in group_losses]}
        if partial:
            loss = sum(group_losses) / len(group_losses)
            extra["eval_of"] = GROUPS_MEAN
        else:
            with fedavg.averaged():
                (loss,), average_time = evaluate(model, trainer, seed, blocks, device)
            eval_time += average_time
            extra.update(eval_of=AVERAGE, averaged=True)
    return {"split": "eval", "step": step, "loss": loss, "perplexity": math.exp(loss), "time_eval": eval_time, **extra}


class Evaluation:
    """The trainer's evaluations of one run: when one is due, and which model each scores."""

    def __init__(
        self,
        model,
        trainer: TrainerConfig,
        seed: int,
        blocks: Blocks,
        device,
        fedavg,
        partial: bool,
        elastic: bool,
        steps: int,
    ):
        self.model, self.trainer, self.seed, self.blocks, self.device = model, trainer, seed, blocks, device
        # partial: parameters left out of algorithm.federate stay local, the groups never hold one model
        self.fedavg, self.partial, self.elastic, self.steps = fedavg, partial, elastic, steps

    def due(self, step: int) -> bool:
        """Every trainer.eval_every steps; the last step has the final evaluation instead."""
        every = self.trainer.eval_every
        return bool(every) and step % every == 0 and step != self.steps

    def periodic(self, step: int, exchange: Exchange) -> dict:
        """The row of an evaluation after `step`, whose aggregation sent and merged `exchange`."""
        # the groups hold one model only just after every fragment aggregated
        synced = self.fedavg is not None and exchange.synced(self.fedavg.fragments)
        # elastic: each group scores its own model (the groups meet only at aggregations)
        differ = self.fedavg is not None and not synced and not self.elastic
        row = eval_row(
            self.model, self.trainer, self.seed, self.blocks, self.device, step, self.fedavg, differ, self.partial
        )
        if self.elastic and not synced:
            row["eval_of"] = GROUP_MODEL
        return row

    def final(self) -> dict:
        """The row of the evaluation after the last step."""
        # after the last step's forced aggregation every group holds the same model, unless federation is partial
        return eval_row(
            self.model,
            self.trainer,
            self.seed,
            self.blocks,
            self.device,
            self.steps,
            self.fedavg,
            groups_differ=False,
            partial=self.partial,
        )
