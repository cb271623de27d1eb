"""The model configs: Llama 3.1 8B exactly, on the meta device, with nothing downloaded."""

import pytest
import torch
from conftest import compose_cfg

from fldp.config import load
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


@pytest.mark.parametrize("model", ["tiny_llama", "ladder_1"])
def test_the_training_flops_fldp_counts_are_torch_s_count_of_the_step_s_matmuls(model):
    """fldp.steptime.flops_per_token (fldp-calibrate's and experiments/bench_flops.py's FLOPs)
    against torch's FlopCounterMode over a real forward and backward (3x forward): the same matmuls,
    the lm_head in and the embedding's lookup out. Not checked by torch: attention's two products
    (its CPU attention kernel is not counted; fldp counts the causal half, 2 x seq x hidden per
    token and layer) and the norms' weights, which fldp counts as 2 FLOPs each (0.3% of tiny_llama's)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fldp.steptime import flops_per_token

    cfg = compose_cfg(f"model={model}", "model.vocab_size=512")
    net = build_model(llama_config(cfg.model), "cpu")
    batch, seq = 2, 16
    ids = torch.randint(0, 512, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        net(ids, labels=ids).loss.backward()
    params = sum(p.numel() for p in net.parameters())
    embedding = net.model.embed_tokens.weight.numel()
    norms = sum(p.numel() for n, p in net.named_parameters() if "norm" in n)
    layers, hidden = cfg.model.num_hidden_layers, cfg.model.hidden_size
    ours = flops_per_token(params, embedding, layers, hidden, seq)
    attention = 2 * layers * seq * hidden
    assert counter.get_total_flops() == 3 * (ours - attention - 2 * norms) * batch * seq


def test_the_model_ladder_is_one_family_growing_over_thirty_fold():
    """conf/model's ladder (issue 49): tiny_llama and ladder_1..3, the same Llama and tokenizer, each
    rung larger; N (without the input embedding and the lm_head) spans more than 30x."""
    from fldp.cost import config_model

    sizes = []
    for name in ("tiny_llama", "ladder_1", "ladder_2", "ladder_3"):
        cfg = compose_cfg(f"model={name}")
        model, _ = config_model(load(cfg))
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 4096, name
        head = model.lm_head.weight.numel() + model.model.embed_tokens.weight.numel()
        sizes.append(sum(p.numel() for p in model.parameters()) - head)
    assert sizes == sorted(sizes) and sizes[-1] / sizes[0] > 30, sizes
