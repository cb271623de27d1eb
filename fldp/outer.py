"""The outer optimiser on the pseudo-gradient (algorithm.outer): its config, and its state for one
bucket (or one simulated fragment): the anchor and torch's SGD or Adam over it.

The pseudo-gradient is the anchor (the weights at the last aggregation) minus the groups' average;
after the step the anchor is the new model for every group. FedAvg is outer SGD with lr 1 and no
momentum; it takes the average as it is and keeps no anchor.
"""

from __future__ import annotations

from typing import cast

import torch

from .config import OUTER_DEFAULTS, OuterConfig  # noqa: F401  (its config, and what null means: for its users)


class OuterState:
    """One flat fp32 anchor (this rank's shards of the weights at the last aggregation) and torch's
    SGD or Adam over it."""

    def __init__(self, config: OuterConfig, start: torch.Tensor):
        """start: the weights, flat."""
        self.anchor = start.detach().to(torch.float32, copy=True)
        if config.name == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                [self.anchor], lr=cast(float, config.lr), momentum=config.momentum, nesterov=config.nesterov
            )
        else:  # lr and eps: OuterConfig gave them their defaults
            betas = (float(config.betas[0]), float(config.betas[1]))
            self.optimizer = torch.optim.Adam(
                [self.anchor], lr=cast(float, config.lr), betas=betas, eps=cast(float, config.eps)
            )
        # the state torch would create at the first step, made now so a checkpoint can load into it
        # (same values: a zero momentum buffer times momentum plus the gradient is the gradient)
        state = self.optimizer.state[self.anchor]
        if config.name == "sgd" and config.momentum:
            state["momentum_buffer"] = torch.zeros_like(self.anchor)
        elif config.name == "adam":
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(self.anchor))
            state["exp_avg_sq"] = torch.zeros_like(self.anchor)

    def step(self, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """Step the anchor with the pseudo-gradient (anchor - average, fp32); returns it."""
        self.anchor.grad = pseudo_gradient
        self.optimizer.step()
        self.anchor.grad = None
        return self.anchor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state by kind: the anchor and the optimiser's (elementwise moments; Adam's step count)."""
        return {"anchor": self.anchor, **self.optimizer.state[self.anchor]}
