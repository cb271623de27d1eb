"""The model: transformers' Llama, built from a config with random init (the paper pre-trains from
scratch), and sharded with FSDP2 per decoder layer and at the root."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import re
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from .init import init_parameters

if TYPE_CHECKING:  # imported where used: transformers and FSDP2 (DTensor) took most of fldp-plan's start-up
    from transformers import LlamaConfig, LlamaForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fsdp_reduce_dtype(cfg) -> torch.dtype | None:
    """fsdp.reduce_dtype, the dtype FSDP2 reduces the gradients in (None: the gradients' own); the
    trainer's MixedPrecisionPolicy, the simulator's ring and the cost model's bytes read it here."""
    name = getattr(cfg.fsdp, "reduce_dtype", None)  # typed, or composed (an optional key: maybe absent)
    return DTYPES[name] if name else None


def llama_config(model_cfg, vocab_size: int | None = None) -> LlamaConfig:
    from transformers import LlamaConfig

    vocab = model_cfg.vocab_size or vocab_size
    if vocab is None:
        raise ValueError("llama_config: model.vocab_size is null and no tokenizer's size was given")
    # transformers' config is strict about floats; Hydra reads `model.rms_norm_eps=1` as an int
    rope = {"rope_type": "default", "rope_theta": float(model_cfg.rope_theta)}
    scaling = model_cfg.rope_scaling
    if scaling:  # typed (its unset fields None, left out) or composed
        rope.update(
            {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
            if dataclasses.is_dataclass(scaling) and not isinstance(scaling, type)
            else dict(scaling)
        )
    return LlamaConfig(  # type: ignore[call-arg]
        vocab_size=vocab,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=float(model_cfg.rms_norm_eps),
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        initializer_range=float(model_cfg.initializer_range),
        use_cache=False,
        attn_implementation="sdpa",  # a PretrainedConfig keyword that LlamaConfig's signature lacks
    )


def build_model(config: LlamaConfig, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Random-init Llama. On the meta device nothing is allocated: see `init_weights`."""
    from transformers import LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM(config)


def parameter_counts(model) -> dict[str, int]:
    """All of the model's parameters, those of its matmuls (without the input embedding), and Kaplan
    et al.'s N (without the lm_head too). A sharded (DTensor) parameter counts its whole shape."""
    total = sum(p.numel() for p in model.parameters())  # a tied lm_head once
    embedding = model.model.embed_tokens.weight.numel()
    head = 0 if model.config.tie_word_embeddings else model.lm_head.weight.numel()
    return {"params": total, "params_matmul": total - embedding, "params_non_embedding": total - embedding - head}


# what the model's first forward imports lazily (transformers' masks bring torch._dynamo): measured
# with `python -X importtime` on a local_8 run, as the modules each forked worker imported again
FORWARD_IMPORTS = (
    "transformers.generation.candidate_generator",
    "transformers.generation.stopping_criteria",
    "transformers.integrations.sdpa_attention",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.modeling_outputs",
    "transformers.tokenization_python",
    "transformers.utils.type_validators",
)


def import_forward() -> None:
    """Import FORWARD_IMPORTS: a launcher calls it before forking its workers, which then share
    these modules instead of each importing them (the default local_8 job, 2 steps, side by side on
    the idle 2-core machine: 17.5 -> 11 s of CPU, 13.0 -> 10.1 s). A module another transformers lacks is skipped: only time is lost."""
    for name in FORWARD_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's parameters: model.layers.<i>.


def fsdp_unit(name: str) -> int:
    """The FSDP unit parallelize() puts a parameter in, by its name, in depth order: 0 the root
    (embeddings, final norm, lm_head), i + 1 decoder layer i."""
    m = _LAYER.search(name)
    return int(m.group(1)) + 1 if m else 0


def parallelize(
    model: LlamaForCausalLM,
    mesh,
    dtype: torch.dtype,
    reshard_root_after_forward: bool = False,
    activation_checkpointing: str = "none",
    reduce_dtype: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """FSDP2 on each decoder layer, then the root (embeddings, final norm, lm_head; a tied
    lm_head shares the root's embedding parameter). A 2-D (replicate, shard) mesh makes it HSDP.
    Pure low precision as in the paper: the parameters themselves are cast, no mixed-precision
    policy; buffers keep the dtype the model gives them (transformers keeps RoPE's inv_freq fp32:
    in bf16 its 0.2% error grows to ~0.85 rad of phase at position 2047).
    Layers reshard after forward (all-gathered again in backward, FULL_SHARD). The root does not by
    default: FSDP1's FULL_SHARD, which the authors ran, keeps the root gathered from forward to
    backward; True adds one all-gather of the root unit per step.
    activation_checkpointing (model.activation_checkpointing): `full` recomputes each decoder layer's
    forward in its backward instead of keeping what it saved (`checkpoint_layers`).
    reduce_dtype (fsdp.reduce_dtype): the gradients summed in it, then cast back to `dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)  # param_dtype None: the parameters' own

    for p in model.parameters():
        p.data = p.data.to(dtype)  # in place, so a tied lm_head stays the embedding's parameter
    if activation_checkpointing == "full":
        checkpoint_layers(model)
    elif activation_checkpointing != "none":  # fldp.config's Choice refuses it before any worker starts
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r}: none or full")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_root_after_forward, mp_policy=policy)
    return model


def checkpoint_layers(model: LlamaForCausalLM) -> None:
    """Each decoder layer keeps only its inputs in forward and runs its forward again in backward
    (torch.utils.checkpoint, non-reentrant). The layer's own forward is wrapped, not the module:
    parameter names stay as they are (the initial weights, federate patterns and checkpoints go by
    them), and FSDP2's hooks stay on the layer, so its parameters are gathered for the recompute as
    for any backward (torchtitan's order: checkpoint inside, fully_shard outside)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(_recomputed, layer.forward)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@torch.no_grad()
def init_weights(model: LlamaForCausalLM, device: torch.device, seed: int) -> None:
    """Give a (possibly meta-built, possibly sharded) model its initial weights on `device`: the
    parameters from (seed, name, element index) alone (fldp.init), so every algorithm, mesh and
    init device starts from the same values; a meta-built model's buffers (the rotary
    frequencies, lost by `to_empty`) are recomputed as the model defines them."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to_empty(device=device)
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding"):
                with torch.device(device):
                    fresh = type(module)(model.config)
                for name, buffer in fresh.named_buffers():
                    getattr(module, name).copy_(buffer)
    init_parameters(model, seed, model.config.initializer_range)
