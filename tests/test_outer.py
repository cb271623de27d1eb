"""Outer optimisers (FedAvg, DiLoCo, FedAdam) against an independent single-process reference, the
aggregation schedule, partial federation and the precision of the cross-group average."""

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from conftest import Snapshot, compose_cfg, identical, read_rows, run_world, train_world

from analysis.stats import TIE
from fldp.data import RankBatches, prepare
from fldp.model import build_model, init_weights, llama_config

STEPS, EVERY, GROUPS, WORLD = 6, 2, 2, 8
FL = ["algorithm=fl_fsdp", "topology=local_8", f"trainer.steps={STEPS}", f"algorithm.every={EVERY}"]
OUTERS = {
    "fedavg": [],
    "diloco": ["algorithm.outer.lr=0.7", "algorithm.outer.momentum=0.9", "algorithm.outer.nesterov=true"],
    "fedadam": [
        "algorithm.outer.name=adam",
        "algorithm.outer.lr=0.01",
        "algorithm.outer.betas=[0.9,0.99]",
        "algorithm.outer.eps=1e-8",
    ],
}


def reference(cfg, outer: str) -> list[float]:
    """Two federation groups in one process, plain tensors, from the definitions: each group trains
    its own model (AdamW, the run's schedule) on its 4 ranks' batches; every A steps the pseudo-
    gradient delta = anchor - mean(groups) drives the outer update of the anchor, which both groups
    then continue from. Returns the per-step loss averaged over the 8 ranks."""
    blocks = prepare(cfg.dataset)
    o = cfg.algorithm.outer
    groups, optimizers, schedulers = [], [], []
    for _ in range(GROUPS):
        model = build_model(llama_config(cfg.model, blocks.vocab_size))
        init_weights(model, torch.device("cpu"), cfg.seed)  # the run's init (tests/test_init.py)
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optimizer.lr,
            betas=tuple(cfg.optimizer.betas),
            weight_decay=cfg.optimizer.weight_decay,
        )
        from transformers import get_cosine_schedule_with_warmup

        groups.append(model)
        optimizers.append(opt)
        schedulers.append(get_cosine_schedule_with_warmup(opt, int(cfg.optimizer.warmup * STEPS), STEPS))
    names = [n for n, _ in groups[0].named_parameters()]
    anchor = {n: p.detach().clone() for n, p in groups[0].named_parameters()}
    m = {n: torch.zeros_like(p) for n, p in anchor.items()}
    v = {n: torch.zeros_like(p) for n, p in anchor.items()}
    ranks = [RankBatches(blocks.train, cfg.trainer.batch_size, r, WORLD, cfg.seed).stream() for r in range(WORLD)]
    losses, rounds = [], 0
    for step in range(1, STEPS + 1):
        batches = [next(it) for it in ranks]
        step_losses = []
        for g, (model, opt, sched) in enumerate(zip(groups, optimizers, schedulers)):
            x = torch.cat(batches[g * 4 : (g + 1) * 4])
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / GROUPS)
        if step % EVERY and step != STEPS:
            continue
        rounds += 1
        with torch.no_grad():
            params = [dict(model.named_parameters()) for model in groups]
            for n in names:
                mean = sum(p[n] for p in params) / GROUPS
                if outer == "fedavg":
                    new = mean
                else:
                    delta = anchor[n] - mean
                    if outer == "diloco":  # SGD, momentum 0.9, Nesterov: m = mu m + d; step = d + mu m
                        m[n] = o.momentum * m[n] + delta
                        new = anchor[n] - o.lr * (delta + o.momentum * m[n])
                    else:  # Adam with bias correction
                        b1, b2 = o.betas
                        m[n] = b1 * m[n] + (1 - b1) * delta
                        v[n] = b2 * v[n] + (1 - b2) * delta * delta
                        m_hat, v_hat = m[n] / (1 - b1**rounds), v[n] / (1 - b2**rounds)
                        new = anchor[n] - o.lr * m_hat / (v_hat.sqrt() + o.eps)
                anchor[n] = new.clone()
                for p in params:
                    p[n].copy_(new)
    return losses


@pytest.fixture(scope="module")
def outer_runs(tmp_path_factory):
    runs = {}
    for name, overrides in OUTERS.items():
        out = tmp_path_factory.mktemp(name)
        cfg = compose_cfg(*FL, *overrides)
        snap = Snapshot(out, [STEPS], cfg)
        runs[name] = (cfg, train_world(cfg, out / "run", snap), snap, out / "run")
    return runs


@pytest.mark.parametrize("outer", list(OUTERS))
def test_outer_optimisers_match_the_reference(outer_runs, outer):
    cfg, rows, snap, run_dir = outer_runs[outer]
    expected = reference(cfg, outer)
    measured = [r["loss"] for r in rows]
    assert measured == pytest.approx(expected, rel=1e-6, abs=0), (measured, expected)
    assert identical(snap.load(0, 0, STEPS), snap.load(1, 0, STEPS))  # all groups continue from the anchor
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer"]["name"] == cfg.algorithm.outer.name and summary["outer"]["reduce_dtype"] is None


def test_fedavg_is_outer_sgd_lr1_bit_for_bit_and_diloco_departs_after_the_first_aggregation(outer_runs, tmp_path):
    fedavg = [r["loss"] for r in outer_runs["fedavg"][1]]
    explicit = train_world(
        compose_cfg(*FL, "algorithm.outer.name=sgd", "algorithm.outer.lr=1.0", "algorithm.outer.momentum=0.0"),
        tmp_path / "run",
    )
    assert [r["loss"] for r in explicit] == fedavg
    diloco = [r["loss"] for r in outer_runs["diloco"][1]]
    assert diloco[:EVERY] == fedavg[:EVERY] and diloco[EVERY] != fedavg[EVERY]


PARTIAL = [
    "algorithm=fl_fsdp",
    "topology=local_8",
    "trainer.steps=8",
    "algorithm.every=[[0,1],[2,3]]",
    "algorithm.federate=[model\\.layers\\..*]",
    "trainer.eval_every=2",
    "trainer.eval_batches=null",
    "dataset.eval_blocks=16",
    "optimizer.lr=3e-3",
]  # the local parameters drift apart visibly


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    """Only the decoder layers federated; evaluations at 2 (an aggregation), 4, 6 and the end."""
    out = tmp_path_factory.mktemp("partial")
    cfg = compose_cfg(*PARTIAL)
    snap = Snapshot(out, [2, 4, 5, 6, 8], cfg)
    return cfg, train_world(cfg, out / "run", snap), snap, out / "run"


def test_partial_federation_and_schedule(partial_run):
    """Only the decoder layers are federated: they are identical across groups after an aggregation,
    the embeddings, norms and lm_head are not. The schedule aggregates at 1, 2, then every 3."""
    cfg, rows, snap, _ = partial_run
    assert [r["step"] for r in rows if r["aggregated"]] == [1, 2, 5, 8]
    g0, g1 = snap.load(0, 0, 5), snap.load(1, 0, 5)
    for name in g0:
        assert torch.equal(g0[name], g1[name]) == name.startswith("model.layers."), name


def _rule(schedule, last_step: int) -> list[int]:
    """The aggregation rule written from its definition, step by step: A is the period of the phase
    holding the step (the last phase starting before it); aggregate once A steps have passed since
    the previous aggregation, and at the last step."""
    steps, previous = [], 0
    for step in range(1, last_step + 1):
        period = [a for start, a in schedule if start < step][-1]
        if step - previous >= period or step == last_step:
            steps.append(step)
            previous = step
    return steps


def test_a_schedule_counts_each_period_from_the_last_aggregation():
    """Not from the phase's start: an unchanged A stays periodic across a phase boundary, and a
    resumed run (which knows only the step number) agrees, since `due` is a function of it."""
    from fldp.aggregation import FedAvgConfig

    def due(every, last):
        config = FedAvgConfig(every=every)
        return [s for s in range(1, last + 1) if config.due(s, last)]

    assert due([[0, 8], [12, 8]], 32) == [8, 16, 24, 32]  # as every=8 (a phase count: 8, 20, 28, 32)
    assert due([[0, 8], [12, 16]], 40) == [8, 24, 40]  # (a phase count: 8, 28, 40)
    assert due([[0, 1], [16, 8]], 32) == [*range(1, 17), 24, 32]
    assert due([[0, 16], [20, 4]], 30) == [16, 21, 25, 29, 30]  # A shrinks: 4 steps since 16 have passed at 21
    assert due(3, 10) == [3, 6, 9, 10] and due(5, 1) == [1]
    import random

    rng = random.Random(0)
    for _ in range(300):
        starts = sorted(rng.sample(range(1, 40), rng.randint(0, 4)))
        schedule = [[0, rng.randint(1, 9)]] + [[s, rng.randint(1, 9)] for s in starts]
        last = rng.randint(1, 50)
        assert due(schedule, last) == _rule(schedule, last), (schedule, last)


def test_partial_federation_evaluates_each_groups_own_model_on_the_whole_split(partial_run):
    """With partial federation the groups hold different models at every evaluation, the final one
    included (the last aggregation leaves the local parameters alone): each is scored on the whole
    held-out split, and the headline is the exp of the mean of their losses, checked against plain
    single-process models built from the groups' weights."""
    cfg, _, snap, run_dir = partial_run
    blocks = prepare(cfg.dataset)

    def score(params):  # mean loss over the whole held-out split (one batch of it), one unsharded model
        model = build_model(llama_config(cfg.model, blocks.vocab_size))
        model.load_state_dict(params, strict=False)  # parameters only; the rotary buffer is built
        with torch.no_grad():
            return model(input_ids=blocks.eval.long(), labels=blocks.eval.long()).loss.item()

    evals = read_rows(run_dir, "eval")
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    for e in evals:
        groups = [snap.load(f, 0, e["step"]) for f in range(GROUPS)]
        assert not identical(*groups), e["step"]
        losses = [score(g) for g in groups]
        # sharded vs plain: ~1e-7 apart; a mix of the groups on halves of the split was ~1e-3 off
        assert e["loss"] == pytest.approx(sum(losses) / GROUPS, rel=1e-6), (e, losses)
        # compared as losses: exp() multiplies a relative error by the loss (~8: 1.3e-7 became 1.07e-6)
        assert [math.log(p) for p in e["group_perplexity"]] == pytest.approx(losses, rel=1e-6), (e, losses)
        assert e["eval_of"] == "the groups' mean loss" and "averaged" not in e
    summary = json.loads((run_dir / "summary.json").read_text())
    final = evals[-1]
    assert summary["eval_perplexity"] == pytest.approx(math.exp(final["loss"]), rel=1e-12)
    assert summary["eval_of"] == "the groups' mean loss"
    assert summary["group_eval_perplexity"] == final["group_perplexity"]
    assert len(set(summary["group_eval_perplexity"])) == GROUPS  # the groups' models differ


def _average_error(cfg, out_path, device):
    """Each of 8 groups (8x1x1) holds different bf16 weights; FedAvg's result against the exact
    (fp64) mean, for each reduce dtype: the median relative error over all elements."""
    from fldp.aggregation import FedAvg, FedAvgConfig, OuterConfig
    from fldp.mesh import MeshShape, build_mesh, group_mesh
    from fldp.model import parallelize

    shape = MeshShape(8, 1, 1)
    mesh = build_mesh(shape, "cpu")
    out = {}
    for reduce_dtype in ("bf16", "fp32"):
        model = parallelize(build_model(llama_config(cfg.model, 512)), group_mesh(mesh, shape), torch.bfloat16)
        torch.manual_seed(100 + dist.get_rank())  # different weights in every group
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().copy_(torch.randn_like(p.to_local(), dtype=torch.float32) * 0.02 + 0.05)
        mine = torch.cat([p.to_local().reshape(-1).double() for p in model.parameters()])
        every = [torch.empty_like(mine) for _ in range(8)]
        dist.all_gather(every, mine)
        exact = torch.stack(every).mean(0)
        FedAvg(model, mesh, shape, FedAvgConfig(every=1, outer=OuterConfig(reduce_dtype=reduce_dtype)), 1)()
        got = torch.cat([p.to_local().reshape(-1).double() for p in model.parameters()])
        out[reduce_dtype] = ((got - exact).abs() / exact.abs()).median().item()
    if dist.get_rank() == 0:
        torch.save(out, out_path)


def test_fp32_reduce_is_closer_to_the_exact_mean_than_bf16(tmp_path):
    run_world(_average_error, 8, compose_cfg(), str(tmp_path / "errors.pt"))
    errors = torch.load(tmp_path / "errors.pt")
    print("median relative error against the fp64 mean, F=8:", errors)
    # fp32 accumulation then one rounding to bf16: within bf16's half ulp (2**-9 relative)
    assert errors["fp32"] <= 2**-9
    assert errors["bf16"] > errors["fp32"]


def test_a_new_algorithm_is_one_yaml(tmp_path):
    """conf/algorithm/diloco_hsdp.yaml extends fl_hsdp with DiLoCo's outer optimiser: it gets fl_hsdp's
    mesh from every topology (layouts are keyed by dimensions, not names) and trains exactly as
    fl_hsdp with the same outer settings."""
    common = ["topology=local_8", "trainer.steps=4", "algorithm.every=2"]
    new = compose_cfg("algorithm=diloco_hsdp", *common)
    assert (new.mesh.federation, new.mesh.replicate, new.mesh.shard) == (2, 2, 2)
    a = train_world(new, tmp_path / "new")
    b = train_world(compose_cfg("algorithm=fl_hsdp", *common, *OUTERS["diloco"]), tmp_path / "old")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert json.loads((tmp_path / "new" / "summary.json").read_text())["algorithm"] == "diloco_hsdp"


def test_fedadam_with_its_defaults_stays_near_fedavg(tmp_path):
    """algorithm.outer.name=adam alone: lr and eps null mean FedAdam's own (1e-3 each). With the
    shared lr 1 its first (bias-corrected) step, ~lr * sign(delta), moved every weight by ~1 and the
    loss went from 8.3 to 36 after the first aggregation."""
    common = ["algorithm=fl_fsdp", "topology=local_2", "trainer.steps=8", "algorithm.every=4"]
    fedavg = train_world(compose_cfg(*common), tmp_path / "fedavg")
    adam = train_world(compose_cfg(*common, "algorithm.outer.name=adam"), tmp_path / "adam")
    pairs = [
        (a["loss"], b["loss"])
        for a, b in zip(adam + read_rows(tmp_path / "adam", "eval"), fedavg + read_rows(tmp_path / "fedavg", "eval"))
    ]
    assert len(pairs) == 9 and all(math.isfinite(a) and abs(a - b) <= TIE * max(a, b) for a, b in pairs), pairs
    outer = json.loads((tmp_path / "adam" / "summary.json").read_text())["outer"]
    assert (outer["name"], outer["lr"], outer["eps"]) == ("adam", 1e-3, 1e-3)
    assert json.loads((tmp_path / "fedavg" / "summary.json").read_text())["outer"]["lr"] == 1.0


# the outer optimisers as FedAvgConfig takes them: FedAvg, DiLoCo, FedAdam (its defaults)
OUTER_CONFIGS = {"fedavg": {}, "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True}, "fedadam": {"name": "adam"}}


def _identical_groups_worker(cfg, out, device):
    """2 groups: for every parameter dtype, reduce dtype and outer optimiser, groups holding the same
    weights are aggregated twice (weights and anchor must not move); then group 1's weights change
    and one more aggregation must leave both groups with the same weights again."""
    from fldp.aggregation import FedAvg, FedAvgConfig, OuterConfig
    from fldp.mesh import MeshShape, build_mesh, group_mesh
    from fldp.model import parallelize

    shape = MeshShape(2, 1, 1)
    mesh = build_mesh(shape, "cpu")
    fed = mesh["federation"].get_group()
    moved = []
    for dtype in (torch.float32, torch.bfloat16):
        for reduce_dtype in (None, "bf16", "fp32"):
            for name, outer in OUTER_CONFIGS.items():
                case = f"{str(dtype)[6:]} params, reduce_dtype={reduce_dtype}, {name}"
                torch.manual_seed(0)  # the same weights in both groups
                model = parallelize(build_model(llama_config(cfg.model, 512)), group_mesh(mesh, shape), dtype)
                before = [p.to_local().clone() for p in model.parameters()]
                config = FedAvgConfig(every=1, bucket_mb=0.05, outer=OuterConfig(reduce_dtype=reduce_dtype, **outer))
                fedavg = FedAvg(model, mesh, shape, config, last_step=3)
                anchors = [b.outer.anchor.clone() for b in fedavg.buckets if b.outer]
                fedavg()
                fedavg()
                if not all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters())):
                    moved.append(f"{case}: the weights")
                if not all(
                    torch.equal(a, b) for a, b in zip(anchors, [b.outer.anchor for b in fedavg.buckets if b.outer])
                ):
                    moved.append(f"{case}: the anchor")
                with torch.no_grad():  # the groups differ: after an aggregation they agree again
                    for p in model.parameters():
                        p.to_local().add_(torch.randn_like(p.to_local()) * 0.01 * dist.get_rank())
                fedavg()
                mine = torch.cat([p.to_local().reshape(-1).float() for p in model.parameters()])
                both = [torch.empty_like(mine) for _ in range(2)]
                dist.all_gather(both, mine, group=fed)
                if not torch.equal(*both):
                    moved.append(f"{case}: the groups differ after an aggregation")
    if dist.get_rank() == 0:
        with open(os.path.join(out, "moved.json"), "w") as f:
            json.dump(moved, f)


def test_aggregating_identical_groups_changes_nothing_in_any_reduce_dtype(tmp_path):
    """The all-reduce's dtype (algorithm.outer.reduce_dtype) rounds what is reduced, never the weights
    or the anchor: fp32 weights reduced in bf16 used to be rounded to bf16 at every aggregation (all
    of them changed, DiLoCo's anchor by up to 1.2e-3) with no group having trained at all."""
    run_world(_identical_groups_worker, 2, compose_cfg(), str(tmp_path))
    assert json.loads((tmp_path / "moved.json").read_text()) == []
