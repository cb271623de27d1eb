"""fldp/stacked_attention.py: every group's attention one kernel call under vmap, bit for bit what
transformers' sdpa computes group by group (its reference: the unchanged sdpa path, and aten's
kernel called on each group alone)."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.func import functional_call, vmap

from fldp import CONF
from fldp.model import build_model, llama_config
from fldp.stacked_attention import causal_attention, register


def stacked_losses_and_grads(impl: str, groups: int = 4):
    torch.manual_seed(0)
    model = build_model(llama_config(OmegaConf.load(CONF / "model" / "tiny_llama.yaml"), 4096))
    model.config._attn_implementation = impl
    params = {
        n: (p.detach().unsqueeze(0).expand(groups, *p.shape) + 0.01 * torch.randn(groups, *p.shape)).requires_grad_()
        for n, p in model.named_parameters()
    }
    x = torch.randint(0, 4096, (groups, 3, 16), generator=torch.Generator().manual_seed(1))

    def loss(p, xx):
        return functional_call(model, p, args=(), kwargs={"input_ids": xx, "labels": xx}).loss

    losses = vmap(loss)(params, x)
    losses.sum().backward()
    return losses.detach(), {n: p.grad for n, p in params.items()}


def test_stacked_groups_equal_sdpa_group_by_group_bit_for_bit():
    ref_losses, ref_grads = stacked_losses_and_grads("sdpa")
    losses, grads = stacked_losses_and_grads(register())
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.parametrize("unbatched", [None, 1])
def test_vmap_folds_batched_and_unbatched_inputs_into_one_call(unbatched):
    """Nested vmap (the noise scale's), and a key/value shared by every group (in_dims None)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 2, 5, 2, 7, 8, generator=g, requires_grad=True) for _ in range(3))
    kv = k[0, 0].detach().requires_grad_() if unbatched else k

    def one(qq, kk, vv):
        return causal_attention(qq, kk, vv, 0.3)[0]

    k_dims = None if unbatched else 0
    out = vmap(vmap(one, in_dims=(0, k_dims, 0)), in_dims=(0, k_dims, 0))(q, kv, v)
    ref = torch.stack(
        [
            torch.stack(
                [
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q[i, j], kv if unbatched else kv[i, j], v[i, j], 0.0, True, scale=0.3
                    )[0]
                    for j in range(2)
                ]
            )
            for i in range(3)
        ]
    )
    assert torch.equal(out, ref)
    grad = torch.autograd.grad(out.square().sum(), (q, kv, v))
    ref_grad = torch.autograd.grad(ref.square().sum(), (q, kv, v))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grad, ref_grad))
