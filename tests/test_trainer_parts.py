"""The trainer's components alone, with stand-ins for what they drive: the step (fldp.step), when an
evaluation is due (fldp.evaluation), the drills (fldp.faults), and trainer.py's Checkpoints and
RunRecords. One rank in this process (gloo over a file store), a one-parameter model: seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fldp.config import TrainerConfig
from fldp.evaluation import Evaluation
from fldp.faults import Drills
from fldp.records import PHASES
from fldp.step import TrainingState, TrainStep, step_row
from fldp.streaming import Exchange
from fldp.trainer import Checkpoints, RunRecords

CPU = torch.device("cpu")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Scale(torch.nn.Module):
    """loss = w * mean(batch): the batch a step trained on is its loss over w."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, labels):
        return SimpleNamespace(loss=self.w * input_ids.float().mean())


class Counting:
    """RankBatches' stream: after `skip` batches, batch n is all n."""

    def stream(self, skip: int = 0):
        n = skip
        while True:
            n += 1
            yield torch.full((1, 2), n)


class HealsTo:
    """FedAvg every step, whose aggregation heals the group to a peer's `step` (as elastic's does)."""

    def __init__(self, state: TrainingState, step: int):
        self.state, self.step = state, step

    def due(self, step: int) -> Exchange:
        return Exchange(sends=(0,), merges=(0,))

    def exchange(self, exchange: Exchange) -> bool:
        self.state.step = self.step
        return True


def state(fedavg=None) -> TrainingState:
    model = Scale()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return TrainingState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), fedavg)


def test_a_step_trains_the_step_after_the_states_and_its_row_is_the_ranks_reduction(one_rank):
    s = state()
    s.step = 3  # resumed after step 3: the stream skips 3 batches
    outcome = TrainStep(s, Counting(), CPU)()
    assert s.step == outcome.step == 4 and not outcome.aggregated and outcome.committed is None
    assert outcome.loss.item() == 4.0 and s.model.w.item() == 1.0 - 0.5 * 4.0
    assert set(outcome.times) == set(PHASES) and outcome.times["aggregation"] == 0.0
    row = step_row(outcome, None, elastic=False, tokens_per_step=10, device=CPU)
    assert (row["step"], row["loss"], row["lr"], row["tokens"], row["aggregated"]) == (4, 4.0, 0.5, 40, False)
    assert row["time_step"] == outcome.time_step and "bytes_shard" not in row


def test_a_non_finite_loss_stops_the_run(one_rank):
    outcome = TrainStep(state(), Counting(), CPU)()
    outcome.loss = torch.tensor(float("nan"))
    with pytest.raises(FloatingPointError, match="at step 1"):
        step_row(outcome, None, elastic=False, tokens_per_step=1, device=CPU)


def test_a_heal_in_the_aggregation_moves_the_state_and_the_batches_follow():
    s = state()
    s.fedavg = HealsTo(s, 10)
    train_step = TrainStep(s, Counting(), CPU)
    first = train_step()
    assert first.step == 1 and first.aggregated and first.committed and s.step == 10
    s.fedavg.step = 11  # the next aggregation heals nothing away: the state stays at its step
    second = train_step()
    # w = 1 - 0.5 after step 1; batch 11, the one after the peer's step 10
    assert second.step == 11 and second.loss.item() == 0.5 * 11


def test_an_evaluation_is_due_every_eval_every_steps_but_the_last():
    evaluation = Evaluation(
        None, TrainerConfig(eval_every=4), 0, None, CPU, None, partial=False, elastic=False, steps=12
    )
    assert [s for s in range(1, 13) if evaluation.due(s)] == [4, 8]
    evaluation = Evaluation(
        None, TrainerConfig(eval_every=0), 0, None, CPU, None, partial=False, elastic=False, steps=12
    )
    assert not any(evaluation.due(s) for s in range(1, 13))


def test_without_a_checkpointer_checkpoints_do_nothing_and_records_keep_the_summarys_totals():
    s = state()
    checkpoints = Checkpoints(None, s, CPU)
    checkpoints.resume("/nonexistent", "auto")
    checkpoints.after(1)
    checkpoints.finish()
    assert s.step == 0 and not checkpoints.owed
    records = RunRecords(None)  # a rank that writes no records
    records.step({"step": 1, "time_step": 0.25})
    records.step({"step": 2, "time_step": 0.5})
    records.log({"split": "eval"})
    assert records.train_time == 0.75 and records.last_row["step"] == 2
    assert records.finish(None, None, None, None, {}, {}) is None


def test_the_elastic_drill_points_are_elastic_runs_only(monkeypatch):
    monkeypatch.setenv("FLDP_FAULT", "group=0,step=3,at=aggregation")
    Drills(0, elastic=False).aggregation(3)  # a static run has no such point: the rank lives on
    Drills(0, elastic=True).aggregation(2)  # not the step it names
    Drills(1, elastic=True).aggregation(3)  # nor the group
    Drills(0, incarnation=1, elastic=True).aggregation(3)  # a restarted group, without repeat=true
