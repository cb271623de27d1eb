"""The model configs: Llama 3.1 8B exactly, on the meta device, with nothing downloaded."""

import torch
from conftest import compose_cfg

from fldp.model import build_model, init_weights, llama_config


def test_llama3_1_8b_on_meta_device():
    cfg = compose_cfg("model=llama3_1_8b")
    model = build_model(llama_config(cfg.model), "meta")
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.vocab_size) == (32, 4096, 8, 128256)
    assert c.rope_parameters["rope_type"] == "llama3" and not c.tie_word_embeddings
    assert all(p.device.type == "meta" for p in model.parameters())


def test_meta_init_matches_a_cpu_built_model():
    """The same weights, bit for bit, whether built in full or on the meta device; the rotary
    frequencies (buffers, lost by to_empty) recomputed."""
    cfg = compose_cfg(
        "model=llama3_1_8b",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "model.vocab_size=512",
    )
    config = llama_config(cfg.model)
    cpu = build_model(config)
    meta = build_model(config, "meta")
    for model in (cpu, meta):
        init_weights(model, torch.device("cpu"), seed=3)
    for (name, a), (_, b) in zip(cpu.named_buffers(), meta.named_buffers()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(cpu.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
        if name.endswith("norm.weight"):
            assert torch.equal(b, torch.ones_like(b))
        else:
            assert abs(b.std().item() - 0.02) < 0.004, name
