"""cluster=simulate (fldp/simulate.py) computes what the distributed trainer computes: the same losses
step by step and the same final evaluation, for every algorithm, from one process."""

import json
import re

import pytest
import torch
from conftest import cli, compose_cfg, read_rows, train_world

from fldp.data import RankBatches, WorldBatches, prepare
from fldp.simulate import Simulation

# enough steps for 2 aggregations, a learning rate at which the loss moves (3e-4 barely leaves the
# initial loss in 8 tiny steps), and more than one held-out batch per rank
COMMON = [
    "topology=local_8",
    "trainer.steps=8",
    "algorithm.every=4",
    "optimizer.lr=1e-2",
    "trainer.eval_batches=2",
    "trainer.precision=fp32",
]
ALGORITHMS = {
    "fsdp": ["algorithm=fsdp"],
    # hsdp: FSDP's computation here (test_hsdp_is_fsdp_in_the_simulator); in bf16 with
    # cluster.reductions=ring it is its own, and tests/test_ring.py checks it against the trainer
    "fl_fsdp": ["algorithm=fl_fsdp"],
    "fl_hsdp": ["algorithm=fl_hsdp", "algorithm.fedavg.mode=leader_broadcast"],
    "fl_hsdp_all_replicas": ["algorithm=fl_hsdp", "algorithm.fedavg.mode=all_replicas"],
    "diloco_hsdp": ["algorithm=diloco_hsdp"],
    "fedadam_fsdp": ["algorithm=fl_fsdp", "algorithm.outer.name=adam"],
    # partial federation (the groups end as different models) on a schedule, evaluated mid-run
    "partial_schedule": [
        "algorithm=fl_fsdp",
        "algorithm.federate=[model\\.layers\\..*]",
        "algorithm.every=[[0,2],[6,4]]",
        "trainer.eval_every=3",
    ],
}
TOLERANCE = 1e-5


def simulate(cfg, run_dir) -> tuple[list[float], float]:
    summary = Simulation(cfg, prepare(cfg.dataset), torch.device("cpu")).run(str(run_dir))
    return [r["loss"] for r in read_rows(run_dir)], summary["eval_loss"]


def evaluations(run_dir) -> list[tuple]:
    return [(r["step"], r["eval_of"], r["loss"], *r.get("group_perplexity", [])) for r in read_rows(run_dir, "eval")]


@pytest.mark.parametrize("world, batch, shuffle", [(8, 2, True), (6, 3, True), (5, 2, False)])
def test_world_batches_are_every_ranks_batches(world, batch, shuffle):
    """The simulator's data: rank r's row of each step is RankBatches' (DistributedSampler's) batch
    for rank r, across epoch boundaries; 50 blocks do not divide by 6 or 4 (dropped tails)."""
    blocks = torch.arange(50 * 3).view(50, 3)
    ranks = [RankBatches(blocks, batch, r, world, seed=7, shuffle=shuffle).stream() for r in range(world)]
    together = WorldBatches(blocks, batch, world, seed=7, shuffle=shuffle).stream()
    for _ in range(3 * (50 // world // batch) + 1):
        assert torch.equal(next(together), torch.stack([next(r) for r in ranks]))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_simulator_agrees_with_the_distributed_trainer(name, tmp_path):
    cfg = compose_cfg(*ALGORITHMS[name], *COMMON)
    trained = [r["loss"] for r in train_world(cfg, tmp_path / "trainer")]
    trained_eval = json.loads((tmp_path / "trainer" / "summary.json").read_text())["eval_loss"]
    simulated, simulated_eval = simulate(compose_cfg(*ALGORITHMS[name], *COMMON, "cluster=simulate"), tmp_path / "sim")
    assert len(simulated) == len(trained) == 8
    assert trained[-1] < trained[0] - 0.2  # it learnt something: the comparison is not of flat lines
    worst = max(abs(a - b) for a, b in zip(simulated, trained))
    assert worst <= TOLERANCE, f"{name}: per-step losses differ by up to {worst:.2e}\n{simulated}\n{trained}"
    assert abs(simulated_eval - trained_eval) <= TOLERANCE, (simulated_eval, trained_eval)
    # every evaluation, mid-run ones included: the same kind of loss, the same values
    for a, b in zip(evaluations(tmp_path / "sim"), evaluations(tmp_path / "trainer"), strict=True):
        assert a[:2] == b[:2] and a[2:] == pytest.approx(b[2:], rel=TOLERANCE), (a, b)


def test_hsdp_is_fsdp_in_the_simulator(tmp_path):
    """Inside a group the layout is only where the work runs: HSDP and FSDP on the same pool are the
    same full-batch step, so the simulator gives them the same records to the bit."""
    fsdp = simulate(compose_cfg("algorithm=fsdp", *COMMON, "cluster=simulate"), tmp_path / "fsdp")
    hsdp = simulate(compose_cfg("algorithm=hsdp", *COMMON, "cluster=simulate"), tmp_path / "hsdp")
    assert fsdp == hsdp


@pytest.mark.timeout(300)
def test_the_paper_shape_runs_from_the_command_line(tmp_path):
    """+experiment=paper_shape is the paper's 512-rank layouts in one process (2 steps here; in fp32,
    as the studies run it: this CPU has no fast bf16 matmul, 33 s against 12 s on the 2-core VM)."""
    # the experiment's own eval_blocks: the token cache it makes is the one CI's paper-shape study reads
    out = cli(
        "+experiment=paper_shape",
        "algorithm=fl_fsdp",
        "trainer.steps=2",
        "trainer.precision=fp32",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["federation"], summary["replicate"], summary["shard"], summary["world_size"]) == (128, 1, 4, 512)
    assert summary["executor"] == "simulator" and summary["network"] == "none"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", summary["commit"])  # the fldp that ran: this checkout
    assert summary["tokens"] == 2 * 512 * 2 * 16


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.checkpoint_every=4", "keeps no checkpoints"),
        ("comm.emulate=true", "nothing to emulate"),
        ("fsdp.reduce_dtype=bf16", "use cluster.reductions=ring"),  # fp32 runs: once has no reduction to cast
    ],
)
def test_what_the_simulator_cannot_do_is_refused(override, words, tmp_path):
    out = cli("cluster=simulate", override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


class CudaLabelledCpu(str):
    """A device that says it is CUDA (`.type`) while torch, reading the string, puts the tensors on
    the CPU: the timing path takes it for a GPU, the arithmetic runs here."""

    type = "cuda"


def test_on_cuda_the_simulators_phase_times_are_taken_after_a_synchronise(tmp_path, monkeypatch):
    """On a GPU the kernels run after their launch: a phase's time is right only if the clock is read
    after torch.cuda.synchronize(), at every phase boundary, as the trainer's PhaseTimer does."""
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    cfg = compose_cfg(
        "algorithm=fl_fsdp",
        "topology=local_2",
        "trainer.steps=2",
        "algorithm.every=2",
        "trainer.eval_batches=1",
        "cluster=simulate",
    )
    sim = Simulation(cfg, prepare(cfg.dataset), torch.device("cpu"))
    sim.device = CudaLabelledCpu("cpu")
    for name in ("losses", "exchange"):  # the forward pass and the aggregation, as they run
        monkeypatch.setattr(sim, name, _marked(getattr(sim, name), name, events))
    monkeypatch.setattr(sim.optimizer, "step", _marked(sim.optimizer.step, "optimizer", events))
    sim.run(str(tmp_path / "run"))
    # per step: synchronise, forward, synchronise (forward's end), backward, synchronise, the
    # optimiser, synchronise; at step 2 the aggregation, then a synchronise again
    step = ["sync", "losses", "sync", "sync", "optimizer", "sync"]
    assert events == step + step + ["exchange", "sync"], events
    rows = read_rows(tmp_path / "run")
    assert all(r[f"time_{p}"] >= 0 for r in rows for p in ("forward", "backward", "optimizer", "aggregation"))


def _marked(call, name: str, events: list):
    def marked(*args, **kwargs):
        events.append(name)
        return call(*args, **kwargs)

    return marked
