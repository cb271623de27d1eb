"""The memory model (fldp/memory.py) against torch's own accounting: what autograd keeps of a real
decoder layer (saved-tensor hooks), and the peak of real training steps under torch's
FSDPMemTracker (torch.distributed._tools), on 8 gloo ranks, for every algorithm, with and without
activation checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from conftest import compose_cfg, run_world

from fldp.aggregation import FedAvg, FedAvgConfig
from fldp.config import load
from fldp.cost import config_model, config_shapes, model_units
from fldp.data import prepare
from fldp.memory import Shapes, for_config, for_shapes, layer_activations, rotary_tables
from fldp.mesh import MeshShape, build_mesh, group_mesh
from fldp.model import DTYPES, build_model, llama_config
from fldp.steptime import workload_for, workload_of
from fldp.trainer import build_optimizer, sharded_model

# wider layers than tiny_llama's, so that the decoder layers, not the 4,096-token vocabulary, hold
# most of the activations: the layer terms are what is checked
WIDE = [
    "model.hidden_size=192",
    "model.intermediate_size=512",
    "model.num_attention_heads=6",
    "model.num_key_value_heads=2",
    "model.num_hidden_layers=3",
]


def kept_by_autograd(layer, rotary, hidden: torch.Tensor, params: set) -> int:
    """Bytes of the distinct storages a decoder layer's forward saves for backward (its input too,
    where a norm keeps it; parameters not)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    position = torch.arange(hidden.shape[1])[None]
    cos_sin = rotary(hidden, position)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, position_embeddings=cos_sin, attention_mask=None, position_ids=position)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape",
    [
        [],
        WIDE,
        [
            "model.hidden_size=96",
            "model.num_attention_heads=3",
            "model.num_key_value_heads=1",
            "model.intermediate_size=256",
        ],
    ],
)
def test_a_layers_activations_are_what_autograd_keeps(shape, precision):
    cfg = compose_cfg(*shape)
    dtype = DTYPES[precision]
    model = build_model(llama_config(cfg.model, 4096), "cpu").to(dtype)
    hidden = torch.randn(2, 128, model.config.hidden_size, dtype=dtype, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    got = kept_by_autograd(model.model.layers[0], model.model.rotary_emb, hidden, params)
    m, e = Shapes.of(model.config), dtype.itemsize
    assert got == layer_activations(m, 2, 128, e) + rotary_tables(m, 128, e)


def _measure(cfg, blocks, out, device):
    """Two training steps (the second with the optimiser's state, and an aggregation where the
    algorithm has one) under FSDPMemTracker, FedAvg built inside it; rank 0's peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    shape = MeshShape(cfg.mesh.federation, cfg.mesh.replicate, cfg.mesh.shard)
    mesh = build_mesh(shape, "cpu")
    model = sharded_model(load(cfg), blocks.vocab_size, group_mesh(mesh, shape), device)
    optimizer = build_optimizer(model, cfg.optimizer)
    config = FedAvgConfig.from_algorithm(cfg.algorithm)
    x = blocks.train[dist.get_rank() * 2 : dist.get_rank() * 2 + cfg.trainer.batch_size].long()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((x,))
    with tracker:
        fedavg = FedAvg(model, mesh, shape, config, last_step=2) if config else None
        for step in (1, 2):
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if fedavg is not None:
                fedavg.exchange(fedavg.due(step))
            tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
    if dist.get_rank() == 0:
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        out[cfg.model.activation_checkpointing] = peak["Total"]


# pure bf16 where the outer optimiser's fp32 state is largest against the rest
@pytest.mark.parametrize(
    "algorithm,precision",
    [("fsdp", "fp32"), ("hsdp", "fp32"), ("fl_fsdp", "fp32"), ("fl_hsdp", "fp32"), ("diloco_hsdp", "bf16")],
)
def test_the_predicted_peak_is_within_10_percent_of_the_tracked(algorithm, precision):
    measured = {}
    for checkpointing in ("none", "full"):
        cfg = compose_cfg(
            f"algorithm={algorithm}",
            "topology=local_8",
            *WIDE,
            f"trainer.precision={precision}",
            f"model.activation_checkpointing={checkpointing}",
        )
        blocks = prepare(cfg.dataset)
        out = torch.multiprocessing.Manager().dict()
        run_world(_measure, 8, cfg, blocks, out)
        model = build_model(llama_config(cfg.model, blocks.vocab_size), "meta")
        units = model_units(model, DTYPES[cfg.trainer.precision])
        measured[checkpointing] = (out[checkpointing], for_config(load(cfg), model, units).peak)
    for checkpointing, (got, want) in measured.items():
        assert abs(want / got - 1) <= 0.10, f"{checkpointing}: tracked {got:,}, predicted {want:,}"
    assert measured["full"][0] < measured["none"][0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=tiny_llama"],  # its vocabulary from the tokenizer
        ["model=llama3_1_8b"],
        ["model=llama3_1_8b", "trainer.precision=bf16"],
        ["model=tiny_llama", "model.tie_word_embeddings=true", "model.num_key_value_heads=2"],
    ],
)
def test_the_shapes_from_the_config_are_the_models(overrides):
    """fldp-plan reads the parameters from the config (cost.config_shapes: no model is built): they
    must be the meta-device model's, name by name in named_parameters' order, with each one's FSDP
    unit, its buffers' bytes, and what the memory and step-time models make of them."""
    conf = load(compose_cfg(*overrides, "algorithm=fl_hsdp", "topology=local_8"))
    model, units = config_model(conf)
    shapes, buffers, found = config_shapes(conf)
    assert shapes == Shapes.of(model.config)
    assert list(zip(found.names, (s for s, _ in found.params))) == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    assert found == units  # shapes, units, names and element size
    assert buffers == sum(b.numel() * b.element_size() for b in model.buffers())
    assert sum(math.prod(s) for s, _ in found.params) == sum(p.numel() for p in model.parameters())
    assert workload_of(conf, shapes, found) == workload_for(conf, (model, units))
    for shape in (MeshShape(2, 2, 2), MeshShape(1, 1, 8), MeshShape(8, 1, 1)):
        assert for_shapes(conf, shapes, buffers, found, shape) == for_config(conf, model, units, shape)
