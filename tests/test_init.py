"""Every algorithm, mesh and init device starts from the same weights (fldp.init), and pure bf16
keeps the buffers the model defines in fp32."""

import math

import pytest
import torch
from conftest import Snapshot, compose_cfg, identical, train_world

from fldp.data import RankBatches, prepare
from fldp.init import _cos_2pi, _log, standard_normal
from fldp.model import build_model, init_weights, llama_config, parallelize


def test_a_value_depends_on_its_index_only():
    """The same element, computed in a long vectorised batch, alone, or at another chunk offset,
    is the same bits: the operations round identically in any loop."""
    batch = standard_normal(7, "model.layers.0.mlp.up_proj.weight", 1000, 301, "cpu")
    alone = torch.cat([standard_normal(7, "model.layers.0.mlp.up_proj.weight", 1000 + i, 1, "cpu") for i in range(301)])
    parts = torch.cat(
        [
            standard_normal(7, "model.layers.0.mlp.up_proj.weight", 1000, 13, "cpu"),
            standard_normal(7, "model.layers.0.mlp.up_proj.weight", 1013, 288, "cpu"),
        ]
    )
    assert torch.equal(batch, alone) and torch.equal(batch, parts)
    assert not torch.equal(batch, standard_normal(8, "model.layers.0.mlp.up_proj.weight", 1000, 301, "cpu"))
    assert not torch.equal(batch, standard_normal(7, "model.layers.1.mlp.up_proj.weight", 1000, 301, "cpu"))


def test_exact_operation_log_and_cos_agree_with_libm():
    u = torch.linspace(2.0**-33, 1.0, 100_001, dtype=torch.float64)
    torch.testing.assert_close(_log(u), torch.log(u), rtol=1e-13, atol=1e-15)
    h = torch.randint(0, 2**32, (100_000,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_cos_2pi(h), torch.cos(2 * math.pi * h.double() / 2**32), rtol=0, atol=1e-13)


def test_values_are_standard_normal():
    z = standard_normal(42, "w", 0, 400_000, "cpu")
    assert abs(z.mean().item()) < 0.006 and abs(z.std().item() - 1) < 0.006
    # mass within 1, 2 and 3 sigma, against the normal CDF (sampling sd ~ 0.0008 at this n)
    for k in (1, 2, 3):
        assert abs((z.abs() < k).double().mean().item() - math.erf(k / math.sqrt(2))) < 0.004, k
    assert 4.0 < z.abs().max().item() < 7.0


MESHES = [
    ("algorithm=fsdp",),
    ("algorithm=hsdp",),
    ("algorithm=fl_fsdp",),
    ("algorithm=fl_hsdp",),
    ("algorithm=fl_hsdp", "model.init_device=meta"),
    ("algorithm=fsdp", "model.init_device=meta"),
]


def single_process(cfg):
    """The reference: one unsharded model, and the mean of the 8 ranks' step-1 losses."""
    blocks = prepare(cfg.dataset)
    model = build_model(llama_config(cfg.model, blocks.vocab_size))
    init_weights(model, torch.device("cpu"), cfg.seed)
    with torch.no_grad():
        losses = [
            model(input_ids=x, labels=x).loss.item()
            for x in (
                next(RankBatches(blocks.train, cfg.trainer.batch_size, r, 8, cfg.seed).stream()) for r in range(8)
            )
        ]
    return {n: p.detach() for n, p in model.named_parameters()}, sum(losses) / 8


def test_same_initial_weights_and_step_one_loss_everywhere(tmp_path):
    """fsdp 1x1x8, hsdp 1x2x4, fl_fsdp 2x1x4, fl_hsdp 2x2x2 (cpu and meta init) and one process."""
    initial, first_loss = {}, {}
    for overrides in MESHES:
        name = "-".join(o.split("=")[1] for o in overrides)
        cfg = compose_cfg("topology=local_8", "trainer.steps=1", *overrides)
        snap = Snapshot(tmp_path / name, [0], cfg)
        rows = train_world(cfg, tmp_path / name / "run", snap)
        replicas = [snap.load(f, r, 0) for f in range(cfg.mesh.federation) for r in range(cfg.mesh.replicate)]
        assert all(identical(replicas[0], other) for other in replicas[1:]), name  # every group and replica
        initial[name], first_loss[name] = replicas[0], rows[0]["loss"]
    reference, reference_loss = single_process(cfg)
    for name in initial:
        assert identical(initial[name], reference), name
        assert first_loss[name] == first_loss["fsdp"], name  # bitwise: the same model on the same data
    assert first_loss["fsdp"] == pytest.approx(reference_loss, rel=1e-6)
    for name, weight in reference.items():
        if weight.dim() == 2:  # no repeated rows (a rank-deficient weight of repeated shard blocks)
            assert torch.unique(weight, dim=0).shape[0] == weight.shape[0], name
        elif name.endswith("norm.weight"):
            assert torch.equal(weight, torch.ones_like(weight)), name
    embedding = reference["model.embed_tokens.weight"]
    assert abs(embedding.std().item() - cfg.model.initializer_range) < 0.001


def test_bf16_keeps_rotary_frequencies_fp32(tmp_path):
    """Pure bf16 casts parameters only; RoPE's inv_freq stays fp32 as transformers defines it, so the
    rotary angles at the last positions are right to bf16's rounding of cos/sin, not off by the
    0.2% error of a bf16 inv_freq times the position."""
    import torch.distributed as dist

    cfg = compose_cfg("model.max_position_embeddings=2048", "model.vocab_size=64")
    config = llama_config(cfg.model)
    for meta in (False, True):
        model = build_model(config, "meta" if meta else "cpu")
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"store{meta}"), 1), rank=0, world_size=1)
        try:
            from torch.distributed.device_mesh import init_device_mesh

            parallelize(model, init_device_mesh("cpu", (1,)), torch.bfloat16)
            init_weights(model, torch.device("cpu"), 0)
            rotary = model.model.rotary_emb
            assert rotary.inv_freq.dtype == torch.float32
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            dim = config.hidden_size // config.num_attention_heads
            exact = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            torch.testing.assert_close(rotary.inv_freq.double(), exact, rtol=1e-6, atol=0)
            positions = torch.arange(2040, 2048)[None]
            cos, sin = rotary(torch.zeros(1, 8, dim, dtype=torch.bfloat16), positions)
            angles = positions[0, :, None].double() * exact[None, :]
            want = torch.cat([angles, angles], dim=-1)
            assert cos.dtype == torch.bfloat16
            torch.testing.assert_close(cos[0].double(), want.cos(), rtol=0, atol=8e-3)
            torch.testing.assert_close(sin[0].double(), want.sin(), rtol=0, atol=8e-3)
        finally:
            dist.destroy_process_group()
