"""One training step on one rank: what it trains (TrainingState), the step itself (TrainStep: a
batch's forward and backward, the optimiser's step and, when due, FedAvg's exchange, each phase
timed), and its row in the records (step_row: reduced over the ranks)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .aggregation import fragment_fields
from .comm import all_ranks
from .mesh import DIMS
from .records import PHASES
from .streaming import Exchange

# a step's collectives and bytes per mesh dimension, in its row when the run meters them
COUNTED = [f"{kind}_{d}" for kind in ("bytes", "collectives") for d in DIMS]


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
        self.times: dict[str, float] = {}
        self.t0 = self.last = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.times[phase] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.t0


@dataclasses.dataclass
class TrainingState:
    """What one rank trains: the model, its optimiser and schedule, FedAvg (None without
    federation) and `position`, {"step": the last step trained}, which an elastic heal moves to
    the peer's step (fldp.elastic.Federation tracks the same dict). `on_step` callbacks get it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    fedavg: Any = None  # fldp.aggregation.FedAvg
    position: dict = dataclasses.field(default_factory=lambda: {"step": 0})
    clip_norm: float | None = None  # optimizer.clip_norm

    @property
    def step(self) -> int:
        return self.position["step"]

    @step.setter
    def step(self, step: int) -> None:
        self.position["step"] = step

    @property
    def partial(self) -> bool:
        """Whether parameters left out of algorithm.federate stay local: the groups never hold one model."""
        names = [n for n, _ in self.model.named_parameters()]
        return self.fedavg is not None and not all(self.fedavg.config.federated(names))


@dataclasses.dataclass
class StepOutcome:
    """What one step did on this rank, before it is reduced over the ranks."""

    step: int
    loss: torch.Tensor
    lr: float | torch.Tensor  # the scheduler's, as it gives it
    times: dict  # seconds per phase (fldp.records.PHASES)
    time_step: float
    comm: dict  # the meter's counters ({} without one)
    exchange: Exchange  # the fragments sent and merged after it (empty: no aggregation)
    committed: bool | None = None  # FedAvg's verdict on the aggregation
    grad_norm: torch.Tensor | None = None  # the group's gradient norm before clipping (None: no clipping)

    @property
    def aggregated(self) -> bool:
        return bool(self.exchange)


class TrainStep:
    """Trains the step after the state's, on the batch stream of this rank (RankBatches), inside
    the meter (fldp.comm.CommMeter, or None). `drills` (fldp.faults.Drills, or None) may kill the
    rank as an aggregation begins."""

    def __init__(self, state: TrainingState, batches, device: torch.device, meter=None, drills=None):
        self.state, self.batches_from, self.device = state, batches.stream, device
        self.meter, self.drills = meter, drills
        self.timer = PhaseTimer(device)
        self.batches = self.batches_from(state.step)

    def __call__(self) -> StepOutcome:
        """Train one step. A heal in its aggregation moves the state to a peer's step: the batches follow."""
        state, step, timer = self.state, self.state.step + 1, self.timer
        with self.meter or contextlib.nullcontext():
            timer.start()
            x = next(self.batches).to(self.device)
            lr = state.scheduler.get_last_lr()[0]
            loss = state.model(input_ids=x, labels=x).loss
            timer.lap("forward")
            loss.backward()
            timer.lap("backward")
            grad_norm = clip_gradients(state.model, state.clip_norm) if state.clip_norm is not None else None
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
            timer.lap("optimizer")
            state.step = step
            exchange, committed = self._aggregate(step)
        comm = self.meter.take() if self.meter else {}
        if state.step != step:
            self.batches = self.batches_from(state.step)
        return StepOutcome(step, loss, lr, timer.times, timer.total(), comm, exchange, committed, grad_norm)

    def _aggregate(self, step: int) -> tuple[Exchange, bool | None]:
        """FedAvg's exchange when due after `step`, timed as the aggregation phase."""
        fedavg = self.state.fedavg
        exchange = fedavg.due(step) if fedavg is not None else Exchange()
        if not exchange:
            self.timer.times["aggregation"] = 0.0  # the phase did not run this step
            return exchange, None
        if self.drills is not None:
            self.drills.aggregation(step)
        committed = fedavg.exchange(exchange)
        self.timer.lap("aggregation")
        return exchange, committed


@torch.no_grad()
def clip_gradients(model: torch.nn.Module, clip_norm: float) -> torch.Tensor:
    """Scale the model's gradients by min(1, clip_norm / (norm + 1e-6)), torch's clip_grad_norm_,
    where norm is the L2 norm of all of them together; returns that norm, before clipping.
    The gradients are DTensors over this rank's federation group's mesh (shard, or replicate x
    shard): the norm's all-reduce runs over that mesh, so each group is clipped by its own model's
    norm, whichever parameters FedAvg federates. As torchtitan, the norm is made whole
    (full_tensor) once, not by each grad's multiplication."""
    params = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([g for p in params if (g := p.grad) is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, clip_norm, norm)
    return norm


def step_row(
    outcome: StepOutcome, fedavg, elastic: bool, tokens_per_step: int, device, group_size: int | None = None
) -> dict:
    """The step's row in the records, reduced over the ranks outside its timed phases: the mean
    loss; times, bytes and collectives as the largest rank's; `critical_`: the slowest rank's phases;
    with clipping, `grad_norm`: each federation group's norm before clipping (consecutive runs of
    `group_size` ranks; None: the process group is one group). Raises FloatingPointError on a
    non-finite loss."""
    counted = COUNTED if outcome.comm else []
    comm = outcome.comm
    times = [outcome.times[p] for p in PHASES]
    norm = [] if outcome.grad_norm is None else [outcome.grad_norm.item()]
    stats = all_ranks([outcome.loss.item(), *times, outcome.time_step, *(comm[k] for k in counted), *norm], device)
    norms, stats = stats[:, stats.shape[1] - len(norm) :], stats[:, : stats.shape[1] - len(norm)]
    mean_loss = stats[:, 0].mean().item()
    if not math.isfinite(mean_loss):
        raise FloatingPointError(f"non-finite loss ({mean_loss}) at step {outcome.step}: stopping")
    largest = stats[:, 1:].max(dim=0).values.tolist()
    times, step_time, counts = largest[: len(PHASES)], largest[len(PHASES)], largest[len(PHASES) + 1 :]
    critical = stats[stats[:, 1 + len(PHASES)].argmax(), 1 : 1 + len(PHASES)].tolist()  # the slowest rank's
    row = {
        "step": outcome.step,
        "loss": mean_loss,
        "perplexity": math.exp(mean_loss),
        "lr": outcome.lr,
        "tokens": outcome.step * tokens_per_step,
        **{f"time_{p}": t for p, t in zip(PHASES, times)},
        "time_step": step_time,
        **{f"critical_{p}": t for p, t in zip(PHASES, critical)},
        "aggregated": outcome.aggregated,
        **{k: (int(v) if k.startswith("collectives") else v) for k, v in zip(counted, counts)},
    }
    if norm:  # every rank of a group holds its norm: its first rank's
        row["grad_norm"] = norms[:: group_size or len(norms), 0].tolist()
    if outcome.aggregated:  # algorithm.streaming: which parts of the model
        row.update(fragment_fields(fedavg.config, outcome.exchange))
    if elastic and outcome.aggregated:  # the groups in it, those left out and why, and whether it was applied
        row.update(participants=fedavg.participants, left_out=fedavg.transport.left_out, committed=outcome.committed)
    return row
