"""Quantised aggregation (algorithm.outer.quantize, fldp/quantize.py) against a reference written here
from the definition (plain tensors, one process): blocks of `block` elements, scale absmax / qmax,
round half to even (int) or torch's float8_e4m3fn cast, the groups' mean of the dequantised changes
summed in fp32 and quantised again; error feedback carries what each group's quantisation lost."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import Snapshot, compose_cfg, identical, read_rows, train_world

from fldp.data import RankBatches, prepare
from fldp.errors import ConfigError
from fldp.model import build_model, init_weights, llama_config
from fldp.quantize import Quantizer, quantized_mean, residual_for
from fldp.train import precheck
from fldp.trainer import build_optimizer

pytestmark = pytest.mark.timeout(300, method="signal")

QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def dequantised(x: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """x (fp32, whole blocks) as the receiver sees it: each block scaled by its absmax / qmax into
    the kind's grid (at most qmax in magnitude: the grid has nothing beyond), then back."""
    out = []
    for b in x.split(block):
        scale = b.abs().max() / QMAX[kind]
        scale = scale if scale > 0 else torch.tensor(1.0)
        ratio = torch.clamp(b / scale, -QMAX[kind], QMAX[kind])
        grid = ratio.to(torch.float8_e4m3fn).float() if kind == "fp8" else torch.round(ratio)
        out.append(grid * scale)
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_a_block_whose_largest_value_is_subnormal_keeps_its_signs(kind):
    """A subnormal absmax divides inexactly: absmax / (absmax / 127) can be 127.6, which rounds to
    128 and, as int8, wraps to -128 (int4: 8, past its nibble). Blocks [a, -a, a / 2, 0] over every
    subnormal a: each value decodes with its own sign, as the definition (grid clamped to qmax) says."""
    q = Quantizer(kind, 4)
    bits = torch.cat([torch.arange(1, 2**13), torch.arange(2**13, 2**23, 1021)]).to(torch.int32)
    subnormals = bits.view(torch.float32)  # the smallest 8,191 subnormals, then 1 in 1,021
    x = torch.stack([subnormals, -subnormals, subnormals / 2, torch.zeros_like(subnormals)], dim=1).reshape(-1)
    decoded = q.decode(q.encode(x), x.numel())
    assert torch.equal(decoded, dequantised(x, kind, 4))
    assert not (decoded * x < 0).any(), x[decoded * x < 0][:4].tolist()
    assert (decoded.view(-1, 4)[:, 0] >= 0).all() and (decoded.view(-1, 4)[:, 1] <= 0).all()


def reference_mean(changes, kind: str, block: int, residuals=None) -> torch.Tensor:
    """The groups' quantised mean: pad to F chunks of whole blocks, quantise each group's change (+
    its residual), sum the dequantised in group order, divide by F, quantise the mean."""
    F, n = len(changes), changes[0].numel()
    padded = math.ceil(n / (F * block)) * block * F
    sent = []
    for g, x in enumerate(changes):
        x = torch.cat([x, torch.zeros(padded - n)])
        if residuals is not None:
            x = x + residuals[g]
        q = dequantised(x, kind, block)
        if residuals is not None:
            residuals[g] = x - q
        sent.append(q)
    return dequantised(sum(sent) / F, kind, block)[:n]


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_the_quantised_mean_follows_its_definition_with_and_without_error_feedback(kind):
    torch.manual_seed(0)
    F, n, block = 3, 1000, 16  # 1000 is no multiple of F * block: the last chunk is padded
    q = Quantizer(kind, block)
    changes = [torch.randn(n) * 0.01 * (g + 1) for g in range(F)]
    changes[1][:block] = 0  # a block of zeros: scale 1, sends zeros
    assert torch.equal(quantized_mean(changes, q), reference_mean(changes, kind, block))
    mine = [residual_for(n, F, q, "cpu") for _ in range(F)]
    theirs = [torch.zeros_like(r) for r in mine]
    for _ in range(3):  # the residuals carry over
        assert torch.equal(quantized_mean(changes, q, mine), reference_mean(changes, kind, block, theirs))
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert any(r.abs().max() > 0 for r in mine)
    # on the wire: the payload in `bits` per element (int4: two per byte) and an fp32 scale per block
    assert q.encode(torch.randn(4 * block)).numel() == 4 * block * q.bits // 8 + 4 * 4
    exact = sum(changes) / F
    assert (quantized_mean(changes, q) - exact).abs().max() < {"int8": 1e-3, "fp8": 4e-3, "int4": 1e-2}[kind]


# --- the trainer against the reference: 2 groups of one rank each (local_2, 2x1x1), one bucket
STEPS, EVERY = 7, 3
CASES = {
    "int8-feedback": ["algorithm.outer.quantize=int8", "algorithm.outer.error_feedback=true"],
    "int4-diloco": [
        "algorithm.outer.quantize=int4",
        "algorithm.outer.quantize_block=64",
        "algorithm.outer.lr=0.7",
        "algorithm.outer.momentum=0.9",
        "algorithm.outer.nesterov=true",
    ],
    "fp8": ["algorithm.outer.quantize=fp8"],
}
FL2 = [
    "algorithm=fl_fsdp",
    "topology=local_2",
    "mesh.federation=2",
    "mesh.shard=1",
    f"trainer.steps={STEPS}",
    f"algorithm.every={EVERY}",
]


def reference_run(cfg) -> tuple[list[float], dict]:
    """Two groups trained side by side in one process; at each aggregation the change of each since
    the last (flat, parameter order) is quantised and averaged as reference_mean says; FedAvg adds
    the mean to the weights of the last aggregation, DiLoCo's Nesterov SGD steps its anchor with
    minus the mean. Per-step mean loss, and the final weights."""
    blocks, o = prepare(cfg.dataset), cfg.algorithm.outer
    models, optimizers, schedulers = [], [], []
    from transformers import get_cosine_schedule_with_warmup

    for _ in range(2):
        model = build_model(llama_config(cfg.model, blocks.vocab_size))
        init_weights(model, torch.device("cpu"), cfg.seed)
        opt = build_optimizer(model, cfg.optimizer)
        models.append(model)
        optimizers.append(opt)
        schedulers.append(get_cosine_schedule_with_warmup(opt, int(cfg.optimizer.warmup * STEPS), STEPS))
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).float()  # noqa: E731
    base, momentum = flat(models[0]), None
    residuals = (
        [torch.zeros(2 * math.ceil(base.numel() / (2 * o.quantize_block)) * o.quantize_block) for _ in range(2)]
        if o.error_feedback
        else None
    )
    ranks = [RankBatches(blocks.train, cfg.trainer.batch_size, r, 2, cfg.seed).stream() for r in range(2)]
    losses = []
    for step in range(1, STEPS + 1):
        step_losses = []
        for model, opt, sched, batches in zip(models, optimizers, schedulers, ranks):
            x = next(batches)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / 2)
        if step % EVERY and step != STEPS:
            continue
        mean = reference_mean([flat(m) - base for m in models], o.quantize, o.quantize_block, residuals)
        if o.momentum:  # Nesterov SGD on the pseudo-gradient d = -mean: m = mu m + d; anchor -= lr (d + mu m)
            d = -mean  # in torch's order of operations: a rounding off by one ulp may move an int4 level
            momentum = d.clone() if momentum is None else momentum.mul(o.momentum).add(d)
            base = base.add(d.add(momentum, alpha=o.momentum), alpha=-o.lr)
        else:
            base = base + mean
        with torch.no_grad():
            for model in models:
                torch.nn.utils.vector_to_parameters(base.clone(), model.parameters())
    return losses, {n: p.detach() for n, p in models[0].named_parameters()}


def assert_close_but_for_rounding_flips(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal within 1e-6, but for a few elements (at most 1 in 1,000 of the model's) that sat on a
    quantisation level's boundary: another CPU's kernels sum the gradients in another order, and an
    element a hair apart rounds to the neighbouring level (with error feedback its residual carries
    the flip on). Those differ by about one level (int8 here: 8e-6; int4: 6e-5), far under a step's
    update (~1e-3); a wrong aggregation moves many elements, and by as much as an update."""
    off = ~torch.isclose(got, want, rtol=1e-6, atol=1e-6)
    flips = int(off.sum())
    assert flips <= max(1, got.numel() // 1_000), (
        f"{name}: {flips} of {got.numel()} elements differ, by up to {(got - want).abs().max():.2e}"
    )
    if flips:
        assert (got - want).abs().max() < 1e-4, f"{name}: differs by {(got - want).abs().max():.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainers_quantised_aggregation_matches_the_reference(tmp_path, case):
    cfg = compose_cfg(*FL2, *CASES[case])
    snap = Snapshot(tmp_path, [STEPS], cfg)
    rows = train_world(cfg, tmp_path / "run", snap)
    losses, weights = reference_run(cfg)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-6, abs=0)
    final = snap.load(0, 0, STEPS)
    assert final.keys() == weights.keys()
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(d)])  # noqa: E731
    assert_close_but_for_rounding_flips(flat(final), flat(weights), "the model")
    assert torch.equal(
        torch.cat([t.reshape(-1) for t in snap.load(1, 0, STEPS).values()]),
        torch.cat([t.reshape(-1) for t in final.values()]),
    )  # both groups hold one model


# the simulator against the trainer where buckets matter: 2 groups of 2 shards (FSDP2 cuts each
# parameter's rows in two), 2 fragments, buckets of 10 KiB (several per fragment and shard)
SHARDED = [
    "algorithm=fl_fsdp",
    "topology=local_4",
    "mesh.federation=2",
    "mesh.shard=2",
    "trainer.steps=9",
    "algorithm.every=4",
    "algorithm.streaming.fragments=2",
    "algorithm.fedavg.bucket_mb=0.01",
    "trainer.eval_every=2",
    "trainer.eval_batches=2",
]
# the simulator runs the trainer's Quantizer (fldp/quantize.py, one definition, each kind checked
# against its definition above and in the trainer against the reference): what the simulator adds is
# where each shard rank's buckets are cut and its error-feedback residual kept, the same for every
# kind. So one integer kind (int4: two values a byte, a block of 64) and one float kind (fp8, under
# DiLoCo's outer Nesterov step), each with error feedback (int8 and the kinds without feedback ran
# here too, and cost CI ~5 worker-minutes for no path of their own)
SIMULATED = {
    "fp8-feedback-diloco": [
        *CASES["int4-diloco"][2:],
        "algorithm.outer.quantize=fp8",
        "algorithm.outer.error_feedback=true",
    ],
    "int4-feedback": [
        "algorithm.outer.quantize=int4",
        "algorithm.outer.quantize_block=64",
        "algorithm.outer.error_feedback=true",
    ],
}


@pytest.mark.parametrize("case", list(SIMULATED))
def test_the_simulator_quantises_as_the_trainer_does(tmp_path, case):
    """cluster=simulate runs the trainer's buckets (fldp.stacked: each shard rank's, quantised block
    by block as that rank quantises them) in one process: its per-step losses and evaluations equal
    the trainer's within 1e-5 (fp32's order of additions), with error feedback (without it: the
    same bucket arithmetic, which the trainer's runs above check against the reference)."""
    common = [*SHARDED, *SIMULATED[case]]
    trained = train_world(compose_cfg(*common), tmp_path / "trainer")
    from fldp import simulate

    cfg = compose_cfg(*common, "cluster=simulate")
    simulate.run(cfg, str(tmp_path / "sim"), prepare(cfg.dataset))
    simulated = read_rows(tmp_path / "sim")
    assert [r.get("fragments") for r in simulated] == [r.get("fragments") for r in trained]
    assert [r["loss"] for r in simulated] == pytest.approx([r["loss"] for r in trained], rel=1e-5, abs=0)
    evals = [read_rows(tmp_path / d, "eval") for d in ("trainer", "sim")]  # 2, 4, 6, 8: the groups differ
    assert len(evals[1]) == 5
    assert [r["loss"] for r in evals[1]] == pytest.approx([r["loss"] for r in evals[0]], rel=1e-5, abs=0)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["algorithm.outer.quantize=int2"], "algorithm.outer.quantize"),
        (["algorithm.outer.quantize=int8", "algorithm.outer.quantize_block=7"], "must be an even integer"),
        (["algorithm.outer.quantize=int8", "algorithm.outer.reduce_dtype=bf16"], "set reduce_dtype to null"),
        (["algorithm.outer.error_feedback=true"], "needs algorithm.outer.quantize"),
        (["algorithm.outer.quantize=int8", "algorithm.elastic=true"], "a quantised one is not built yet"),
    ],
)
def test_quantisation_refuses_what_it_cannot_do_before_any_worker_starts(overrides, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        precheck(["algorithm=fl_fsdp", "topology=local_4", *overrides], multirun=False)


def test_fl_hsdps_leader_broadcast_hands_the_replicas_what_every_replica_would_compute(tmp_path):
    """2x2x2, int4 with error feedback and FedAdam: leader_broadcast (replica 0 quantises, exchanges
    and steps, then broadcasts the new weights) equals all_replicas (every replica does it itself,
    each with its own residual and outer state) bit for bit: the replicas hold the same shards."""
    common = [
        "algorithm=fl_hsdp",
        "topology=local_8",
        "trainer.steps=6",
        "algorithm.every=2",
        "algorithm.outer.quantize=int4",
        "algorithm.outer.error_feedback=true",
        "algorithm.outer.name=adam",
        "algorithm.outer.lr=0.01",
    ]
    runs = {}
    for mode in ("leader_broadcast", "all_replicas"):
        cfg = compose_cfg(*common, f"algorithm.fedavg.mode={mode}")
        snap = Snapshot(tmp_path / mode, [6], cfg)
        runs[mode] = (
            [r["loss"] for r in train_world(cfg, tmp_path / mode / "run", snap)],
            [snap.load(f, r, 6) for f in range(2) for r in range(2)],
        )
    (losses, weights), (losses_all, weights_all) = runs.values()
    assert losses == losses_all
    assert all(identical(a, b) for a, b in zip(weights, weights_all))
    assert all(identical(weights[0], w) for w in weights[1:])  # one model in every group and replica
