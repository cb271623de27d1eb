"""The gradient noise scale (McCandlish, Kaplan, Amodei and the OpenAI Dota team, "An Empirical
Model of Large-Batch Training", 2018): B_simple = tr(Sigma) / |G|^2, the batch size (here in
sequences) at which the gradient's noise and its signal are equal. Far below it a larger batch
helps almost linearly; far above it the extra sequences are mostly wasted.

Its appendix A estimates both terms from the squared norms of gradients at two batch sizes: a mean
gradient over b sequences has E|g_b|^2 = |G|^2 + tr(Sigma) / b. Here the small batch is each of K
disjoint parts of a step's sequences (b sequences each, a rank's batch) and the big one their mean
(K * b sequences), on the same weights:

    |G|^2      ~ (B_big |g_big|^2 - B_small |g_small|^2) / (B_big - B_small)
    tr(Sigma)  ~ (|g_small|^2 - |g_big|^2) / (1 / B_small - 1 / B_big)

with |g_small|^2 the mean over the K parts. Each is unbiased; their ratio is not, and one step's is
noisy (the signal estimate can even be negative), so an analysis averages `noise_trace` and
`noise_signal` over steps before dividing, as the paper does."""

from __future__ import annotations

import torch


def estimate(grads: list[torch.Tensor], small: int) -> dict:
    """grads: each parameter's gradients [K, ...], row k the mean gradient of part k (`small`
    sequences); the step's record fields: noise_trace (tr Sigma, per sequence), noise_signal
    (|G|^2), noise_scale (their ratio, B_simple in sequences) and noise_batches ("K x small")."""
    parts = grads[0].shape[0]
    if parts < 2:
        raise ValueError("the gradient noise scale needs at least 2 parts of the batch")
    small_sq = torch.stack([(g.double().flatten(1) ** 2).sum(1) for g in grads]).sum(0).mean().item()
    big_sq = torch.stack([(g.double().mean(0) ** 2).sum() for g in grads]).sum().item()
    big = parts * small
    signal = (big * big_sq - small * small_sq) / (big - small)
    trace = (small_sq - big_sq) / (1 / small - 1 / big)
    return {
        "noise_trace": trace,
        "noise_signal": signal,
        "noise_scale": trace / signal if signal != 0 else float("nan"),
        "noise_batches": f"{parts} x {small}",
    }
