"""Causal attention for the simulator's F stacked groups: one kernel call under vmap, not F.

vmap has no batching rule for CPU flash attention, so under it torch runs the kernel group by group
and autograd records a slice per group; each slice's backward then zeroes and adds a gradient as
large as all F groups' together: F^2 work, ~45% of an FL+FSDP step at F = 128 (docs/algorithms.md).
Here the same kernel (aten's CPU flash attention, forward and backward) is a custom op whose vmap
rule folds the vmapped dimensions into the batch: one call over every group's sequences, and one
backward. Registered with transformers as the attention implementation "fldp_stacked" (its masks
those of "sdpa": none for a causal block without padding)."""

from __future__ import annotations

import torch
from torch import Tensor

NAME = "fldp_stacked"


@torch.library.custom_op("fldp::causal_attention", mutates_args=())
def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """q, k, v [batch, heads, T, head_dim] -> (output, logsumexp), causal, no dropout."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse


@causal_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse = ctx.saved_tensors
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), q, k, v, out, lse, 0.0, True, scale=ctx.scale
    )
    return *grads, None


causal_attention.register_autograd(_backward, setup_context=_setup)


def _folded(t: Tensor, dim: int | None, size: int) -> Tensor:
    t = t.movedim(dim, 0) if dim is not None else t.expand(size, *t.shape)
    return t.reshape(-1, *t.shape[2:])


@causal_attention.register_vmap
def _vmap(info, in_dims, q: Tensor, k: Tensor, v: Tensor, scale: float):
    size = info.batch_size
    out, lse = causal_attention(*(_folded(t, d, size) for t, d in zip((q, k, v), in_dims[:3])), scale)
    return (out.unflatten(0, (size, -1)), lse.unflatten(0, (size, -1))), (0, 0)


def stacked_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface: [B, H, T, D] in, ([B, T, H, D], None) out, as sdpa's."""
    if attention_mask is not None or dropout or query.device.type != "cpu" or query.shape[2] < 2:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out, _ = causal_attention(query, key, value, float(scale))
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make "fldp_stacked" an attention implementation transformers' Llama can be given; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, stacked_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
