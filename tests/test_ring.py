"""fldp.ring sums as gloo's collectives sum, bit for bit (real processes); with it the simulator
(cluster.reductions=ring) computes what the distributed trainer computes in pure bf16: the same
parameters to the bit after steps and an aggregation, for each algorithm. Summed once, it does not."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import Snapshot, compose_cfg, read_rows, run_world, train_world

from fldp.data import prepare
from fldp.ring import ring_mean, ring_sum
from fldp.simulate import Simulation

# lengths that do not divide by the ranks, and odd pieces (gloo's chunks straddle them)
CASES = [(1001, "bfloat16"), (4099, "bfloat16"), (4096, "bfloat16"), (777, "float32")]


def _gloo_against_ring(out_dir, device):
    rank, ranks = dist.get_rank(), dist.get_world_size()
    found = []
    for i, (length, dtype_name) in enumerate(CASES):
        gen = torch.Generator().manual_seed(100 * i + rank)
        # magnitudes over many binades, so that rounding at each hop shows
        x = (torch.randn(length, generator=gen) * torch.exp(3 * torch.randn(length, generator=gen))).to(
            getattr(torch, dtype_name)
        )
        every = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(every, x)
        terms = torch.stack(every)
        summed, averaged = x.clone(), x.clone()
        dist.all_reduce(summed)
        dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
        piece = length // ranks
        scattered = torch.empty(piece, dtype=x.dtype)
        dist.reduce_scatter_tensor(scattered, x[: piece * ranks].clone(), op=dist.ReduceOp.AVG)
        mine = ring_mean(terms[:, : piece * ranks])[rank * piece : (rank + 1) * piece]
        found.append(
            {
                "sum": torch.equal(ring_sum(terms), summed),
                "mean": torch.equal(ring_mean(terms), averaged),
                "scatter": torch.equal(mine, scattered),
                "once_equal": torch.equal(terms.sum(dim=0), summed),  # torch.sum rounds once
            }
        )
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))


@pytest.mark.parametrize("ranks", [3, 4])
def test_ring_sums_as_gloo_sums(ranks, tmp_path):
    run_world(_gloo_against_ring, ranks, tmp_path)
    for rank in range(ranks):
        for case, found in zip(CASES, json.loads((tmp_path / f"rank{rank}.json").read_text()), strict=True):
            assert found["sum"] and found["mean"] and found["scatter"], (rank, case, found)
            if case[1] == "bfloat16":  # the case tells a ring from one rounding
                assert not found["once_equal"], (rank, case)


COMMON = [
    "topology=local_8",
    "trainer.steps=6",
    "algorithm.every=4",
    "optimizer.lr=1e-2",
    "trainer.eval_batches=2",
    "trainer.precision=bf16",
]
ALGORITHMS = {
    "fsdp": ["algorithm=fsdp"],  # a reduce-scatter over 8 shards
    # HSDP's reduce-scatter over shards, then its all-reduce over 2 replicas, in each of 2 groups (2x2x2),
    # and FedAvg's over the groups; plain HSDP (1x2x4: the same two reductions) is this case's
    "fl_hsdp": ["algorithm=fl_hsdp", "algorithm.fedavg.mode=leader_broadcast"],
    # the reductions in fp32: FSDP2's MixedPrecisionPolicy(reduce_dtype) and FedAvg's change since the
    # last aggregation, both summed in fp32 and cast back (cluster.reductions=once refuses the first)
    "fl_fsdp_fp32_reductions": ["algorithm=fl_fsdp", "fsdp.reduce_dtype=fp32", "algorithm.outer.reduce_dtype=fp32"],
}


def simulated(overrides, run_dir) -> tuple[Simulation, list[float]]:
    cfg = compose_cfg(*overrides, *COMMON, "cluster=simulate")
    simulation = Simulation(cfg, prepare(cfg.dataset), torch.device("cpu"))
    simulation.run(str(run_dir))
    return simulation, [r["loss"] for r in read_rows(run_dir)]


def differing(simulation: Simulation, snapshot: Snapshot, step: int) -> list[str]:
    """The parameters of any group that differ from the trainer's at `step`, in any bit."""
    found = []
    for g in range(simulation.shape.federation):
        trained = snapshot.load(g, 0, step)
        found += [f"{g}:{n}" for n, p in simulation.groups.by_name().items() if not torch.equal(p[g], trained[n])]
    return found


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_ring_simulator_is_the_bf16_trainer_to_the_bit(name, tmp_path, monkeypatch):
    # the ranks' gradients in blocks of 3 (fldp.simulate.RANK_BLOCK): a group's 8, 4 or 2 ranks span
    # blocks, as the paper shape's 512 do
    monkeypatch.setattr("fldp.simulate.RANK_BLOCK", 3)
    cfg = compose_cfg(*ALGORITHMS[name], *COMMON)
    snapshot = Snapshot(tmp_path / "snap", [6], cfg)
    trained = [r["loss"] for r in train_world(cfg, tmp_path / "trainer", on_step=snapshot)]
    ring, ring_losses = simulated([*ALGORITHMS[name], "cluster.reductions=ring"], tmp_path / "ring")
    assert differing(ring, snapshot, 6) == []  # every parameter, after 6 steps and an aggregation
    # the records' losses: each rank's loss of the same bits, averaged in another order
    assert ring_losses == pytest.approx(trained, abs=1e-6)
    if "fsdp.reduce_dtype=fp32" in ALGORITHMS[name]:
        return  # once has no reduction to cast: fldp.train refuses it (tests/test_simulate.py)
    once, once_losses = simulated(ALGORITHMS[name], tmp_path / "once")
    assert differing(once, snapshot, 6) != []  # one rounding per reduction is another computation
    assert max(abs(a - b) for a, b in zip(once_losses, trained)) > 1e-5
