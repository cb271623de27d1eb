"""The outer optimiser on the pseudo-gradient (algorithm.outer): its config, and its state for one
bucket (or one simulated fragment): the anchor and torch's SGD or Adam over it.

The pseudo-gradient is the anchor (the weights at the last aggregation) minus the groups' average;
after the step the anchor is the new model for every group. FedAvg is outer SGD with lr 1 and no
momentum; it takes the average as it is and keeps no anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from .errors import ConfigError
from .quantize import Quantizer
from .schema import check_values

# What algorithm.outer's null lr / eps mean, per optimiser. sgd: lr 1 (with momentum 0: FedAvg).
# adam: FedAdam's server lr and tau (= eps) of Reddi et al. 2021, 1e-3 each, with torch's bias
# correction (their Algorithm 2 has none): the first step is about lr * sign(delta), so the shared
# lr 1 would move every weight by ~1 (init std 0.02). sgd's eps is unused.
OUTER_DEFAULTS = {"sgd": {"lr": 1.0, "eps": 1e-8}, "adam": {"lr": 1e-3, "eps": 1e-3}}


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimiser on the pseudo-gradient (algorithm.outer)."""

    name: str = "sgd"
    lr: float | None = None  # None: OUTER_DEFAULTS[name]
    momentum: float = 0.0
    nesterov: bool = False
    betas: tuple = (0.9, 0.99)
    eps: float | None = None  # None: OUTER_DEFAULTS[name]
    reduce_dtype: str | None = None  # None: the parameters' dtype (the authors' bf16 all-reduce)
    quantize: str | None = None  # fldp/quantize.py: int8, fp8, int4; None: not quantised
    quantize_block: int = 256
    error_feedback: bool = False

    def __post_init__(self):
        check_values({f"algorithm.outer.{k}": getattr(self, k) for k in self.__dataclass_fields__})
        Quantizer.of(self)  # its own checks
        if self.quantize and self.reduce_dtype is not None:
            raise ConfigError(
                f"algorithm.outer.reduce_dtype={self.reduce_dtype} with algorithm.outer.quantize="
                f"{self.quantize}: the quantised exchange sums in fp32; set reduce_dtype to null"
            )
        if self.error_feedback and not self.quantize:
            raise ConfigError(
                "algorithm.outer.error_feedback=true: needs algorithm.outer.quantize (int8, fp8 "
                "or int4); without it nothing is lost to feed back"
            )
        for key, value in OUTER_DEFAULTS[self.name].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.nesterov and not self.momentum:
            raise ConfigError(
                f"algorithm.outer.nesterov=True: needs algorithm.outer.momentum > 0, not {self.momentum!r}"
            )

    @property
    def averages(self) -> bool:
        """Plain FedAvg: the new model is the groups' average itself."""
        return self.name == "sgd" and self.lr == 1 and self.momentum == 0


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
