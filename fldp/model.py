"""The model: transformers' Llama, built from a config with random init (the paper pre-trains from
scratch), and sharded with FSDP2 per decoder layer and at the root."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from .mesh import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def llama_config(model_cfg, vocab_size: int | None = None) -> LlamaConfig:
    vocab = model_cfg.vocab_size or vocab_size
    if vocab is None:
        raise ConfigError("model.vocab_size=null and no tokenizer to take it from")
    rope = {"rope_type": "default", "rope_theta": model_cfg.rope_theta}
    if model_cfg.rope_scaling:
        rope.update(dict(model_cfg.rope_scaling))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        initializer_range=model_cfg.initializer_range,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_model(config: LlamaConfig, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Random-init Llama. On the meta device nothing is allocated: see `init_weights`."""
    with torch.device(device):
        return LlamaForCausalLM(config)


def parallelize(model: LlamaForCausalLM, mesh, dtype: torch.dtype) -> LlamaForCausalLM:
    """FSDP2 on each decoder layer, then the root (embeddings, final norm, lm_head; a tied
    lm_head shares the root's embedding parameter). A 2-D (replicate, shard) mesh makes it HSDP.
    Pure low precision as in the paper: parameters themselves are cast, no mixed-precision policy."""
    model.to(dtype)
    for layer in model.model.layers:
        # reshard after forward: the paper's FSDP all-gathers each layer again in backward
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, device: torch.device) -> None:
    """Materialise a meta-built (and possibly sharded) model on `device` with Llama's init:
    N(0, initializer_range) for linear and embedding weights, ones for RMSNorm, and the rotary
    frequencies recomputed (they are buffers, lost by `to_empty`). Same seed -> same values on
    every rank holding the same shard; federation groups are synchronised afterwards anyway."""
    model.to_empty(device=device)
    std = model.config.initializer_range
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif type(module).__name__.endswith("RMSNorm"):
            nn.init.ones_(module.weight)
        elif type(module).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(model.config)
            for name, buffer in fresh.named_buffers():
                getattr(module, name).copy_(buffer)
