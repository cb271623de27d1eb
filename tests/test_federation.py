"""FedAvg across federation groups, on real processes over gloo."""

import gc
import json
import math
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import Snapshot, compose_cfg, identical, read_rows, run_world, train_world

import fldp.aggregation as aggregation
from fldp.aggregation import FedAvg, FedAvgConfig, OuterConfig
from fldp.mesh import MeshShape, build_mesh, group_mesh
from fldp.model import build_model, llama_config, parallelize

# FL+HSDP 2x2x2 with A=3 over 7 steps: aggregations at 3, 6 and the forced last step 7.
STEPS, EVERY = 7, 3
AGGREGATED = {3, 6, 7}


@pytest.fixture(scope="module")
def fl_hsdp_runs(tmp_path_factory):
    """One FL+HSDP run per FedAvg mode, every replica's parameters after every step."""
    runs = {}
    for mode in ("leader_broadcast", "all_replicas"):
        out = tmp_path_factory.mktemp(mode)
        cfg = compose_cfg(
            "algorithm=fl_hsdp",
            "topology=local_8",
            f"trainer.steps={STEPS}",
            f"algorithm.every={EVERY}",
            f"algorithm.fedavg.mode={mode}",
        )
        snap = Snapshot(out, range(1, STEPS + 1), cfg)
        runs[mode] = (snap, train_world(cfg, out / "run", snap))
    return runs


def test_groups_identical_after_aggregation_and_differ_between(fl_hsdp_runs):
    snap, rows = fl_hsdp_runs["leader_broadcast"]
    assert [r["aggregated"] for r in rows] == [s in AGGREGATED for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        replicas = {(f, r): snap.load(f, r, step) for f in range(2) for r in range(2)}
        # HSDP replicas inside a group always agree
        for f in range(2):
            assert identical(replicas[f, 0], replicas[f, 1]), f"group {f} replicas differ at step {step}"
        same = identical(replicas[0, 0], replicas[1, 0])
        assert same == (step in AGGREGATED), f"step {step}: groups identical={same}"


def test_leader_broadcast_equals_all_replicas_bitwise(fl_hsdp_runs):
    (a, rows_a), (b, rows_b) = fl_hsdp_runs["leader_broadcast"], fl_hsdp_runs["all_replicas"]
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    for step in range(1, STEPS + 1):
        for f in range(2):
            for r in range(2):
                assert identical(a.load(f, r, step), b.load(f, r, step))


def test_fl_fsdp_with_tied_embeddings(tmp_path):
    """FL+FSDP 2x1x4, A=2, a model whose lm_head shares the embedding: still one parameter,
    averaged once, groups identical after aggregation."""
    cfg = compose_cfg(
        "algorithm=fl_fsdp",
        "topology=local_8",
        "trainer.steps=3",
        "algorithm.every=2",
        "model.tie_word_embeddings=true",
    )
    snap = Snapshot(tmp_path, [1, 2, 3], cfg)
    train_world(cfg, tmp_path / "run", snap)
    g0, g1 = snap.load(0, 0, 2), snap.load(1, 0, 2)
    assert "lm_head.weight" not in g0  # tied: named_parameters lists the shared tensor once
    assert identical(g0, g1)
    assert not identical(snap.load(0, 0, 1), snap.load(1, 0, 1))
    assert identical(snap.load(0, 0, 3), snap.load(1, 0, 3))  # forced final aggregation


def test_intermediate_evaluation_scores_the_groups_average(tmp_path):
    """FL+FSDP 2x1x2, A=2, evaluation every step: at step 1 the groups differ, and the evaluation
    scores their average (and each group), checked against plain single-process models built from
    the groups' weights; training is not changed by it."""
    from fldp.data import prepare

    common = [
        "algorithm=fl_fsdp",
        "topology=local_4",
        "trainer.steps=2",
        "algorithm.every=2",
        "trainer.eval_batches=null",
        "dataset.eval_blocks=8",
    ]
    cfg = compose_cfg(*common, "trainer.eval_every=1")
    snap = Snapshot(tmp_path / "eval", [1, 2], cfg)
    rows = train_world(cfg, tmp_path / "eval" / "run", snap)
    evals = read_rows(tmp_path / "eval" / "run", "eval")
    assert [e["step"] for e in evals] == [1, 2]
    groups = [snap.load(f, 0, 1) for f in range(2)]
    assert not identical(*groups)

    blocks = prepare(cfg.dataset)

    def score(params):  # mean loss over the whole held-out split, one unsharded model
        model = build_model(llama_config(cfg.model, blocks.vocab_size))
        model.load_state_dict(params, strict=False)  # parameters only; the rotary buffer is built
        with torch.no_grad():
            return sum(model(input_ids=x[None].long(), labels=x[None].long()).loss.item() for x in blocks.eval) / len(
                blocks.eval
            )

    average = {n: (groups[0][n] + groups[1][n]) / 2 for n in groups[0]}
    assert evals[0]["averaged"] is True
    assert evals[0]["loss"] == pytest.approx(score(average), rel=1e-5)
    for f in range(2):
        assert math.log(evals[0]["group_perplexity"][f]) == pytest.approx(score(groups[f]), rel=1e-5)
    assert "group_perplexity" not in evals[1]  # step 2 aggregated: one model, scored as at the end

    plain = train_world(compose_cfg(*common), tmp_path / "plain" / "run")
    assert [r["loss"] for r in plain] == [r["loss"] for r in rows]  # the evaluation changed nothing


def _in_place_worker(cfg, out, device):
    """FL+FSDP 2x1x2 on a model with an odd MLP width: FSDP2 pads gate/up_proj's dim 0 on shard 1."""
    shape = MeshShape(2, 1, 2)
    mesh = build_mesh(shape, "cpu")
    model_cfg = cfg.model.copy()
    model_cfg.intermediate_size = 171
    torch.manual_seed(0)
    model = parallelize(build_model(llama_config(model_cfg, 512)), group_mesh(mesh, shape), torch.float32)
    f, _, s = shape.coords(dist.get_rank())
    fsdp_modules = [m for m in model.modules() if hasattr(m, "unshard")]
    with torch.no_grad():
        # FSDP2's lazy init (at the first forward) would re-derive what it all-gathers from the
        # local shards; done first, so FedAvg alone must keep the two the same
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        for m in fsdp_modules:
            m.reshard()
        for p in model.parameters():  # make the groups differ
            p.to_local().mul_(1.0 + f).add_(0.25 * f)
    # the expected average, from every group's shard (all_gather, not the all-reduce under test)
    fed = mesh["federation"].get_group()
    expected = {}
    for name, p in model.named_parameters():
        both = [torch.empty_like(p.to_local()) for _ in range(2)]
        dist.all_gather(both, p.to_local().contiguous(), group=fed)
        expected[name] = (both[0] + both[1]) / 2  # exact: halving an fp32 sum rounds nothing more
    padded = [
        n for n, p in model.named_parameters() if p.to_local().numel() and p.to_local().shape[0] < -(-p.shape[0] // 2)
    ]
    assert bool(padded) == (s == 1), padded  # chunk 0 is never padded
    old = [weakref.ref(p._local_tensor) for p in model.parameters()]

    fedavg = FedAvg(model, mesh, shape, FedAvgConfig(every=1, bucket_mb=0.05), last_step=1)
    # every shard lives in a bucket but the padded ones, which are copied in and out of it
    copied = sum(len(b.copied) for b in fedavg.buckets)
    assert copied == len(padded) and all(b.flat is not None for b in fedavg.buckets)
    gc.collect()
    alive = sum(r() is not None for r in old)
    assert alive == len(padded), f"{alive} old shard storages kept alive"
    fedavg()
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), expected[name]), name
    # what FSDP2 all-gathers for forward is the average, not the shards before it
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    for m in fsdp_modules:
        m.unshard()
    for name, p in model.named_parameters():
        assert not hasattr(p, "to_local") and torch.equal(p, full[name]), name
    for m in fsdp_modules:
        m.reshard()
    # the optimiser's in-place steps land in the buckets: the next average sees them
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0 + f)
    fedavg()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.to_local(), expected[name] + 1.5)  # (x+1 + y+2) / 2, rounded
    # a parameter replaced after FedAvg was built would no longer be what FSDP2 gathers: refused
    model.load_state_dict(model.state_dict(), assign=True)
    try:
        fedavg()
        raise AssertionError("a replaced parameter was averaged")
    except RuntimeError as e:
        assert "replaced after FedAvg was built" in str(e)
    if dist.get_rank() == 0:
        open(os.path.join(out, "ok"), "w").close()


def test_fedavg_averages_fsdp_shards_in_place(tmp_path):
    """FSDP2's local shards are views of FedAvg's buckets (padded shards copied), the old storage
    is freed, the average equals one computed from the groups' shards, FSDP2's all-gather reads it,
    and a parameter replaced after FedAvg was built stops the next aggregation."""
    run_world(_in_place_worker, 4, compose_cfg(), str(tmp_path))
    assert (tmp_path / "ok").exists()


def _copied_alike_worker(cfg, out, device):
    """8 groups of bf16 weights, DiLoCo, several buckets: FedAvg reducing the shards in place and
    FedAvg packing them (nothing resident) give the same bits, twice (momentum in play)."""
    shape = MeshShape(4, 1, 1)
    mesh = build_mesh(shape, "cpu")
    config = FedAvgConfig(every=1, bucket_mb=0.02, outer=OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    results = []
    for resident in (True, False):
        model = parallelize(build_model(llama_config(cfg.model, 512)), group_mesh(mesh, shape), torch.bfloat16)
        torch.manual_seed(100 + dist.get_rank())
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().copy_(torch.randn_like(p.to_local(), dtype=torch.float32) * 0.02 + 0.05)
        owners = aggregation._fsdp_params
        if not resident:
            aggregation._fsdp_params = lambda model: {}
        try:
            fedavg = FedAvg(model, mesh, shape, config, last_step=2)
        finally:
            aggregation._fsdp_params = owners
        assert all((b.flat is not None) == resident for b in fedavg.buckets)
        fedavg()
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(torch.randn_like(p.to_local(), dtype=torch.float32) * 0.01)
        fedavg()
        results.append([p.to_local().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    if dist.get_rank() == 0:
        open(os.path.join(out, "ok"), "w").close()


def test_in_place_and_packed_fedavg_give_the_same_bits(tmp_path):
    run_world(_copied_alike_worker, 4, compose_cfg(), str(tmp_path))
    assert (tmp_path / "ok").exists()


# each kind of FedAvg bucket: (FedAvg's resident flag, reduce_dtype, federated parameters)
BUCKET_KINDS = {
    "resident": (True, None, [".*"]),  # FSDP2's shards are views of the bucket
    "copied (resident=False)": (False, None, [".*"]),  # trainer.async_save
    "copied (casting reduce_dtype)": (True, "bf16", [".*"]),  # fp32 weights, bf16 all-reduce
    "padded": (True, None, [r".*\.(gate|up)_proj\.weight"]),  # shard 1's: 85 of 86 rows, copied
}


def _stale_worker(cfg, out, device):
    """FL+FSDP 2x1x2 with an odd MLP width (padded shards on shard 1): for every bucket kind, a
    model whose parameters are replaced after FedAvg was built (load_state_dict(assign=True)) stops
    the next aggregation on every rank."""
    shape = MeshShape(2, 1, 2)
    mesh = build_mesh(shape, "cpu")
    model_cfg = cfg.model.copy()
    model_cfg.intermediate_size = 171
    _, _, s = shape.coords(dist.get_rank())
    refused = {}
    for kind, (resident, reduce_dtype, federate) in BUCKET_KINDS.items():
        torch.manual_seed(0)
        model = parallelize(build_model(llama_config(model_cfg, 512)), group_mesh(mesh, shape), torch.float32)
        config = FedAvgConfig(every=1, federate=tuple(federate), outer=OuterConfig(reduce_dtype=reduce_dtype))
        fedavg = FedAvg(model, mesh, shape, config, last_step=2, resident=resident)
        built = ["resident" if b.flat is not None else "copied" for b in fedavg.buckets]
        assert built == ["copied" if kind != "resident" and (kind != "padded" or s == 1) else "resident"], built
        fedavg()
        model.load_state_dict(model.state_dict(), assign=True)
        try:
            fedavg()
            refused[kind] = False
        except RuntimeError as e:
            refused[kind] = "replaced after FedAvg was built" in str(e)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, refused)
    if dist.get_rank() == 0:
        with open(os.path.join(out, "refused.json"), "w") as f:
            json.dump(everyone, f)


def test_a_replaced_parameter_stops_every_kind_of_bucket(tmp_path):
    """Copied buckets (resident=False, a casting reduce_dtype, padded shards) used to keep averaging
    the tensors captured when FedAvg was built: the model's live parameters silently stopped being
    federated. Every kind now refuses, as resident buckets did."""
    run_world(_stale_worker, 4, compose_cfg(), str(tmp_path))
    refused = json.loads((tmp_path / "refused.json").read_text())
    assert refused == [{kind: True for kind in BUCKET_KINDS}] * 4, refused
